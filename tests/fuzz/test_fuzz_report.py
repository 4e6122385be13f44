"""``python -m fuzz report``: the HTML page and the JUnit XML made from a report.json.

The inputs are hand-written report.json documents (schema 2 with the new
fields: timeline, known, throughput, crash/timeout failures; and schema 1),
with reproducer files holding text that must be escaped.
"""

from __future__ import annotations

import html
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fuzz.cli import main
from fuzz.report.html import render_html
from fuzz.report.junit import build_junit
from fuzz.report.load import ReportError, load_report

SECTIONS = ("summary", "timeline", "coverage", "outcomes", "failures", "known", "build-errors", "fallback", "captures")

# Reproducer text with markup and quotes that must come out escaped.
NASTY = '# </pre><script>alert("x")</script> & <b>bold</b>\nx = torch.ones(3) < 2\n'


def _failure(fid: str, subject: str, status: str, kind: str, outcome: dict[str, Any], reproducer: bool = True) -> dict:
    sig = f"{subject}@cpu {status} {kind}: {fid.lower()}"
    return {
        "id": fid,
        "signature": sig,
        "count": 2,
        "subject": subject,
        "device": "cpu",
        "status": status,
        "kind": kind,
        "ops": ["mul", "sin"],
        "hooks": ["hook:tensor.zero"],
        "original_ops": 7,
        "shrunk_ops": 2,
        "reproducer": f"failures/{fid}/reproducer.py" if reproducer else None,
        "program_json": f"failures/{fid}/program.json",
        "first_outcome": outcome,
    }


def _schema2() -> dict[str, Any]:
    return {
        "schema": 2,
        "seed": 7,
        "budget_s": 60.0,
        "elapsed_s": 40.0,
        "programs_run": 500,
        "peer_every": 4,
        "op_counts": {"mul": 120, "sin": 80, "neg": 3},
        "feature_counts": {"hook:tensor.zero": 11, "mode:grad": 40},
        "coverage": {
            "features": {"op=mul": 100, "op=sin": 70, "op=neg": 3, "mode=grad": 40},
            "pairs": {"loss=sum & mode=grad": 40},
            "feature_groups": {"op": {"total": 5, "covered": 3, "uncovered": ["op=exp", "op=bmm"]}},
            "pair_groups": {
                "loss x mode": {
                    "total": 4,
                    "covered": 1,
                    "uncovered": ["loss=sum & mode=backward", "loss=separate & mode=backward", "loss=separate & mode=grad"],
                }
            },
        },
        "steered": True,
        "subjects": ["cagrad[eager]", "torch_ca[eager]", "broken"],
        "devices": ["cpu"],
        "failures": [
            _failure("F001", "broken", "mismatch", "value", {
                "status": "mismatch",
                "mismatches": [{"where": "leaf 0 grad", "detail": "Tensor-likes are not close!"}],
            }),
            _failure("F002", "torch_ca[eager]", "error", "AssertionError", {
                "status": "error",
                "error": {"type": "AssertionError", "message": "queue_callback() <only> with fullgraph", "traceback": ""},
            }),
            _failure("F003", "broken", "crash", "crash", {"status": "crash", "signal": "SIGABRT", "detail": "core dumped"}),
            _failure("F004", "broken", "timeout", "timeout", {"status": "timeout", "seconds": 30.0}, reproducer=False),
        ],
        "known": [
            {
                "id": "torch-ca-hook-order",
                "signature": "torch_ca[eager]@cpu mismatch trace: hook order",
                "count": 9,
                "note": "torch's compiled autograd runs <pre> hooks late",
                "link": "https://github.com/pytorch/pytorch/issues/1",
            }
        ],
        "build_errors": 1,
        "outcome_counts": {
            "cagrad[eager]@cpu": {"equal": 500},
            "torch_ca[eager]@cpu": {"equal": 480, "error": 2, "mismatch": 9, "fallback": 9},
            "broken@cpu": {"equal": 494, "mismatch": 2, "crash": 2, "timeout": 2},
        },
        "fallback_reasons": {"cagrad[eager]@cpu": {"unsupported hook": 4}},
        "sequence_captures": {
            "cagrad[eager]@cpu": {"sequences": 5, "variants": 15, "captures": 6, "over_first": 1, "rule_failures": 0}
        },
        "rounds": 3,
        "sessions": [{"budget_s": 60.0, "programs_run": 500, "elapsed_s": 40.0}],
        "torch_version": "2.13.0+cpu",
        "op_substitutions": {"aminmax": "torch.amin and torch.amax (this torch has no derivative for aminmax)"},
        "shard": "1/2",
        "throughput": {"programs_per_s": 12.5, "workers": 2},
        "timeline": [[0.0, 0, 0], [5.0, 60, 1], [10.0, 130, 2], [40.0, 500, 4]],
        "exit_status": 1,
    }


def _schema1() -> dict[str, Any]:
    d = _schema2()
    for field in ("known", "throughput", "timeline", "shard", "exit_status", "sequence_captures", "coverage", "steered"):
        del d[field]
    d["schema"] = 1
    d["failures"] = d["failures"][:2]
    return d


