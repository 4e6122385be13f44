"""python -m harness.bench: every cell measured, cagrad's cells on guarded
hits with no fallback, the JSON holding what the table shows."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from harness.bench.cli import main


def test_bench_measures_every_cell_and_writes_json(tmp_path):
    # its own process, as users run it: hooks other tests leave alive in this
    # one would (rightly) keep cagrad off its guarded hit path
    out = tmp_path / "bench.json"
    args = ["--workloads", "mlp,chain200", "--subjects", "eager,cagrad[eager]", "--iters", "3", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "harness.bench", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
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


def test_bench_rejects_an_unknown_workload():
    result = CliRunner().invoke(main, ["--workloads", "mlp,resnet"])
    assert result.exit_code == 2
    assert "unknown ['resnet']" in result.output
