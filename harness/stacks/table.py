"""The stacks report as a rich table: one row per (stack, subject)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from harness.stacks.outcome import StackOutcome, StacksReport, StackStatus

_STYLE = {
    StackStatus.MATCH: "green",
    StackStatus.MISMATCH: "red",
    StackStatus.ERROR: "bold red",
    StackStatus.FELL_BACK: "yellow",
    StackStatus.SKIPPED: "dim",
}


def _count(o: StackOutcome, key: str) -> str:
    return "" if key not in o.counts else str(o.counts[key])


def render(report: StacksReport) -> Table:
    """Columns: stack, subject, status, captures, segments (compiled graphs:
    1 per whole graph, else the segments between its opaque calls), cache
    hits, fallbacks (cagrad's counter deltas over the run; rank 0's when distributed,
    fallbacks summed over the ranks) and
    detail (max abs diff and first differing value, error, skip reason or
    fallback reasons). A peer's subject is marked ``(peer)`` and its
    failures dimmed: they do not count. Cells are plain
    :class:`~rich.text.Text`: subject names hold brackets rich would read as
    markup."""
    failed = len(report.failures())
    title = f"stacks on {report.device}: " + ("all match" if report.ok else f"{failed} failing")
    table = Table(title=Text(title), title_justify="left")
    for col in ("stack", "subject", "status", "captures", "segments", "cache hits", "fallbacks", "detail"):
        table.add_column(col, overflow="fold", no_wrap=col in ("stack", "subject", "status"))
    previous = None
    for o in report.outcomes:
        table.add_row(
            Text("" if o.stack == previous else o.stack),
            Text(o.subject + (" (peer)" if o.peer else "")),
            Text(o.status.value, style="dim" if o.peer and o.status is not StackStatus.MATCH else _STYLE[o.status]),
            Text(_count(o, "captures")),
            Text(_count(o, "graph_segments")),
            Text(_count(o, "cache_hits")),
            Text(_count(o, "fallbacks")),
            Text(o.describe()),
        )
        previous = o.stack
    return table