def _write_out(tmp_path: Path, report: dict[str, Any]) -> Path:
    out = tmp_path / "out"
    for f in report["failures"]:
        if f["reproducer"]:
            path = out / f["reproducer"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# reproducer of {f['id']}\n{NASTY}")
    (out / "build_errors").mkdir(parents=True, exist_ok=True)
    (out / "build_errors" / "B001.json").write_text("{}")
    (out / "report.json").write_text(json.dumps(report))
    return out


def _invoke(*args: str):
    return CliRunner().invoke(main, ["report", *args])


@pytest.fixture(scope="module")
def page2(tmp_path_factory) -> tuple[Path, str]:
    out = _write_out(tmp_path_factory.mktemp("r2"), _schema2())
    result = _invoke(str(out))
    assert result.exit_code == 0, result.output
    return out, (out / "report.html").read_text()


def test_html_is_one_offline_file_with_every_section(page2):
    out, page = page2
    assert not re.search(r"""src\s*=\s*["']?\s*(https?:)?//""", page), "external resource in the page"
    assert "<script src" not in page and "<link" not in page
    assert len(page) > 1_000_000  # plotly.js is inlined, not fetched
    for section in SECTIONS:
        assert f'<section id="{section}">' in page
    for plot in ("timeline", "ops", "features", "coverage", "outcomes", "captures"):
        assert f'id="plot-{plot}"' in page
    assert "not recorded" not in page.lower()


def test_html_summary_and_tables_hold_the_report_numbers(page2):
    _, page = page2
    text = re.sub(r"<[^>]+>", " ", page)
    text = re.sub(r"\s+", " ", text)
    for expected in ("seed 7", "programs run 500", "programs / s 12.50", "workers 2", "shard 1/2", "exit status 1",
                     "4 signature(s), hit by 8 program(s)", "1 signature(s), hit by 9 program(s)",
                     "torch's compiled autograd) ran on one program in 4"):
        assert expected in text
    # failures table: status, kind, ops, shrink, and the one-line detail of each outcome
    for expected in ("leaf 0 grad: Tensor-likes are not close!", "SIGABRT: core dumped", "no answer within 30 s",
                     "mul, sin, hook:tensor.zero", "7 → 2 ops"):
        assert expected in text
    assert html.escape("AssertionError: queue_callback() <only> with fullgraph") in page
    assert "no reproducer recorded" in page  # F004 has none
    assert '<a href="https://github.com/pytorch/pytorch/issues/1">' in page
    assert "runs &lt;pre&gt; hooks late" in page
    assert "build_errors/B001.json" in page and "unsupported hook" in page
    assert "op substitutions aminmax: torch.amin and torch.amax (this torch has no derivative for aminmax)" in text


def test_html_coverage_section_shows_op_shares_and_what_was_never_seen(page2):
    _, page = page2
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))
    # op_counts: 120 + 80 + 3 = 203 uses over the 5 ops of feature_groups.op: 40.6
    # per op; mul has 120 = 59.1 % of them, 120 / 40.6 = 2.96 x the mean
    assert "203 op uses over 5 ops: 40.6 per op on average; the most used, mul, 120 (59.1%, 2.96 x the mean)" in text
    assert "steered toward what earlier rounds covered least" in text
    assert "op 3 5 2 op=exp, op=bmm" in text
    assert "loss x mode 1 4 3 loss=sum & mode=backward, loss=separate & mode=backward" in html.unescape(text)
    assert 'id="plot-coverage"' in page


def test_coverage_of_the_wrong_shape_is_named(tmp_path):
    report = _schema2()
    report["coverage"]["pair_groups"]["loss x mode"]["uncovered"] = "loss=sum"
    with pytest.raises(ReportError, match=r"coverage\.pair_groups\['loss x mode'\]\.uncovered: 'loss=sum' is not of type 'array'"):
        load_report(_write_out(tmp_path, report))


def test_html_inlines_every_reproducer_escaped(page2):
    out, page = page2
    assert '<script>alert("x")</script>' not in page and "<b>bold</b>" not in page
    blocks = [html.unescape(b) for b in re.findall(r"<pre>(.*?)</pre>", page, flags=re.S)]
    for fid in ("F001", "F002", "F003"):
        assert (out / "failures" / fid / "reproducer.py").read_text() in blocks
    assert page.count("<details><summary>reproducer") == 3


