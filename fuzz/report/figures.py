"""The plots of the HTML report, as plotly figures made from a report.json.

Each function takes the report document (a dict) and returns a
:class:`plotly.graph_objects.Figure`, or None when the report lacks the
data (an older schema, or nothing recorded). :func:`figure_div` turns a
figure into an HTML ``<div>`` that needs plotly.js loaded once on the page.
"""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

#: One colour per outcome status, the same in every plot.
STATUS_COLOURS = {
    "equal": "#2e7d32",
    "fallback": "#9e9e9e",
    "mismatch": "#c62828",
    "error": "#ef6c00",
    "crash": "#6a1b9a",
    "timeout": "#1565c0",
}

_LAYOUT = dict(template="plotly_white", margin=dict(l=10, r=10, t=40, b=10), font=dict(size=12))


def _bar_height(n: int) -> int:
    """Pixels for a horizontal bar chart of ``n`` bars (readable labels, bounded)."""
    return max(220, min(2400, 60 + 18 * n))


def timeline_figure(report: dict[str, Any]) -> go.Figure | None:
    """Programs run and failures recorded against elapsed seconds (``timeline``)."""
    points = report.get("timeline") or []
    if not points:
        return None
    elapsed = [p[0] for p in points]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=elapsed, y=[p[1] for p in points], name="programs run", mode="lines+markers"))
    fig.add_trace(
        go.Scatter(
            x=elapsed,
            y=[p[2] for p in points],
            name="failures",
            mode="lines",
            line=dict(shape="hv", color=STATUS_COLOURS["mismatch"]),
            yaxis="y2",
        )
    )
    fig.update_layout(
        title="Programs over time",
        xaxis_title="elapsed (s)",
        yaxis=dict(title="programs run", rangemode="tozero"),
        yaxis2=dict(
            title="failures",
            overlaying="y",
            side="right",
            rangemode="tozero",
            showgrid=False,
            tick0=0,
            dtick=max(1, math.ceil(max(p[2] for p in points) / 6)),  # whole failures only
        ),
        legend=dict(orientation="h", y=-0.2),
        height=360,
        **_LAYOUT,
    )
    return fig


def counts_figure(counts: dict[str, int], title: str, axis: str) -> go.Figure | None:
    """A horizontal bar chart of ``counts`` (name -> number), largest on top."""
    if not counts:
        return None
    items = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]))
    fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h", marker_color="#455a64"))
    fig.update_layout(title=title, xaxis_title=axis, height=_bar_height(len(items)), **_LAYOUT)
    fig.update_yaxes(type="category", automargin=True)
    return fig


def op_share_figure(report: dict[str, Any]) -> go.Figure | None:
    """Uses per op (``op_counts``) as bars, every op of ``coverage`` included
    (0 for an op never drawn), with the mean and three times the mean as
    lines: an op far above them crowds the others out."""
    counts = dict(report.get("op_counts") or {})
    groups = (report.get("coverage") or {}).get("feature_groups") or {}
    for name in (groups.get("op") or {}).get("uncovered", []):
        counts.setdefault(name.removeprefix("op="), 0)
    if not counts:
        return None
    items = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]))
    mean = sum(counts.values()) / len(counts)
    fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h", marker_color="#455a64",
                           name="uses"))  # fmt: skip
    for x, label, dash in ((mean, "mean", "dot"), (3 * mean, "3 x mean", "dash")):
        fig.add_vline(x=x, line_dash=dash, line_color=STATUS_COLOURS["mismatch"], annotation_text=label)
    fig.update_layout(title="Op coverage: uses per op", xaxis_title="uses in the programs run", height=_bar_height(len(items)),
                      **_LAYOUT)  # fmt: skip
    fig.update_yaxes(type="category", automargin=True)
    return fig


def coverage_figure(report: dict[str, Any]) -> go.Figure | None:
    """Stacked bars per axis and pair of axes (``coverage``): how many of its
    values (pairs) some program had, and how many none had."""
    cov = report.get("coverage") or {}
    groups = {**(cov.get("feature_groups") or {}), **(cov.get("pair_groups") or {})}
    if not groups:
        return None
    names = list(groups)
    fig = go.Figure()
    fig.add_trace(go.Bar(name="covered", y=names, x=[groups[n]["covered"] for n in names], orientation="h",
                         marker_color=STATUS_COLOURS["equal"]))  # fmt: skip
    fig.add_trace(go.Bar(name="never seen", y=names, x=[groups[n]["total"] - groups[n]["covered"] for n in names],
                         orientation="h", marker_color=STATUS_COLOURS["mismatch"]))  # fmt: skip
    fig.update_layout(title="Features and feature pairs covered", barmode="stack", xaxis_title="values (pairs)",
                      height=_bar_height(len(names)) + 60, legend=dict(orientation="h", y=-0.2), **_LAYOUT)  # fmt: skip
    fig.update_yaxes(type="category", automargin=True, autorange="reversed")
    return fig


def outcomes_figure(report: dict[str, Any]) -> go.Figure | None:
    """Stacked bars: outcomes (equal, mismatch, error, ...) per ``subject@device``."""
    per_subject = report.get("outcome_counts") or {}
    if not per_subject:
        return None
    subjects = list(per_subject)
    statuses = [s for s in STATUS_COLOURS if any(s in c for c in per_subject.values())]
    statuses += sorted({s for c in per_subject.values() for s in c} - set(statuses))
    fig = go.Figure()
    for status in statuses:
        fig.add_trace(
            go.Bar(
                name=status,
                y=subjects,
                x=[per_subject[s].get(status, 0) for s in subjects],
                orientation="h",
                marker_color=STATUS_COLOURS.get(status),
            )
        )
    fig.update_layout(
        title="Outcomes per subject",
        barmode="stack",
        legend_traceorder="normal",
        xaxis_title="programs",
        height=max(220, 120 + 50 * len(subjects)),
        legend=dict(orientation="h", y=-0.25),
        **_LAYOUT,
    )
    fig.update_yaxes(type="category", automargin=True, autorange="reversed")  # the report's order, top down
    return fig


def captures_figure(report: dict[str, Any]) -> go.Figure | None:
    """Grouped bars of ``sequence_captures``: size variants run and captures made per ``subject@device``."""
    seq = report.get("sequence_captures") or {}
    if not seq:
        return None
    subjects = list(seq)
    fig = go.Figure()
    for field, label in (("variants", "size variants run"), ("captures", "captures"), ("over_first", "captures at new sizes")):
        fig.add_trace(go.Bar(name=label, x=subjects, y=[seq[s].get(field, 0) for s in subjects]))
    fig.update_layout(title="Captures per size variant", barmode="group", height=340, legend=dict(orientation="h", y=-0.25), **_LAYOUT)
    fig.update_xaxes(type="category")
    return fig


def figure_div(fig: go.Figure, div_id: str) -> str:
    """``fig`` as an HTML ``<div>`` (plus its script), without plotly.js itself."""
    return pio.to_html(
        fig,
        full_html=False,
        include_plotlyjs=False,
        div_id=div_id,
        config={"displaylogo": False, "responsive": True},
        default_height=f"{fig.layout.height or 360}px",
    )
