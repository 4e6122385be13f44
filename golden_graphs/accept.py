"""Accepting current captures as the new snapshots.

:func:`accept` rewrites the snapshot of each requested scenario (all when
none are named) and reports, per scenario, what it did. It never deletes or
overwrites anything it was not asked to: files of other scenarios are left
alone, stale files (no scenario) are only reported unless ``prune`` is set,
a scenario that fails to capture keeps its old file, and replacing a file
that did not parse is reported as such.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from .compare import Outcome, Status, compare, stale
from .store import SnapshotStore


class Action(enum.Enum):
    """What :func:`accept` did with one file."""

    CREATED = "created"
    UPDATED = "updated"
    REPLACED_MALFORMED = "replaced malformed"
    UNCHANGED = "unchanged"
    FAILED = "failed (file kept)"
    STALE_KEPT = "stale (kept; --prune deletes)"
    PRUNED = "pruned"


@dataclasses.dataclass
class Accepted:
    """One file's fate.

    Attributes:
        outcome: the comparison made before writing (its diff is what
            changed).
        action: what was done.
        added / removed: the diff's ``+`` / ``-`` line counts.
    """

    outcome: Outcome
    action: Action
    added: int = 0
    removed: int = 0

    @property
    def changed(self) -> bool:
        return self.action in (Action.CREATED, Action.UPDATED, Action.REPLACED_MALFORMED, Action.PRUNED)


_ACTION = {
    Status.OK: Action.UNCHANGED,
    Status.CHANGED: Action.UPDATED,
    Status.MISSING: Action.CREATED,
    Status.MALFORMED: Action.REPLACED_MALFORMED,
}


def accept(
    store: SnapshotStore, names: Sequence[str] | None = None, prune: bool = False
) -> list[Accepted]:
    """Writes the current snapshots of ``names`` (None: all scenarios).

    Args:
        store: where to write (its directory is created if needed).
        names: scenarios to accept; None accepts every scenario and also
            looks for stale files.
        prune: delete stale files (only with ``names=None``).

    Raises:
        KeyError: a name that is not a registered scenario (nothing is
            written then).
        OSError: a file could not be written (earlier files stay written).
    """
    results = []
    for outcome in compare(store, names):
        if outcome.status is Status.STALE:
            continue
        if outcome.status is Status.ERROR:
            results.append(Accepted(outcome, Action.FAILED))
            continue
        action = _ACTION[outcome.status]
        if action is not Action.UNCHANGED:
            assert outcome.current is not None
            store.write(outcome.name, outcome.current)
        results.append(Accepted(outcome, action, *_counts(outcome.diff)))
    if names is None:
        for outcome in stale(store):
            if prune:
                store.remove(outcome.name)
                results.append(Accepted(outcome, Action.PRUNED, 0, _count_lines(outcome.stored)))
            else:
                results.append(Accepted(outcome, Action.STALE_KEPT))
    return results


def _counts(diff: list[str]) -> tuple[int, int]:
    added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
    removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
    return added, removed


def _count_lines(text: str | None) -> int:
    return 0 if text is None else len(text.splitlines())
