"""JUnit XML for CI dashboards, made from a report.json (by ``junitparser``).

One test suite ``cagrad-fuzz``; test cases with classname ``fuzz.<subject>``:

* one failing case per (signature, subject): ``<failure>`` for a divergence
  (mismatch, error, cache), ``<error>`` for a crash or a timeout of the
  subject's process; its text names the programs count, the reproducer and
  what went wrong;
* one passing case ``no divergence`` per subject that had no failure;
* one skipped case per known issue (``known``), its message the note.

Suite properties carry the seed, torch version, programs run and programs/s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from junitparser import Error, Failure, JUnitXml, Skipped, TestCase, TestSuite

from fuzz.report.describe import outcome_detail
from fuzz.report.files import atomic_write
from fuzz.report.load import CampaignReport

#: Statuses reported as a JUnit ``<error>`` (the subject's process failed) rather than a ``<failure>``.
ERROR_STATUSES = ("crash", "timeout")


def _subject_of(signature: str) -> str:
    """The subject of a signature ``"subject@device status kind: ..."``."""
    return signature.split(" ", 1)[0].rsplit("@", 1)[0]


def _failure_case(subject: str, signature: str, failures: list[dict[str, Any]], out: Path) -> TestCase:
    case = TestCase(signature, classname=f"fuzz.{subject}")
    first = failures[0]
    count = sum(f["count"] for f in failures)
    detail = outcome_detail(first.get("first_outcome"))
    process_failed = first["status"] in ERROR_STATUSES or first["kind"] in ERROR_STATUSES
    result = (Error if process_failed else Failure)(
        message=f"{signature} ({count} program(s))", type_=f"{first['status']} {first['kind']}"
    )
    lines = [f"{count} program(s) hit this signature."]
    if detail:
        lines.append(detail)
    for f in failures:
        if f.get("reproducer"):
            lines.append(f"reproducer ({f.get('id', '?')}): python -m fuzz replay {out / f['reproducer']}")
    result.text = "\n".join(lines)
    case.result = [result]
    return case


def build_junit(rep: CampaignReport) -> JUnitXml:
    """The JUnit document for ``rep`` (see the module docstring for its cases)."""
    d = rep.data
    suite = TestSuite("cagrad-fuzz" + (f" shard {d['shard']}" if d.get("shard") else ""))
    pps = rep.programs_per_s()
    properties = {
        "seed": d["seed"],
        "torch_version": d.get("torch_version"),
        "programs_run": d["programs_run"],
        "programs_per_s": None if pps is None else f"{pps:.3f}",
        "workers": (d.get("throughput") or {}).get("workers"),
        "shard": d.get("shard"),
        "report_schema": d["schema"],
    }
    for name, value in properties.items():
        if value is not None:
            suite.add_property(name, str(value))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for f in d["failures"]:
        groups.setdefault((f["subject"], f["signature"]), []).append(f)
    for (subject, signature), failures in groups.items():
        suite.add_testcase(_failure_case(subject, signature, failures, rep.out))
    failed = {subject for subject, _ in groups}
    per_subject: dict[str, int] = {}
    for key, counts in (d.get("outcome_counts") or {}).items():
        subject = key.rsplit("@", 1)[0]
        per_subject[subject] = per_subject.get(subject, 0) + sum(counts.values())
    for subject in d.get("subjects") or []:
        if subject not in failed:
            case = TestCase("no divergence", classname=f"fuzz.{subject}")
            case.system_out = f"{per_subject.get(subject, d['programs_run'])} program(s) run, no divergence from eager autograd."
            suite.add_testcase(case)
    for k in d.get("known") or []:
        case = TestCase(k["signature"], classname=f"fuzz.{_subject_of(k['signature'])}")
        note = k.get("note") or "known issue"
        skipped = Skipped(message=f"known issue {k['id']}: {note}" if k.get("id") else f"known issue: {note}")
        skipped.text = f"{k['count']} program(s) matched." + (f" See {k['link']}" if k.get("link") else "")
        case.result = [skipped]
        suite.add_testcase(case)
    suite.update_statistics()
    if isinstance(d.get("elapsed_s"), (int, float)):
        suite.time = float(d["elapsed_s"])
    xml = JUnitXml("cagrad-fuzz")
    xml.add_testsuite(suite)
    return xml


def write_junit(rep: CampaignReport, path: str | Path) -> Path:
    """Writes :func:`build_junit` to ``path`` atomically (temp file, then ``os.replace``).

    Raises:
        OSError: the file cannot be written; an existing one is left as it was.
    """
    path = Path(path)
    xml = build_junit(rep)
    atomic_write(path, lambda tmp: xml.write(str(tmp), pretty=True))
    return path
