"""A value that one graph segment computes reaches the steps that read it
later in the strides the trace gave it: a later segment, compiled for those
strides, and a hook or AccumulateGrad, which see eager's layout.

Found on the H100: inductor returned a transposed ``where`` from one segment
contiguous, and the next segment's size-and-stride assert failed at its
first call, so it ran uncompiled from then on (``segment_compile_failures``).
The backend here does what inductor did, on CPU: its code checks its inputs'
strides against the example inputs it was compiled for, and returns its
outputs contiguous.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.registry import register_backend

import cagrad

from .conftest import same


@register_backend(name="cagrad_test_contiguous_outputs")
def _contiguous_outputs(gm, example_inputs):
    expected = [tuple(x.stride()) if isinstance(x, torch.Tensor) else None for x in example_inputs]

    def run(*args):
        for k, (a, want) in enumerate(zip(args, expected)):
            if want is not None and isinstance(a, torch.Tensor):
                got = a.stride()
                wrong = [d for d, n in enumerate(a.shape) if n > 1 and got[d] != want[d]]
                assert not wrong, f"input {k}: strides {tuple(got)}, compiled for {want}"
        outs = gm(*args)
        return [o.contiguous() if isinstance(o, torch.Tensor) else o for o in outs]

    return run


def _program(trace: list) -> list:
    g = torch.Generator().manual_seed(0)
    x1 = torch.rand((2, 2, 4), generator=g).requires_grad_(True)
    x2 = torch.rand((2, 1, 4), generator=g).requires_grad_(True)
    c1 = torch.rand((), generator=g).requires_grad_(True)
    v = torch.minimum(x1.transpose(0, 1), x2)  # its gradient is transposed
    v.register_hook(lambda grad: trace.append(grad.clone()))  # opaque: the graph is cut here
    (v.sum() + c1.sum()).backward()
    return [x1.grad, x2.grad, c1.grad]


def test_a_value_crossing_segments_is_restrided_for_the_segment_that_reads_it():
    expected_trace: list = []
    expected = _program(expected_trace)
    with cagrad.enable("cagrad_test_contiguous_outputs", dynamic=False):
        for _ in range(3):
            trace: list = []
            got = _program(trace)
            for a, b in zip(expected, got):
                same(a, b)
            same(expected_trace[0], trace[0])
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["segment_compile_failures"] == 0
    assert cagrad.counters["backend_compiles"] >= 2  # segmented
    assert cagrad.counters["cache_hits"] == 2


def _sized(n: int, trace: list) -> list:
    g = torch.Generator().manual_seed(n)
    x1 = torch.rand((n, n, 4), generator=g).requires_grad_(True)
    x2 = torch.rand((n, 1, 4), generator=g).requires_grad_(True)
    v = torch.minimum(x1.transpose(0, 1), x2)
    v.register_hook(lambda grad: trace.append(grad.clone()))
    v.sum().backward()
    return [x1.grad, x2.grad]


def test_symbolic_strides_of_a_crossing_value_follow_the_sizes():
    # the traced strides are functions of the size symbols, evaluated at
    # each call's sizes: one capture serves every size, and eager's
    # gradients come out at each
    sizes = [2, 3, 5, 3]
    expected = [_sized(n, []) for n in sizes]
    with cagrad.enable("aot_eager", dynamic=True):
        got = [_sized(n, []) for n in sizes]
    for e, g in zip(expected, got):
        for a, b in zip(e, g):
            same(a, b)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["segment_compile_failures"] == 0
    assert cagrad.counters["captures"] <= 2


def _transposed_grad(hook) -> list:
    g = torch.Generator().manual_seed(0)
    x1 = torch.rand((2, 2, 4), generator=g).requires_grad_(True)
    x2 = torch.rand((2, 1, 4), generator=g).requires_grad_(True)
    c = torch.rand((), generator=g).requires_grad_(True)
    v3 = x1.transpose(0, 1)
    v3.register_hook(hook)  # its gradient comes from minimum's backward, transposed
    (torch.minimum(v3, x2).sum() * c).backward()
    return [x1.grad, x2.grad, c.grad]


# torch 2.14's MinimumBackward0 takes an out-of-place masked_fill (contiguous
# result) when a Python dispatch mode is active, where eager's in-place
# masked_fill_ keeps where()'s transposed strides: cagrad traces under
# FakeTensorMode and hands the hook a contiguous gradient (values equal). A
# known divergence to fix in the tracer (the node's eager output strides),
# not hidden: strict, so the test fails once it is fixed.
_MODE_SENSITIVE_FORMULAS = pytest.mark.xfail(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14),
    reason="torch 2.14: MinimumBackward0 gives other strides under a dispatch mode than in eager",
    strict=True,
)


@_MODE_SENSITIVE_FORMULAS
def test_a_hook_sees_the_strides_eager_gives_it():
    expected: list = []
    _transposed_grad(lambda g: expected.append(g.stride()))
    assert expected == [(4, 8, 1)]  # transposed, from x1's layout
    seen: list = []
    with cagrad.enable("cagrad_test_contiguous_outputs", dynamic=False):
        for _ in range(2):
            _transposed_grad(lambda g: seen.append(g.stride()))
    assert seen == expected * 2
    assert cagrad.counters["segment_compile_failures"] == 0


def test_a_hook_that_changes_a_restrided_gradient_in_place_changes_what_follows():
    def doubles(g):
        g.mul_(2)  # returns None: the same, changed tensor goes on

    expected = _transposed_grad(doubles)
    with cagrad.enable("cagrad_test_contiguous_outputs", dynamic=False):
        for _ in range(2):
            got = _transposed_grad(doubles)
            for a, b in zip(expected, got):
                same(a, b)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


def test_only_layouts_with_a_place_per_element_are_written_into():
    from cagrad.capture.segments import _distinct_places, _restrided

    assert _distinct_places((2, 2, 4), (4, 8, 1)) and _distinct_places((2, 1, 4), (4, 99, 1))
    assert not _distinct_places((2, 2, 4), (0, 4, 1))  # expanded
    assert not _distinct_places((2, 3), (1, 1))  # overlapping
    t = torch.arange(16.0).reshape(2, 2, 4)
    moved = _restrided(t, (4, 8, 1))
    assert moved.stride() == (4, 8, 1) and torch.equal(moved, t)
    assert _restrided(t, (0, 0, 1)) is t  # an expanded target keeps the value as it is
