"""Unit tests of value comparison and error magnitudes."""

from __future__ import annotations

import math

import pytest
import torch

from harness.compare import compare_structure, compare_tensor, compare_trace, error_magnitudes
from harness.tolerance import Tolerance, tolerance_for


def tol(dtype):
    return tolerance_for(dtype, "eager")


FLOAT_TOL = tolerance_for(torch.float32, "eager")


def test_error_magnitudes_basic_and_special_values():
    e = torch.tensor([1.0, 2.0, 0.0, float("nan"), float("inf")])
    a = torch.tensor([1.5, 2.0, 0.0, float("nan"), float("inf")])
    assert error_magnitudes(e, a) == (0.5, 0.5)
    assert error_magnitudes(torch.tensor([0.0]), torch.tensor([1e-3])) == (pytest.approx(1e-3), math.inf)
    assert error_magnitudes(torch.tensor([1.0]), torch.tensor([float("nan")])) == (math.inf, math.inf)
    assert error_magnitudes(torch.tensor([1.0]), torch.tensor([float("-inf")])) == (math.inf, math.inf)
    assert error_magnitudes(torch.empty(0), torch.empty(0)) == (0.0, 0.0)
    assert error_magnitudes(torch.tensor([1 + 1j]), torch.tensor([1 + 2j])) == (1.0, pytest.approx(1 / math.sqrt(2)))


def test_compare_tensor_none_shape_dtype_device():
    t = torch.ones(2, 3)
    assert compare_tensor(None, None, "x", tol) is None
    assert compare_tensor(t, t.clone(), "x", tol) is None
    assert compare_tensor(torch.tensor([float("nan")]), torch.tensor([float("nan")]), "x", tol) is None
    m = compare_tensor(t, None, "leaf 0 .grad", tol)
    assert m.where == "leaf 0 .grad" and "subject has None" in m.detail and m.max_abs is None
    assert "shape" in compare_tensor(t, torch.ones(3, 2), "x", tol).detail
    assert "dtype" in compare_tensor(t, t.double(), "x", tol).detail
    # a sparse grad against a dense one is a layout difference
    assert "layout" in compare_tensor(t, t.to_sparse(), "x", tol).detail
    assert compare_tensor(t.to_sparse(), t.to_sparse(), "x", tol) is None


def test_compare_tensor_uses_tolerance_of_the_expected_dtype():
    e = torch.tensor([1.0, 2.0], dtype=torch.float64)
    a = e * (1 + 1e-6)
    m = compare_tensor(e, a, "x", tol)
    assert m is not None and m.max_rel == pytest.approx(1e-6, rel=1e-6) and m.rtol == 1e-7
    assert compare_tensor(e.float(), a.float(), "x", tol) is None


def test_compare_structure_and_trace():
    t = torch.arange(3.0)
    exp = [("hook", t, {"n": 1, "f": 0.5}), "tag"]
    assert compare_trace(exp, [("hook", t.clone(), {"n": 1, "f": 0.5}), "tag"], tol, FLOAT_TOL) == []
    got = [("hook", t + 1, {"n": 2, "f": 0.5 * (1 + 1e-7)}), "other", "extra"]
    ms = compare_trace(exp, got, tol, FLOAT_TOL)
    assert [m.where for m in ms] == ["trace length", "trace[0][1]", "trace[0][2]['n']", "trace[1]"]
    assert ms[1].max_abs == 1.0
    # floats use the float32 policy; a real difference is measured
    m = compare_structure(1.0, 1.1, "trace[0]", tol, FLOAT_TOL)
    assert len(m) == 1 and m[0].max_abs == pytest.approx(0.1)
    assert compare_structure(float("nan"), float("nan"), "t", tol, FLOAT_TOL) == []
    # container type and tensor-vs-nontensor differences
    assert "list" in compare_structure([1], (1,), "t", tol, FLOAT_TOL)[0].detail
    assert compare_structure(t, 3, "t", tol, FLOAT_TOL)[0].where == "t"
    assert compare_structure(1, True, "t", tol, FLOAT_TOL) != []  # type matters: 1 is not True


