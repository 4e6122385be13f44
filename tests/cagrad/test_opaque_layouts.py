"""An opaque call's gradient in another layout than the trace assumed.

The trace assumes an opaque node returns its gradients contiguous. Eager
hands on whatever layout the node returns: ``CopySlices`` (an in-place op on
a view) returns its base's strides, a custom Function what its backward
computed. cagrad copied such a gradient into the assumed strides, so hooks
and later nodes saw another layout than eager's (found by an H100 campaign
with ``CAGRAD_FUZZ_STRIDES=1``, seed 41). Now the first run with such a
result hands it on as it is (the interpreter finishes the backward, as
eager would), and the next capture assumes the dimension order it saw
(``cagrad.run.runtime._pattern``, ``cagrad.autograd.walk.Layout``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cagrad
from cagrad.compile import variants
from cagrad.capture.layouts import dimension_order, strides_in_order


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of the dimensions with more than one element (the others
    address no other place)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def _copy_slices_run(n: int):
    """A tensor hook on a leaf whose gradient passes through CopySlices
    (an in-place ``mul_`` on a slice of ``x.transpose(0, 2) * 1``): the
    strides the hook saw, and the leaf's gradient."""
    torch.manual_seed(n)
    x = torch.rand(5, n, 1, requires_grad=True)
    y = x.transpose(0, 2) * 1
    y[0:1].mul_(torch.rand(()))
    seen = []
    x.register_hook(lambda g: seen.append(g.stride()))
    y.sum().backward()
    return seen[0], x.grad


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_hook_after_copy_slices_sees_eagers_strides_at_every_size(backend):
    sizes = (4, 4, 8, 8, 6, 4)
    expected = [_copy_slices_run(n) for n in sizes]
    cagrad.reset()
    with cagrad.enable(backend):
        got = [_copy_slices_run(n) for n in sizes]
    for (e_strides, e_grad), (g_strides, g_grad) in zip(expected, got):
        assert g_strides == e_strides  # every dimension, the ones of one element too
        torch.testing.assert_close(g_grad, e_grad, rtol=0, atol=0)
    counters = cagrad.counters
    # the first backward hands CopySlices' result on as eager does and is
    # traced again at its end assuming that layout; the dynamic capture at
    # the first new size assumes it too
    assert counters["deopts"] == 1 and counters["retraces"] == 1 and counters["fallbacks"] == 0
    assert counters["captures"] == 2 and counters["cache_hits"] == len(sizes) - 2


class _TransposedGrad(torch.autograd.Function):
    """Returns its gradient as ``g.t().contiguous().t()`` (or contiguous,
    when ``flip`` says so for this backward): the values eager's
    ``x * 1`` gives, in a layout of the Function's choice."""

    flip: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        if _TransposedGrad.flip and _TransposedGrad.flip.pop(0):
            return g.contiguous()
        return g.t().contiguous().t()


def _function_run():
    torch.manual_seed(0)
    x = torch.rand(4, 6, requires_grad=True)
    y = _TransposedGrad.apply(x)
    seen = []
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_inputs[0].stride()))
    (y * y).sum().backward()
    return seen[0], x.grad


def test_a_post_hook_of_a_custom_function_sees_the_layout_its_backward_returned():
    expected = _function_run()
    assert expected[0] == (1, 4)
    cagrad.reset()
    with cagrad.enable("aot_eager"):
        got = [_function_run() for _ in range(4)]
    for strides, grad in got:
        assert strides == expected[0]
        torch.testing.assert_close(grad, expected[1], rtol=0, atol=0)
    # the first backward is traced again at its end: every later one hits
    assert cagrad.counters["deopts"] == 1 and cagrad.counters["retraces"] == 1
    assert cagrad.counters["captures"] == 1 and cagrad.counters["cache_hits"] == 3


def test_a_layout_that_keeps_changing_is_learnt_a_bounded_number_of_times():
    """A backward whose layout flips every time: cagrad learns it
    MAX_LAYOUT_RESPECULATIONS times (traced again at the end of a first run
    that deopted, or recaptured by the next backward after a hit that did),
    then copies into the layout it assumes (the values stay eager's; no
    fallback)."""
    bound = variants.MAX_LAYOUT_RESPECULATIONS
    runs = 2 * bound + 4
    cagrad.reset()
    _TransposedGrad.flip = [i % 2 == 1 for i in range(runs)]
    try:
        with cagrad.enable("aot_eager"):
            got = [_function_run() for _ in range(runs)]
    finally:
        _TransposedGrad.flip = []
    expected_grad = _function_run()[1]
    for _, grad in got:
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    c = cagrad.counters
    assert c["deopts"] == bound and c["fallbacks"] == 0
    # run 0 captures, deopts and is traced again; run 1 (a hit) deopts and
    # drops it; run 2 captures, deopts and is traced again, the last time
    assert bound == 3 and c["captures"] == 2 and c["retraces"] == 2
    assert c["cache_hits"] == runs - 2


