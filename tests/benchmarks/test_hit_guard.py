"""One hit guard's call on a fresh graph: its structure walk and per-node
checks as one C++ call each (:mod:`cagrad.native.guard_program`) against
Python lines.

Run with ``tox -e bench -- -k hit_guard``. Each round builds a new forward
graph in ``setup`` (not timed) and times the guard alone (the structure walk,
the checks, the lifted tensors and size values), as a backward's hit path
calls it. Both variants of a workload are in one group, so the table gives
their ratio measured in one run.
"""

from __future__ import annotations

import pytest
import torch

import cagrad
from cagrad import engine, native
from harness.bench import workloads

pytestmark = pytest.mark.benchmark


@pytest.mark.parametrize("checks", ["program", "lines"])
@pytest.mark.parametrize("workload", ["cnn", "mlp", "transformer"])
def test_hit_guard(benchmark, monkeypatch, workload, checks):
    if checks == "lines":
        monkeypatch.setattr(native, "collect_fn", lambda: None)
        monkeypatch.setattr(native, "walk_fn", lambda: None)
    elif native.collect_fn() is None or native.walk_fn() is None:
        pytest.skip("the C++ extension cannot be built here (no compiler)")
    torch.manual_seed(0)
    wl = workloads.WORKLOADS[workload]("cpu")
    cagrad.reset()
    with cagrad.enable("eager"):
        for _ in range(2):  # capture, then a guarded hit
            wl.step(wl.model).backward()
    assert cagrad.counters["guard_hits"] == 1
    [guard] = engine.cache_for("eager", None).guards
    assert ("_collect(" in guard.source) == (checks == "program")
    grads = [torch.ones(())]
    holder = {}

    def setup():
        holder["roots"] = [wl.step(wl.model)]

    benchmark.pedantic(lambda: guard.fn(holder["roots"], grads, None), setup=setup, rounds=300, warmup_rounds=5)
    assert guard.fn(holder["roots"], grads, None) is not None
