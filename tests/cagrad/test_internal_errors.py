"""The safety net (cagrad.internal_errors): a cagrad bug before anything of
the backward ran hands the backward to eager (eager's gradients, a counted
and logged fallback); with CAGRAD_STRICT=1 (the suite's default) it raises.

The bugs are planted where a torch cagrad does not know would break it: the
key collection (a Node attribute that moved), the trace (a FakeTensor API
that changed) and the guarded hit path (a guard program that reads a field
that moved); one planted where the graph already ran must propagate.
"""

from __future__ import annotations

import logging

import pytest
import torch

import cagrad
from cagrad import internal_errors
from cagrad.compile import variants
from cagrad.keys import compiled_node_args
from cagrad.run import hits

from .conftest import run_both, same


def _build():
    w = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    x = torch.randn(5, 4)
    torch.nn.functional.gelu(x @ w + b).sin().sum().backward()
    return [w.grad, b.grad]


def _moved_attribute(*args, **kwargs):
    raise AttributeError("'AddmmBackward0' object has no attribute '_saved_mat2'")


@pytest.fixture
def lenient(monkeypatch):
    monkeypatch.delenv(internal_errors.STRICT_ENV, raising=False)
    internal_errors._warned.clear()


def test_a_collection_bug_falls_back_to_eager(lenient, monkeypatch, caplog):
    monkeypatch.setattr(compiled_node_args.Collector, "collect", _moved_attribute)
    with caplog.at_level(logging.INFO, logger="cagrad"):
        expected, actual = run_both(_build)
        for x, y in zip(expected, actual):
            same(x, y)
        with cagrad.enable("eager"):
            _build()
    assert cagrad.counters["fallback_reasons"] == {"internal_error": 2}
    assert cagrad.counters["captures"] == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "cagrad"]
    assert len(warnings) == 1  # once per raising line; each one at INFO
    assert warnings[0].exc_info[0] is AttributeError
    assert "CAGRAD_STRICT=1" in warnings[0].getMessage()
    infos = [r.getMessage() for r in caplog.records if r.name == "cagrad" and "internal_error" in r.getMessage()]
    assert len(infos) == 2 and all("AttributeError" in m and "_saved_mat2" in m for m in infos)


def test_a_trace_bug_falls_back_once_per_key(lenient, monkeypatch):
    calls = []

    def broken_trace(*args, **kwargs):
        calls.append(1)
        raise TypeError("FakeTensorMode.__init__() got an unexpected keyword argument 'shape_env'")

    monkeypatch.setattr(variants, "trace_with_retries", broken_trace)
    for _ in range(3):
        expected, actual = run_both(_build)
        for x, y in zip(expected, actual):
            same(x, y)
    assert cagrad.counters["fallback_reasons"] == {"internal_error": 3}
    assert len(calls) == 1  # the key's verdict: not traced again


def test_a_hit_path_bug_falls_back_to_eager(lenient, monkeypatch):
    with cagrad.enable("eager"):
        _build()
        _build()  # the guard is built after a full-path hit
    assert cagrad.counters["guard_hits"] + cagrad.counters["cache_hits"] >= 1
    monkeypatch.setattr(hits, "try_guards", _moved_attribute)
    cagrad.counters.clear()
    expected, actual = run_both(_build)
    for x, y in zip(expected, actual):
        same(x, y)
    assert cagrad.counters["fallback_reasons"] == {"internal_error": 1}


def test_strict_mode_raises_the_bug(monkeypatch):
    monkeypatch.setenv(internal_errors.STRICT_ENV, "1")
    monkeypatch.setattr(compiled_node_args.Collector, "collect", _moved_attribute)
    with cagrad.enable("eager"), pytest.raises(AttributeError, match="_saved_mat2"):
        _build()
    assert cagrad.counters["fallbacks"] == 0


def test_a_bug_once_the_graph_ran_is_not_run_again_by_eager(lenient, monkeypatch):
    # by its second call the graph is handed the saved tensors and frees
    # them: eager cannot run this backward again, the error propagates
    from cagrad.run import runtime

    def run(broken: bool):
        w = torch.randn(4, 3, requires_grad=True)
        out = torch.nn.functional.gelu(torch.randn(5, 4) @ w).sum()
        if broken:
            monkeypatch.setattr(runtime, "call_whole", _moved_attribute)
        out.backward()
        return w

    with cagrad.enable("eager"):
        run(broken=False)
        run(broken=False)
        with pytest.raises(AttributeError, match="_saved_mat2"):
            run(broken=True)
    assert cagrad.counters["fallbacks"] == 0
