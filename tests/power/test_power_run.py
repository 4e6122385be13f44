"""harness.power.runner: resume, parameters checked, the user's tree never
mutated; one real run of cosmic-ray over a tiny module with a fast killer, and
(slow) one over cagrad itself."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.power import report, runner, session
from harness.power.session import SessionError

pytest.importorskip("cosmic_ray")

MODULE = textwrap.dedent(
    """\
    def clamp(x, lo, hi):
        if x < lo:
            return lo
        if x > hi:
            return hi
        return x
    """
)
TEST = "from pkg.mod import clamp\n\n\ndef test_clamp():\n    assert (clamp(5, 0, 3), clamp(-1, 0, 3), clamp(2, 0, 3)) == (3, 0, 2)\n"


def _repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text(MODULE)
    (root / "test_mod.py").write_text(TEST)
    return root


def _digest(root: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))).hexdigest()


def _cfg(root: Path, out: Path, **kw) -> runner.RunConfig:
    kw.setdefault("sample", 5)
    return runner.RunConfig(
        out=out, targets=("pkg",), killers=("pytest:test_mod.py",), copied=("pkg", "test_mod.py"), package="pkg",
        scratch=root.parent, **kw,
    )  # fmt: skip


def test_resume_runs_only_pending_mutants(tmp_path, monkeypatch):
    import cosmic_ray.mutating
    from cosmic_ray.work_item import WorkResult, WorkerOutcome
    from cosmic_ray.work_item import TestOutcome as Verdict

    root = _repo(tmp_path)
    ran: list[str] = []

    def fake_mutate_and_test(mutations, command, timeout):
        (spec,) = mutations
        assert timeout == 5.0 * 2.0  # the factor times the measured baseline
        assert Path.cwd().name.startswith("cagrad-power-tree-")  # applied in the copy
        ran.append(f"{spec.module_path}:{spec.operator_name}:{spec.occurrence}")
        return WorkResult(WorkerOutcome.NORMAL, "harness.power: survived", Verdict.SURVIVED, "diff")

    monkeypatch.setattr(cosmic_ray.mutating, "mutate_and_test", fake_mutate_and_test)
    monkeypatch.setattr(runner, "baseline", lambda *a, **k: 2.0)
    out = tmp_path / "out"
    runner.run(_cfg(root, out, max_mutants=2), log=lambda m: None, root=root)
    first = list(ran)
    assert len(first) == 2
    runner.run(_cfg(root, out), log=lambda m: None, root=root)  # resumed
    assert len(ran) == 5 and not set(ran[2:]) & set(first)
    meta = session.load_meta(out)
    assert [f"{i.split(':')[0]}:{i.split(':')[2]}:{i.split(':')[3]}" for i in meta.ids] == ran  # sampled order
    assert len(meta.runs) == 2  # a baseline per start
    runner.run(_cfg(root, out), log=lambda m: None, root=root)  # nothing pending: no mutant, no baseline
    assert len(ran) == 5 and len(session.load_meta(out).runs) == 2
    with pytest.raises(SessionError, match=r"seed 0 != 1"):
        runner.run(_cfg(root, out, seed=1), log=lambda m: None, root=root)
    (root / "pkg" / "mod.py").write_text(MODULE + "\n# changed\n")
    with pytest.raises(SessionError, match="sources changed"):
        runner.run(_cfg(root, out), log=lambda m: None, root=root)


def test_a_real_run_over_a_tiny_module(tmp_path):
    """cosmic-ray applies each mutant in a copy; the killer kills the ones
    that change clamp's results; the checkout is untouched."""
    root = _repo(tmp_path)
    before = _digest(root)
    out = tmp_path / "out"
    runner.run(_cfg(root, out, sample=3, seed=4), log=lambda m: None, root=root)
    assert _digest(root) == before and not list(root.rglob("__pycache__"))
    assert not list(tmp_path.glob("cagrad-power-*"))  # copy, extension seed and scratch removed
    rep = report.build([out])
    outcomes = {r["id"]: (r["outcome"], r["killer"]) for r in rep["mutants"]}
    assert len(outcomes) == 3 and rep["total"]["pending"] == 0
    # judged independently: which of the three mutants change clamp(5,0,3), clamp(-1,0,3) or clamp(2,0,3)
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    for ident, (outcome, killer) in outcomes.items():
        _, _, op, occ = ident.rsplit(":", 3)[0], *ident.rsplit(":", 3)[1:]
        source = mutate_code(MODULE, get_operator(op)(), int(occ))
        scope: dict = {}
        exec(source, scope)
        changed = (scope["clamp"](5, 0, 3), scope["clamp"](-1, 0, 3), scope["clamp"](2, 0, 3)) != (3, 0, 2)
        assert (outcome, killer) == (("killed", "pytest:test_mod.py") if changed else ("survived", None)), ident


