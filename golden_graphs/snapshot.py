"""The snapshot file format: render and parse.

One UTF-8 text file per scenario. Example (abridged)::

    # cagrad golden graph snapshot, format 1
    # regenerate with: python -m golden_graphs accept broadcast
    scenario: broadcast
    torch: 2.13
    about: (3,1) * (1,4) + (4,): broadcast grads are summed back to each shape.

    [task_key]
    GraphTask 4101746407666c6f61743332760363707500000000

    [cache_keys]
    SumBackward0 005400...
        [00] node id = 0
        [54] needed = True (T)
        ...
    AddBackward0 015400...

    [graph]
    placeholder inputs
    %in0 : f32[] = inputs[0]
    # SumBackward0 (NodeCall 0)
    %expand : f32[3, 4] stride=(0, 0) = aten.expand.default(%in0, [3, 4])
    return [%view, %sum_1]

    [end]

Rules the parser enforces:

* line 1 is exactly :data:`MAGIC`; then ``#`` comment lines and the header
  fields ``scenario``, ``torch`` (``<major>.<minor>``) and ``about`` (may be
  empty), each exactly once, in any order;
* then the sections ``[task_key]`` (exactly one key line), ``[cache_keys]``
  (one key line per autograd node, in run order, at least one) and
  ``[graph]`` (the lines of :mod:`golden_graphs.normalize`, the last one a
  ``return``), in that order, and the closing ``[end]`` line; nothing may
  follow ``[end]`` but blank lines, and a file without it is reported as
  truncated;
* a key line is ``<NodeType> <hex>`` (:meth:`cagrad.CacheKey.hex`): an
  identifier, one space, an even number of lowercase hex digits;
* a key line may be followed by its decoded fields
  (:mod:`golden_graphs.key_fields`), one per line:
  ``    [<hex>] <name> = <value>`` (four spaces). When present, the fields'
  bytes must concatenate to the key's bytes exactly, so the readable view
  cannot disagree with the hex;
* blank lines are ignored outside the header.

Reading one: the ``# <Node> (NodeCall k)`` comments in ``[graph]`` refer to
the k-th line (counting from 0) of ``[cache_keys]``, the order the engine
runs the nodes in; nodes that run no ops (``AccumulateGrad``, ``GraphRoot``)
have a key line but no comment.

A file that breaks a rule raises :class:`SnapshotError` naming the file, the
line and what was expected there. :func:`render` is the only writer, and
``parse(render(s)) == s`` for every snapshot ``s``.
"""

from __future__ import annotations

import dataclasses
import re

from cagrad import CacheKey

from .key_fields import Field

MAGIC = "# cagrad golden graph snapshot, format 1"
SECTIONS = ("task_key", "cache_keys", "graph")
HEADER_FIELDS = ("scenario", "torch", "about")

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_TORCH = re.compile(r"\d+\.\d+")
_SECTION = re.compile(r"\[([a-z_]+)\]")
_FIELD = re.compile(r"    \[((?:[0-9a-f]{2})*)\] (.+?) = (.*)")
FIELD_INDENT = "    "


