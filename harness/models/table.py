"""The models report as a rich table: one row per (model row, subject)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from harness.models.outcome import ModelsReport, RowOutcome, RowStatus

_STYLE = {
    RowStatus.MATCH: "green",
    RowStatus.MISMATCH: "red",
    RowStatus.ERROR: "bold red",
    RowStatus.FELL_BACK: "yellow",
    RowStatus.SKIPPED: "dim",
}


def _count(o: RowOutcome, key: str) -> str:
    return "" if key not in o.counts else str(o.counts[key])


def _opaque(o: RowOutcome) -> str:
    return ", ".join(f"{name} x{n}" for name, n in sorted(o.opaque_nodes.items()))


def render(report: ModelsReport) -> Table:
    """Columns: row, subject, status, captures, cache hits, fallbacks,
    deopts (cagrad's counter deltas over the run), opaque (the nodes its
    captured graphs call as they are, with why, and in how many graphs) and
    detail (first difference and max abs diff, error, skip reason, degraded
    counters, fallback reasons). A peer is marked ``(peer)``; its failures
    are dimmed. Cells are plain :class:`~rich.text.Text` (subject names hold
    brackets rich would read as markup)."""
    failed = len(report.failures())
    title = f"models on {report.device}: " + ("all match" if report.ok else f"{failed} failing")
    table = Table(title=Text(title), title_justify="left")
    for col in ("row", "subject", "status", "captures", "cache hits", "fallbacks", "deopts", "opaque", "detail"):
        table.add_column(col, overflow="fold", no_wrap=col in ("row", "subject", "status"))
    previous = None
    for o in report.outcomes:
        style = "dim" if o.peer and o.status is not RowStatus.MATCH else _STYLE[o.status]
        table.add_row(
            Text("" if o.row == previous else o.row),
            Text(o.subject + (" (peer)" if o.peer else "")),
            Text(o.status.value, style=style),
            Text(_count(o, "captures")),
            Text(_count(o, "cache_hits")),
            Text(_count(o, "fallbacks")),
            Text(_count(o, "deopts")),
            Text(_opaque(o)),
            Text(o.describe()),
        )
        previous = o.row
    return table
