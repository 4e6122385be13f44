"""A dimension marked with ``torch._dynamo.mark_dynamic`` stays symbolic in
cagrad's backward graph (:func:`cagrad.compile.variants.slots_to_trace_dynamic`):
with the default ``dynamic=None`` (static first capture) a backward whose
marked size changes is a cache hit, not a recapture, and every ``.grad`` is
eager's at each size."""

from __future__ import annotations

import contextlib

import pytest
import torch

import cagrad

SIZES = (2, 4, 7)


def _grads(lin: torch.nn.Linear, n: int, use_cagrad: bool, mark: bool, leaf_only: bool, dynamic) -> list:
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n), requires_grad=True)
    if mark:
        torch._dynamo.mark_dynamic(x, 0)
    for p in lin.parameters():
        p.grad = None
    ctx = cagrad.enable("aot_eager", dynamic=dynamic) if use_cagrad else contextlib.nullcontext()
    with ctx:
        if leaf_only:
            # x is no saved tensor: only its AccumulateGrad carries the mark
            loss = (lin(x * 2.0)).sum()
        else:
            loss = (lin(x).relu() * x.sum(1, keepdim=True)).sum()
        loss.backward()
    return [x.grad, lin.weight.grad, lin.bias.grad]


@pytest.mark.parametrize("dynamic", [None, False])
@pytest.mark.parametrize("leaf_only", [False, True], ids=["saved", "leaf"])
def test_a_marked_size_that_changes_hits(dynamic, leaf_only):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 5)
    cagrad.reset()
    for n in SIZES:
        expected = _grads(lin, n, False, True, leaf_only, dynamic)
        actual = _grads(lin, n, True, True, leaf_only, dynamic)
        for e, a in zip(expected, actual, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
            assert a.stride() == e.stride()
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == len(SIZES) - 1


def test_without_a_mark_the_first_capture_stays_static():
    # the default policy is unchanged: the first capture is static, the
    # first change of size captures once more (symbolic)
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 5)
    cagrad.reset()
    for n in SIZES:
        _grads(lin, n, True, False, False, None)
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["cache_hits"] == len(SIZES) - 2
