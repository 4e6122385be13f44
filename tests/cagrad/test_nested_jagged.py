"""Jagged nested tensors in a backward (cagrad.keys.subclasses, sizes).

A jagged nested tensor (``torch.nested.nested_tensor(..., layout=
torch.jagged)``) is a wrapper subclass: cagrad lifts its values, offsets
and cached sequence lengths, keys its nested ints by structure (which
nested tensors share offsets) and traces its ``__torch_dispatch__``. Every
gradient is compared with eager autograd run on copies of the same inputs:
class, the nested int (a leaf's ``.grad`` shares the leaf's offsets, as in
eager), values bit for bit; and errors eager raises are raised.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cagrad
from cagrad import internals
from cagrad.keys.sizes import SizeInputs

from .conftest import run_both, same
from .test_custom_function_traced import Cube

jagged = getattr(torch, "jagged", None)
pytestmark = pytest.mark.skipif(jagged is None, reason="torch without the jagged layout")

W = torch.linspace(-1.0, 1.0, 15).reshape(3, 5)


def _njt(lengths, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, 3, generator=g) for n in lengths]
    return torch.nested.nested_tensor(parts, layout=torch.jagged, device=device, requires_grad=True)


def _program(x, w):
    h = torch.nn.functional.linear(x, w.t())
    return (h.relu() * h.sin()).values().pow(2).sum() + (x * 3).values().sum()


def _same_njt_grad(leaf, expected_leaf):
    actual, expected = leaf.grad, expected_leaf.grad
    assert type(actual) is type(expected)
    # eager's .grad carries the leaf's own nested int (its offsets)
    assert (actual.shape == leaf.shape) == (expected.shape == expected_leaf.shape)
    assert (actual.offsets() is leaf.offsets()) == (expected.offsets() is expected_leaf.offsets())
    torch.testing.assert_close(actual.offsets(), expected.offsets(), rtol=0, atol=0)
    assert actual.values().stride() == expected.values().stride()
    torch.testing.assert_close(actual.values(), expected.values(), rtol=0, atol=0)


def _counts():
    c = cagrad.counters
    return c["captures"], c["cache_hits"], c["fallbacks"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_jagged_leaf_compiles_and_hits_by_structure(backend, device):
    # (4, 2) has the sizes of (2, 4) (values, offsets, and the minimum and
    # maximum lengths, which a jagged tensor holds as the sizes of two
    # tensors): the graph reads the offsets as data, so it hits; (3, 3) and
    # (5, 5, 1) are other static variants
    for step, lengths in enumerate([(2, 4), (4, 2), (3, 3), (5, 5, 1), (2, 4)]):
        x, y = _njt(lengths, step, device), _njt(lengths, step, device)
        wx, wy = (W.to(device, copy=True).requires_grad_() for _ in range(2))
        _program(y, wy).backward()
        with cagrad.enable(backend):
            _program(x, wx).backward()
        _same_njt_grad(x, y)
        torch.testing.assert_close(wx.grad, wy.grad, rtol=0, atol=0)
    assert _counts() == (3, 2, 0), dict(cagrad.counters)


def test_plain_values_through_a_jagged_tensor():
    # the leaf is the values; the nested tensor is built in the forward
    offsets = torch.tensor([0, 2, 6])

    def build():
        values = torch.randn(6, 3, requires_grad=True)
        nt = torch.nested.nested_tensor_from_jagged(values, offsets)
        (nt.cos() * nt).values().sum().backward()
        return values.grad

    for _ in range(2):  # a capture, then a hit
        expected, got = run_both(build)
        same(got, expected)
        assert got.stride() == expected.stride()
    assert _counts() == (1, 1, 0), dict(cagrad.counters)


def test_autograd_grad_of_a_jagged_leaf():
    x, y = _njt((2, 4), 0), _njt((2, 4), 0)
    (gy,) = torch.autograd.grad((y.sin() * y).values().sum(), y)
    with cagrad.enable("eager"):
        (gx,) = torch.autograd.grad((x.sin() * x).values().sum(), x)
    assert type(gx) is type(gy) and gx.offsets() is x.offsets()
    torch.testing.assert_close(gx.values(), gy.values(), rtol=0, atol=0)
    assert _counts() == (1, 0, 0)


def test_accumulating_into_a_jagged_grad_raises_as_eager():
    # torch 2.13's AccumulateGrad adds into a jagged .grad, then its layout
    # check reads strides the jagged dispatch does not have and raises
    def build():
        x = _njt((2, 4), 0)
        outcomes = []
        for _ in range(2):
            try:
                (x.sin() * x).values().sum().backward()
                outcomes.append(None)
            except RuntimeError as e:
                outcomes.append(str(e))
        return outcomes, x.grad.values()

    (expected, expected_values), (actual, actual_values) = run_both(build)
    assert actual == expected
    same(actual_values, expected_values)


def test_nested_ints_are_keyed_by_structure():
    a, b = _njt((2, 4), 0), _njt((1, 1), 1)
    j1, j2 = a.shape[1], b.shape[1]
    first, second = SizeInputs(), SizeInputs()
    first.add_static([2, j1, 3], "a")
    first.add_static([j1 * 3, 3, 1, j2], "b")
    # the same structure with the roles of the nested ints swapped
    second.add_static([2, j2, 3], "a")
    second.add_static([j2 * 3, 3, 1, j1], "b")
    assert first.values == second.values
    assert first.values[1] != first.values[3] != first.values[6]  # j1, 3*j1, j2: three markers
    assert all(v < 0 for v in (first.values[1], first.values[3], first.values[6]))
    assert not any(first.dynamic_ok)
    shared = SizeInputs()
    shared.add_static([2, j1, 3], "a")
    shared.add_static([j1 * 3, 3, 1, j1], "b")
    assert shared.values != first.values


def test_jagged_tensors_fall_back_when_the_nested_int_internal_changes(monkeypatch):
    # a torch whose nested-int registry is not as cagrad expects (its check
    # fails): jagged backwards run in eager, counted
    entry = internals.REGISTRY["nested_ints"]
    monkeypatch.setitem(internals.REGISTRY, "nested_ints", dataclasses.replace(entry, check=lambda: "simulated"))
    internals.recheck()
    try:
        x, y = _njt((2, 4), 0), _njt((2, 4), 0)
        (y.sin() * y).values().sum().backward()
        with cagrad.enable("eager"):
            (x.sin() * x).values().sum().backward()
        torch.testing.assert_close(x.grad.values(), y.grad.values(), rtol=0, atol=0)
        assert dict(cagrad.counters["fallback_reasons"]) == {"internal:nested_ints": 1}
    finally:
        monkeypatch.undo()
        internals.recheck()
    assert internals.ok("nested_ints")


def test_a_custom_function_on_a_jagged_tensor_runs_in_eager():
    """A custom Function whose output is jagged: its ragged size has no
    size slot, so the backward runs in eager, counted as tensor_subclass
    (the key raised ``ValueError: ge: relation is indeterminate`` comparing
    the nested int with 0, found by the fuzzer's jagged leaves)."""
    x, y = _njt((2, 4), 0), _njt((2, 4), 0)
    Cube.apply(y.sin()).values().sum().backward()
    with cagrad.enable("eager"):
        Cube.apply(x.sin()).values().sum().backward()
    _same_njt_grad(x, y)
    assert dict(cagrad.counters["fallback_reasons"]) == {"tensor_subclass": 1}
