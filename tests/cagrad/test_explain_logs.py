"""cagrad.explain and the loggers name why a backward misses the cache."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import cagrad
from cagrad import logs


def _mlp_loss(model, n):
    return model(torch.randn(n, 8)).sum()


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_explain_first_hit_sizes_new_node_and_key(model):
    assert cagrad.explain(_mlp_loss(model, 4), compiler_fn="eager", dynamic=False).kind == "first"
    with cagrad.enable("eager", dynamic=False):
        _mlp_loss(model, 4).backward()
    d = cagrad.explain(_mlp_loss(model, 4), compiler_fn="eager", dynamic=False)
    assert d.hit and str(d) == "cache hit"
    d = cagrad.explain(_mlp_loss(model, 6), compiler_fn="eager", dynamic=False)
    assert not d.hit and d.kind == "sizes"
    assert {(old, new) for _, _, old, new in d.changed} == {(4, 6)}
    assert any("AddmmBackward0" in where for _, where, _, _ in d.changed)
    x = torch.randn(4, 3, requires_grad=True)
    with cagrad.enable("eager", dynamic=False):
        x.sum(0).exp().sum().backward()
    d = cagrad.explain(x.sum(1).exp().sum(), compiler_fn="eager", dynamic=False)
    assert d.kind == "key" and d.node_type == "SumBackward1" and d.byte_offset is not None
    d = cagrad.explain(x.sin().sum(), compiler_fn="eager", dynamic=False)
    assert d.kind == "new_node" and d.node_type == "SinBackward0"
    assert "new node SinBackward0" in str(d)
    # explain changes nothing
    assert x.grad is not None and cagrad.counters["captures"] == 2


def test_dynamic_variant_explains_a_hit_for_new_sizes(model):
    with cagrad.enable("eager", dynamic=True):
        _mlp_loss(model, 4).backward()
    assert cagrad.explain(_mlp_loss(model, 9), compiler_fn="eager", dynamic=True).hit


def test_verbose_log_names_the_miss_and_the_dynamic_sizes(model, caplog):
    caplog.set_level(logging.DEBUG, logger="cagrad.verbose")
    with cagrad.enable("eager", dynamic=False):
        for n in (4, 4, 5):
            _mlp_loss(model, n).backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "cagrad.verbose"]
    assert lines[0] == "capture: cache miss: nothing cached yet for this compiler"
    assert lines[1].startswith("capture: cache miss: sizes changed:") and "4 -> 5" in lines[1]
    assert lines[2].startswith("sizes marked dynamic:") and "AddmmBackward0" in lines[2]
    assert len(lines) == 3


def test_graph_log_once_per_capture(model, caplog):
    caplog.set_level(logging.DEBUG, logger="cagrad")
    with cagrad.enable("eager"):
        for _ in range(3):
            _mlp_loss(model, 4).backward()
    graphs = [r for r in caplog.records if r.getMessage().startswith("captured graph:")]
    assert len(graphs) == 1
    assert "torch.ops.aten.mm.default" in graphs[0].getMessage()


def test_cagrad_logs_env_parsing():
    try:
        logs.from_env("verbose, graph")
        assert logs.verbose_log.level == logging.DEBUG
        assert logs.log.level == logging.DEBUG
        with pytest.raises(ValueError, match="unknown"):
            logs.from_env("nonsense")
    finally:
        logs.set_logs()
    assert logs.log.level == logging.WARNING


def test_explain_and_the_verbose_log_name_a_changed_global_state(model, caplog):
    # "eager" is a named backend: its graphs record the global state
    caplog.set_level(logging.DEBUG, logger="cagrad.verbose")
    with cagrad.enable("eager", dynamic=False):
        _mlp_loss(model, 4).backward()
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        d = cagrad.explain(_mlp_loss(model, 4), compiler_fn="eager", dynamic=False)
        assert not d.hit and d.kind == "global_state" and d.detail
        assert str(d).startswith("cache miss: the global state changed since the graph was compiled: ")
        with cagrad.enable("eager", dynamic=False):
            _mlp_loss(model, 4).backward()
    finally:
        torch.use_deterministic_algorithms(before)
    lines = [r.getMessage() for r in caplog.records if r.name == "cagrad.verbose"]
    assert lines[1] == f"capture: {d}"
    assert lines[2] == f"global state changed since this graph was compiled: {d.detail}"
    assert cagrad.counters["recompiles_global_state"] == 1


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_a_meta_kernel_that_raises_in_the_trace_logs_no_error(caplog):
    """torch's FakeTensor logs a meta kernel that raises at ERROR, with its
    traceback, then raises (torch 2.13 and 2.14: ``_grouped_mm``'s rejects
    float32, which the CPU kernel takes, as in the models suite's
    mixtral_grouped_mm row). cagrad catches the failure and runs that node
    as it is; a program that logs nothing in eager logs nothing at WARNING
    or above under cagrad, and the record goes to cagrad.verbose at DEBUG."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="cagrad.verbose")
    torch.manual_seed(0)
    a, b = torch.randn(8, 8, requires_grad=True), torch.randn(2, 8, 8, requires_grad=True)
    offs, weight = torch.tensor([4, 8], dtype=torch.int32), torch.randn(8, 8)

    def grads():
        a.grad = b.grad = None
        (torch._grouped_mm(a * 1, b * 1, offs=offs) * weight).sum().backward()
        return a.grad, b.grad

    expected = grads()
    caplog.clear()
    with cagrad.enable("eager"):
        actual = grads()
    for e, g in zip(expected, actual):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert cagrad.counters["opaque_reasons"]["trace_failed:GroupedMmBackward0"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    held = [r for r in caplog.records if r.name == "cagrad.verbose" and "run meta" in r.getMessage()]
    assert len(held) == 1 and held[0].exc_info is not None
    assert logging.getLogger(logs.FAKE_TENSOR_LOGGER).filters == []  # torch's records pass again