def test_timeout_is_its_own_outcome(tmp_path):
    """cosmic-ray's test runner kills a command past its timeout; the report
    counts that apart from a killer's failure."""
    from cosmic_ray.testing import run_tests

    from harness.power.outcomes import classify
    from cosmic_ray.work_item import WorkResult, WorkerOutcome

    outcome, output = run_tests(f"{sys.executable} -c 'import time; time.sleep(60)'", 1.0)
    assert classify(WorkResult(WorkerOutcome.NORMAL, output, outcome)) == ("timeout", None)


@pytest.mark.slow
def test_cagrad_end_to_end(tmp_path):
    """The CLI over three mutants of cagrad/autograd/ready_queue.py with one killer."""
    root = Path(__file__).resolve().parents[2]
    before = _digest(root / "cagrad" / "autograd")
    proc = subprocess.run(
        [sys.executable, "-m", "harness.power", "run", "--out", str(tmp_path / "out"), "--module",
         "cagrad/autograd/ready_queue.py", "--sample", "3", "--seed", "0", "--killers",
         "pytest:tests/cagrad/test_ready_queue.py", "--scratch", str(tmp_path)],
        cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _digest(root / "cagrad" / "autograd") == before
    rep = report.build([tmp_path / "out"])
    assert rep["total"]["mutants"] == 3 and rep["total"]["pending"] == rep["total"]["incompetent"] == 0
    assert (tmp_path / "out" / "report.md").read_text().startswith("# Mutation report")


def test_named_mutants_instead_of_a_sample(tmp_path, monkeypatch):
    import cosmic_ray.mutating
    from cosmic_ray.work_item import WorkResult, WorkerOutcome

    root = _repo(tmp_path)
    ran: list[str] = []
    monkeypatch.setattr(
        cosmic_ray.mutating, "mutate_and_test",
        lambda mutations, command, timeout: ran.append(mutations[0].operator_name) or WorkResult(WorkerOutcome.NO_TEST),
    )  # fmt: skip
    monkeypatch.setattr(runner, "baseline", lambda *a, **k: 1.0)
    wanted = ("pkg/mod.py:2:core/ReplaceComparisonOperator_Lt_Gt:0", "pkg/mod.py:4:core/ReplaceComparisonOperator_Gt_Lt:0")
    runner.run(_cfg(root, tmp_path / "out", only=wanted), log=lambda m: None, root=root)
    assert ran == ["core/ReplaceComparisonOperator_Lt_Gt", "core/ReplaceComparisonOperator_Gt_Lt"]
    with pytest.raises(SessionError, match="no such mutant in pkg/__init__.py, pkg/mod.py: pkg/mod.py:9:core/AddNot:0"):
        runner.run(_cfg(root, tmp_path / "out2", only=("pkg/mod.py:9:core/AddNot:0",)), log=lambda m: None, root=root)


@pytest.mark.slow  # about 25 s on a loaded machine
def test_an_interrupted_run_stops_the_mutants_killers_and_resumes(tmp_path):
    """SIGTERM while a mutant's killer runs: the killer's process group is
    killed (cosmic-ray started it in its own session), the copy removed, that
    mutant left pending; the same command resumes."""
    import os
    import signal
    import time

    root = _repo(tmp_path)
    marker = tmp_path / "killer.pid"
    # the killer passes at once on the original, and on a mutant records its pid and hangs
    (root / "test_mod.py").write_text(
        "import os, pathlib, time\n\n\ndef test_mod():\n"
        f"    if pathlib.Path('pkg/mod.py').read_text() != {MODULE!r}:\n"
        f"        pathlib.Path({str(marker)!r}).write_text(str(os.getpid()))\n"
        "        time.sleep(120)\n"
    )
    out = tmp_path / "out"
    script = (
        "import sys; from pathlib import Path; from harness.power import runner\n"
        f"cfg = runner.RunConfig(out=Path({str(out)!r}), sample=2, targets=('pkg',), killers=('pytest:test_mod.py',),\n"
        f"    copied=('pkg', 'test_mod.py'), package='pkg', scratch=Path({str(tmp_path)!r}), timeout_factor=1000)\n"
        f"runner.run(cfg, log=print, root=Path({str(root)!r}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for _ in range(600):  # the first mutant's killer has started (bounded by polls, not time)
        if marker.exists() and marker.read_text():
            break
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the killer never started")
    killer = int(marker.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    for _ in range(100):  # reaped by init once killed
        try:
            os.kill(killer, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the mutant's killer {killer} still runs")
    assert not list(tmp_path.glob("cagrad-power-*"))
    db = session.open_db(out)
    assert session.done_ids(db) == set()  # the interrupted mutant has no result
    db.close()
