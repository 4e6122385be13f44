"""python -m harness.bench: every cell measured, cagrad's cells on guarded
hits with no fallback, the JSON holding what the table shows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from harness.bench.cli import main


def _bench(*args: str) -> subprocess.CompletedProcess:
    """``python -m harness.bench ARGS`` in its own process, as users run it;
    asserts it exits 0."""
    result = subprocess.run(
        [sys.executable, "-m", "harness.bench", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_bench_measures_every_cell_and_writes_json(tmp_path):
    # its own process, as users run it: hooks other tests leave alive in this
    # one would (rightly) keep cagrad off its guarded hit path
    out = tmp_path / "bench.json"
    result = _bench("--workloads", "mlp,chain200", "--subjects", "eager,cagrad[eager]", "--iters", "3",
                    "--json", str(out))
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu"
    for workload, nodes in (("mlp", 22), ("chain200", 203)):
        cells = data["cells"][workload]
        assert set(cells) == {"eager", "cagrad[eager]"}
        assert all(c["error"] is None and c["ms"] > 0 for c in cells.values())
        cagrad_cell = cells["cagrad[eager]"]
        assert cagrad_cell["nodes"] == nodes
        # 3 warm-up backwards (1 capture, 2 hits) and 3 timed hits
        assert cagrad_cell["counters"] == {"captures": 1, "cache_hits": 5, "guard_hits": 5, "fallbacks": 0}
        assert cagrad_cell["overhead_us_per_node"] > 0
    assert "chain200 (203)" in result.stdout


def test_the_checkpointed_workload_runs_compiled_after_one_capture(tmp_path):
    """Selective checkpointing: AddmmBackward0 runs as it is and returns a
    column-major gradient, which the first backward hands on as eager does
    and is traced again at its end assuming (tests/cagrad/test_opaque_layouts.py);
    every later backward hits."""
    out = tmp_path / "bench.json"
    _bench("--workloads", "checkpointed_mlp", "--subjects", "eager,cagrad[eager]", "--iters", "3",
           "--json", str(out))
    cells = json.loads(out.read_text())["cells"]["checkpointed_mlp"]
    assert all(c["error"] is None and c["ms"] > 0 for c in cells.values())
    counters = cells["cagrad[eager]"]["counters"]
    # 3 warm-up backwards (a capture, traced again at its end, 2 hits) and 3 timed hits
    assert (counters["captures"], counters["cache_hits"], counters["fallbacks"]) == (1, 5, 0)


def test_the_ddp_and_fsdp2_workloads_run_segmented_hits_with_their_hooks(tmp_path):
    """DistributedDataParallel and FSDP2 in a process group of one (gloo):
    their hooks cut the backward into segments; each is captured once and
    every later backward hits, with no fallback (a hook that did not run
    would leave DDP's reducer unfinished, which raises at the next forward,
    or FSDP2's gradients unreduced and its parameters unsharded)."""
    out = tmp_path / "bench.json"
    _bench("--workloads", "ddp_mlp,fsdp2_mlp", "--subjects", "eager,cagrad[eager]", "--iters", "3",
           "--json", str(out))
    for workload in ("ddp_mlp", "fsdp2_mlp"):
        cells = json.loads(out.read_text())["cells"][workload]
        assert all(c["error"] is None and c["ms"] > 0 for c in cells.values()), workload
        counters = cells["cagrad[eager]"]["counters"]
        # 3 warm-up backwards (a capture, 2 hits) and 3 timed hits; DDP's
        # (C++ hooks on leaves only) through the hit guard, FSDP2's (Python
        # hooks) through the full collection
        guarded = 5 if workload == "ddp_mlp" else 0
        assert counters == {"captures": 1, "cache_hits": 5, "guard_hits": guarded, "fallbacks": 0}, workload


def test_bench_rejects_an_unknown_workload():
    result = CliRunner().invoke(main, ["--workloads", "mlp,resnet"])
    assert result.exit_code == 2
    assert "unknown ['resnet']" in result.output


def test_first_backward_mode_splits_cagrads_time_and_fits_the_growth(tmp_path):
    out = tmp_path / "first.json"
    _bench("--mode", "first", "--workloads", "chain50,chain100", "--subjects", "cagrad[eager]",
           "--no-warm", "--json", str(out))
    data = json.loads(out.read_text())
    assert data["meta"]["mode"] == "first"
    for workload, nodes in (("chain50", 53), ("chain100", 103)):
        cold = data["cells"][workload]["cagrad[eager]"]["cold"]
        assert cold["error"] is None and cold["nodes"] == nodes
        assert cold["counters"] == {"captures": 1, "fallbacks": 0, "disk_hits": 0}
        # the capture's parts are parts of the first backward
        assert 0 < cold["trace_s"] and 0 < cold["compile_s"]
        assert cold["trace_s"] + cold["compile_s"] < cold["seconds"]
        assert data["cells"][workload]["cagrad[eager]"]["warm"]["seconds"] is None  # --no-warm
    assert isinstance(data["growth_exponents"]["chain"]["cagrad[eager]"], float)


def test_first_backward_mode_times_inductors_compile_for_both_compiled_autograds(tmp_path):
    out = tmp_path / "first.json"
    result = _bench("--mode", "first", "--workloads", "mlp", "--subjects", "torch_ca[inductor],cagrad[inductor]",
                    "--no-warm", "--json", str(out))
    cells = json.loads(out.read_text())["cells"]["mlp"]
    ours, theirs = cells["cagrad[inductor]"]["cold"], cells["torch_ca[inductor]"]["cold"]
    assert ours["error"] is None and theirs["error"] is None
    # inductor's compile_fx runs inside each first backward, and inside
    # cagrad's own backend-compile span
    assert 0 < theirs["backend_s"] < theirs["seconds"]
    assert 0 < ours["backend_s"] <= ours["compile_s"] < ours["seconds"]
    assert theirs["trace_s"] is None
    assert "floor" in result.stdout


def test_first_backward_of_the_eager_backend_has_no_inductor_time(tmp_path):
    from harness.bench.first import fresh_cache_dir, measure_first

    cache = fresh_cache_dir()
    try:
        cell = measure_first("chain50", "cagrad[eager]", "cpu", cache, None)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    assert cell.error is None and cell.backend_s is None and cell.compile_s > 0


def test_growth_exponent_of_known_power_laws():
    from harness.bench.first import growth_exponent

    assert abs(growth_exponent([(n, 0.003 * n) for n in (50, 100, 200, 400)]) - 1.0) < 1e-9
    assert abs(growth_exponent([(n, 2e-5 * n**2) for n in (50, 100, 400)]) - 2.0) < 1e-9
    assert growth_exponent([(100, 1.0)]) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernel_time_of_a_host_bound_backward_is_below_its_wall_time():
    from harness.bench.measure import measure
    from harness.bench.subjects import SUBJECTS
    from harness.bench.workloads import WORKLOADS

    for subject in ("eager", "cagrad[eager]"):
        cell = measure(WORKLOADS["chain200"]("cuda"), SUBJECTS[subject], "cuda", 5)
        assert cell.error is None
        # 200 elementwise kernels of 4096 floats: microseconds of GPU work
        # each, launched one by one from the host
        assert 0 < cell.gpu_ms < cell.ms


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_allocate_nothing_and_recordings_are_told_apart():
    """A replay allocates nothing: the steady peak of a reduce-overhead MLP
    is about 0 MiB, whatever its recordings in the timed window allocated; eager
    allocates its gradients and intermediates on every backward."""
    from harness.bench.measure import measure
    from harness.bench.subjects import SUBJECTS
    from harness.bench.workloads import WORKLOADS

    eager = measure(WORKLOADS["mlp"]("cuda"), SUBJECTS["eager"], "cuda", 12)
    graphed = measure(WORKLOADS["mlp"]("cuda"), SUBJECTS["cagrad[inductor,reduce-overhead]"], "cuda", 12)
    assert eager.error is None and graphed.error is None
    assert graphed.counters.get("cudagraph_replays", 0) >= 6, graphed.counters
    # the root gradient (ones_like) is all a replaying backward allocates
    assert graphed.peak_steady_mib < 0.01 and eager.peak_mib > 10
    assert graphed.peak_mib >= graphed.peak_steady_mib and graphed.records_timed >= 0


def test_rounds_combine_into_median_ratios_against_the_same_rounds_eager():
    from harness.bench.cli import combine_rounds

    def cell(ms, peak=None, steady=None, records=None):
        return {"ms": ms, "overhead_us_per_node": None if ms is None else ms * 10, "gpu_ms": None,
                "peak_mib": peak, "peak_steady_mib": steady, "records_timed": records, "nodes": 4,
                "counters": {}, "error": None if ms else "boom"}

    eager = [cell(1.0), cell(1.0), cell(2.0)]
    got = combine_rounds([cell(2.0, 5.0, 0.0, 2), cell(None), cell(3.0, 7.0, 1.0, 1)], eager)
    # rounds 1 and 3 measured: ratios 2.0 / 1.0 and 3.0 / 2.0
    assert got["ratio"] == pytest.approx(1.75) and got["ratio_range"] == [1.5, 2.0]
    assert got["ms"] == pytest.approx(2.5) and got["overhead_us_per_node"] == pytest.approx(25.0)
    assert got["peak_mib"] == 7.0 and got["round_ms"] == [2.0, None, 3.0] and got["error"] is None
    assert got["peak_steady_mib"] == 1.0 and got["records_timed"] == 3
    failed = combine_rounds([cell(None), cell(None)], eager[:2])
    assert failed["error"] == "boom" and "ratio" not in failed


@pytest.mark.parametrize("mode", ["--interleave", "--sequential"])
def test_bench_rounds_measure_the_table_again(tmp_path, mode):
    out = tmp_path / "bench.json"
    _bench("--workloads", "mlp", "--subjects", "eager,cagrad[eager]", "--iters", "3", "--rounds", "2",
           mode, "--json", str(out))
    data = json.loads(out.read_text())
    assert data["meta"]["rounds"] == 2 and data["meta"]["interleave"] == (mode == "--interleave")
    cells = data["cells"]["mlp"]
    eager, compiled = cells["eager"], cells["cagrad[eager]"]
    assert len(compiled["round_ms"]) == 2 and all(ms > 0 for ms in compiled["round_ms"])
    for sub in (eager, compiled):  # each round's ms: the median of its 3 timed backwards
        assert [sorted(t)[1] for t in sub["round_turn_ms"]] == pytest.approx(sub["round_ms"])
    if mode == "--interleave":
        # each round's ratio: the median of the turns' ratios, cagrad's
        # backward over eager's of the same turn
        ratios = [sorted(c / e for c, e in zip(ct, et))[1]
                  for ct, et in zip(compiled["round_turn_ms"], eager["round_turn_ms"])]
    else:
        ratios = [c / e for c, e in zip(compiled["round_ms"], eager["round_ms"])]
    assert compiled["ratio_range"] == pytest.approx([min(ratios), max(ratios)])
    # each round starts from a reset cagrad: 1 capture, then hits only
    assert compiled["counters"] == {"captures": 1, "cache_hits": 5, "guard_hits": 5, "fallbacks": 0}


def test_a_row_times_its_subjects_in_rotating_turns():
    """measure_row: each subject's warm-up backwards, then one timed backward
    of every subject per turn, the order rotating from turn to turn; a
    subject whose backward raises is reported and left out of later turns."""
    import contextlib

    from harness.bench.measure import WARMUP, measure_row
    from harness.bench.subjects import Subject
    from harness.bench.workloads import mlp

    ran: list[str] = []

    def context(name: str, fail_at: int | None = None):
        @contextlib.contextmanager
        def ctx():
            ran.append(name)
            if fail_at is not None and ran.count(name) == fail_at:
                raise RuntimeError("boom")
            yield

        return ctx

    subjects = {"eager": Subject(lambda m: m, context("eager")), "a": Subject(lambda m: m, context("a")),
                "b": Subject(lambda m: m, context("b", fail_at=WARMUP + 2))}
    cells = measure_row(mlp("cpu"), subjects, "cpu", 3)
    warm = ["eager"] * WARMUP + ["a"] * WARMUP + ["b"] * WARMUP
    # turn 1: eager a b; turn 2 starts at the second: a b (raises) eager;
    # turn 3 of the two left starts at the first (3rd turn, 2 subjects)
    assert ran == warm + ["eager", "a", "b", "a", "b", "eager", "eager", "a"]
    assert cells["b"].error == "RuntimeError: boom" and cells["b"].ms is None
    assert [t is not None for t in cells["b"].turn_ms] == [True, False, False]
    assert all(t is not None for t in cells["a"].turn_ms + cells["eager"].turn_ms)
    ratios = sorted(a / e for a, e in zip(cells["a"].turn_ms, cells["eager"].turn_ms))
    assert cells["a"].ratio == pytest.approx(ratios[1]) and cells["eager"].ratio is None
