"""A captured graph and its size expressions as plain data (JSON types only).

:mod:`cagrad.compile.disk_cache` stores captured backwards in files another process
reads. Nothing here runs code named by the data: a graph is a list of nodes
whose targets are looked up in fixed tables (ATen and prims operator
overloads by name, a few ``operator`` and ``torch.sym_*`` functions), and a
sympy expression is a tree whose function heads are looked up in a table
of sympy's and torch's size functions (``FloorDiv``, ``Mod``, ...), with
symbols bound by name to symbols the caller provides. Anything outside those
tables raises :class:`NotSerializable` on writing and :class:`ValueError`
on reading.

Encodings:

* a value (node argument): ``None``, ``bool``, ``int`` as themselves;
  ``["n", name]`` a node; ``["f", float.hex()]``; ``["c", re, im]`` complex;
  ``["str", s]``; ``["l", items]`` list; ``["t", items]`` tuple;
  ``["dtype", name]``, ``["device", str]``, ``["layout", name]``,
  ``["mf", name]`` (memory format);
* a target: ``["s", str]`` (placeholder, output), ``["op", "ns::name",
  overload]``, ``["fn", "operator.mul"]``;
* a node: ``[op, name, target, args, kwargs]``;
* an expression: an ``int``; ``["sym", name]``; ``["rat", p, q]``;
  ``["float", hex]``; ``["true"]``/``["false"]``; ``[head, *args]``.
"""

from __future__ import annotations

import inspect
import math
import operator
from typing import Any

import sympy
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import PythonKeyTracer
from torch.utils._sympy import functions as _torch_sympy


