"""The self-contained HTML report: one file, plots included, works offline.

The page is rendered by a jinja2 template (``templates/report.html.j2``,
autoescaped) with plotly.js inlined once in its head, so it needs no
network. Sections: summary, programs over time, op and feature coverage
(uses per op against their mean, features and feature pairs of
:mod:`fuzz.coverage` covered and never seen),
outcomes per subject, failures by signature (each reproducer's text inline,
collapsible), known issues, build errors, fallback reasons, captures per
size variant. A section whose data the report lacks (an older schema) says
so instead of failing.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jinja2
import plotly.offline

from fuzz.report import figures
from fuzz.report.describe import outcome_detail
from fuzz.report.files import atomic_write_text
from fuzz.report.load import CampaignReport

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("fuzz.report", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _safe_link(link: Any) -> str | None:
    """``link`` if it is an http(s) URL (anything else is shown as text, never as an href)."""
    return link if isinstance(link, str) and link.startswith(("https://", "http://")) else None


def _fmt_seconds(value: Any) -> str:
    return f"{value:,.1f} s" if isinstance(value, (int, float)) else "not recorded"


def _substitutions(value: Any) -> str:
    """report.json's ``op_substitutions``: ops this torch ran as an equivalent substitute."""
    if value is None:
        return "not recorded"
    return "; ".join(f"{op}: {what}" for op, what in sorted(value.items())) or "none"


def _summary(rep: CampaignReport) -> list[tuple[str, str]]:
    d = rep.data
    pps = rep.programs_per_s()
    throughput = d.get("throughput") or {}
    if pps is None:
        pps_text = "not recorded"
    else:
        pps_text = f"{pps:.2f}" + ("" if "programs_per_s" in throughput else " (programs / elapsed; not recorded)")
    shard = d.get("shard", "not recorded (schema 1)") if rep.schema >= 2 else "not recorded (schema 1)"
    exit_status = d.get("exit_status")
    return [
        ("seed", str(d["seed"])),
        ("torch version", d.get("torch_version", "not recorded")),
        ("op substitutions", _substitutions(d.get("op_substitutions"))),
        ("budget", _fmt_seconds(d.get("budget_s"))),
        ("elapsed", _fmt_seconds(d.get("elapsed_s"))),
        ("programs run", f"{d['programs_run']:,}"),
        ("programs / s", pps_text),
        ("workers", str(throughput.get("workers", "not recorded"))),
        ("shard", "whole campaign" if shard is None else str(shard)),
        ("exit status", "not recorded" if exit_status is None else str(exit_status)),
        ("subjects", ", ".join(d.get("subjects") or []) or "not recorded"),
        ("devices", ", ".join(d.get("devices") or []) or "not recorded"),
        ("rounds / sessions", f"{d.get('rounds', '?')} / {len(d.get('sessions') or [])}"),
        ("report schema", str(rep.schema)),
    ]


def _shrunk_text(failure: dict[str, Any]) -> str:
    if failure.get("shrunk") is False:
        return "not shrunk"
    if "original_ops" in failure and "shrunk_ops" in failure:
        return f"{failure['original_ops']} → {failure['shrunk_ops']} ops"
    return ""


def _unused_ops(report: dict[str, Any]) -> list[str]:
    """Ops of the current catalog that no program of the report drew (empty when the catalog cannot be read)."""
    try:
        from fuzz.ops import OPS
    except Exception:  # the report is still worth writing without this line
        return []
    used = report.get("op_counts") or {}
    return sorted(name for name in OPS if name not in used)


