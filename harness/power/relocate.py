"""Finding a sampled mutant again after the code around it moved.

A mutant's identity (:class:`~harness.power.mutants.MutantId`) is a line and
an occurrence count, and both move when lines or mutation sites are added
above it, by a bug fix or by another change merged between a sample's run
and a rerun of its survivors. What stays is the change itself: the lines the
mutant removes and adds, and the context cosmic-ray's unified diff shows
around them. :func:`body` is that diff without its file and hunk headers,
:func:`change` its removed and added lines alone: two mutants of one module
and one operator that make the same change (and, where that line of code is
in several places, have the same context) are the same mutant.

Example::

    >>> body("--- a/m.py\\n+++ b/m.py\\n@@ -3,1 +3,1 @@\\n-x == y\\n+x is y")
    ('-x == y', '+x is y')
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

from harness.power.mutants import MutantId, enumerate_mutants


def body(diff: str) -> tuple[str, ...]:
    """The lines of a unified diff without its ``---``/``+++`` file headers
    and ``@@`` hunk headers (which hold the line numbers)."""
    return tuple(
        line for line in diff.splitlines() if not line.startswith(("--- ", "+++ ", "@@", "--- mutation diff ---"))
    )


def change(diff: str) -> tuple[str, ...]:
    """The removed and added lines of a unified diff (no context)."""
    return tuple(line for line in body(diff) if line.startswith(("-", "+")))


def mutant_diff(root: Path, ident: MutantId) -> str | None:
    """The unified diff (cosmic-ray's format: ``a/``, ``b/`` prefixes, no line
    terminators) that mutant ``ident`` makes to its module under ``root``;
    None when the module has no such occurrence of the operator.

    Raises:
        ImportError: cosmic-ray is not installed.
        OSError: the module cannot be read.
    """
    import parso  # noqa: F401  (before cosmic-ray's operator plugins, as in enumerate_mutants)
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    source = (root / ident.module).read_text()
    mutated = mutate_code(source, get_operator(ident.operator)(), ident.occurrence)
    if mutated is None:
        return None
    name = Path(ident.module).as_posix()
    lines = difflib.unified_diff(
        source.split("\n"), mutated.split("\n"), fromfile="a/" + name, tofile="b/" + name, lineterm=""
    )
    return "\n".join(lines)


def relocate(root: Path, rows: Iterable[dict], sample_tree: Path | None = None) -> dict[str, str | None]:
    """``{row id: id of the same mutant in the tree at root}``, for report rows
    (``id`` and ``diff``, as :func:`harness.power.report.load_rows` makes):
    the one mutant of the same module and operator that removes and adds the
    same lines (:func:`change`; where several do, the one whose whole
    :func:`body`, context included, equals the row's); its line and
    occurrence may differ from the row's. None
    when there is none or more than one (the code itself changed: judge it
    again). A row without a diff (pending: never run) takes the diff its id
    makes in ``sample_tree`` (a checkout of the sample's commit), else None.

    Cost: cosmic-ray parses the module once per candidate mutant (minutes
    for a package on a loaded 2-core machine).

    Raises:
        ImportError: cosmic-ray is not installed.
    """
    found: dict[str, str | None] = {}
    by_module: dict[str, list[MutantId]] = {}
    for row in rows:
        ident, want = MutantId.parse(row["id"]), body(row.get("diff") or "")
        if not want and sample_tree is not None and (sample_tree / ident.module).exists():
            want = body(mutant_diff(sample_tree, ident) or "")
        if not want or not (root / ident.module).exists():
            found[row["id"]] = None
            continue
        if ident.module not in by_module:
            by_module[ident.module] = list(enumerate_mutants(root, [ident.module]))
        diffs = {m: mutant_diff(root, m) or "" for m in by_module[ident.module] if m.operator == ident.operator}
        same = [m for m, d in diffs.items() if change(d) == change_of(want)]
        if len(same) > 1:  # the same line of code in several places: the context decides
            same = [m for m in same if body(diffs[m]) == want]
        found[row["id"]] = str(same[0]) if len(same) == 1 else None
    return found


def change_of(lines: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(line for line in lines if line.startswith(("-", "+")))


def load_map(path: Path) -> dict[str, str]:
    """``{current id: sample id}`` from a file :func:`relocate`'s command
    wrote (``{sample id: current id or null}``).

    Raises:
        ValueError: not such a file (says what and where).
    """
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a relocation map ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in data.items()):
        raise ValueError(f"{path}: not a relocation map (a JSON object of sample id -> current id or null)")
    for key in (*data, *(v for v in data.values() if v)):
        MutantId.parse(key)
    return {current: sample for sample, current in data.items() if current}
