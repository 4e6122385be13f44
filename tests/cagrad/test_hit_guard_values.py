"""Hit guards (cagrad.keys.hit_path) on attribute values and tensors that
common graphs do not hold: a complex scalar attribute, int-tuple attributes,
an index a binding hands out as uint64, a saved tensor list, and guards
written without the C++ metadata readers.

Each backward runs twice under ``cagrad.enable("eager")``: the gradients must
be eager's, and the second must be a hit taken through the guard (the
``guard_hits`` counter), since it repeats the first exactly. Every test runs
with the per-node checks as one C++ program call and as Python lines, as in
``test_hit_path``. (Survivors of the mutation run, docs/mutation-testing.md:
each of these guards was broken, or written another way, with no check
noticing.)
"""

from __future__ import annotations

import gc

import pytest
import torch

import cagrad
from cagrad import engine, native


@pytest.fixture(autouse=True, params=["program", "lines"])
def checks(request, monkeypatch):
    gc.collect()
    if request.param == "lines":
        monkeypatch.setattr(native, "collect_fn", lambda: None)
        monkeypatch.setattr(native, "walk_fn", lambda: None)
    elif native.collect_fn() is None or native.walk_fn() is None:
        pytest.skip("the C++ extension cannot be built here (no compiler)")
    cagrad.reset()
    yield request.param
    cagrad.reset()


def _twice_through_the_guard(loss, leaves):
    """Runs ``loss().backward()`` in eager, then twice under cagrad; asserts
    eager's gradients each time and one capture, then one guarded hit.
    Returns the graph's guards."""
    for t in leaves:
        t.grad = None
    loss().backward()
    want = [t.grad.clone() for t in leaves]
    with cagrad.enable("eager"):
        for _ in range(2):
            for t in leaves:
                t.grad = None
            loss().backward()
            for w, t in zip(want, leaves):
                assert torch.equal(w, t.grad)
    c = cagrad.counters
    assert (c["captures"], c["cache_hits"], c["guard_hits"], c["fallbacks"]) == (1, 1, 1, 0), dict(c)
    return engine.cache_for("eager", None).guards


def test_a_complex_scalar_attribute_of_a_real_graph():
    """AddBackward0 keeps ``alpha=1j`` (a complex Python scalar) while every
    lifted tensor and leaf is real: the guard compares it by its key bytes."""
    x = torch.randn(3, requires_grad=True)

    def loss():
        z = x.to(torch.complex64)
        return torch.add(z, z, alpha=1j).real.sum() + (x * x).sum()

    _twice_through_the_guard(loss, [x])


def test_int_tuple_attributes_are_compared_as_ints_not_as_key_bytes():
    """SumBackward1's ``dim`` and AmaxBackward0's ``dim`` are int tuples: the
    guard compares them item by item (a C++ instruction, or a Python line of
    types and values), never through a KeyWriter (``_key_bytes``), which is
    the slow form kept for values no instruction covers."""
    x = torch.randn(3, 4, 5, requires_grad=True)
    [guard] = _twice_through_the_guard(lambda: x.sum((0, 2)).amax((0,)), [x])
    assert "_saved_dim" in guard.source
    assert "_key_bytes(" not in guard.source


def test_a_negative_index_read_back_as_uint64():
    """``x[-1]``: SelectBackward0's ``index`` reads 2**64 - 1 from Python (its
    binding hands int64 fields out as uint64); the full collection and the
    guard both take it as the int64 -1, so the repeat hits through the guard."""
    x = torch.randn(5, 4, requires_grad=True)
    assert x[-1].grad_fn._saved_index == (1 << 64) - 1  # the premise
    _twice_through_the_guard(lambda: (x[-1] * x[-2:].sum(0)).sum(), [x])


def test_a_saved_tensor_list():
    """IndexBackward0 saves its index tensors as a list."""
    x = torch.randn(4, 3, requires_grad=True)
    idx = torch.tensor([0, 2, 2])
    [guard] = _twice_through_the_guard(lambda: (x[idx, idx] * 2).sum(), [x])
    assert "_saved_indices" in guard.source


def test_guards_written_without_the_cpp_metadata_readers(monkeypatch):
    """Without the C++ readers (an extension that does not load), a guard
    compares tensors and input metadata through their Python attributes."""
    monkeypatch.setattr(native, "metadata_fns", lambda: None)
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 4)

    def loss():
        return (x @ w).tanh().sum()

    [guard] = _twice_through_the_guard(loss, [w])
    assert "_tm(" not in guard.source and ".stride()" in guard.source