def _coverage_rows(report: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Per axis and pair of axes of ``coverage``: covered, total, the names never seen (None: not recorded)."""
    cov = report.get("coverage")
    if cov is None:
        return None
    rows = []
    for kind, key in (("feature", "feature_groups"), ("pair", "pair_groups")):
        for group, g in (cov.get(key) or {}).items():
            rows.append({"kind": kind, "group": group, "covered": g["covered"], "total": g["total"], "uncovered": g["uncovered"]})
    return rows


def _op_stats(report: dict[str, Any]) -> str | None:
    """One line on how evenly ops were drawn: uses, mean per op, the most used op and its multiple of the mean."""
    counts = report.get("op_counts") or {}
    groups = (report.get("coverage") or {}).get("feature_groups") or {}
    n_ops = (groups.get("op") or {}).get("total") or len(counts)
    uses = sum(counts.values())
    if not uses or not n_ops:
        return None
    mean = uses / n_ops
    name, top = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
    return (f"{uses:,} op uses over {n_ops} ops: {mean:.1f} per op on average; the most used, {name}, "
            f"{top:,} ({top / uses:.1%}, {top / mean:.2f} x the mean)")  # fmt: skip


def _failures(rep: CampaignReport) -> list[dict[str, Any]]:
    rows = []
    for i, f in enumerate(rep.data["failures"]):
        outcome = f.get("first_outcome")
        rows.append(
            {
                "id": f.get("id") or f"#{i + 1}",
                "anchor": f"failure-{i + 1}",
                "signature": f["signature"],
                "count": f["count"],
                "subject": f["subject"] + (f"@{f['device']}" if f.get("device") else ""),
                "status": f["status"],
                "kind": f["kind"],
                "ops": ", ".join(list(f.get("ops") or []) + list(f.get("hooks") or [])) or "(none)",
                "shrunk": _shrunk_text(f),
                "detail": outcome_detail(outcome),
                "reproducer_path": f.get("reproducer"),
                "replay": f"python -m fuzz replay {rep.out / f['reproducer']}" if f.get("reproducer") else None,
                "reproducer": rep.reproducer_text(f),
                "outcome_json": json.dumps(outcome, indent=1) if outcome else None,
            }
        )
    return rows


def _known(rep: CampaignReport) -> list[dict[str, Any]] | None:
    if "known" not in rep.data:
        return None
    return [
        {
            "id": k.get("id", ""),
            "signature": k["signature"],
            "count": k["count"],
            "note": k.get("note") or "",
            "link": k.get("link") or "",
            "href": _safe_link(k.get("link")),
        }
        for k in rep.data["known"]
    ]


def _build_error_files(rep: CampaignReport) -> list[str]:
    d = rep.out / "build_errors"
    try:
        return sorted(str(p.relative_to(rep.out)) for p in d.iterdir() if p.is_file())
    except OSError:
        return []


def render_html(rep: CampaignReport) -> str:
    """The HTML page for ``rep`` as a string (one self-contained document)."""
    d = rep.data
    figs = {
        "timeline": figures.timeline_figure(d),
        "ops": figures.op_share_figure(d),
        "coverage": figures.coverage_figure(d),
        "features": figures.counts_figure(
            d.get("feature_counts") or {}, "Feature coverage: programs per feature", "programs that had it"
        ),
        "outcomes": figures.outcomes_figure(d),
        "captures": figures.captures_figure(d),
    }
    plots = {name: (figures.figure_div(fig, f"plot-{name}") if fig is not None else None) for name, fig in figs.items()}
    fallback = [
        (subject, reason, n)
        for subject, reasons in (d.get("fallback_reasons") or {}).items()
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])
    ]
    failures = _failures(rep)
    known = _known(rep)
    template = _ENV.get_template("report.html.j2")
    return template.render(
        title=f"cagrad-fuzz report — seed {d['seed']}, {d['programs_run']:,} programs, {len(failures)} failure(s)",
        generated=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        source=str(rep.path),
        plotly_js=plotly.offline.get_plotlyjs(),
        summary=_summary(rep),
        failures=failures,
        failure_programs=sum(f["count"] for f in failures),
        known=known,
        known_programs=sum(k["count"] for k in known or []),
        plots=plots,
        has_timeline="timeline" in d,
        has_op_counts="op_counts" in d,
        unused_ops=_unused_ops(d) if "op_counts" in d else [],
        has_feature_counts="feature_counts" in d,
        coverage_rows=_coverage_rows(d),
        op_stats=_op_stats(d),
        steered=d.get("steered"),
        peer_every=d.get("peer_every"),
        has_outcomes="outcome_counts" in d,
        has_captures="sequence_captures" in d,
        sequence_captures=d.get("sequence_captures") or {},
        has_fallback="fallback_reasons" in d,
        fallback=fallback,
        build_errors=d.get("build_errors"),
        build_error_files=_build_error_files(rep),
        exit_status=d.get("exit_status", 1 if failures else 0),
        schema=rep.schema,
    )


def write_html(rep: CampaignReport, path: str | Path) -> Path:
    """Writes :func:`render_html` to ``path`` atomically (temp file, then ``os.replace``).

    Raises:
        OSError: the file (or its directory) cannot be written; an existing
            file at ``path`` is then left as it was.
    """
    path = Path(path)
    atomic_write_text(path, render_html(rep))
    return path

