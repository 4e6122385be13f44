"""Code that warns while cagrad traces it runs as it is, so that its warning
is emitted on every backward as in eager (cagrad.capture.warnings_in_trace).

``F.softmax`` without ``dim`` warns on every call ("Implicit dimension
choice for softmax has been deprecated"); a hook or a custom Function's
backward made only of such calls is accepted by cagrad's tracing checkers.
Traced, the warning would be emitted at capture and never on a cache hit.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import cagrad
from cagrad.capture.warnings_in_trace import WarnedInTrace, warnings_refused
from harness.warnings_seen import recording

IMPLICIT_DIM = "Implicit dimension choice for softmax"


class SoftmaxBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return F.softmax(g) * 3


def _hooked(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    y.register_hook(lambda g: F.softmax(g))
    return y.cos().sum()


def _custom(x: torch.Tensor) -> torch.Tensor:
    return SoftmaxBackward.apply(x.sin()).cos().sum()


def _backward(build, compiled: bool) -> tuple[torch.Tensor, list[str]]:
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    loss = build(x)
    with recording() as seen:
        if compiled:
            with cagrad.enable("eager"):
                loss.backward()
        else:
            loss.backward()
    return x.grad, [r.message for r in seen]


@pytest.mark.parametrize("build", [_hooked, _custom], ids=["tensor_hook", "custom_backward"])
def test_a_warning_in_traceable_code_is_emitted_on_every_backward(build) -> None:
    grad, want = _backward(build, compiled=False)
    assert len(want) == 1 and IMPLICIT_DIM in want[0]
    cagrad.reset()
    before = dict(cagrad.counters)
    for k in range(3):  # a capture, then hits
        got_grad, got = _backward(build, compiled=True)
        torch.testing.assert_close(got_grad, grad, rtol=0, atol=0)
        assert got == want, f"backward {k}"
    assert cagrad.counters["captures"] - before.get("captures", 0) == 1
    assert cagrad.counters["cache_hits"] - before.get("cache_hits", 0) == 2


@pytest.mark.parametrize("build", [_hooked, _custom], ids=["tensor_hook", "custom_backward"])
def test_under_warnings_as_errors_cagrad_raises_as_eager_on_every_backward(build) -> None:
    cagrad.reset()
    for k in range(2):
        for compiled in (False, True):
            x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
            loss = build(x)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with pytest.raises(UserWarning, match=IMPLICIT_DIM):
                    if compiled:
                        with cagrad.enable("eager"):
                            loss.backward()
                    else:
                        loss.backward()


def test_warnings_refused_raises_in_its_thread_only_and_restores_warn() -> None:
    original = warnings.warn
    filters = list(warnings.filters)
    other: list = []

    def elsewhere() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.warn("from another thread", UserWarning, stacklevel=1)
        other.extend((str(w.message), w.filename) for w in caught)

    with warnings_refused():
        assert warnings.warn is not original
        with pytest.raises(WarnedInTrace, match="UserWarning: traced"):
            warnings.warn("traced", UserWarning, stacklevel=2)
        with warnings_refused(), pytest.raises(WarnedInTrace, match="DeprecationWarning"):  # nested
            warnings.warn(DeprecationWarning("an instance"))
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    assert warnings.warn is original and warnings.filters == filters
    # the other thread's warning is attributed to its own line, not the wrapper's
    assert other == [("from another thread", __file__)]


def test_under_warnings_as_errors_a_capture_raises_nothing_eager_does_not() -> None:
    """FakeTensor reads each lifted non-leaf's ``.grad`` (torch warns about
    such a read and hides it from display, but an ``"error"`` filter raises
    first): cagrad's capture holds torch's warnings, so the backward is
    captured and no exception reaches the program."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    h = x.sin()
    (h * h.cos()).sum().backward()  # saves the non-leaf h
    want = x.grad.clone()
    x.grad = None
    cagrad.reset()
    before = dict(cagrad.counters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            h = x.sin()
            with cagrad.enable("eager"):
                (h * h.cos()).sum().backward()
    torch.testing.assert_close(x.grad, 2 * want, rtol=0, atol=0)
    assert cagrad.counters["captures"] - before.get("captures", 0) == 1
    assert cagrad.counters["fallbacks"] - before.get("fallbacks", 0) == 0
