"""Static specializations (:mod:`cagrad.specialize`): a symbolic inductor
graph called a second time at one tuple of sizes is compiled again for those
sizes, and calls at exactly those sizes run that code; every other size runs
the symbolic code. Gradients are compared with eager autograd at every step.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from torch import nn

import cagrad
from cagrad import specialize


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 12)


def _grads(lin: nn.Module, x: torch.Tensor, ctx) -> list[torch.Tensor]:
    lin.zero_grad(set_to_none=True)
    with ctx:
        a, b = lin(x).chunk(2, dim=1)  # b: a view at an offset, saved by mul
        (a.sin() * b).sum().backward()
    return [p.grad.clone() for p in lin.parameters()]


def _train(backend: str, batches: list[int]) -> None:
    lin, ref = _model(), _model()
    for n in batches:
        x = torch.randn(n, 8)
        expected = _grads(ref, x, contextlib.nullcontext())
        got = _grads(lin, x, cagrad.enable(backend))
        torch.testing.assert_close(got, expected)


def test_each_hot_size_gets_its_own_compile_and_eager_gradients():
    """Batch 4 is specialized at its second backward, batch 7 at its
    second; one capture serves both (dynamic sizes) and the symbolic code
    runs the first backward at each."""
    _train("inductor", [4, 4, 4, 7, 7, 4, 7])
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["specializations"] == 2
    assert cagrad.counters["fallbacks"] == 0


def test_at_most_max_specializations_per_graph(monkeypatch):
    monkeypatch.setattr(specialize, "MAX_SPECIALIZATIONS", 1)
    _train("inductor", [4, 4, 5, 5, 5, 4])
    assert cagrad.counters["specializations"] == 1


def test_off_by_environment_and_for_other_backends(monkeypatch):
    _train("eager", [4, 4, 4])
    assert cagrad.counters["specializations"] == 0
    monkeypatch.setenv("CAGRAD_SPECIALIZE", "0")
    _train("inductor", [4, 4, 4])
    assert cagrad.counters["specializations"] == 0


def test_a_failed_specialization_keeps_the_symbolic_code(monkeypatch, caplog):
    def fail(*_args, **_kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(specialize, "static_examples", fail)
    with caplog.at_level(logging.INFO, logger="cagrad"):
        _train("inductor", [4, 4, 4, 4])
    assert cagrad.counters["specializations"] == 0
    assert cagrad.counters["fallbacks"] == 0
    assert [r.getMessage() for r in caplog.records if "no static specialization" in r.getMessage()] == [
        "cagrad: no static specialization (RuntimeError: planted); the symbolic code runs"
    ]


def test_static_examples_bind_sizes_strides_and_offset():
    """A fake tensor with symbolic geometry becomes one with the numbers the
    binding gives (checked against the values computed by hand)."""
    import sympy
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    env = mode.shape_env
    s0 = env.create_symintnode(env.create_symbol(5, source=ConstantSource("s")), hint=5)
    with mode:
        base = torch.empty(s0 * 12)
        view = base.as_strided((s0, 6), (12, 1), 6)  # the second half of (s0, 12) rows
    static, n = specialize.static_examples([view, s0 * 2], {s0.node.expr: sympy.Integer(3)}, FakeTensorMode())
    assert (tuple(static.shape), static.stride(), static.storage_offset()) == ((3, 6), (12, 1), 6)
    assert n == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_record_the_specialized_code():
    """reduce-overhead warms a specializing graph up twice, so the CUDA
    graph is recorded from the specialized code; gradients stay eager's."""
    lin, ref = _model().cuda(), copy.deepcopy(_model()).cuda()
    for _ in range(5):
        x = torch.randn(4, 8, device="cuda")
        expected = _grads(ref, x, contextlib.nullcontext())
        got = _grads(lin, x, cagrad.enable("inductor", mode="reduce-overhead"))
        torch.testing.assert_close(got, expected)
    assert cagrad.counters["specializations"] == 1
    assert cagrad.counters["cudagraph_records"] == 1
    assert cagrad.counters["cudagraph_replays"] == 3
