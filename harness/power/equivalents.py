"""The reviewed equivalents file: survivors judged to behave as the original.

A TOML file with one ``[[equivalent]]`` table per reviewed mutant::

    [[equivalent]]
    module = "cagrad/keys/cache.py"       # relative to the repository root
    line = 42                             # 1-based line where the mutation starts
    operator = "core/NumberReplacer"      # cosmic-ray's operator name
    occurrence = 3                        # cosmic-ray's occurrence number
    reason = "the bound is a size hint; any positive value keys the same"

The four identity fields are a :class:`~harness.power.mutants.MutantId`; an
entry whose identity no longer matches a mutant (the code moved) simply
stops applying and the report lists it as stale. The shipped file is
``harness/power/equivalents.toml``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from harness.power.mutants import MutantId

DEFAULT_PATH = Path(__file__).with_name("equivalents.toml")

_FIELDS = {"module": str, "line": int, "operator": str, "occurrence": int, "reason": str}


class EquivalentsError(Exception):
    """A malformed equivalents file; the message names the file and entry."""


def parse(text: str, path: str) -> dict[MutantId, str]:
    """``{MutantId: reason}`` from the file's text; ``path`` names it in errors.

    Raises:
        EquivalentsError: not TOML, top-level keys other than ``equivalent``,
            an entry with a missing, unknown or mistyped field, an empty
            reason, a negative or zero line, or the same mutant twice.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise EquivalentsError(f"{path}: not valid TOML: {e}") from None
    extra = sorted(set(data) - {"equivalent"})
    if extra:
        raise EquivalentsError(f"{path}: unknown top-level key(s) {extra}: expected only [[equivalent]] tables")
    entries = data.get("equivalent", [])
    if not isinstance(entries, list):
        raise EquivalentsError(f"{path}: 'equivalent' must be an array of tables ([[equivalent]])")
    out: dict[MutantId, str] = {}
    for n, entry in enumerate(entries, 1):
        where = f"{path}: entry {n}"
        if not isinstance(entry, dict):
            raise EquivalentsError(f"{where}: expected a table, got {type(entry).__name__}")
        missing = [k for k in _FIELDS if k not in entry]
        unknown = sorted(set(entry) - set(_FIELDS))
        if missing or unknown:
            raise EquivalentsError(
                f"{where}: " + "; ".join(
                    ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)}"] if unknown else [])
                ) + f" (fields: {', '.join(_FIELDS)})"
            )  # fmt: skip
        for key, kind in _FIELDS.items():
            value = entry[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise EquivalentsError(f"{where}: {key} must be {kind.__name__}, got {value!r}")
        ident = MutantId(entry["module"], entry["line"], entry["operator"], entry["occurrence"])
        where = f"{where} ({ident})"
        if entry["line"] < 1 or entry["occurrence"] < 0:
            raise EquivalentsError(f"{where}: line must be >= 1 and occurrence >= 0")
        if "/" not in entry["operator"]:
            raise EquivalentsError(f"{where}: operator {entry['operator']!r} is not a cosmic-ray name like core/AddNot")
        if not entry["reason"].strip():
            raise EquivalentsError(f"{where}: reason is empty: say why the mutant behaves as the original")
        if ident in out:
            raise EquivalentsError(f"{where}: the same mutant is listed twice")
        out[ident] = entry["reason"].strip()
    return out


def load(path: Path | None = None) -> dict[MutantId, str]:
    """:func:`parse` of a file (default: the shipped one; none there: empty).

    Raises:
        EquivalentsError: as :func:`parse`, or a file named but missing.
    """
    if path is None:
        path = DEFAULT_PATH
        if not path.exists():
            return {}
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise EquivalentsError(f"{path}: cannot read the equivalents file: {e}") from None
    return parse(text, str(path))
