"""The oracle on CUDA (skipped cleanly without a CUDA device)."""

from __future__ import annotations

import pytest
import torch

import harness
from harness import Status, examples

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_default_devices_include_cuda():
    assert [d.type for d in harness.available_devices()] == ["cpu", "cuda"]


@pytest.mark.parametrize("mode", ["backward", "grad"])
def test_mlp_agrees_on_cpu_and_cuda(mode):
    report = harness.run_differential(
        examples.mlp_program(mode), ["eager", "torch_ca[eager]", "cagrad[eager]", "cagrad[aot_eager]"]
    )
    assert report.devices == ["cpu", "cuda"]
    assert len(report.outcomes) == 8
    for o in report.outcomes:
        assert o.status is Status.EQUAL, f"{o.subject} {o.device}: {o.describe()}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_mlp_on_cuda(dtype):
    report = harness.run_differential(
        examples.mlp_program("backward", dtype), ["torch_ca[eager]", "cagrad[aot_eager]"], devices="cuda"
    )
    assert all(o.status is Status.EQUAL for o in report.outcomes), report.summary()


def test_hook_trace_on_cuda():
    report = harness.run_differential(examples.hooks_program(), ["torch_ca[eager]", "cagrad[eager]"], devices="cuda")
    assert report.outcome("torch_ca[eager]", "cuda").status is Status.EQUAL, report.summary()
    # cagrad may compile hooks or fall back for them, never differ
    o = report.outcome("cagrad[eager]", "cuda")
    assert o.status in (Status.EQUAL, Status.FALLBACK), report.summary()
    assert o.status is Status.EQUAL or o.fallback_reasons


def test_cuda_grads_stay_on_cuda():
    ex = harness.execute(harness.EagerSubject(), examples.mlp_program(), torch.device("cuda"))
    assert ex.error is None
    assert all(g.device.type == "cuda" for g in ex.leaf_grads if g is not None)


def test_cuda_error_parity():
    report = harness.run_differential(
        examples.backward_twice_program(None), ["torch_ca[eager]", "cagrad[eager]"], devices="cuda"
    )
    assert report.eager_errors["cuda"].type == "RuntimeError"
    assert all(o.ok and o.error.type == "RuntimeError" for o in report.outcomes), report.summary()


@pytest.mark.parametrize("mode", ["backward", "grad"])
def test_cuda_graph_subject_records_replays_and_agrees_at_every_step(mode):
    """The reduce-overhead subject's four steps on CUDA: a warm-up, a
    recording, then replays (the last one early where the allocator gave
    the same addresses back); each step equal to eager within inductor's
    tolerance."""
    report = harness.run_differential(
        examples.mlp_program(mode), ["cagrad[inductor,reduce-overhead]"], devices="cuda"
    )
    (o,) = report.outcomes
    assert o.status is Status.EQUAL, o.describe()
    assert o.counts["cudagraph_records"] >= 1 and o.counts["cudagraph_replays"] >= 2, o.counts
