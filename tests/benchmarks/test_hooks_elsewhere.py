"""A hit while a hooked graph lives elsewhere in the process: guarded (the
guard reads its own nodes' hook lists) against the full collection (what
a process-wide census gate gave) and eager's backward, in one run.

Run with ``tox -e bench -- -k hooks_elsewhere``. The workload is the
bench's ``mlp``; beside it lives a small graph with a tensor hook, a node
pre-hook and ``retain_grad``. The variants are one group, so the table
gives their ratios. "full path" tries no guard while any hook is live.
"""

from __future__ import annotations

import pytest
import torch

import cagrad
from cagrad.keys import hit_path
from harness.bench import workloads

from .hits import process_wide_gate, time_backward

pytestmark = pytest.mark.benchmark


def _hooked_graph() -> torch.Tensor:
    x = torch.randn(3, requires_grad=True)
    mid = x.sin()
    mid.register_hook(lambda g: g)
    mid.retain_grad()
    out = mid.exp()
    out.grad_fn.register_prehook(lambda gs: None)
    return out


@pytest.mark.parametrize("path", ["eager", "guarded", "full path"])
@pytest.mark.parametrize("workload", ["mlp"])
def test_hooks_elsewhere(benchmark, monkeypatch, workload, path):
    if path == "full path":
        monkeypatch.setattr(hit_path, "census_allows", process_wide_gate)
    torch.manual_seed(0)
    wl = workloads.WORKLOADS[workload]("cpu")
    keep = _hooked_graph()
    cagrad.reset()
    time_backward(benchmark, wl, path != "eager", 300)
    if path != "eager":
        c = cagrad.counters
        assert c["fallbacks"] == 0 and c["cache_hits"] >= 300
        assert c["guard_hits"] == (0 if path == "full path" else c["cache_hits"])
    del keep