def test_junit_has_one_case_per_signature_and_subject(page2):
    out, _ = page2
    root = ET.parse(out / "junit.xml").getroot()
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    failing = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    report = _schema2()
    assert sorted((c.get("classname"), c.get("name")) for c in failing) == sorted(
        (f"fuzz.{f['subject']}", f["signature"]) for f in report["failures"]
    )
    # crash and timeout are errors of the subject's process, the rest failures
    assert {c.get("name").split(":")[0] for c in failing if c.find("error") is not None} == {
        "broken@cpu crash crash", "broken@cpu timeout timeout"}
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("6", "2", "2", "1")
    passing = [c for c in cases if len(c) == 0 or all(e.tag == "system-out" for e in c)]
    assert [(c.get("classname"), c.get("name")) for c in passing] == [("fuzz.cagrad[eager]", "no divergence")]
    (skipped,) = [c for c in cases if c.find("skipped") is not None]
    assert skipped.get("classname") == "fuzz.torch_ca[eager]"
    assert "runs <pre> hooks late" in skipped.find("skipped").get("message")
    failure = next(c for c in failing if c.get("name").startswith("broken@cpu mismatch")).find("failure")
    assert "failures/F001/reproducer.py" in failure.text and "2 program(s)" in failure.text
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["programs_per_s"] == "12.500" and props["seed"] == "7" and props["shard"] == "1/2"
    assert float(suite.get("time")) == 40.0


def test_junit_merges_failures_of_one_signature_and_subject(tmp_path):
    report = _schema2()
    twin = dict(report["failures"][0], id="F009", count=5)
    report["failures"].append(twin)
    rep = load_report(_write_out(tmp_path, report))
    suite = ET.fromstring(build_junit(rep).tostring()).find("testsuite")
    same = [c for c in suite.findall("testcase") if c.get("name") == twin["signature"]]
    assert len(same) == 1 and "7 program(s)" in same[0].find("failure").text


def test_schema1_report_says_what_is_missing(tmp_path):
    out = _write_out(tmp_path, _schema1())
    result = _invoke(str(out), "--html", "--junit", str(tmp_path / "j.xml"))
    assert result.exit_code == 0, result.output
    page = (out / "report.html").read_text()
    for section in SECTIONS:
        assert f'<section id="{section}">' in page
    assert "this report (schema 1) has no <code>timeline</code>" in page
    assert "this report (schema 1) has no <code>known</code>" in page
    assert "no <code>sequence_captures</code>" in page
    assert "this report has no <code>coverage</code>" in page
    # programs/s from programs_run / elapsed_s when throughput was not recorded
    assert "12.50 (programs / elapsed; not recorded)" in page
    suite = ET.parse(tmp_path / "j.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("3", "2", "0", "0")
    assert not (out / "junit.xml").exists()


def test_flags_choose_the_outputs(tmp_path):
    out = _write_out(tmp_path, _schema2())
    result = _invoke(str(out / "report.json"), "--junit")
    assert result.exit_code == 0, result.output
    assert (out / "junit.xml").exists() and not (out / "report.html").exists()
    result = _invoke(str(out), "--html", str(tmp_path / "elsewhere" / "page.html"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "elsewhere" / "page.html").exists() and not (out / "report.html").exists()


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, r"report\.json: no such file; expected a campaign's report\.json"),
        ('{"schema": 2,\n "seed": 1,\n "failures": [', r"report\.json:3:\d+: not valid JSON"),
        ("[1, 2]", r"report\.json: expected a JSON object"),
        (b"\xff\xfe{", r"report\.json: byte 0 is not UTF-8"),
        ('{"schema": 9, "seed": 1, "programs_run": 0, "failures": []}', r"field 'schema' is 9; expected one of \[1, 2\]"),
        ('{"schema": 2, "seed": 1, "programs_run": "many", "failures": []}', r"field \$\.programs_run: 'many' is not of type 'integer'"),
        ('{"schema": 2, "seed": 1, "programs_run": 3, "failures": [{"signature": "s"}]}', r"field \$\.failures\[0\]: 'subject' is a required property"),
        ('{"schema": 2, "seed": 1, "programs_run": 3, "failures": [], "timeline": [[1, 2]]}', r"field \$\.timeline\[0\]"),
    ],
)
def test_bad_report_exits_2_naming_the_file(tmp_path, content, expected):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.html").write_text("earlier page")
    if isinstance(content, bytes):
        (out / "report.json").write_bytes(content)
    elif content is not None:
        (out / "report.json").write_text(content)
    result = _invoke(str(out))
    assert result.exit_code == 2
    assert str(out / "report.json") in result.stderr and re.search(expected, result.stderr), result.stderr
    assert (out / "report.html").read_text() == "earlier page"  # nothing written over
    with pytest.raises(ReportError):
        load_report(out)


def test_unwritable_output_exits_2_and_keeps_nothing_half_written(tmp_path):
    out = _write_out(tmp_path, _schema2())
    (tmp_path / "file").write_text("x")
    result = _invoke(str(out), "--junit", str(tmp_path / "file" / "junit.xml"))
    assert result.exit_code == 2 and "cannot write" in result.stderr and "file/junit.xml" in result.stderr


def test_reproducer_outside_out_is_not_read(tmp_path):
    report = _schema2()
    report["failures"][0]["reproducer"] = "../secret.txt"
    (tmp_path / "secret.txt").write_text("do not show")
    out = _write_out(tmp_path, report)
    page = render_html(load_report(out))
    assert "do not show" not in page and "is outside" in page
