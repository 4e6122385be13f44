"""Isolated workers: a subject that aborts its process or hangs is recorded
as a ``crash``/``timeout`` failure with a reproducer, and the campaign goes on.

No outcome here depends on how busy the machine is: campaigns are bounded by
rounds of a fixed size (``--rounds``, ``--round-size``; the ``--budget`` is
only a cap no run comes near), and the hang is a loop caught by the CPU-time
limit (``--cpu-timeout``), which a slow but working program does not reach
on a loaded machine; the wall-clock limit is large. The time limits of
:func:`fuzz.workers.probe` are checked on processes that never end by
themselves."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.ir import Program
from tests.conftest import HANG_GUARD_S

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CRASHING = HERE / "crashing_subject.py"


@pytest.mark.slow
def test_crashing_and_hanging_subjects_are_recorded_and_the_campaign_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable, "-m", "fuzz", "campaign", "--device", "cpu", "--budget", "3600", "--seed", "2",
            "--rounds", "2", "--round-size", "8", "--out", str(out), "--workers", "2", "--timeout", "600",
            "--cpu-timeout", "3", "--shrink-seconds", "5", "--no-progress",
            "--ops", "sin,exp,neg,abs,sum", "--max-ops", "2", "--no-hooks", "--known", "none", "--neighbours", "0",
            "--plugin", f"{CRASHING}:AbortOnSin", "--plugin", f"{CRASHING}:HangOnExp",
        ],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["exit_status"] == 1 and report["throughput"]["workers"] == 2
    # every round ran to its end: crashes and hangs did not cut one short
    state = json.loads((out / "state.json").read_text())
    assert sorted(state["rounds_done"]) == [0, 1] and report["programs_run"] == 16, state["rounds_done"]
    by_kind = {f["kind"]: f for f in report["failures"]}
    assert set(by_kind) == {"crash", "timeout"}, [f["signature"] for f in report["failures"]]
    crash, hang = by_kind["crash"], by_kind["timeout"]
    assert crash["signature"] == "abort[sin]@cpu crash crash: SIGABRT"
    assert crash["first_outcome"]["signal"] == "SIGABRT" and crash["status"] == "crash"
    assert hang["signature"] == "hang[exp]@cpu timeout timeout: timeout"
    assert hang["first_outcome"]["seconds"] == 3 and hang["first_outcome"]["clock"] == "cpu"
    assert hang["status"] == "timeout"
    # the recorded programs hold the op that triggers each (shrinking keeps it)
    assert "sin" in Program.from_json((out / crash["program_json"]).read_text()).op_names()
    assert "exp" in Program.from_json((out / hang["program_json"]).read_text()).op_names()
    # programs beside the failing ones ran and were counted (a crash did not end the campaign)
    assert report["programs_run"] > max(crash["count"], hang["count"])
    # the crash reproducer, run, dies the same way
    repro = subprocess.run([sys.executable, str(out / crash["reproducer"])], capture_output=True, timeout=600, cwd=ROOT)
    assert repro.returncode == -signal.SIGABRT
    assert (out / hang["reproducer"]).exists()


def test_a_crash_the_known_issues_file_lists_is_counted_as_known_not_recorded(tmp_path: Path) -> None:
    known = tmp_path / "known.toml"
    known.write_text(
        'schema = 1\n\n[[issue]]\nid = "abort-on-sin"\npattern = "abort[sin]@* crash crash: SIGABRT"\n'
        'note = "the test subject aborts on SinBackward0"\n'
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable, "-m", "fuzz", "campaign", "--device", "cpu", "--budget", "3600", "--seed", "2",
            "--rounds", "1", "--round-size", "8", "--out", str(out), "--workers", "1", "--shrink-seconds", "5",
            "--no-progress", "--ops", "sin,neg,sum", "--max-ops", "2", "--no-hooks", "--known", str(known), "--neighbours", "0",
            "--plugin", f"{CRASHING}:AbortOnSin",
        ],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["failures"] == [] and report["exit_status"] == 0
    (entry,) = report["known"]
    assert (entry["id"], entry["signature"]) == ("abort-on-sin", "abort[sin]@cpu crash crash: SIGABRT")
    # every crash was counted, and the programs beside them ran
    assert 1 <= entry["count"] < report["programs_run"] == 8
    assert not (out / "failures").exists() or not any((out / "failures").iterdir())


def test_a_device_error_ends_the_worker_and_is_recorded_as_a_crash(tmp_path: Path) -> None:
    """After a CUDA error the process's CUDA context is broken and eager
    itself would raise the same error, "agreeing" with every subject: the
    worker exits instead, the parent records a crash (``device lost``) of the
    subject that met the error, and a fresh worker goes on."""
    from fuzz.workers import DEVICE_LOST_EXIT, signal_name

    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable, "-m", "fuzz", "campaign", "--device", "cpu", "--budget", "3600", "--seed", "2",
            "--rounds", "1", "--round-size", "8", "--out", str(out), "--workers", "1", "--shrink-seconds", "5",
            "--no-progress", "--ops", "neg,sin,sum", "--max-ops", "2", "--no-hooks", "--known", "none", "--neighbours", "0",
            "--plugin", f"{CRASHING}:DeviceErrorOnNeg",
        ],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    (crash,) = report["failures"]
    assert signal_name(DEVICE_LOST_EXIT) == "device lost"
    assert crash["signature"] == "device_error[neg]@cpu crash crash: device lost", crash["signature"]
    assert "neg" in Program.from_json((out / crash["program_json"]).read_text()).op_names()
    # the programs without a neg ran in fresh workers and were counted
    assert report["programs_run"] == 8 > crash["count"] >= 1


def test_a_probe_is_stopped_by_whichever_time_limit_it_passes() -> None:
    """:func:`fuzz.workers._wait` on processes that never end by themselves
    (so no load makes the outcome differ): one that sleeps uses no CPU and
    is stopped by the wall clock; one that loops is stopped by its CPU time
    first; one that ends is not stopped."""
    from fuzz.workers import _wait, cpu_clock_available

    assert cpu_clock_available()  # CI runs on Linux
    cases = [
        ("import time; time.sleep(3600)", 1.0, 60.0, {"status": "timeout", "seconds": 1.0, "clock": "wall"}),
        ("while True: pass", 3600.0, 0.5, {"status": "timeout", "seconds": 0.5, "clock": "cpu"}),
        ("pass", 3600.0, 60.0, None),
    ]
    for code, wall, cpu, expected in cases:
        proc = subprocess.Popen([sys.executable, "-c", code])
        try:
            assert _wait(proc, wall, cpu) == expected, code
        finally:
            proc.kill()
            proc.wait()