class SnapshotError(ValueError):
    """A snapshot file that does not parse.

    ``str(e)`` is ``"<source>:<line>: <message>"``; the parts are the
    attributes ``source``, ``line`` (1-based) and ``message``.
    """

    def __init__(self, source: str, line: int, message: str) -> None:
        super().__init__(f"{source}:{line}: {message}")
        self.source = source
        self.line = line
        self.message = message


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One scenario's golden data.

    Attributes:
        scenario: the scenario's name (also the file's stem).
        torch: the torch ``major.minor`` the snapshot was taken with.
        about: the scenario's one-line description.
        task_key: :attr:`cagrad.Capture.task_key`.
        cache_keys: :attr:`cagrad.Capture.cache_keys`, in run order.
        graph: the normalized graph lines (:func:`golden_graphs.normalize.graph_lines`).
        task_fields: the task key's decoded fields (empty: not recorded).
        key_fields: each cache key's decoded fields, parallel to
            ``cache_keys`` (empty: not recorded).
    """

    scenario: str
    torch: str
    about: str
    task_key: CacheKey
    cache_keys: tuple[CacheKey, ...]
    graph: tuple[str, ...]
    task_fields: tuple[Field, ...] = ()
    key_fields: tuple[tuple[Field, ...], ...] = ()


def _key_lines(key: CacheKey, fields: tuple[Field, ...]) -> list[str]:
    return [key.hex(), *(f"{FIELD_INDENT}[{f.data.hex()}] {f.line()}" for f in fields)]


def render(snap: Snapshot) -> str:
    """The file text of ``snap`` (newline-terminated).

    Raises:
        ValueError: a field that the parser could not read back (a newline
            in ``about`` or a graph line, a blank graph line, a bad node
            type name, a graph that does not end in ``return``).
    """
    _check_renderable(snap)
    lines = [
        MAGIC,
        f"# regenerate with: python -m golden_graphs accept {snap.scenario}",
        f"scenario: {snap.scenario}",
        f"torch: {snap.torch}",
        f"about: {snap.about}".rstrip(),
        "",
        "[task_key]",
        *_key_lines(snap.task_key, snap.task_fields),
        "",
        "[cache_keys]",
        *(
            line
            for i, k in enumerate(snap.cache_keys)
            for line in _key_lines(k, snap.key_fields[i] if snap.key_fields else ())
        ),
        "",
        "[graph]",
        *snap.graph,
        "",
        "[end]",
    ]
    return "\n".join(lines) + "\n"


def parse(text: str, source: str = "<snapshot>") -> Snapshot:
    """Reads a snapshot from its file text.

    Args:
        text: the file's contents.
        source: the name used in error messages (usually the path).

    Raises:
        SnapshotError: the text breaks a rule of the format (see the module
            docstring); the error names ``source`` and the line.
    """
    return _Parser(text, source).parse()


def _check_renderable(snap: Snapshot) -> None:
    if "\n" in snap.about or "\r" in snap.about:
        raise ValueError("about must be one line")
    if not _TORCH.fullmatch(snap.torch):
        raise ValueError(f"torch must be '<major>.<minor>', got {snap.torch!r}")
    if not snap.cache_keys:
        raise ValueError("a snapshot needs at least one cache key")
    if snap.key_fields and len(snap.key_fields) != len(snap.cache_keys):
        raise ValueError("key_fields must have one entry per cache key")
    for key, fields in ((snap.task_key, snap.task_fields), *zip(snap.cache_keys, snap.key_fields)):
        if fields and b"".join(f.data for f in fields) != key.key:
            raise ValueError(f"the fields of {key.node_type} do not add up to its key bytes")
        for f in fields:
            if "\n" in f.line() or " = " in f.name or not f.name:
                raise ValueError(f"field {f.line()!r} cannot be stored")
    for key in (snap.task_key, *snap.cache_keys):
        if not _IDENT.fullmatch(key.node_type):
            raise ValueError(f"node type {key.node_type!r} is not an identifier")
    if not snap.graph or not snap.graph[-1].startswith("return"):
        raise ValueError("the graph must end with its return line")
    for line in snap.graph:
        if not line.strip() or "\n" in line or "\r" in line or _SECTION.fullmatch(line):
            raise ValueError(f"graph line {line!r} cannot be stored")


class _Parser:
    def __init__(self, text: str, source: str) -> None:
        self.lines = text.split("\n")
        if self.lines and self.lines[-1] == "":
            self.lines.pop()  # the final newline
        self.source = source
        self.i = 0  # index of the next line
        self.section_line = 0  # 1-based line of the open section's header

    def error(self, message: str, line: int | None = None) -> SnapshotError:
        return SnapshotError(self.source, self.i + 1 if line is None else line, message)

    def got(self) -> str:
        if self.i >= len(self.lines):
            return "the end of the file (truncated?)"
        text = self.lines[self.i]
        if len(text) > 60:
            text = text[:57] + "..."
        return repr(text)

    def parse(self) -> Snapshot:
        if not self.lines or self.lines[0] != MAGIC:
            raise self.error(f"expected the first line {MAGIC!r}, got {self.got()}")
        self.i = 1
        header = self.header()
        task = self.keys("task_key", limit=1)
        if not task:
            raise self.error("expected the task's key line in [task_key]", self.section_line)
        keys = self.keys("cache_keys")
        if not keys:
            raise self.error("expected at least one key line in [cache_keys]", self.section_line)
        graph = self.graph()
        self.end()
        key_fields = tuple(f for _, f in keys)
        if not any(key_fields):
            key_fields = ()
        elif not all(key_fields):
            raise self.error("either every key line or none has decoded fields", self.section_line)
        return Snapshot(
            header["scenario"],
            header["torch"],
            header["about"],
            task[0][0],
            tuple(k for k, _ in keys),
            tuple(graph),
            task[0][1],
            key_fields,
        )

    def header(self) -> dict[str, str]:
        fields: dict[str, str] = {}
        while self.i < len(self.lines):
            line = self.lines[self.i]
            if line.startswith("#"):
                self.i += 1
                continue
            if line.strip() == "" or _SECTION.fullmatch(line):
                break
            name, sep, value = line.partition(":")
            if not sep or name not in HEADER_FIELDS:
                raise self.error(
                    f"expected a header field ({', '.join(f'{f}: ...' for f in HEADER_FIELDS)}),"
                    f" got {self.got()}"
                )
            if name in fields:
                raise self.error(f"header field {name!r} given twice")
            value = value.strip()
            if name == "torch" and not _TORCH.fullmatch(value):
                raise self.error(f"expected 'torch: <major>.<minor>', got {self.got()}")
            if name == "scenario" and not value:
                raise self.error("the scenario field is empty")
            fields[name] = value
            self.i += 1
        missing = [f for f in HEADER_FIELDS if f not in fields]
        if missing:
            raise self.error(f"expected header field {missing[0]!r} before {self.got()}")
        return fields

    def skip_blank(self) -> None:
        while self.i < len(self.lines) and self.lines[self.i].strip() == "":
            self.i += 1

    def open_section(self, name: str) -> None:
        self.skip_blank()
        if self.i >= len(self.lines) or self.lines[self.i] != f"[{name}]":
            raise self.error(f"expected the section header '[{name}]', got {self.got()}")
        self.section_line = self.i + 1
        self.i += 1

    def at_section(self) -> bool:
        return self.i >= len(self.lines) or bool(_SECTION.fullmatch(self.lines[self.i]))

    def keys(self, section: str, limit: int | None = None) -> list[tuple[CacheKey, tuple[Field, ...]]]:
        self.open_section(section)
        keys = []
        while True:
            self.skip_blank()
            if self.at_section():
                return keys
            if limit is not None and len(keys) == limit:
                raise self.error(
                    f"expected a section header after the {limit} line(s) of [{section}],"
                    f" got {self.got()}"
                )
            key_at = self.i + 1
            key = self.key_line(self.lines[self.i])
            self.i += 1
            fields = self.fields()
            if fields and b"".join(f.data for f in fields) != key.key:
                raise self.error(
                    f"the decoded fields under {key.node_type} do not add up to its key bytes "
                    f"({b''.join(f.data for f in fields).hex()} != {key.key.hex()})",
                    key_at,
                )
            keys.append((key, fields))

    def fields(self) -> tuple[Field, ...]:
        out = []
        while self.i < len(self.lines) and self.lines[self.i].startswith(FIELD_INDENT):
            m = _FIELD.fullmatch(self.lines[self.i])
            if m is None:
                raise self.error(
                    f"expected a decoded field '{FIELD_INDENT}[<hex bytes>] <name> = <value>', got {self.got()}"
                )
            out.append(Field(m.group(2), m.group(3), bytes.fromhex(m.group(1))))
            self.i += 1
        return tuple(out)

    def key_line(self, line: str) -> CacheKey:
        node_type, sep, hexbytes = line.partition(" ")
        expected = "expected a key line '<NodeType> <hex bytes>'"
        if not sep or not _IDENT.fullmatch(node_type):
            raise self.error(f"{expected}, got {self.got()}")
        if not _HEX.fullmatch(hexbytes):
            bad = next((c for c in hexbytes if c not in "0123456789abcdef"), None)
            if bad is not None:
                col = len(node_type) + 2 + hexbytes.index(bad)
                why = f"{bad!r} at column {col} is not a lowercase hex digit"
            else:
                why = f"odd number of hex digits ({len(hexbytes)})"
            raise self.error(f"{expected}: {why}")
        return CacheKey(node_type, bytes.fromhex(hexbytes))

    def graph(self) -> list[str]:
        self.open_section("graph")
        lines = []
        while True:
            self.skip_blank()
            if self.at_section():
                break
            lines.append(self.lines[self.i])
            self.i += 1
        if not lines:
            raise self.error("expected at least one line in [graph]", self.section_line)
        if not lines[-1].startswith("return"):
            self.i -= 1
            while self.lines[self.i].strip() == "":
                self.i -= 1
            raise self.error(f"expected the graph's 'return ...' line, got {self.got()}")
        return lines

    def end(self) -> None:
        if self.i >= len(self.lines):
            raise self.error("expected '[end]', got the end of the file (truncated?)")
        if self.lines[self.i] != "[end]":
            raise self.error(f"expected '[end]' after [graph], got {self.got()}")
        self.i += 1
        self.skip_blank()
        if self.i < len(self.lines):
            raise self.error(f"expected nothing after '[end]', got {self.got()}")