class NotSerializable(Exception):
    """This graph or expression has something the encoding does not cover.

    Args:
        reason: a short slug (``"target"``, ``"value"``, ``"expr"``).
        detail: what it was.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# -- sympy expressions ----------------------------------------------------------

_SYMPY_HEADS: tuple[type, ...] = (
    sympy.Add,
    sympy.Mul,
    sympy.Pow,
    sympy.Eq,
    sympy.Ne,
    sympy.Lt,
    sympy.Le,
    sympy.Gt,
    sympy.Ge,
    sympy.And,
    sympy.Or,
    sympy.Not,
    sympy.Max,
    sympy.Min,
    sympy.Mod,
    sympy.floor,
    sympy.ceiling,
    sympy.Abs,
)


def _head_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _heads() -> dict[str, type]:
    heads = {_head_name(c): c for c in _SYMPY_HEADS}
    for value in vars(_torch_sympy).values():
        if (
            inspect.isclass(value)
            and issubclass(value, sympy.Basic)
            and value.__module__ == _torch_sympy.__name__
        ):
            heads[_head_name(value)] = value
    return heads


_HEADS = _heads()


def expr_to_data(e: Any) -> Any:
    """``e`` (an int or a sympy expression) as plain data.

    Raises:
        NotSerializable: a function or atom outside the tables.
    """
    if isinstance(e, bool):
        raise NotSerializable("expr", f"a Python bool {e!r} where an expression was expected")
    if isinstance(e, int):
        return e
    if e is sympy.true:
        return ["true"]
    if e is sympy.false:
        return ["false"]
    if isinstance(e, sympy.Integer):
        return int(e)
    if isinstance(e, sympy.Rational):
        return ["rat", int(e.p), int(e.q)]
    if isinstance(e, sympy.Float):
        f = float(e)
        if sympy.Float(f) != e:
            raise NotSerializable("expr", f"float {e} is not a binary64")
        return ["float", f.hex()]
    if isinstance(e, sympy.Symbol):
        return ["sym", e.name]
    head = _head_name(type(e))
    if head not in _HEADS or _HEADS[head] is not type(e):
        raise NotSerializable("expr", f"{type(e).__name__} in {e}")
    return [head, *(expr_to_data(a) for a in e.args)]


def expr_from_data(d: Any, symbols: dict[str, Any]) -> Any:
    """The expression ``d`` encodes, its symbols taken from ``symbols`` by name.

    Raises:
        ValueError: a malformed tree, an unknown head or symbol.
    """
    if isinstance(d, bool):
        raise ValueError(f"a bool {d!r} is not an expression")
    if isinstance(d, int):
        return sympy.Integer(d)
    if not isinstance(d, list) or not d or not isinstance(d[0], str):
        raise ValueError(f"malformed expression {d!r:.80}")
    tag = d[0]
    if tag == "sym":
        if len(d) != 2 or d[1] not in symbols:
            raise ValueError(f"unknown symbol in {d!r:.80}")
        return symbols[d[1]]
    if tag == "true" and len(d) == 1:
        return sympy.true
    if tag == "false" and len(d) == 1:
        return sympy.false
    if tag == "rat" and len(d) == 3 and all(type(x) is int for x in d[1:]):
        return sympy.Rational(d[1], d[2])
    if tag == "float" and len(d) == 2 and isinstance(d[1], str):
        return sympy.Float(float.fromhex(d[1]))
    cls = _HEADS.get(tag)
    if cls is None:
        raise ValueError(f"unknown expression head {tag!r:.80}")
    return cls(*(expr_from_data(a, symbols) for a in d[1:]))


# -- FX graphs -------------------------------------------------------------------

_NAMESPACES = ("aten", "prims")

_FUNCTIONS: dict[str, Any] = {
    **{
        f"operator.{name}": getattr(operator, name)
        for name in (
            "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos",
            "abs", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_",
            "lshift", "rshift", "invert",
        )
    },
    **{
        f"torch.{name}": getattr(torch, name)
        for name in ("sym_max", "sym_min", "sym_not", "sym_float", "sym_int", "sym_ite", "sym_sum", "_sym_sqrt")
        if hasattr(torch, name)
    },
    "math.ceil": math.ceil,
    "math.floor": math.floor,
    "math.trunc": math.trunc,
}  # fmt: skip
_FUNCTION_NAMES = {id(fn): name for name, fn in _FUNCTIONS.items()}


def _target_to_data(node: torch.fx.Node) -> list:
    target = node.target
    if node.op in ("placeholder", "output"):
        if not isinstance(target, str):
            raise NotSerializable("target", f"{node.op} {node.name} has target {target!r}")
        return ["s", target]
    if node.op != "call_function":
        raise NotSerializable("node", f"{node.op} node {node.name}")
    if isinstance(target, torch._ops.OpOverload):
        qualified = target._schema.name
        ns = qualified.split("::", 1)[0]
        if ns not in _NAMESPACES:
            raise NotSerializable("target", f"operator {qualified} (namespace {ns})")
        return ["op", qualified, target._overloadname]
    name = _FUNCTION_NAMES.get(id(target))
    if name is None or _FUNCTIONS[name] is not target:
        raise NotSerializable("target", f"{getattr(target, '__name__', target)!r} called by {node.name}")
    return ["fn", name]


def _target_from_data(d: Any) -> Any:
    if not isinstance(d, list) or not d:
        raise ValueError(f"malformed target {d!r:.80}")
    if d[0] == "s" and len(d) == 2 and isinstance(d[1], str):
        return d[1]
    if d[0] == "fn" and len(d) == 2 and d[1] in _FUNCTIONS:
        return _FUNCTIONS[d[1]]
    if d[0] == "op" and len(d) == 3 and isinstance(d[1], str) and isinstance(d[2], str):
        ns, _, name = d[1].partition("::")
        if ns not in _NAMESPACES or not name.isidentifier() or not d[2].isidentifier():
            raise ValueError(f"operator {d[1]}.{d[2]} is not one cagrad stores")
        packet = getattr(getattr(torch.ops, ns), name, None)
        overload = getattr(packet, d[2], None) if isinstance(packet, torch._ops.OpOverloadPacket) else None
        if not isinstance(overload, torch._ops.OpOverload):
            raise ValueError(f"no operator {d[1]}.{d[2]} in this torch")
        return overload
    raise ValueError(f"malformed target {d!r:.80}")


def _value_to_data(v: Any) -> Any:
    if v is None or isinstance(v, bool):
        return v
    t = type(v)
    if t is int:
        return v
    if isinstance(v, torch.fx.Node):
        return ["n", v.name]
    if t is float:
        return ["f", v.hex()]
    if t is complex:
        return ["c", v.real.hex(), v.imag.hex()]
    if t is str:
        return ["str", v]
    if isinstance(v, list):  # immutable_list too
        return ["l", [_value_to_data(x) for x in v]]
    if t is tuple:
        return ["t", [_value_to_data(x) for x in v]]
    if t is torch.dtype:
        return ["dtype", str(v).removeprefix("torch.")]
    if t is torch.device:
        return ["device", str(v)]
    if t is torch.layout:
        return ["layout", str(v).removeprefix("torch.")]
    if t is torch.memory_format:
        return ["mf", str(v).removeprefix("torch.")]
    raise NotSerializable("value", f"a {t.__name__} argument")


def _named(kind: type, name: Any) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if type(value) is not kind:
        raise ValueError(f"no torch {kind.__name__} named {name!r:.80}")
    return value


def _value_from_data(d: Any, nodes: dict[str, torch.fx.Node]) -> Any:
    if d is None or isinstance(d, (bool, int)):
        return d
    if not isinstance(d, list) or len(d) < 2 or not isinstance(d[0], str):
        raise ValueError(f"malformed value {d!r:.80}")
    tag, arg = d[0], d[1]
    if tag == "n" and len(d) == 2:
        if arg not in nodes:
            raise ValueError(f"argument names node {arg!r:.80} before it is defined")
        return nodes[arg]
    if tag == "f" and len(d) == 2 and isinstance(arg, str):
        return float.fromhex(arg)
    if tag == "c" and len(d) == 3 and isinstance(arg, str) and isinstance(d[2], str):
        return complex(float.fromhex(arg), float.fromhex(d[2]))
    if tag == "str" and len(d) == 2 and isinstance(arg, str):
        return arg
    if tag in ("l", "t") and len(d) == 2 and isinstance(arg, list):
        items = [_value_from_data(x, nodes) for x in arg]
        return items if tag == "l" else tuple(items)
    if tag == "dtype" and len(d) == 2:
        return _named(torch.dtype, arg)
    if tag == "device" and len(d) == 2 and isinstance(arg, str):
        return torch.device(arg)
    if tag == "layout" and len(d) == 2:
        return _named(torch.layout, arg)
    if tag == "mf" and len(d) == 2:
        return _named(torch.memory_format, arg)
    raise ValueError(f"malformed value {d!r:.80}")


def graph_to_data(gm: torch.fx.GraphModule) -> list:
    """The nodes of ``gm`` as plain data, in graph order.

    Raises:
        NotSerializable: a node other than placeholder/call_function/output,
            a target or argument outside the tables.
    """
    out = []
    for node in gm.graph.nodes:
        if node.type is not None:
            raise NotSerializable("node", f"{node.name} has a type annotation")
        kwargs = {k: _value_to_data(v) for k, v in node.kwargs.items()}
        out.append([node.op, node.name, _target_to_data(node), _value_to_data(tuple(node.args)), kwargs])
    return out


def graph_from_data(data: Any) -> torch.fx.GraphModule:
    """The GraphModule :func:`graph_to_data` encoded, with the same node names
    (and so the same code), built as :mod:`cagrad.capture.compiler` builds it.

    Raises:
        ValueError: malformed data, an unknown target, or a name the graph
            would not keep.
    """
    if not isinstance(data, list):
        raise ValueError("the graph is not a list of nodes")
    graph = torch.fx.Graph(tracer_cls=PythonKeyTracer)
    nodes: dict[str, torch.fx.Node] = {}
    for item in data:
        if not (isinstance(item, list) and len(item) == 5 and isinstance(item[1], str)):
            raise ValueError(f"malformed node {item!r:.80}")
        op, name, target, args, kwargs = item
        if op not in ("placeholder", "call_function", "output") or not isinstance(kwargs, dict):
            raise ValueError(f"malformed node {item!r:.80}")
        args = _value_from_data(args, nodes)
        if not isinstance(args, tuple):
            raise ValueError(f"node {name!r:.80}: arguments are not a tuple")
        kw = {str(k): _value_from_data(v, nodes) for k, v in kwargs.items()}
        node = graph.create_node(op, _target_from_data(target), args, kw, name=name)
        if node.name != name:
            raise ValueError(f"node {name!r:.80} would be named {node.name!r}")
        nodes[name] = node
    graph.lint()
    return torch.fx.GraphModule(torch.nn.Module(), graph, "CompiledAutograd")
