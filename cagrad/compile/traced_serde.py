"""A capture (:class:`~cagrad.capture.traced.Traced`) as plain data, and back.

:func:`traced_to_data` writes what rebuilds a capture without tracing (the
graph's nodes through :mod:`cagrad.compile.graph_serde`, the fake values it
reads as expressions over the trace's symbols, the symbols in creation
order, the size check, the input/output plan); :func:`traced_from_data`
rebuilds it in another process. :mod:`cagrad.compile.disk_cache` stores
these records and says what is stored and why (its module docstring).

Raises:
    NotSerializable: a value the data cannot hold (``traced_to_data``).
    ValueError, KeyError, TypeError: a malformed record
        (``traced_from_data``; :mod:`cagrad.compile.disk_cache` turns them
        into a CacheFileError naming the file).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx

from ..keys.sizes import rebuilt_check, static_check
from . import graph_serde
from .graph_serde import NotSerializable, expr_from_data, expr_to_data


def _sym_to_data(x: Any) -> Any:
    if isinstance(x, torch.SymInt):
        return expr_to_data(x.node.expr)
    if type(x) is int:
        return x
    raise NotSerializable("value", f"a size {x!r}")


def _float_to_data(f: float) -> str:
    return float(f).hex()


def _reads(gm: torch.fx.GraphModule, name: str) -> list[torch.fx.Node]:
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == name)
    return list(ph.users)


def traced_to_data(traced: Any) -> dict[str, Any]:
    """The record that rebuilds ``traced`` (see the module docstring).

    Raises:
        NotSerializable: something in it the record cannot hold.
    """
    gm = traced.graph_module
    inputs, sizes = [], []
    for node in _reads(gm, "inputs"):
        val = node.meta.get("val")
        if not (node.target is operator.getitem and isinstance(val, torch.Tensor)):
            raise NotSerializable("input", f"graph input read {node.name}")
        if val.layout is not torch.strided or val.is_conj() or val.is_neg() or type(val).__name__ != "FakeTensor":
            raise NotSerializable("input", f"graph input {node.name} is not a plain strided fake")
        spec = {
            "dtype": str(val.dtype).removeprefix("torch."),
            "device": str(val.device),
            "shape": [_sym_to_data(s) for s in val.shape],
            "stride": [_sym_to_data(s) for s in val.stride()],
            "offset": _sym_to_data(val.storage_offset()),
            "requires_grad": bool(node.meta["cagrad_requires_grad"]),
        }
        inputs.append([node.name, spec])
    size_exprs: dict[int, Any] = {}
    for node in _reads(gm, "sizes"):
        val = node.meta.get("val")
        if node.target is not operator.getitem or not isinstance(val, (torch.SymInt, int)):
            raise NotSerializable("size", f"graph size read {node.name}")
        sizes.append([node.name, _sym_to_data(val)])
        size_exprs[node.args[1]] = sizes[-1][1]
    if sorted(size_exprs) != list(range(len(traced.size_inputs))):
        raise NotSerializable("size", "the size inputs are not the graph's size reads")
    check = traced.check
    env = traced.shape_env
    if check.is_static:
        symbols = None
        check_data: dict[str, Any] = {"expected": list(check.expected)}
    else:
        created = getattr(env, "source_to_var", None)
        values = getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", None)
        if created is None or values is None:
            raise NotSerializable("shape_env", "this torch's ShapeEnv does not list its symbols")
        symbols = []
        for source, sym in created.items():
            if not isinstance(sym, sympy.Symbol) or sym not in values:
                raise NotSerializable("shape_env", f"symbol {sym} of {source}")
            symbols.append([source, sym.name, int(values[sym]), bool(sym.is_positive)])
        names = {name for _, name, _, _ in symbols}
        if any(sym.name not in names for sym in check.bound_symbols):
            raise NotSerializable("shape_env", "a bound symbol the ShapeEnv did not create")
        if len(check.derived_exprs) != len(check.derived):
            raise NotSerializable("check", "derived slots without their expressions")
        check_data = {
            "expected": list(check.expected),
            "static": list(check.static),
            "symbols": [list(s) for s in check.symbols],
            "derived": [[slot, expr_to_data(e)] for (slot, _), e in zip(check.derived, check.derived_exprs)],
            "ranges": [[_float_to_data(lo), _float_to_data(hi)] for lo, hi in check.ranges],
            "guards": [expr_to_data(e) for e in check.guard_exprs],
            "bound": [sym.name for sym in check.bound_symbols],
            "hints": list(check.hints),
        }
    notes = {}
    for node in gm.graph.nodes:
        origin = node.meta.get("autograd_node")
        if isinstance(origin, str):
            notes[node.name] = origin
    return {
        "graph": graph_serde.graph_to_data(gm),
        "autograd_node": notes,
        "inputs": inputs,
        "sizes": sizes,
        "size_inputs": [size_exprs[j] for j in range(len(size_exprs))],
        "input_indices": list(traced.input_indices),
        "leaf_outputs": [list(x) for x in traced.leaf_outputs],
        "capture_outputs": list(traced.capture_outputs),
        "returns_input": list(traced.returns_input),
        "accumulate_at_end": bool(traced.accumulate_at_end),
        "symbols": symbols,
        "check": check_data,
    }


def _int_list(d: Any, what: str) -> list[int]:
    if not isinstance(d, list) or not all(type(x) is int for x in d):
        raise ValueError(f"{what} is not a list of ints")
    return d


class _Replace:
    """``ShapeEnv.replace`` of a ShapeEnv made after the check (identity before)."""

    __slots__ = ("env",)

    def __init__(self) -> None:
        self.env: Any = None

    def __call__(self, expr: Any) -> Any:
        return expr if self.env is None else self.env.replace(expr)


def traced_from_data(
    data: dict[str, Any], plans: list[Any], values: Sequence[int], hints: bool = True
) -> Any:
    """Rebuilds the :class:`~cagrad.capture.traced.Traced` a record holds, or None
    when its size check rejects ``values``.

    Args:
        plans: the node plans of the backward (its collector's).
        values: the backward's size slot values.
        hints: True: the symbols get ``values``' values as hints (as a trace
            of this backward would); False: the record's own.

    Raises:
        ValueError, KeyError, TypeError: a malformed record.
    """
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer, set_meta
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from ..capture.traced import Traced

    cd = data["check"]
    expected = _int_list(cd["expected"], "check.expected")
    symbol_list = data["symbols"]
    replace = _Replace()
    if symbol_list is None:
        check = static_check(expected)
        by_name: dict[str, Any] = {}
        sym_values: list[int] | None = [] if check.match(values) is not None else None
    else:
        by_name = {}
        for item in symbol_list:
            if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)):
                raise ValueError("malformed symbol list")
            _, name, hint, positive = item
            if not isinstance(name, str) or type(hint) is not int or type(positive) is not bool or name in by_name:
                raise ValueError("malformed symbol list")
            by_name[name] = sympy.Symbol(name, integer=True, positive=True if positive else None)
        bound_names = cd["bound"]
        if not isinstance(bound_names, list) or any(n not in by_name for n in bound_names):
            raise ValueError("the check binds an unknown symbol")
        bound = [by_name[n] for n in bound_names]
        ranges = [(float.fromhex(lo), float.fromhex(hi)) for lo, hi in cd["ranges"]]
        check = rebuilt_check(
            expected,
            _int_list(cd["static"], "check.static"),
            [_int_list(s, "check.symbols") for s in cd["symbols"]],
            [(slot, expr_from_data(e, by_name)) for slot, e in cd["derived"]],
            ranges,
            [expr_from_data(e, by_name) for e in cd["guards"]],
            bound,
            _int_list(cd["hints"], "check.hints"),
            replace,
        )
        if not (len(bound) == len(check.symbols) == len(ranges) == len(check.hints)):
            raise ValueError("the check's symbol lists differ in length")
        sym_values = check.match(values)
    if sym_values is None:
        return None
    sym_of = dict(zip(check.bound_symbols, sym_values if hints else check.hints))
    env = None
    point: dict[Any, Any] = {}
    if symbol_list is not None:
        env = ShapeEnv()
        for source, name, stored, positive in symbol_list:
            hint = sym_of.get(by_name[name], stored)
            if hint < 2:
                return None  # would be specialized: trace instead
            if positive:
                sym = env.create_symbol(hint, ConstantSource(source), dynamic_dim=DimDynamic.DYNAMIC)
            else:  # a symbol that may be 0 (cagrad.capture.shape_env.create_symbol)
                from torch.utils._sympy.numbers import int_oo

                sym = env.create_symbol(
                    hint, ConstantSource(source), dynamic_dim=DimDynamic.DYNAMIC, positive=None,
                    do_not_specialize_zero_one=True,
                )
                env.constrain_symbol_range(sym, 0, int_oo)
            if sym != by_name[name]:
                raise ValueError(f"the ShapeEnv names the symbol of {source} {sym}, not {name}")
            point[sym] = sympy.Integer(hint)
        replace.env = env
        fake_mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=False, shape_env=env)
    else:
        fake_mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=False)

    def size(d: Any) -> Any:
        e = expr_from_data(d, by_name)
        if e.is_number:
            return int(e)
        if env is None:
            raise ValueError(f"a static graph with a symbolic size {e}")
        return env.create_symintnode(e, hint=int(e.xreplace(point)))

    gm = graph_serde.graph_from_data(data["graph"])
    nodes = {n.name: n for n in gm.graph.nodes}
    tracer = PythonKeyTracer()  # set_meta as the trace sets it
    tracer.graph = gm.graph
    for name, origin in data["autograd_node"].items():
        nodes[name].meta["autograd_node"] = str(origin)
    filled = set()
    for name, spec in data["inputs"]:
        node = nodes[name]
        dtype = getattr(torch, spec["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"no dtype {spec['dtype']!r}")
        device = torch.device(spec["device"])
        shape = [size(s) for s in spec["shape"]]
        stride = [size(s) for s in spec["stride"]]
        offset = size(spec["offset"])
        if len(shape) != len(stride):
            raise ValueError(f"input {name}: sizes and strides differ in length")
        with fake_mode:
            if isinstance(offset, int) and offset == 0:
                fake = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            else:
                extent = offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1
                base = torch.empty((extent,), dtype=dtype, device=device)
                fake = base.as_strided(shape, stride, offset)
        set_meta(torch.fx.Proxy(node, tracer), fake)
        node.meta["cagrad_requires_grad"] = bool(spec["requires_grad"])
        filled.add(node)
    for name, d in data["sizes"]:
        node = nodes[name]
        set_meta(torch.fx.Proxy(node, tracer), size(d))
        filled.add(node)
    for ph in ("inputs", "sizes"):
        if any(n not in filled for n in _reads(gm, ph)):
            raise ValueError(f"a read of {ph} has no value")
    if env is None:
        if data["size_inputs"]:
            raise ValueError("a static graph with size inputs")
        size_inputs = []
    else:
        size_inputs = [check.function(expr_from_data(d, by_name)) for d in data["size_inputs"]]

    def to_value(x: Any) -> Any:
        if isinstance(x, torch.SymInt):
            return check.function(x.node.expr)
        return lambda *_sym, x=x: x

    return Traced(
        gm,
        _int_list(data["input_indices"], "input_indices"),
        [(int(pos), int(i)) for pos, i in data["leaf_outputs"]],
        [None if i is None else int(i) for i in data["capture_outputs"]],
        [bool(a) for a in data["returns_input"]],
        bool(data["accumulate_at_end"]),
        check,
        size_inputs,
        to_value,
        list(plans),
        frozenset(),
        env,
    )


