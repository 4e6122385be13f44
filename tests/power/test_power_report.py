"""harness.power: outcomes and report aggregation, from hand-made cosmic-ray
results (no mutation run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.power import report, session
from harness.power.mutants import MutantId
from harness.power.outcomes import classify

cosmic_ray = pytest.importorskip("cosmic_ray")
from cosmic_ray.work_item import MutationSpec, WorkerOutcome, WorkItem, WorkResult  # noqa: E402
from cosmic_ray.work_item import TestOutcome as Verdict  # noqa: E402  (not a test class)


def _killed(name, diff="d"):
    return WorkResult(WorkerOutcome.NORMAL, f"...\nharness.power: killed-by {name} (exit 1)\n", Verdict.KILLED, diff)


SURVIVED = WorkResult(WorkerOutcome.NORMAL, "harness.power: survived\n", Verdict.SURVIVED, "--- a\n+++ b\n-x\n+y")
TIMEOUT = WorkResult(WorkerOutcome.NORMAL, "timeout", Verdict.KILLED, "d")


def test_classify():
    assert classify(_killed("golden")) == ("killed", "golden")
    assert classify(_killed("pytest:t.py")) == ("killed", "pytest:t.py")
    assert classify(SURVIVED) == ("survived", None)
    assert classify(TIMEOUT) == ("timeout", None)
    assert classify(WorkResult(WorkerOutcome.NO_TEST)) == ("no-test", None)
    assert classify(WorkResult(WorkerOutcome.EXCEPTION, "tb", Verdict.INCOMPETENT)) == ("incompetent", None)
    # a non-zero exit without the runner's last line is the runner failing, not a kill
    assert classify(WorkResult(WorkerOutcome.NORMAL, "Traceback", Verdict.KILLED)) == ("incompetent", None)


def _session(out: Path, results: dict[str, WorkResult | None], shard=(1, 1), seed=0, only=None) -> None:
    """A session folder written by hand: one work item per id, the given results."""
    out.mkdir()
    items = {}
    for text in results:
        ident = MutantId.parse(text)
        spec = MutationSpec(ident.module, ident.operator, ident.occurrence, (ident.line, 0), (ident.line, 1), {}, "f")
        items[ident] = WorkItem.single(text, spec)
    db = session.open_db(out, items)
    for job_id, result in results.items():
        if result is not None:
            db.set_result(job_id, result)
    db.close()
    params = session.Params(seed, 6, shard, ["a.py", "b.py"], ["tests"], 30, "digest", only=only)
    session.save_meta(out, session.Meta(params, 99, {"a.py": 2}, list(results), [{"started": 0.0, "baseline_seconds": 1.0, "timeout_seconds": 5.0}]))
    for n, (job_id, result) in enumerate(results.items()):
        if result is not None:
            session.append_time(out, job_id, float(n + 1))


A = ["a.py:1:core/AddNot:0", "a.py:2:core/AddNot:1", "a.py:3:core/AddNot:2", "a.py:4:core/AddNot:3"]
B = ["b.py:1:core/AddNot:0", "b.py:2:core/AddNot:1"]


def test_report_aggregates_hand_made_shards(tmp_path):
    # shard 1: a.py killed by tests, a.py survived (listed equivalent), b.py timeout
    _session(tmp_path / "s1", {A[0]: _killed("tests"), A[1]: SURVIVED, B[0]: TIMEOUT}, shard=(1, 2))
    # shard 2: a.py killed by fuzz, a.py survived, b.py pending
    _session(tmp_path / "s2", {A[2]: _killed("fuzz"), A[3]: SURVIVED, B[1]: None}, shard=(2, 2))
    eq = tmp_path / "eq.toml"
    eq.write_text(
        '[[equivalent]]\nmodule = "a.py"\nline = 2\noperator = "core/AddNot"\noccurrence = 1\nreason = "dead branch"\n'
        '[[equivalent]]\nmodule = "z.py"\nline = 9\noperator = "core/AddNot"\noccurrence = 0\nreason = "gone"\n'
        # a killed mutant is not made equivalent by a (stale) entry
        '[[equivalent]]\nmodule = "a.py"\nline = 1\noperator = "core/AddNot"\noccurrence = 0\nreason = "wrong"\n'
    )
    rep = report.build([tmp_path / "s1", tmp_path / "s2"], eq)
    a, b, total = rep["modules"]["a.py"], rep["modules"]["b.py"], rep["total"]
    # a.py: 2 killed, 1 survived, 1 equivalent: 2 / 3 scored
    assert (a["mutants"], a["killed"], a["survived"], a["equivalent"], a["timeout"]) == (4, 2, 1, 1, 0)
    assert a["score"] == pytest.approx(2 / 3)
    # b.py: 1 timeout (scored as killed), 1 pending (not scored): 1 / 1
    assert (b["mutants"], b["timeout"], b["pending"], b["score"]) == (2, 1, 1, 1.0)
    assert (total["mutants"], total["score"]) == (6, pytest.approx(3 / 4))
    assert rep["killers"] == {"tests": 1, "fuzz": 1}
    assert rep["shards_seen"] == [1, 2] and rep["stale_equivalents"] == [A[0], "z.py:9:core/AddNot:0"]
    rows = {r["id"]: r for r in rep["mutants"]}
    assert rows[A[1]]["outcome"] == "equivalent" and rows[A[1]]["equivalent_reason"] == "dead branch"
    assert rows[A[3]]["outcome"] == "survived" and "+y" in rows[A[3]]["diff"]
    assert rep["seconds_per_mutant"] == pytest.approx((1 + 2 + 3 + 1 + 2) / 5)  # pending has no time
    json_path, md_path = report.write(rep, tmp_path / "rep")
    md = md_path.read_text()
    assert "**Score: 75.0%**" in md and f"### `{A[3]}`" in md and f"### `{A[1]}`" not in md
    assert f"* `{A[1]}`: dead branch" in md and "| `a.py` | 4 | 2 | 0 | 1 | 1 | 0 | 0 | 66.7% |" in md


def test_report_refuses_mixed_runs(tmp_path):
    _session(tmp_path / "s1", {A[0]: SURVIVED}, shard=(1, 2))
    _session(tmp_path / "s2", {A[1]: SURVIVED}, shard=(2, 2), seed=5)
    with pytest.raises(report.ReportError, match="another run"):
        report.build([tmp_path / "s1", tmp_path / "s2"])
    with pytest.raises(report.ReportError, match="no harness.power session"):
        report.build([tmp_path])


def _rerun(out: Path, results: dict[str, WorkResult | None]) -> None:
    """A ``run --mutant ...`` folder of the given mutants."""
    _session(out, results, only=list(results))


def test_a_rerun_of_survivors_replaces_their_outcome_and_keeps_the_first(tmp_path):
    (tmp_path / "none.toml").write_text("")
    _session(tmp_path / "s", {A[0]: _killed("tests"), A[1]: SURVIVED, A[2]: SURVIVED, B[0]: None})
    before = report.build([tmp_path / "s"], tmp_path / "none.toml")
    assert (before["total"]["killed"], before["total"]["survived"], before["total"]["pending"]) == (1, 2, 1)
    # first rerun: A[1] still survives, A[2] killed by a new test file; B[0] (pending in the sample) killed
    _rerun(tmp_path / "r1", {A[1]: SURVIVED, A[2]: _killed("pytest:t.py", SURVIVED.diff), B[0]: _killed("tests")})
    # a later rerun wins: A[1] killed at last
    _rerun(tmp_path / "r2", {A[1]: _killed("tests", SURVIVED.diff)})
    rep = report.build([tmp_path / "s"], tmp_path / "none.toml", [tmp_path / "r1", tmp_path / "r2"])
    rows = {r["id"]: r for r in rep["mutants"]}
    assert (rep["total"]["killed"], rep["total"]["survived"], rep["total"]["pending"]) == (4, 0, 0)
    assert rep["total"]["score"] == 1.0
    assert (rows[A[2]]["outcome"], rows[A[2]]["killer"], rows[A[2]]["first_outcome"]) == ("killed", "pytest:t.py", "survived")
    assert (rows[A[1]]["first_outcome"], rows[A[1]]["rerun"]) == ("survived", str(tmp_path / "r2"))
    assert rows[B[0]]["first_outcome"] == "pending"
    assert "first_outcome" not in rows[A[0]]
    assert [r["mutants"] for r in rep["reruns"]] == [3, 1]
    assert f"* `{A[2]}`: survived in the sample, killed (pytest:t.py) now" in report.render_markdown(rep)


@pytest.mark.parametrize(
    "case, message",
    [
        ("sampled", "not a rerun"),
        ("foreign", "not in the sample"),
        ("moved", "another change"),
    ],
)
def test_a_rerun_that_is_not_of_this_sample_is_refused(tmp_path, case, message):
    (tmp_path / "none.toml").write_text("")
    _session(tmp_path / "s", {A[0]: SURVIVED, A[1]: SURVIVED})
    if case == "sampled":
        _session(tmp_path / "r", {A[0]: _killed("tests", SURVIVED.diff)})
    elif case == "foreign":
        _rerun(tmp_path / "r", {A[2]: _killed("tests", SURVIVED.diff)})
    else:
        _rerun(tmp_path / "r", {A[0]: _killed("tests", "--- a\n+++ b\n-x\n+z")})
    with pytest.raises(report.ReportError, match=message):
        report.build([tmp_path / "s"], tmp_path / "none.toml", [tmp_path / "r"])


def test_a_rerun_of_a_moved_mutant_counts_for_the_sample_row_it_relocates_to(tmp_path):
    (tmp_path / "none.toml").write_text("")
    diff = "--- a/a.py\n+++ b/a.py\n@@ -2,1 +2,1 @@\n-x == y\n+x is y"
    _session(tmp_path / "s", {A[1]: WorkResult(WorkerOutcome.NORMAL, "harness.power: survived\n", Verdict.SURVIVED, diff)})
    moved_id = "a.py:9:core/AddNot:5"  # the same change, 7 lines and 4 sites further down now
    _rerun(tmp_path / "r", {moved_id: _killed("tests", diff.replace("-2,1 +2,1", "-9,1 +9,1"))})
    with pytest.raises(report.ReportError, match="not in the sample"):
        report.build([tmp_path / "s"], tmp_path / "none.toml", [tmp_path / "r"])
    rep = report.build([tmp_path / "s"], tmp_path / "none.toml", [tmp_path / "r"], {moved_id: A[1]})
    (row,) = rep["mutants"]
    assert (row["outcome"], row["first_outcome"], row["rerun_id"]) == ("killed", "survived", moved_id)
    # a map that pairs it with a row of another change is refused
    _rerun(tmp_path / "r2", {moved_id: _killed("tests", diff.replace("+x is y", "+x != y"))})
    with pytest.raises(report.ReportError, match="another change"):
        report.build([tmp_path / "s"], tmp_path / "none.toml", [tmp_path / "r2"], {moved_id: A[1]})


def test_an_equivalents_entry_at_a_moved_line_marks_the_sample_row_it_relocates_to(tmp_path):
    _session(tmp_path / "s", {A[1]: SURVIVED})
    eq = tmp_path / "eq.toml"
    eq.write_text('[[equivalent]]\nmodule = "a.py"\nline = 9\noperator = "core/AddNot"\noccurrence = 5\nreason = "moved"\n')
    assert report.build([tmp_path / "s"], eq)["total"]["survived"] == 1  # without the map: stale
    rep = report.build([tmp_path / "s"], eq, (), {"a.py:9:core/AddNot:5": A[1]})
    assert (rep["total"]["equivalent"], rep["stale_equivalents"]) == (1, [])
