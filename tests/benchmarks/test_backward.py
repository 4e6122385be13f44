"""Backward time per iteration: eager vs torch's compiled autograd vs cagrad.

Run with ``tox -e bench`` or
``python -m pytest tests/benchmarks --benchmark-enable --benchmark-only``.
Each round builds a fresh forward graph in ``setup`` (not timed) and times
one backward. Steady state means after warm-up rounds, so every compiled
subject is on a cache hit; ``first_backward`` times the capture plus compile
of cagrad and of torch's compiled autograd, with dynamic (symbolic) and
static sizes, the caches and Dynamo reset before each round.
"""

from __future__ import annotations

import functools

import pytest
import torch

import cagrad

from ..models import loss_fn, mlp

pytestmark = pytest.mark.benchmark


def _mlp_workload():
    torch.manual_seed(0)
    model, make_batch = mlp()
    x, y = make_batch(0)

    def forward():
        model.zero_grad(set_to_none=True)
        return loss_fn(model(x), y)

    return forward


def _chain_workload(n: int = 200):
    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)

    def forward():
        x.grad = None
        z = x
        for i in range(n):
            z = z.sin() if i % 2 else z * 1.01
        return z.sum()

    return forward


WORKLOADS = {"mlp": _mlp_workload, "chain200": _chain_workload}


def _torch_ca(backend: str):
    from torch._dynamo import compiled_autograd

    compiler_fn = functools.partial(torch.compile, backend=backend, fullgraph=True)
    return lambda: compiled_autograd._enable(compiler_fn)


def _cagrad(backend: str):
    return lambda: cagrad.enable(backend)


SUBJECTS = {
    "eager": None,
    "torch_ca[eager]": _torch_ca("eager"),
    "torch_ca[inductor]": _torch_ca("inductor"),
    "cagrad[eager]": _cagrad("eager"),
    "cagrad[inductor]": _cagrad("inductor"),
}


def _backward_in(ctx_factory, loss):
    if ctx_factory is None:
        loss.backward()
        return
    with ctx_factory():
        loss.backward()


@pytest.mark.parametrize("subject", list(SUBJECTS))
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_steady_state_backward(benchmark, workload, subject):
    torch._dynamo.reset()
    cagrad.reset()
    forward = WORKLOADS[workload]()
    ctx = SUBJECTS[subject]
    for _ in range(3):  # warm up: capture + compile, then hits
        _backward_in(ctx, forward())
    holder = {}

    def setup():
        holder["loss"] = forward()

    benchmark.pedantic(lambda: _backward_in(ctx, holder["loss"]), setup=setup, rounds=200, warmup_rounds=5)
    if subject.startswith("cagrad"):
        assert cagrad.counters["fallbacks"] == 0
        assert cagrad.counters["captures"] == 1


def _torch_ca_first(backend: str, dynamic: bool):
    from torch._dynamo import compiled_autograd

    compiler_fn = functools.partial(torch.compile, backend=backend, fullgraph=True)
    return lambda: compiled_autograd._enable(compiler_fn, dynamic=dynamic)


# first backward = capture + compile: cagrad's default (static first capture),
# symbolic sizes from the first capture, and static sizes, for cagrad and
# torch's compiled autograd
FIRST_SUBJECTS = {
    "cagrad[eager]": lambda: cagrad.enable("eager"),
    "cagrad[eager,dynamic]": lambda: cagrad.enable("eager", dynamic=True),
    "cagrad[eager,static]": lambda: cagrad.enable("eager", dynamic=False),
    "cagrad[inductor]": lambda: cagrad.enable("inductor"),
    "cagrad[inductor,dynamic]": lambda: cagrad.enable("inductor", dynamic=True),
    "torch_ca[eager]": _torch_ca_first("eager", True),
    "torch_ca[eager,static]": _torch_ca_first("eager", False),
    "torch_ca[inductor]": _torch_ca_first("inductor", True),
}


@pytest.mark.parametrize("subject", list(FIRST_SUBJECTS))
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_first_backward(benchmark, workload, subject):
    forward = WORKLOADS[workload]()
    ctx = FIRST_SUBJECTS[subject]
    holder = {}

    def setup():
        torch._dynamo.reset()
        cagrad.reset()
        holder["loss"] = forward()

    benchmark.pedantic(
        lambda: _backward_in(ctx, holder["loss"]), setup=setup, rounds=3 if "inductor" in subject else 5
    )
    if subject.startswith("cagrad"):
        assert cagrad.counters["captures"] == 1