@st.composite
def _dense_layouts(draw):
    """A tensor with a random shape (sizes 1 to 3, dimensions of one element
    included) permuted from contiguous: a dense layout in any order."""
    shape = draw(st.lists(st.integers(1, 3), min_size=0, max_size=5))
    perm = draw(st.permutations(range(len(shape))))
    return torch.empty(shape).permute(*perm) if shape else torch.empty(())


@given(_dense_layouts())
def test_dense_strides_in_the_learnt_order_are_the_tensors_own(t):
    """What the next capture assumes (:func:`strides_in_order` of the order
    :func:`dimension_order` saw) is the layout that was seen, for dimensions
    of one element too; so a learnt layout is never copied again."""
    assert strides_in_order(t.shape, dimension_order(t)) == t.stride()


def _grouped_mm_run(w: torch.Tensor, steps: int) -> list:
    """``F.grouped_mm`` with the experts' weights used transposed, as an MoE
    experts kernel does: GroupedMmBackward0 fails to trace on CPU (its fake
    kernel wants bfloat16) and runs as it is, returning mat_b's gradient in
    mat_b's transposed layout. Per step: the gradients and their strides."""
    out = []
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    for _ in range(steps):
        x = torch.randn(10, 8, requires_grad=True)
        y = torch.nn.functional.grouped_mm(x, w.transpose(1, 2), offs=offs)
        y.tanh().sum().backward()
        out.append([(g.clone(), g.stride()) for g in (x.grad, w.grad)])
    return out


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_opaque_node_in_another_layout_hits_from_the_second_backward(backend):
    steps = 4
    torch.manual_seed(0)
    w = torch.randn(3, 4, 8, requires_grad=True)
    expected = _grouped_mm_run(w, steps)
    torch.manual_seed(0)
    w = torch.randn(3, 4, 8, requires_grad=True)
    with cagrad.enable(backend):
        got = _grouped_mm_run(w, steps)
    for e_step, g_step in zip(expected, got):
        for (e, e_strides), (g, g_strides) in zip(e_step, g_step):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
            assert g_strides == e_strides
    c = cagrad.counters
    assert c["opaque_reasons"] == {"trace_failed:GroupedMmBackward0": 1}
    assert c["fallbacks"] == 0 and c["deopts"] == 1 and c["retraces"] == 1
    assert c["captures"] == 1 and c["cache_hits"] == steps - 1


class _OtherStrideInADimensionOfOne(torch.autograd.Function):
    """Backward returns its (4, 1) gradient with strides (1, 4): the
    contiguous strides (1, 1) but in the dimension of one element."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return torch.empty_strided((4, 1), (1, 4)).copy_(g * 2)


def _dimension_of_one_run(seed: int):
    torch.manual_seed(seed)
    x = torch.randn(4, 1, requires_grad=True)
    w = torch.randn(4, 1, requires_grad=True)
    h = x.exp()
    seen = []
    h.register_hook(lambda g: seen.append(g.stride()) or None)
    (_OtherStrideInADimensionOfOne.apply(h) * w).sum().backward()
    return seen[0], x.grad, w.grad


def test_strides_differing_only_in_a_dimension_of_one_element_are_the_assumed_places():
    """Such a gradient addresses the places the trace assumed
    (cagrad.capture.segments._conform): the graph goes on with it as it is,
    without the interpreter; no layout is learnt, every backward after the
    capture hits, and ``.grad`` has eager's strides, in the dimension of one
    element too (a view in the assumed strides gave (1, 1) for eager's
    (1, 4))."""
    expected = [_dimension_of_one_run(s) for s in range(3)]
    assert expected[0][0] == (1, 4)
    cagrad.reset()
    with cagrad.enable("eager"):
        got = [_dimension_of_one_run(s) for s in range(3)]
    for (e_strides, e_x, e_w), (g_strides, g_x, g_w) in zip(expected, got):
        assert g_strides == e_strides
        torch.testing.assert_close(g_x, e_x, rtol=0, atol=0)
        torch.testing.assert_close(g_w, e_w, rtol=0, atol=0)
    assert cagrad.counters["deopts"] == 0 and cagrad.counters["retraces"] == 0
    assert cagrad.counters["captures"] == 1 and cagrad.counters["cache_hits"] == 2
