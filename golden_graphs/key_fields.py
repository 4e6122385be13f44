"""Readable cache keys: each key's fields, named, recorded as they are written.

While :func:`recording` is active, cagrad's collectors write keys with
:class:`AnnotatingKeyWriter`, a :class:`cagrad.keys.cache_key.KeyWriter` that
also records, for every outermost write (``size``, ``tag``, ``value``,
``dtype``, ``device``, ``text``, ``int``), a :class:`Field`: a name, the value
written and the exact bytes it produced. The bytes are the writer's own, so
the decoded view can never drift from the encoding: the fields of a key
concatenate to its bytes (checked by :func:`fields_of` and by the snapshot
parser). Names come from the call site: the calling function, the argument
expression on its source line and its local variables (``attr``, ``what``,
``i``...), through :data:`_LABELS`; a call site missing from the table gets
``?<function>: <expression>`` (a test keeps the table complete).

Used only by golden_graphs (``take``): nothing in cagrad's hot path changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import linecache
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from cagrad import CacheKey
from cagrad.keys import collection as _collection
from cagrad.keys import compiled_node_args as _compiled_node_args
from cagrad.keys.cache_key import KeyWriter

UNNAMED = "?"  #: prefix of a field whose call site is not in the label table


@dataclasses.dataclass(frozen=True)
class Field:
    """One named field of a key.

    Attributes:
        name: what the field is (``"attribute dim"``, ``"edge 0: node id"``).
        value: the value as text (``"3"``, ``"float32"``, ``"T"``).
        data: the exact key bytes the field wrote.
    """

    name: str
    value: str
    data: bytes

    def line(self) -> str:
        """``"<name> = <value>"``."""
        return f"{self.name} = {self.value}"


# (calling function, argument expression) -> name template, formatted with
# the caller's locals
_LABELS: dict[tuple[str, str], str] = {
    # task key (cagrad.keys.collection.collect_backward)
    ("collect_backward", 'b"c"'): "create_graph",
    ("collect_backward", 'b"A" if accumulate_grad else b"G"'): "accumulate_grad (A) or grad (G)",
    ("collect_backward", "len(grad_tensors)"): "root gradients",
    ("collect_backward", "root.id"): "root edge {i}: node id",
    ("collect_backward", "root_nr"): "root edge {i}: input_nr",
    ("collect_backward", "len(task.output_edges)"): "autograd.grad inputs",
    ("collect_backward", 'b"N"'): "input: no node",
    ("collect_backward", "call.id"): "input: node id",
    ("collect_backward", "input_nr"): "input: input_nr",
    # every node (Collector.collect)
    ("collect", "call.id"): "node id",
    ("collect", 'b"T" if call.needed else b"F"'): "needed",
    ("collect", "len(call.captures)"): "captured inputs",
    ("collect", "input_nr"): "capture input_nr",
    ("collect", "out_idx"): "capture output index",
    ("collect", "_KIND_TAG[plan.kind]"): "runs as",
    ("collect", 'b"-"'): "hooks",
    # traced nodes
    ("_write_traced", 'getattr(node, "_saved_" + attr)'): "attribute {attr}",
    ("_write_traced", "len(values)"): "saved list {attr}: length",
    ("_sym_attr", 'b"N"'): "{what}: symint",
    ("_sym_attr", 'b"("'): "{what}: symints",
    ("_sym_attr", 'b"i"'): "{what}: symint",
    ("_sym_attr", "len(value)"): "{what}: length",
    ("_lift", 'b"N"'): "{what}: undefined",
    # tensors and input metadata
    ("write_tensor", 'b"t" if not t.requires_grad else b"r"'): "{what}: requires_grad",
    ("write_tensor", "t.dtype"): "{what}: dtype",
    ("write_tensor", "t.device"): "{what}: device",
    ("write_tensor", "len(shape)"): "{what}: ndim",
    ("write_tensor", "(t.is_conj(), t.is_neg())"): "{what}: (conj, neg)",
    ("write_input_metadata", "len(shape)"): "{what}: ndim",
    ("write_input_metadata", "md.dtype"): "{what}: dtype",
    ("write_input_metadata", "md.device"): "{what}: device",
    # custom Functions and inlined AOT backwards
    ("_write_custom", 'f"{cls.__module__}.{cls.__qualname__}"'): "forward class",
    ("_write_custom", "record.is_variable_input"): "is_variable_input",
    ("_write_aot", "node._forward_cls._aot_id"): "aot id",
    ("_write_outputs", "(node.materialize_grads, node._materialize_non_diff_grads)"): (
        "(materialize_grads, materialize_non_diff_grads)"
    ),
    ("_write_outputs", 'b"N"'): "output {i}: none",
    ("_write_outputs", "info.differentiable"): "output {i}: differentiable",
    ("_write_outputs", "info.dtype"): "output {i}: dtype",
    ("_write_outputs", "info.device"): "output {i}: device",
    ("_write_outputs", "len(info.shape)"): "output {i}: ndim",
    ("_write_custom_function", 'b"o"'): "backward: runs as",
    ("_write_custom_function", 'b"O"'): "backward: runs as",
    ("_write_custom_function", 'b"T"'): "backward: runs as",
    ("_write_custom_function", "fp.hex()"): "backward: fingerprint",
    ("_write_aot", 'b"B"'): "backward state",
    ("_write_aot", 'b"-"'): "backward state",
    ("_lift_saved_tensors", "len(values)"): "saved tensors",
    # hooks
    ("_hooks", 'b"H"'): "hooks",
    ("_hooks", 'b"h"'): "hooks",
    ("_hooks", "len(found.cpp_post)"): "C++ post hooks",
    ("_hooks", "len(found.tensor_pre)"): "inputs with tensor pre-hooks",
    ("_hooks", "input_nr"): "hooked input_nr",
    ("_hooks", "len(d)"): "{field} hooks",
    ("_hooks", "len(found.retain_grad)"): "inputs with retain_grad",
    ("_hooks", "0"): "{field} hooks",
    # one hook dict (tensor pre-hooks of an input, node pre- or post-hooks)
    ("_hook_dict", "len(d)"): "{name}",
    ("_hook_dict", 'b"o"'): "hook {k} {hook_of}: runs as",
    ("_hook_dict", 'b"p"'): "hook {k} {hook_of}: runs as",
    ("_hook_dict", "fp.hex()"): "hook {k} {hook_of}: fingerprint",
    ("_hooks", 'b"D"'): "{field} hooks: DDP's python-reducer hooks only",
    # tensor subclasses (cagrad.keys.subclasses)
    ("write_subclass", 'b"S" if not t.requires_grad else b"R"'): "{what}: subclass, requires_grad",
    ("write_subclass", "class_name(cls)"): "{what}: subclass class",
    ("write_subclass", "t.dtype"): "{what}: dtype",
    ("write_subclass", "t.device"): "{what}: device",
    ("write_subclass", "len(size)"): "{what}: ndim",
    ("write_subclass", "len(names)"): "{what}: inner tensors",
    ("write_subclass", "name"): "{what}: inner name",
    ("_write_ctx", 'b"{"'): "flatten metadata: dict",
    ("_write_ctx", "len(ctx)"): "flatten metadata: length",
    ("_write_ctx", "k"): "flatten metadata: key",
    ("_write_ctx", "ctx"): "flatten metadata: value",
    ("_write_ctx", 'b"(" if type(ctx) is tuple else b"["'): "flatten metadata: tuple or list",
    ("_write_ctx", 'b"<"'): "flatten metadata: named tuple",
    ("_write_ctx", "class_name(type(ctx))"): "flatten metadata: class",
    ("_write_ctx", 'b"@"'): "flatten metadata: dataclass",
    ("_write_ctx", "len(fields)"): "flatten metadata: fields",
    ("_write_ctx", "f.name"): "flatten metadata: field",
    ("_write_identity", 'b"o"'): "object by identity",
    ("_write_identity", "class_name(type(v))"): "object class",
    ("_write_identity", "_INTERNED.identity(v)"): "object number",
    ("_write_by_equality", 'b"="'): "value by equality",
    ("_write_by_equality", "class_name(cls)"): "value class",
    ("_write_by_equality", "n"): "value number",
    # edges
    ("_write_edges", "len(edges)"): "edges",
    ("_write_edges", 'b"N"'): "edge {i}: invalid",
    ("_write_edges", "target.id"): "edge {i}: node id",
    ("_write_edges", "input_nr"): "edge {i}: input_nr",
    ("_write_own_inputs", "len(call.input_metadata)"): "inputs",
}

_CALL = re.compile(r"\bw\.(size|sizes|tag|text|int|value|dtype|device)\((.*)\)\s*(?:#.*)?$")


def _label(frame: Any) -> str:
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    m = _CALL.search(line)
    expr = m.group(2) if m else line
    local = dict(frame.f_locals)
    if isinstance(local.get("what"), str):
        local["what"] = _short(local["what"])
    template = _LABELS.get((code.co_name, expr))
    if template is None:
        return f"{UNNAMED}{code.co_name}: {expr}"
    try:
        return template.format(**local)
    except (KeyError, IndexError, AttributeError):
        return f"{UNNAMED}{code.co_name}: {expr}"


def _short(what: str) -> str:
    """``"MmBackward0.mat2"`` -> ``"attribute mat2"``; ``"edge 0 of MmBackward0"`` -> ``"edge 0"``."""
    what = re.sub(r" of [A-Za-z_][\w.]*$", "", what)
    return re.sub(r"^[A-Za-z_]\w*\.(?=[A-Za-z_])", "attribute ", what)


# what a tag byte means, by the last word of its field's name
_TAG_MEANING = {
    "runs as": {
        "t": "traced",
        "o": "opaque",
        "c": "custom Function",
        "g": "inlined AOT backward",
        "a": "AccumulateGrad",
        "p": "traceable hook (fingerprint follows)",
        "T": "traced (fingerprint follows)",
        "O": "opaque after its own hooks",
    },
    "requires_grad": {"t": "False", "r": "True"},
    "needed": {"T": "True", "F": "False"},
    "hooks": {"-": "none", "h": "Python", "H": "C++ post hooks and Python"},
    "backward state": {"B": "yes", "-": "no"},
    "create_graph": {"c": "True"},
    "undefined": {"N": "None"},
    "none": {"N": "None"},
    "invalid": {"N": "None"},
    "symint": {"N": "None", "i": "int (a size slot)"},
    "symints": {"(": "sequence (size slots)"},
}


def _meaning(name: str, tag: str) -> str:
    for suffix, table in _TAG_MEANING.items():
        if name.endswith(suffix) and tag in table:
            return table[tag] if tag == "(" else f"{table[tag]} ({tag})"
    return tag


def _show(kind: str, v: Any) -> str:
    if kind == "tag":
        return bytes(v).decode("latin-1")
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, torch.device):
        return str(v)
    if isinstance(v, (bool, int, float, str)) or v is None:
        return repr(v) if isinstance(v, str) else str(v)
    if isinstance(v, (tuple, list, torch.Size)):
        inner = ", ".join(_show("value", x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    return str(v).removeprefix("torch.")


_LIVE: list[AnnotatingKeyWriter] | None = None


class AnnotatingKeyWriter(KeyWriter):
    """A KeyWriter that also records a :class:`Field` per outermost write.

    The bytes it writes are exactly :class:`KeyWriter`'s (it calls the base
    methods); ``fields`` holds the named pieces in order.
    """

    __slots__ = ("fields", "_depth")

    def __init__(self) -> None:
        super().__init__()
        self.fields: list[Field] = []
        self._depth = 0
        if _LIVE is not None:
            _LIVE.append(self)


def _recorded(kind: str) -> Any:
    base = getattr(KeyWriter, kind)

    def write(self: AnnotatingKeyWriter, *args: Any) -> None:
        if self._depth:
            return base(self, *args)
        start = len(self.buf)
        self._depth += 1
        try:
            base(self, *args)
        finally:
            self._depth -= 1
        label = _label(sys._getframe(1))
        value = _show(kind, args[0])
        if kind == "tag":
            value = _meaning(label, value)
        self.fields.append(Field(label, value, bytes(self.buf[start:])))

    write.__name__ = kind
    write.__doc__ = base.__doc__
    return write


for _kind in ("size", "sizes", "tag", "text", "int", "value", "dtype", "device"):
    setattr(AnnotatingKeyWriter, _kind, _recorded(_kind))


@contextlib.contextmanager
def recording() -> Iterator[list[AnnotatingKeyWriter]]:
    """While active, cagrad's collectors write keys with
    :class:`AnnotatingKeyWriter`; yields the list of writers, in creation
    order (the task key's first, then one per node in run order).

    Not thread-safe and not reentrant (golden_graphs captures one scenario
    at a time).
    """
    global _LIVE
    if _LIVE is not None:
        raise RuntimeError("key_fields.recording() is not reentrant")
    writers: list[AnnotatingKeyWriter] = []
    _LIVE = writers
    saved = (_compiled_node_args.KeyWriter, _collection.KeyWriter)
    _compiled_node_args.KeyWriter = AnnotatingKeyWriter
    _collection.KeyWriter = AnnotatingKeyWriter
    try:
        yield writers
    finally:
        _compiled_node_args.KeyWriter, _collection.KeyWriter = saved
        _LIVE = None


def fields_of(
    writers: Sequence[AnnotatingKeyWriter], keys: Sequence[CacheKey]
) -> list[tuple[Field, ...]]:
    """The fields of each of ``keys``: the writer whose bytes are that key's,
    taken in order (writers that produced no key are skipped).

    Raises:
        ValueError: a key no writer produced, or a writer whose fields do not
            add up to its bytes (the recording missed a write).
    """
    out = []
    it = iter(writers)
    for key in keys:
        for w in it:
            if w.getvalue() == key.key:
                break
        else:
            raise ValueError(f"no recorded writer produced the key of {key.node_type}")
        joined = b"".join(f.data for f in w.fields)
        if joined != key.key:
            raise ValueError(
                f"the recorded fields of {key.node_type} do not add up to its key "
                f"({joined.hex()} != {key.key.hex()})"
            )
        out.append(tuple(w.fields))
    return out


def field_diff(
    old_keys: Sequence[CacheKey],
    old_fields: Sequence[Sequence[Field]],
    new_keys: Sequence[CacheKey],
    new_fields: Sequence[Sequence[Field]],
) -> list[str]:
    """Field-level changes from one key sequence to another, one line each:
    ``"NodeCall 3 MmBackward0: `attribute dim` 2 -> 1"``, ``"... added `x` = 1"``,
    ``"NodeCall 4 AccumulateGrad: added node"``. Keys are aligned by node type
    (:class:`difflib.SequenceMatcher`); an aligned pair with equal bytes
    gives nothing. A key stored without fields is compared as its bytes.
    """
    lines: list[str] = []
    types_a = [k.node_type for k in old_keys]
    types_b = [k.node_type for k in new_keys]
    matcher = difflib.SequenceMatcher(None, types_a, types_b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            for i, j in zip(range(i1, i2), range(j1, j2)):
                a, b = old_keys[i], new_keys[j]
                if a == b:
                    continue
                head = f"NodeCall {j} {b.node_type}" if a.node_type == b.node_type else (
                    f"NodeCall {j} {a.node_type} -> {b.node_type}"
                )
                fa = old_fields[i] if i < len(old_fields) else ()
                fb = new_fields[j] if j < len(new_fields) else ()
                if not fa or not fb:
                    lines.append(f"{head}: key bytes {a.key.hex()} -> {b.key.hex()}")
                    continue
                lines += [f"{head}: {c}" for c in _fields_changes(fa, fb)]
            continue
        for i in range(i1, i2):
            lines.append(f"NodeCall {i} {old_keys[i].node_type}: removed node")
        for j in range(j1, j2):
            lines.append(f"NodeCall {j} {new_keys[j].node_type}: added node")
    return lines


def _fields_changes(a: Sequence[Field], b: Sequence[Field]) -> list[str]:
    out = []
    matcher = difflib.SequenceMatcher(None, list(a), list(b), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        olds, news = list(a[i1:i2]), list(b[j1:j2])
        while olds and news and olds[0].name == news[0].name:
            o, n = olds.pop(0), news.pop(0)
            if o.value == n.value:  # same text, other bytes (a hand-edited file)
                out.append(f"`{o.name}` {o.value} -> {n.value} (bytes {o.data.hex()} -> {n.data.hex()})")
            else:
                out.append(f"`{o.name}` {o.value} -> {n.value}")
        out += [f"removed `{f.name}` = {f.value}" for f in olds]
        out += [f"added `{f.name}` = {f.value}" for f in news]
    return out
