"""A DDP backward's hit: through the hit guard (:mod:`cagrad.keys.leaf_hooks`)
against the full collection, and eager's backward, in one run.

Run with ``tox -e bench -- -k segmented_hit``. The workload is the bench's
``ddp_mlp`` (an 8-layer MLP under ``DistributedDataParallel`` in a process
group of one, gloo on 127.0.0.1): the reducer's C++ hooks on every weight's
AccumulateGrad make the backward segmented. The variants are one group, so
the table gives their ratios. "guarded" runs the accumulations and reducer
hooks in groups (:mod:`cagrad.capture.leaf_hook_groups`), "guarded, per
leaf" each right away (``CAGRAD_LEAF_HOOK_GROUP_BYTES=0``: a segment per
accumulation); "full path" tries no guard while C++ hooks are live, as
cagrad did before these guards.
"""

from __future__ import annotations

import pytest
import torch

import cagrad
from cagrad.keys import hit_path
from harness.bench import workloads

from .hits import process_wide_gate, time_backward

pytestmark = pytest.mark.benchmark


@pytest.mark.parametrize("path", ["eager", "guarded", "guarded, per leaf", "full path"])
@pytest.mark.parametrize("workload", ["ddp_mlp"])
def test_segmented_hit(benchmark, monkeypatch, workload, path):
    if path == "full path":
        monkeypatch.setattr(hit_path, "census_allows", process_wide_gate)
    if path == "guarded, per leaf":
        monkeypatch.setenv("CAGRAD_LEAF_HOOK_GROUP_BYTES", "0")
    torch.manual_seed(0)
    wl = workloads.WORKLOADS[workload]("cpu")
    cagrad.reset()
    time_backward(benchmark, wl, path != "eager", 200)
    if path != "eager":
        guarded = cagrad.counters["guard_hits"]
        assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["cache_hits"] >= 200
        assert guarded == (0 if path == "full path" else cagrad.counters["cache_hits"])
