"""The review artifact: a Markdown summary fit for a pull-request comment.

:func:`review_markdown` turns :func:`golden_graphs.compare.compare`'s
outcomes into GitHub-flavoured Markdown: a headline with the counts, a table
of every scenario that is not OK, then per changed scenario its key field
changes (:func:`golden_graphs.key_fields.field_diff`) and its unified diff
in a collapsed ``<details>`` block (the byte-level record).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .compare import Outcome, Status, summary

_MAX_DIFF_LINES = 400  # per scenario; a longer diff is cut (the CLI shows it whole)


def _fence(lines: Sequence[str]) -> str:
    # a fence longer than any backtick run inside the block
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    return "`" * max(3, longest + 1)


def review_markdown(outcomes: Sequence[Outcome], torch_version: str, against: str | None = None) -> str:
    """The Markdown review of ``outcomes`` (newline-terminated).

    Args:
        outcomes: the comparisons, as :func:`golden_graphs.compare.compare`
            returns them.
        torch_version: the running torch's ``major.minor``.
        against: the snapshot set compared with, when it is not the running
            torch's (``review --against``).
    """
    base = against or torch_version
    title = f"torch {base} snapshots vs the current capture (torch {torch_version})"
    out = [f"## Golden graphs: {title}", "", f"**{summary(outcomes)}**", ""]
    bad = [o for o in outcomes if not o.ok]
    if not bad:
        out += ["Every scenario matches its snapshot.", ""]
        return "\n".join(out)
    out += ["| scenario | status | +/- | key fields changed |", "| --- | --- | --- | --- |"]
    for o in bad:
        plus = sum(1 for d in o.diff if d.startswith("+") and not d.startswith("+++"))
        minus = sum(1 for d in o.diff if d.startswith("-") and not d.startswith("---"))
        counts = f"+{plus} -{minus}" if o.diff else ""
        out.append(f"| `{o.name}` | {o.status.value} | {counts} | {len(o.fields)} |")
    out.append("")
    for o in bad:
        out += [f"### `{o.name}`: {o.status.value}", ""]
        if o.detail:
            out += [f"> {o.detail}", ""]
        if o.status is Status.STALE:
            out += [f"`{o.path}` has no scenario (removed or renamed?).", ""]
            continue
        if o.fields:
            out += ["Key field changes:", ""]
            out += [f"- {_inline(line)}" for line in o.fields]
            out.append("")
        if o.diff:
            diff = o.diff
            cut = len(diff) > _MAX_DIFF_LINES
            if cut:
                diff = diff[:_MAX_DIFF_LINES]
            fence = _fence(diff)
            out += [
                "<details><summary>unified diff of the snapshot file</summary>",
                "",
                f"{fence}diff",
                *diff,
                fence,
            ]
            if cut:
                out.append(f"({len(o.diff) - _MAX_DIFF_LINES} more lines; run `python -m golden_graphs review {o.name}`)")
            out += ["", "</details>", ""]
    return "\n".join(out)


def _inline(line: str) -> str:
    """A field-diff line for a Markdown list item: ``<`` escaped so that no
    HTML is read into it (backticks are kept: they mark field names)."""
    return line.replace("<", "&lt;")