def test_scaled_atol_is_relative_to_expected_magnitude():
    scaled = Tolerance(0.0, 1e-5, scale_atol=True)
    e = torch.tensor([1000.0, 0.0])
    a = torch.tensor([1000.0, 5e-3])  # 5e-3 <= 1e-5 * 1000
    assert compare_tensor(e, a, "x", lambda dt: scaled) is None
    assert compare_tensor(e, a, "x", lambda dt: Tolerance(0.0, 1e-5)) is not None


def test_strides_are_compared_only_when_the_environment_asks(monkeypatch):
    eager = torch.arange(16.0).reshape(2, 2, 4).transpose(0, 1)  # strides (4, 8, 1)
    subject = eager.contiguous()  # the same values, strides (8, 4, 1)
    monkeypatch.delenv("CAGRAD_FUZZ_STRIDES", raising=False)
    assert compare_tensor(eager, subject, "x", tol) is None
    monkeypatch.setenv("CAGRAD_FUZZ_STRIDES", "1")
    m = compare_tensor(eager, subject, "leaf 0 .grad", tol)
    assert m.where == "leaf 0 .grad" and m.detail == "strides differ: eager (4, 8, 1), subject (8, 4, 1)"
    assert compare_tensor(eager, eager.clone(), "x", tol) is None  # clone keeps a dense layout
    # a dimension of one element has no meaningful stride; an expanded eager tensor is compared by value
    assert compare_tensor(torch.ones(3, 1), torch.ones(1, 3).t(), "x", tol) is None
    assert compare_tensor(torch.ones(3).expand(2, 3), torch.ones(2, 3), "x", tol) is None
    # values are checked first
    assert "strides" not in compare_tensor(eager, subject + 1, "x", tol).detail


def _threaded(events, threads, owner=7):
    from harness.program import ThreadTrace

    trace = ThreadTrace(events)
    trace.threads, trace.owner = list(threads), owner
    return trace


def test_a_trace_recorded_in_two_threads_asks_only_for_each_hooks_order():
    # eager on CUDA: the order of independent nodes' hooks varies between runs
    a, b = ("h0 pre v1", torch.ones(2)), ("h1 pre v2", torch.zeros(3))
    a2 = ("h0 pre v1", torch.full((2,), 5.0))  # h0's second call
    eager = _threaded([a, b, a2], [7, 8, 7])
    for order in ([a, b, a2], [b, a, a2], [a, a2, b]):
        assert compare_trace(eager, list(order), tol, FLOAT_TOL) == [], order
    # h0's own two calls swapped: a difference
    ms = compare_trace(eager, [a2, b, a], tol, FLOAT_TOL)
    assert [m.where for m in ms] == ["trace[0][1]", "trace[2][1]"]
    # an event eager did not record: compared position by position
    ms = compare_trace(eager, [b, a, ("h9 post v1", torch.ones(2))], tol, FLOAT_TOL)
    assert ms and ms[0].where == "trace[0][0]"
    # every event on a worker thread (the caller only fed it): still racy
    assert compare_trace(_threaded([a, b, a2], [8, 8, 8]), [b, a, a2], tol, FLOAT_TOL) == []
    # every event on the thread that ran the program (eager on CPU): every position is eager's
    ms = compare_trace(_threaded([a, b, a2], [7, 7, 7]), [b, a, a2], tol, FLOAT_TOL)
    assert ms and ms[0].where == "trace[0][0]"


def test_a_thread_trace_notes_the_recording_thread():
    import threading

    from harness.program import ThreadTrace

    trace = ThreadTrace()
    trace.append(("here", 1))
    worker = threading.Thread(target=lambda: trace.append(("there", 2)))
    worker.start()
    worker.join(timeout=60)
    assert [e[0] for e in trace] == ["here", "there"]
    assert trace.threads[0] == threading.get_ident() == trace.owner and trace.threads[1] != trace.threads[0]
