"""Mutants: cosmic-ray's enumeration, a stable identity, seeded sampling, shards.

cosmic-ray (the ``power`` extra) enumerates every mutation its core operators
can make in a module; each is named here by a :class:`MutantId`, ``(module,
line, operator, occurrence)``: the module's path relative to the repository
root (POSIX), the 1-based line where the mutated code starts, the operator's
cosmic-ray name (``core/ReplaceComparisonOperator_Lt_LtE``) and cosmic-ray's
occurrence number (the operator's n-th site in the module, 0-based, the number
cosmic-ray itself uses to apply the mutation). The text form,
``module:line:operator:occurrence``, is the job id in the session database and
the key of the equivalents file.

Sampling and sharding never look at anything but the sorted identities and
the seed, so every shard of a run (on any machine) draws the same sample and
takes a disjoint share of it.
"""

from __future__ import annotations

import ast
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The core cagrad packages whose Python files are mutated by default.
CORE_PACKAGES = ("cagrad/keys", "cagrad/autograd", "cagrad/capture", "cagrad/run", "cagrad/native")


@dataclass(frozen=True, order=True)
class MutantId:
    """The stable identity of one mutant (see the module docstring)."""

    module: str
    line: int
    operator: str
    occurrence: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line}:{self.operator}:{self.occurrence}"

    @classmethod
    def parse(cls, text: str) -> MutantId:
        """Inverse of ``str``; raises ValueError naming the text."""
        m = re.fullmatch(r"(.+?):(\d+):([^:]+/[^:]+):(\d+)", text)
        if not m:
            raise ValueError(f"bad mutant id {text!r}: expected module:line:operator:occurrence")
        return cls(m.group(1), int(m.group(2)), m.group(3), int(m.group(4)))


def module_paths(root: Path, targets: Iterable[str] = CORE_PACKAGES) -> list[str]:
    """The ``.py`` files (relative POSIX paths, sorted) under each target,
    a package directory or a single file relative to ``root``.

    Raises:
        FileNotFoundError: a target that is neither.
    """
    out: set[str] = set()
    for target in targets:
        path = root / target
        if path.is_file() and path.suffix == ".py":
            out.add(path.relative_to(root).as_posix())
        elif path.is_dir():
            out.update(p.relative_to(root).as_posix() for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        else:
            raise FileNotFoundError(f"mutation target {target!r}: no .py file or package directory at {path}")
    return sorted(out)


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The ``((line, col), (end_line, end_col))`` spans of every annotation
    (arguments, returns, annotated assignments) in a module that starts with
    ``from __future__ import annotations``, where annotations are never
    evaluated; none in any other module."""
    tree = ast.parse(source)
    future = any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    if not future:
        return []
    spans = []
    for node in ast.walk(tree):
        notes = []
        if isinstance(node, ast.arg):
            notes.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            notes.append(node.annotation)
        spans += [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in notes if a is not None]
    return spans


def enumerate_mutants(
    root: Path, modules: Sequence[str], skipped: dict[str, int] | None = None
) -> dict[MutantId, Any]:
    """Every mutant cosmic-ray's operators (those without arguments) make in
    ``modules`` (paths relative to ``root``), as ``{MutantId: WorkItem}``; the
    work items' module paths are relative, so they apply in any copy of the
    tree when run from its root.

    Mutants inside an annotation that is never evaluated (see
    :func:`annotation_spans`) are left out, counted per module in
    ``skipped``: they cannot change behaviour.

    Raises:
        ImportError: cosmic-ray is not installed (``pip install -e .[power]``).
    """
    import parso  # noqa: F401  (first: cosmic-ray's operator plugins import parso partway otherwise)
    from cosmic_ray.commands.init import _all_work_items  # cosmic-ray's own enumeration (pinned 8.7.0)
    from cosmic_ray.work_item import WorkItem

    out: dict[MutantId, Any] = {}
    spans = {m: annotation_spans((root / m).read_text()) for m in modules}
    cwd = os.getcwd()
    os.chdir(root)
    try:
        for item in _all_work_items([Path(m) for m in modules], {}):
            (spec,) = item.mutations
            module = Path(spec.module_path).as_posix()
            if any(a <= tuple(spec.start_pos) < b for a, b in spans[module]):
                if skipped is not None:
                    skipped[module] = skipped.get(module, 0) + 1
                continue
            ident = MutantId(module, spec.start_pos[0], spec.operator_name, spec.occurrence)
            out[ident] = WorkItem(job_id=str(ident), mutations=item.mutations)
    finally:
        os.chdir(cwd)
    return out


def sample(ids: Iterable[MutantId], n: int | None, seed: int) -> list[MutantId]:
    """``n`` identities drawn without replacement by ``random.Random(seed)``
    from the sorted identities (all of them, in sorted order, when ``n`` is
    None or at least their number). Same ids, n and seed: same list."""
    ordered = sorted(ids)
    if n is None or n >= len(ordered):
        return ordered
    return random.Random(seed).sample(ordered, n)


def shard(items: Sequence[MutantId], k: int, n: int) -> list[MutantId]:
    """The k-th (1-based) of n disjoint shares of ``items`` (every n-th from
    the (k-1)-th): the n shares together are ``items``."""
    if not 1 <= k <= n:
        raise ValueError(f"bad shard {k}/{n}: expected 1 <= K <= N")
    return list(items[k - 1 :: n])
