"""Normalized text of a captured backward graph.

:func:`graph_lines` turns a cagrad ``GraphModule`` into lines that depend
only on the graph's structure: no addresses, ids, file paths or names that
vary between processes, and the same lines for the same graph however often
it is traced. One FX node is one line::

    placeholder inputs
    %in0 : f32[] = inputs[0]
    # MeanBackward0 (NodeCall 0)
    %expand : f32[3] = aten.expand.default(%in0, [3])
    %div : f32[3] = aten.div.Scalar(%expand, 3)
    # engine (no autograd_node)
    %add : f32[4, 3] = aten.add.Tensor(%t, %mul)
    return [%mm_1, %mm]

* Names are assigned here, not taken from FX: ``inputs[i]`` reads are
  ``%in<i>``, ``hooks[i]`` reads (runtime objects: hook dicts, opaque nodes,
  leaves) are ``%obj<i>``, every other value is its op's name (``mm``, ``sum``) plus
  ``_<k>`` for the k-th repeat in graph order, so an inserted op renames
  only later ops of the same kind.
* ``: f32[3, 4]`` is ``node.meta["val"]``: dtype and shape, with
  ``stride=(...)`` appended when the value is not contiguous (expands and
  transposes, where the layout matters to a compiler).
* A ``# <autograd node>`` comment precedes each run of ops that came from one
  autograd node (``node.meta["autograd_node"]``); ops without that meta (the
  engine's input-buffer sums between nodes) are under ``# engine (no
  autograd_node)``.
* Constants print as Python literals; an object whose repr holds a memory
  address has the address replaced by ``0x?``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

ENGINE_GROUP = "engine (no autograd_node)"

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")

_DTYPE_ABBR = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.complex64: "c64",
    torch.complex128: "c128",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "b8",
}


def graph_text(gm: torch.fx.GraphModule | torch.fx.Graph) -> str:
    """:func:`graph_lines` joined with newlines (with a final newline)."""
    return "".join(line + "\n" for line in graph_lines(gm))


def graph_lines(gm: torch.fx.GraphModule | torch.fx.Graph) -> list[str]:
    """The normalized lines of a graph or a GraphModule's graph (see the
    module docstring)."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    return list(_Printer(graph).lines())


def dtype_abbr(dtype: torch.dtype) -> str:
    """``f32`` for ``torch.float32``; unlisted dtypes keep their torch name."""
    return _DTYPE_ABBR.get(dtype, str(dtype).removeprefix("torch."))


def value_type(val: Any) -> str | None:
    """The ``f32[2, 3]`` annotation of a node's ``meta["val"]`` (None: none)."""
    if isinstance(val, torch.Tensor):
        shape = ", ".join(str(s) for s in val.shape)
        text = f"{dtype_abbr(val.dtype)}[{shape}]"
        if val.layout is torch.strided and not val.is_contiguous():
            text += f" stride={_tuple(val.stride())}"
        elif val.layout is not torch.strided:
            text += f" {str(val.layout).removeprefix('torch.')}"
        return text
    if isinstance(val, (tuple, list)):
        parts = [value_type(v) or "-" for v in val]
        return "(" + ", ".join(parts) + ")"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return "sym"
    if isinstance(val, (bool, int, float)):
        return type(val).__name__
    return None


def _tuple(items: Any) -> str:
    inner = ", ".join(str(s) for s in items)
    return f"({inner},)" if len(items) == 1 else f"({inner})"


# how reads of each placeholder list are named: inputs[i] -> %in<i>, the
# runtime objects hooks[i] (hook dicts, opaque nodes, leaves) -> %obj<i>
_READ_PREFIX = {"inputs": "in", "hooks": "obj", "sizes": "size", "scalars": "scalar"}


class _Printer:
    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.names: dict[torch.fx.Node, str] = {}
        self.counts: dict[str, int] = {}
        self.taken: set[str] = set()  # every name given, placeholders and inputs too

    def lines(self) -> Iterator[str]:
        group: str | None = None
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self.names[node] = str(node.target)
                self.taken.add(str(node.target))
                yield f"placeholder {node.target}"
                continue
            if node.op == "output":
                yield f"return {self._arg(node.args[0])}"
                continue
            read = self._placeholder_read(node)
            if read is not None:
                placeholder, index = read
                prefix = _READ_PREFIX.get(placeholder, placeholder)
                self.names[node] = f"{prefix}{index}"
                self.taken.add(f"{prefix}{index}")
                yield f"%{prefix}{index}{self._type(node)} = {placeholder}[{index}]"
                continue
            origin = node.meta.get("autograd_node") or ENGINE_GROUP
            if origin != group:
                group = origin
                yield f"# {origin}"
            name = self._fresh(_base_name(node))
            self.names[node] = name
            yield f"%{name}{self._type(node)} = {self._call(node)}"

    def _placeholder_read(self, node: torch.fx.Node) -> tuple[str, int] | None:
        """``(placeholder, i)`` when ``node`` is ``operator.getitem(placeholder, i)``."""
        if node.op != "call_function" or node.target is not operator.getitem:
            return None
        src, index = node.args
        if isinstance(src, torch.fx.Node) and src.op == "placeholder" and isinstance(index, int):
            return str(src.target), index
        return None

    def _fresh(self, base: str) -> str:
        while True:
            k = self.counts.get(base, 0)
            self.counts[base] = k + 1
            name = base if k == 0 else f"{base}_{k}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def _type(self, node: torch.fx.Node) -> str:
        t = value_type(node.meta.get("val"))
        return "" if t is None else f" : {t}"

    def _call(self, node: torch.fx.Node) -> str:
        args = [self._arg(a) for a in node.args]
        args += [f"{k}={self._arg(v)}" for k, v in node.kwargs.items()]
        joined = ", ".join(args)
        if node.op == "call_function":
            return f"{_target_name(node.target)}({joined})"
        if node.op == "call_method":
            return f"{args[0]}.{node.target}({', '.join(args[1:])})"
        if node.op == "call_module":
            return f"module:{node.target}({joined})"
        return f"{node.op}:{node.target}({joined})"

    def _arg(self, a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return "%" + self.names.get(a, f"<unprinted {a.op}>")
        if isinstance(a, list):
            return "[" + ", ".join(self._arg(x) for x in a) + "]"
        if isinstance(a, tuple):
            inner = ", ".join(self._arg(x) for x in a)
            return f"({inner},)" if len(a) == 1 else f"({inner})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{self._arg(k)}: {self._arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self._arg(a.start)}, {self._arg(a.stop)}, {self._arg(a.step)})"
        if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
            return str(a)
        if isinstance(a, torch.device):
            return f"device({a})"
        if isinstance(a, float):
            return repr(a)
        return _ADDRESS.sub("0x?", repr(a))


def _base_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, str):
        return re.sub(r"\W", "_", target.split(".")[-1]) or "op"
    name = getattr(target, "__name__", None) or type(target).__name__
    return re.sub(r"\W", "_", name).lstrip("_") or "op"


def _target_name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if name is None:
        return _ADDRESS.sub("0x?", repr(target))
    module = {"_operator": "operator", "builtins": ""}.get(module, module)
    return f"{module}.{name}" if module else name
