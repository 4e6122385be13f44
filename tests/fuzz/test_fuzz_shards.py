"""Shards and merge; known issues and the exit status of a nightly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fuzz.campaign import parse_shard
from fuzz.cli import main
from tests.conftest import CAMPAIGN_TIMEOUTS, HANG_GUARD_S

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BROKEN = f"{HERE / 'broken_subject.py'}:BrokenMulSubject"
SMALL = ["--ops", "mul,sin,add,exp,sum", "--no-hooks", "--no-shapes", "--max-ops", "4", "--neighbours", "0"]


def _campaign(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fuzz", "campaign", "--device", "cpu", "--seed", "4", "--out", str(out),
         "--no-progress", "--workers", "1", *CAMPAIGN_TIMEOUTS, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip


def _wait(p: subprocess.Popen) -> tuple[int, str]:
    text, _ = p.communicate(timeout=HANG_GUARD_S)
    return p.returncode, text


def test_two_shards_merged_find_what_one_campaign_finds(tmp_path: Path) -> None:
    args = ["--budget", "3600", "--rounds", "4", "--round-size", "6", "--shrink-seconds", "5", "--plugin", BROKEN, *SMALL]
    # the two shards side by side, as two machines would run them
    whole = _campaign(tmp_path / "whole", *args)
    code, text = _wait(whole)
    assert code == 1, text  # a planted divergence fails the campaign, known-issues file or not
    shards = [_campaign(tmp_path / f"s{k}", *args, "--shard", f"{k}/2") for k in (1, 2)]
    for p in shards:
        code, text = _wait(p)
        assert code == 1, text
    one = json.loads((tmp_path / "whole" / "report.json").read_text())
    parts = [json.loads((tmp_path / f"s{k}" / "report.json").read_text()) for k in (1, 2)]
    assert [p["shard"] for p in parts] == ["1/2", "2/2"] and one["shard"] is None
    assert one["rounds"] == 4 and [p["rounds"] for p in parts] == [2, 2]

    result = CliRunner().invoke(main, ["merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "m")])
    assert result.exit_code == 1, result.output
    merged = json.loads((tmp_path / "m" / "report.json").read_text())
    assert {f["signature"] for f in merged["failures"]} == {f["signature"] for f in one["failures"]}
    assert all(f["signature"].startswith("broken[mul]@cpu mismatch value") for f in one["failures"])
    assert merged["programs_run"] == sum(p["programs_run"] for p in parts)
    assert [p["peer_every"] for p in parts] == [4, 4] and merged["peer_every"] == 4
    assert len({f["signature"] for f in merged["failures"]}) == len(merged["failures"])  # deduplicated
    for f in merged["failures"]:
        assert (tmp_path / "m" / f["reproducer"]).exists()
    assert merged["exit_status"] == 1


def test_a_clean_cagrad_nightly_exits_0_and_known_issues_do_not_fail_it(tmp_path: Path) -> None:
    clean = _campaign(tmp_path / "clean", "--budget", "3600", "--max-programs", "8", "--subjects", "cagrad[eager]")
    known_file = tmp_path / "known.toml"
    known_file.write_text(
        '[[issue]]\nid = "planted-mul"\npattern = "broken[mul]@cpu mismatch *"\nnote = "the test plugin"\n'
    )
    planted = _campaign(
        tmp_path / "known", "--budget", "3600", "--max-programs", "12", "--plugin", BROKEN, "--known", str(known_file), *SMALL
    )
    code, text = _wait(clean)
    assert code == 0, text
    report = json.loads((tmp_path / "clean" / "report.json").read_text())
    assert report["failures"] == [] and report["exit_status"] == 0 and report["programs_run"] == 8
    code, text = _wait(planted)
    assert code == 0, text
    report = json.loads((tmp_path / "known" / "report.json").read_text())
    assert report["failures"] == [] and report["exit_status"] == 0
    assert [k["id"] for k in report["known"]] == ["planted-mul"] and report["known"][0]["count"] >= 1


def test_the_default_nightly_exits_0_with_the_shipped_known_file(tmp_path: Path) -> None:
    """The default nightly on this torch (default subjects: cagrad[eager],
    cagrad[aot_eager] and torch's compiled autograd as a peer; the shipped
    known-issues file): torch_ca's known divergences are counted and the exit
    status is 0; without the file they are failures (exit 1); a planted
    cagrad-like fault beside them still fails the run (exit 1)."""
    base = ["--seed", "1", "--budget", "3600", "--max-programs", "40", "--shrink-seconds", "5", *CAMPAIGN_TIMEOUTS]

    def run(out: str, *args: str) -> tuple[int, dict]:
        proc = subprocess.run(
            [sys.executable, "-m", "fuzz", "campaign", "--device", "cpu", "--out", str(tmp_path / out),
             "--no-progress", "--workers", "1", *base, *args],
            capture_output=True, text=True, cwd=ROOT, timeout=HANG_GUARD_S,
        )  # fmt: skip
        return proc.returncode, json.loads((tmp_path / out / "report.json").read_text())

    code, report = run("default")
    assert report["subjects"] == ["cagrad[eager]", "cagrad[aot_eager]", "torch_ca[eager]"]
    assert code == 0 and report["exit_status"] == 0 and report["failures"] == [], report["failures"]
    known = {k["id"]: k["count"] for k in report["known"]}
    assert known and all(i.startswith("torch-ca-") for i in known), known
    code, bare = run("no-known", "--known", "none")
    assert code == 1 and {f["subject"] for f in bare["failures"]} == {"torch_ca[eager]"}
    code, planted = run("planted", "--plugin", BROKEN, "--subjects", "cagrad[eager],torch_ca[eager]")
    assert code == 1 and {f["subject"] for f in planted["failures"]} == {"broken[mul]"}, planted["failures"]
    assert planted["known"]


def test_bad_shard_and_merge_inputs_are_usage_errors(tmp_path: Path) -> None:
    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/2", "3/2", "x", "1/"):
        with pytest.raises(ValueError, match="expected K/N"):
            parse_shard(bad)
    result = CliRunner().invoke(main, ["campaign", "--budget", "1", "--out", str(tmp_path / "o"), "--shard", "5/2"])
    assert result.exit_code == 2 and "K/N" in result.output
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "report.json").write_text("{not json")
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "junk"), "--out", str(tmp_path / "m")])
    assert result.exit_code == 2 and "junk/report.json" in result.output


def test_merged_shards_that_sampled_the_peers_differently_say_so(tmp_path: Path) -> None:
    """``peer_every`` of a merge: the shards' common value, None where they
    differ, 1 for a report written before the field existed."""
    from fuzz.campaign.state import REPORT_SCHEMA
    from fuzz.merge import merge_outputs

    def out(name: str, **extra: int) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "report.json").write_text(json.dumps({"schema": REPORT_SCHEMA, "programs_run": 3, "failures": [], **extra}))
        return d

    a, b, old = out("a", peer_every=4), out("b", peer_every=2), out("old")
    assert merge_outputs([a, out("a2", peer_every=4)], tmp_path / "m1")["peer_every"] == 4
    assert merge_outputs([a, b], tmp_path / "m2")["peer_every"] is None
    assert merge_outputs([old, out("old2")], tmp_path / "m3")["peer_every"] == 1
