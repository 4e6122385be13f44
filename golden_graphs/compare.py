"""Comparing current captures with stored snapshots.

:func:`compare` takes every requested scenario's snapshot now
(:func:`golden_graphs.take.take`), renders it, and compares the text with
the stored file: the file must parse (:func:`golden_graphs.snapshot.parse`)
and be identical, byte for byte, to the rendering. Each scenario gets an
:class:`Outcome`; a stored file with no registered scenario is ``STALE``.

Diffs are unified diffs (:mod:`difflib`) from the stored file to the
current rendering. Like ``git diff``'s function context, every hunk header
names the section and autograd node the hunk starts in::

    @@ -40,7 +40,7 @@ [graph] # SumBackward1 (NodeCall 1)
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
from collections.abc import Iterable, Sequence

from . import scenarios
from .key_fields import field_diff
from .snapshot import SnapshotError, parse, render
from .store import SnapshotStore
from .take import take


class Status(enum.Enum):
    """What :func:`compare` found for one scenario or file."""

    OK = "ok"  #: stored and current agree
    CHANGED = "changed"  #: both exist and differ (see the diff)
    MISSING = "missing"  #: a scenario without a stored snapshot
    MALFORMED = "malformed"  #: the stored file does not parse
    STALE = "stale"  #: a stored file without a scenario
    ERROR = "error"  #: the scenario could not be captured


@dataclasses.dataclass
class Outcome:
    """One scenario's (or stale file's) comparison.

    Attributes:
        name: the scenario (or the stale file's stem).
        status: see :class:`Status`.
        path: the snapshot file as shown to users.
        diff: unified-diff lines from the stored file to the current
            rendering (empty when OK; all ``+`` lines when MISSING).
        detail: the parse error (MALFORMED) or capture error (ERROR).
        current: the current rendering (None for STALE and ERROR).
        stored: the stored text (None for MISSING).
        fields: field-level key changes (CHANGED only), one line each, as
            :func:`golden_graphs.key_fields.field_diff` writes them.
    """

    name: str
    status: Status
    path: str
    diff: list[str] = dataclasses.field(default_factory=list)
    detail: str = ""
    current: str | None = None
    stored: str | None = None
    fields: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


def current_text(name: str, version: str) -> str:
    """The rendering of scenario ``name``'s snapshot taken now.

    Raises: whatever :func:`golden_graphs.take.take` raises.
    """
    return render(take(name, version))


def compare(
    store: SnapshotStore, names: Sequence[str] | None = None, version: str | None = None
) -> list[Outcome]:
    """Compares scenarios ``names`` (None: all, plus a STALE outcome per
    stored file with no scenario) with ``store``.

    Args:
        version: the torch version of the current capture (default:
            ``store.version``; ``review --against`` passes the running
            torch's). A snapshot of another version is compared with the
            capture apart from its ``torch:`` line, so that only what the
            upgrade changed in graphs and keys shows.

    Raises:
        KeyError: a name that is not a registered scenario.
    """
    selected = _select(names)
    outcomes = [_compare_one(store, name, version or store.version) for name in selected]
    if names is None:
        outcomes += stale(store)
    return outcomes


def stale(store: SnapshotStore) -> list[Outcome]:
    """A STALE outcome per stored file that no scenario is registered for."""
    known = set(scenarios.names())
    return [
        Outcome(name, Status.STALE, store.display(name), stored=store.read(name))
        for name in store.stored_names()
        if name not in known
    ]


def unified_diff(old: str | None, new: str | None, path: str) -> list[str]:
    """Unified diff lines from ``old`` (the stored snapshot, None: none) to
    ``new`` (the current capture), hunks annotated with the section and
    autograd node they start in."""
    old_lines = [] if old is None else old.splitlines()
    new_lines = [] if new is None else new.splitlines()
    lines = list(
        difflib.unified_diff(
            old_lines,
            new_lines,
            fromfile=f"{path} (snapshot)" if old is not None else "/dev/null",
            tofile=f"{path} (current capture)" if new is not None else "/dev/null",
            lineterm="",
        )
    )
    return [_annotate_hunk(line, old_lines, new_lines) for line in lines]


def _select(names: Sequence[str] | None) -> list[str]:
    if names is None:
        return scenarios.names()
    for name in names:
        scenarios.get(name)  # raises KeyError for unknown names
    return list(dict.fromkeys(names))


def _compare_one(store: SnapshotStore, name: str, version: str) -> Outcome:
    path = store.display(name)
    stored = store.read(name)
    try:
        now = take(name, version)
        current = render(now)
    except Exception as e:  # noqa: BLE001 - reported, never swallowed
        return Outcome(name, Status.ERROR, path, detail=f"{type(e).__name__}: {e}", stored=stored)
    diff = unified_diff(stored, current, path)
    if stored is None:
        return Outcome(name, Status.MISSING, path, diff, current=current)
    try:
        snap = parse(stored, path)
    except SnapshotError as e:
        return Outcome(name, Status.MALFORMED, path, diff, str(e), current, stored)
    if snap.scenario != name:
        detail = f"{path}:1: the file is for scenario {snap.scenario!r}, expected {name!r}"
        return Outcome(name, Status.MALFORMED, path, diff, detail, current, stored)
    if snap.torch != now.torch:
        # review --against: the torch line always differs; judge the rest
        current = render(dataclasses.replace(now, torch=snap.torch))
        diff = unified_diff(stored, current, path)
    if stored != current:
        task = field_diff([snap.task_key], [snap.task_fields], [now.task_key], [now.task_fields])
        fields = [line.replace("NodeCall 0 ", "task key ", 1) for line in task] + field_diff(
            snap.cache_keys, snap.key_fields, now.cache_keys, now.key_fields
        )
        return Outcome(name, Status.CHANGED, path, diff, current=current, stored=stored, fields=fields)
    return Outcome(name, Status.OK, path, current=current, stored=stored)


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _annotate_hunk(line: str, old: list[str], new: list[str]) -> str:
    m = _HUNK.match(line)
    if m is None:
        return line
    start, lines = int(m.group(1)), old
    if not lines:
        start, lines = int(m.group(3)), new
    return f"{line} {_context(lines, start)}".rstrip()


def _context(lines: list[str], start: int) -> str:
    """The section and the autograd-node comment in force at line ``start``."""
    section = node = ""
    for text in lines[: max(start, 1)]:
        if text.startswith("[") and text.endswith("]"):
            section, node = text, ""
        elif section == "[graph]" and text.startswith("# "):
            node = text
    return f"{section} {node}".strip()


def summary(outcomes: Iterable[Outcome]) -> str:
    """``"11 ok, 1 changed"``: counts per status, in :class:`Status` order."""
    counts: dict[Status, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return ", ".join(f"{counts[s]} {s.value}" for s in Status if s in counts) or "nothing to check"
