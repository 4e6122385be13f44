"""Errors eager raises are raised under cagrad: same type, same cause.

Each case runs the same erroneous program in eager and under cagrad and
compares the exception type and the phrase that names the cause.
"""

from __future__ import annotations

import pytest
import torch

import cagrad


def raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - comparing whatever eager raises
        return e
    return None


def compare(build, phrase):
    torch.manual_seed(0)
    eager = raised(build)
    torch.manual_seed(0)
    with cagrad.enable("eager"):
        ours = raised(build)
    assert eager is not None, "the case must make eager raise"
    assert type(ours) is type(eager), (ours, eager)
    assert phrase in str(eager)
    assert phrase in str(ours)
    return eager, ours


def test_backward_twice_without_retain_graph():
    def build():
        x = torch.randn(3, requires_grad=True)
        y = x.exp().sum()
        y.backward()
        y.backward()

    compare(build, "Trying to backward through the graph a second time")


def test_backward_twice_after_compiled_backward_hits_cache():
    """The graph freed by a compiled backward raises on reuse; a fresh graph
    of the same shape still compiles from the cache afterwards."""
    with cagrad.enable("eager"):
        x = torch.randn(3, requires_grad=True)
        y = x.exp().sum()
        y.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.backward()
        x.exp().sum().backward()
    assert cagrad.counters["cache_hits"] == 1


def test_saved_tensor_modified_in_place_before_backward():
    def build():
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        y = (h * 2).sum() + h.sum()
        with torch.no_grad():
            h.add_(1)
        y.backward()

    compare(build, "modified by an inplace operation")


def test_saved_tensor_modified_between_retained_backwards():
    def build():
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        y = h.sum()
        y.backward(retain_graph=True)
        with torch.no_grad():
            h.mul_(2)
        y.backward()

    compare(build, "modified by an inplace operation")


def test_non_scalar_root_without_gradient():
    def build():
        x = torch.randn(3, requires_grad=True)
        (x * 2).backward()

    compare(build, "grad can be implicitly created only for scalar outputs")


def test_gradient_shape_mismatch():
    def build():
        x = torch.randn(3, requires_grad=True)
        (x * 2).backward(torch.ones(4))

    compare(build, "Mismatch in shape")


def test_root_does_not_require_grad():
    def build():
        torch.randn(3).sum().backward()

    compare(build, "does not require grad")


def test_unused_input_without_allow_unused():
    def build():
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        torch.autograd.grad((a * 2).sum(), [a, b])

    compare(build, "appears to not have been used in the graph")


def test_complex_gradient_for_real_output_is_rejected():
    def build():
        x = torch.randn(3, requires_grad=True)
        (x * 2).backward(torch.ones(3, dtype=torch.complex64))

    compare(build, "complex")


def test_input_that_does_not_require_grad():
    def build():
        a = torch.randn(3, requires_grad=True)
        torch.autograd.grad((a * 2).sum(), [torch.randn(3)])

    compare(build, "does not require grad")
