from __future__ import annotations

import pytest
import torch

import cagrad


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    """Bitwise equality, None included: eager and the eager/aot_eager
    backends run the same aten kernels in the same order."""
    assert (a is None) == (b is None), (a, b)
    if a is not None:
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def run_both(build, backend: str = "eager"):
    """Builds twice from the same seed; runs ``build``'s backward in eager and
    under cagrad. Returns (eager_result, cagrad_result)."""
    torch.manual_seed(0)
    expected = build()
    torch.manual_seed(0)
    with cagrad.enable(backend):
        actual = build()
    return expected, actual


def run_both_traced(build, backend: str = "eager"):
    """Like :func:`run_both` for builders taking a trace list that hooks
    append ``(label, tensor or None)`` to. Returns ((eager result, eager
    trace), (cagrad result, cagrad trace))."""
    out = []
    for use_cagrad in (False, True):
        torch.manual_seed(0)
        trace: list = []
        if use_cagrad:
            with cagrad.enable(backend):
                result = build(trace)
        else:
            result = build(trace)
        out.append((result, trace))
    return out[0], out[1]


def same_trace(a: list, b: list) -> None:
    """Hook traces are equal: same labels in the same order, same values."""
    assert [label for label, _ in a] == [label for label, _ in b]
    for (label, x), (_, y) in zip(a, b):
        assert (x is None) == (y is None), label
        if x is not None:
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m: f"{label}: {m}")


def compiled_without_fallback():
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] >= 1


def check_traced(build, backend: str = "eager") -> list:
    """``build(trace)`` under eager and under cagrad: equal results and hook
    traces, and the backward compiled without a fallback. Returns the trace."""
    (e, et), (c, ct) = run_both_traced(build, backend)
    assert len(e) == len(c)
    for a, b in zip(e, c):
        same(a, b)
    same_trace(et, ct)
    compiled_without_fallback()
    return et


def errors_under_both(build, backend: str = "eager") -> list[Exception]:
    """Runs ``build()`` in eager autograd and under cagrad; returns what each
    raised, in that order (a run that raised nothing adds nothing)."""
    errors = []
    for use_cagrad in (False, True):
        try:
            if use_cagrad:
                with cagrad.enable(backend):
                    build()
            else:
                build()
        except Exception as e:  # noqa: BLE001 - comparing what eager raises
            errors.append(e)
    return errors


@pytest.fixture
def captured() -> list:
    """The CaptureEvents of this test, in order."""
    events: list = []
    cagrad.events.on_capture.append(events.append)
    yield events
    cagrad.events.on_capture.remove(events.append)


@pytest.fixture(scope="module")
def built():
    """The C++ extension's metadata readers (``cagrad.native.metadata_fns()``);
    fails where a C++ compiler is installed but the extension did not build,
    skips where there is no compiler."""
    import os
    import shutil

    from cagrad import native

    if native.load() is None:
        if shutil.which(os.environ.get("CXX", "c++")) is not None:
            pytest.fail("a C++ compiler is installed but the cagrad extension did not build (see the cagrad warning)")
        pytest.skip("no C++ compiler: the extension cannot be built")
    return native.metadata_fns()


def same_with_side_effects(run, seen: list, compiler="eager", calls: int = 3) -> None:
    """``run()`` (returning a list of gradients) under eager and then under
    ``cagrad.enable(compiler)`` gives the same gradients, and its side effect
    (appending to ``seen``) runs ``calls`` times in each, with the same values."""
    expected = run()
    eager_seen = list(seen)
    seen.clear()
    with cagrad.enable(compiler):
        actual = run()
    for a, b in zip(expected, actual):
        same(a, b)
    assert len(seen) == len(eager_seen) == calls
    for a, b in zip(seen, eager_seen):
        same(a, b)
