"""Known issues: a triage file of divergences that are already understood.

A campaign given a known-issues file (``--known FILE``) counts each
divergence whose root-cause signature (:mod:`fuzz.signature`) matches an
entry, does not shrink it again, and does not let it change the exit status;
a divergence that matches no entry is a new failure. The file is TOML (or JSON
with the same structure, chosen by the ``.json`` extension)::

    schema = 1                     # optional; 1 is the only version

    [[issue]]
    id = "torch-ca-hook-order"     # unique, required
    pattern = "torch_ca*@* mismatch trace: trace: hook events in another order"
    subjects = ["torch_ca*"]       # optional globs over the subject name
    ops = ["index_select"]         # optional globs over the program's ops
    torch = ">=2.13,<2.14"         # optional PEP 440 specifier
    note = "what torch does"       # required
    link = "https://github.com/pytorch/pytorch/issues/..."  # optional
    reproducer = "known_reproducers/torch-ca-hook-order.py"   # optional

``pattern`` and ``subjects`` are :mod:`fnmatch` globs matched case-sensitively
with ``*`` and ``?`` as wildcards; square brackets are literal, because
subject names contain them (``torch_ca[eager]``). An entry applies only when
the subject matches one of ``subjects`` (any subject when absent) and the
torch version satisfies ``torch`` (pre-releases and local versions such as
``2.13.0a0+git1234`` or ``2.13.0+cpu`` included), and, where ``ops`` is
given, only to a program each of whose globs matches one of its op names
(:meth:`fuzz.ir.Program.op_names`; the program the divergence was found in,
before shrinking). ``ops`` narrows an entry for a bug of a backend's kernel:
a value mismatch names no op in its signature, and an entry that matched
every value mismatch of a subject would hide that subject's own bugs.

``reproducer`` names a plain-torch script (a path relative to the file's
directory) that exits 1 where the issue reproduces on the installed torch
and 0 where it does not: tests/fuzz/test_known_reproducers.py runs each and
checks that it reproduces exactly where ``torch`` admits the installed
version (docs/torch-versions.md).
Entries are tried in file order; the first that matches wins.

The shipped :meth:`KnownIssues.default` file, ``fuzz/known_issues.toml``,
lists torch's compiled autograd's divergences.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

#: The only version of the file format.
SCHEMA = 1
#: The file shipped with the fuzzer.
DEFAULT_PATH = Path(__file__).with_name("known_issues.toml")

_REQUIRED = ("id", "pattern", "note")
_OPTIONAL = ("subjects", "ops", "torch", "link", "reproducer")
_TOP_LEVEL = ("schema", "issue")


class KnownIssuesError(ValueError):
    """A known-issues file that cannot be read or does not follow the format;
    the message names the file, the line where it can, and what was expected."""


def _glob(pattern: str) -> re.Pattern[str]:
    """An fnmatch glob with ``[`` literal (``[[]`` is fnmatch's literal
    ``[``; a lone ``]`` is literal already)."""
    return re.compile(fnmatch.translate(pattern.replace("[", "[[]")))


@dataclasses.dataclass(frozen=True)
class KnownIssue:
    """One entry of a known-issues file.

    Attributes:
        id: a unique name (``"torch-ca-hook-order"``).
        pattern: a glob over the whole signature
            (``"torch_ca*@* error AssertionError: *queue_callback*"``).
        subjects: globs over the subject name; empty for any subject.
        ops: globs over op names, each of which some op of the program must
            match; empty for any program.
        torch: a PEP 440 specifier over torch's version (``">=2.11,<2.14"``),
            or ``None`` for any version.
        note: what is known (what the subject does, why).
        link: a URL (a PyTorch issue), or ``""``.
        reproducer: a plain-torch script reproducing it, relative to the
            known-issues file's directory (exit 1: reproduces), or ``""``.
    """

    id: str
    pattern: str
    subjects: tuple[str, ...] = ()
    torch: str | None = None
    note: str = ""
    link: str = ""
    ops: tuple[str, ...] = ()
    reproducer: str = ""

    def __post_init__(self) -> None:
        # validated here so that an entry built in code fails like a file does
        spec = SpecifierSet(self.torch) if self.torch is not None else None
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_pattern_re", _glob(self.pattern))
        object.__setattr__(self, "_subject_res", tuple(_glob(s) for s in self.subjects))
        object.__setattr__(self, "_op_res", tuple(_glob(o) for o in self.ops))

    def applies_to(self, subject: str, torch_version: str) -> bool:
        """Whether this entry covers ``subject`` under torch ``torch_version``.

        Raises:
            ValueError: ``torch_version`` is not a PEP 440 version.
        """
        if self._subject_res and not any(r.match(subject) for r in self._subject_res):  # type: ignore[attr-defined]
            return False
        spec: SpecifierSet | None = self._spec  # type: ignore[attr-defined]
        return spec is None or spec.contains(_version(torch_version), prereleases=True)

    def matches(self, signature: str, torch_version: str, ops: Sequence[str] | None = None) -> bool:
        """Whether ``signature`` (:func:`fuzz.signature.make_signature`)
        is this known issue under torch ``torch_version``, for a program
        whose op names are ``ops`` (None: not known, and an entry with
        ``ops`` does not match)."""
        return (
            bool(self._pattern_re.match(signature))  # type: ignore[attr-defined]
            and self.applies_to(signature_subject(signature), torch_version)
            and self._uses_ops(ops)
        )

    def _uses_ops(self, ops: Sequence[str] | None) -> bool:
        op_res: tuple[re.Pattern[str], ...] = self._op_res  # type: ignore[attr-defined]
        if not op_res:
            return True
        if ops is None:
            return False
        return all(any(r.match(op) for op in ops) for r in op_res)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "pattern": self.pattern}
        if self.subjects:
            out["subjects"] = list(self.subjects)
        if self.ops:
            out["ops"] = list(self.ops)
        if self.torch is not None:
            out["torch"] = self.torch
        out["note"] = self.note
        if self.link:
            out["link"] = self.link
        if self.reproducer:
            out["reproducer"] = self.reproducer
        return out


def signature_subject(signature: str) -> str:
    """The subject named by a signature: ``"torch_ca[eager]"`` from
    ``"torch_ca[eager]@cpu mismatch ..."``."""
    head = signature.split(" ", 1)[0]
    subject, at, _ = head.rpartition("@")
    return subject if at else head


def _version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise ValueError(f"torch version {text!r} is not a PEP 440 version (expected e.g. '2.13.0+cpu')") from None


class KnownIssues:
    """The entries of a known-issues file, in file order.

    Args:
        issues: the entries; ids must be unique.
        path: the file they came from, for messages (``None`` if built in code).
    """

    def __init__(self, issues: list[KnownIssue] | tuple[KnownIssue, ...] = (), path: Path | str | None = None):
        self.issues = list(issues)
        self.path = Path(path) if path is not None else None
        seen: set[str] = set()
        for issue in self.issues:
            if issue.id in seen:
                raise KnownIssuesError(f"{self.path or '<known issues>'}: issue id {issue.id!r} is used twice")
            seen.add(issue.id)

    def __len__(self) -> int:
        return len(self.issues)

    def __iter__(self) -> Iterator[KnownIssue]:
        return iter(self.issues)

    def __repr__(self) -> str:
        return f"KnownIssues({len(self.issues)} issues from {self.path})"

    def match(self, signature: str, torch_version: str, ops: Sequence[str] | None = None) -> KnownIssue | None:
        """The first entry that matches ``signature`` under torch
        ``torch_version`` (``torch.__version__``) for a program with op
        names ``ops`` (see :meth:`KnownIssue.matches`), or ``None``.

        Raises:
            ValueError: ``torch_version`` is not a PEP 440 version.
        """
        _version(torch_version)
        for issue in self.issues:
            if issue.matches(signature, torch_version, ops):
                return issue
        return None

    @classmethod
    def default(cls) -> KnownIssues:
        """The shipped file, ``fuzz/known_issues.toml``."""
        return cls.load(DEFAULT_PATH)

    @classmethod
    def load(cls, path: Path | str) -> KnownIssues:
        """Reads a TOML file, or JSON when the name ends in ``.json``.

        Raises:
            KnownIssuesError: the file cannot be read, does not parse, or an
                entry breaks the format (unknown or missing key, wrong type,
                bad specifier, duplicate id); the message names the file,
                the entry (index and line where known) and what was expected.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise KnownIssuesError(f"{path}: cannot read known-issues file: {e}") from None
        is_json = path.suffix.lower() == ".json"
        try:
            data = json.loads(text) if is_json else tomllib.loads(text)
        except json.JSONDecodeError as e:
            raise KnownIssuesError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
        except tomllib.TOMLDecodeError as e:
            raise KnownIssuesError(f"{path}: not valid TOML: {e}") from None
        lines = _TomlLines(text) if not is_json else None
        return cls(_parse(data, path, lines), path)


class _TomlLines:
    """Line numbers of ``[[issue]]`` tables and their keys in a TOML text
    (tomllib gives values only), for error messages."""

    _HEADER = re.compile(r"^\s*\[\[\s*issue\s*\]\]")
    _KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")

    def __init__(self, text: str):
        self.tables: list[tuple[int, dict[str, int]]] = []
        self.top: dict[str, int] = {}
        in_other_table = False
        for n, line in enumerate(text.splitlines(), start=1):
            if self._HEADER.match(line):
                self.tables.append((n, {}))
                in_other_table = False
            elif line.lstrip().startswith("["):
                in_other_table = True
            elif (m := self._KEY.match(line)) and not in_other_table:
                keys = self.tables[-1][1] if self.tables else self.top
                keys.setdefault(m.group(1), n)

    def line(self, index: int | None, key: str | None = None) -> int | None:
        if index is None:
            return self.top.get(key) if key else None
        if index >= len(self.tables):
            return None
        start, keys = self.tables[index]
        return keys.get(key, start) if key else start


def _where(path: Path, lines: _TomlLines | None, index: int | None, key: str | None = None) -> str:
    line = lines.line(index, key) if lines is not None else None
    loc = f"{path}:{line}" if line is not None else str(path)
    return f"{loc}: issue {index + 1}" if index is not None else loc


def _parse(data: Any, path: Path, lines: _TomlLines | None) -> list[KnownIssue]:
    if not isinstance(data, dict):
        raise KnownIssuesError(f"{path}: expected a table with an 'issue' list at the top, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_TOP_LEVEL))
    if unknown:
        raise KnownIssuesError(
            f"{_where(path, lines, None, unknown[0])}: unknown top-level key(s) {unknown}; expected {list(_TOP_LEVEL)}"
        )
    schema = data.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise KnownIssuesError(f"{_where(path, lines, None, 'schema')}: schema {schema!r} is not supported; expected {SCHEMA}")
    entries = data.get("issue", [])
    if not isinstance(entries, list):
        raise KnownIssuesError(f"{path}: 'issue' must be a list of tables ([[issue]] in TOML), got {type(entries).__name__}")
    issues: list[KnownIssue] = []
    ids: dict[str, int] = {}
    for i, entry in enumerate(entries):
        issue = _parse_entry(entry, i, path, lines)
        if issue.id in ids:
            raise KnownIssuesError(
                f"{_where(path, lines, i, 'id')}: id {issue.id!r} is already used by issue {ids[issue.id] + 1}; ids must be unique"
            )
        ids[issue.id] = i
        issues.append(issue)
    return issues


def _parse_entry(entry: Any, i: int, path: Path, lines: _TomlLines | None) -> KnownIssue:
    if not isinstance(entry, dict):
        raise KnownIssuesError(f"{_where(path, lines, i)}: expected a table of keys, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise KnownIssuesError(
            f"{_where(path, lines, i, unknown[0])}: unknown key(s) {unknown}; "
            f"expected {list(_REQUIRED)} and optionally {list(_OPTIONAL)}"
        )
    for key in _REQUIRED:
        if key not in entry:
            raise KnownIssuesError(f"{_where(path, lines, i)}: missing required key {key!r} (a string)")
    for key in ("id", "pattern", "note", "torch", "link", "reproducer"):
        if key in entry and (not isinstance(entry[key], str) or (key in ("id", "pattern") and not entry[key].strip())):
            raise KnownIssuesError(
                f"{_where(path, lines, i, key)}: {key!r} must be a non-empty string, got {entry[key]!r}"
            )
    subjects = entry.get("subjects", [])
    if not isinstance(subjects, list) or not all(isinstance(s, str) and s for s in subjects):
        raise KnownIssuesError(
            f"{_where(path, lines, i, 'subjects')}: 'subjects' must be a list of glob strings "
            f"(e.g. [\"torch_ca*\"]), got {subjects!r}"
        )
    ops = entry.get("ops", [])
    if not isinstance(ops, list) or not all(isinstance(o, str) and o for o in ops):
        raise KnownIssuesError(
            f"{_where(path, lines, i, 'ops')}: 'ops' must be a list of glob strings over op names "
            f"(e.g. [\"index_select\"]), got {ops!r}"
        )
    torch_spec = entry.get("torch")
    if torch_spec is not None:
        try:
            SpecifierSet(torch_spec)
        except InvalidSpecifier:
            raise KnownIssuesError(
                f"{_where(path, lines, i, 'torch')}: 'torch' = {torch_spec!r} is not a PEP 440 "
                "version specifier; expected e.g. \">=2.11,<2.14\""
            ) from None
    return KnownIssue(
        id=entry["id"],
        pattern=entry["pattern"],
        subjects=tuple(subjects),
        ops=tuple(ops),
        torch=torch_spec,
        note=entry["note"],
        link=entry.get("link", ""),
        reproducer=entry.get("reproducer", ""),
    )
