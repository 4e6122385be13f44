"""The op catalog's vocabulary: :class:`OpSpec`, its attributes, the
registry (:data:`OPS`, :func:`register`, :func:`get`), and the shape rules
and generators the op modules share.

The ops themselves are registered by :mod:`fuzz.ops_math`,
:mod:`fuzz.ops_shape`, :mod:`fuzz.ops_custom` and :mod:`fuzz.ops_inplace`;
:mod:`fuzz.ops` imports them all, in that order (the catalog's order, which
the strategies draw from), and is what the rest of the fuzzer reads.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from fuzz.ir_check import is_int as _is_int

Shape = tuple[int, ...]
DrawFn = Callable[[st.SearchStrategy[Any]], Any]
Plan = tuple[list[Shape], dict[str, Any]]
MAX_RANK = 4
MAX_DIM = 5

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class SpecError(ValueError):
    """Base of the errors an op's rules raise on bad inputs or attributes."""


class ShapeError(SpecError):
    pass


class DTypeError(SpecError):
    pass


class AttrError(SpecError):
    def __init__(self, message: str, attr: str | None = None):
        super().__init__(message)
        self.attr = attr


# ------------------------------------------------------------ attributes
ATTR_KINDS = ("int", "float", "bool", "dim", "dims", "opt_dims", "opt_dim", "shape", "dtype", "ints", "str")


@dataclasses.dataclass(frozen=True)
class Attr:
    """One attribute: ``kind`` is one of :data:`ATTR_KINDS`.

    ``dim``: an int; ``opt_dim``: int or null; ``dims``: a non-empty list of
    distinct ints or an int; ``opt_dims``: the same or null (all dims);
    ``shape``/``ints``: a list of ints; ``dtype``: "float32" or "float64";
    ``str``: a string (usually with ``choices``).
    """

    kind: str
    choices: tuple[Any, ...] | None = None


def _check_value(kind: str, value: Any) -> str | None:
    """Returns what is wrong with ``value`` for ``kind``, or None."""
    if kind in ("int", "dim"):
        return None if _is_int(value) else "expected an int"
    if kind == "opt_dim":
        return None if value is None or _is_int(value) else "expected an int or null"
    if kind == "float":
        ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
        return None if ok else "expected a finite number"
    if kind == "bool":
        return None if isinstance(value, bool) else "expected a bool"
    if kind in ("dims", "opt_dims"):
        if value is None:
            return None if kind == "opt_dims" else "expected an int or a list of ints"
        if _is_int(value):
            return None
        if not isinstance(value, (list, tuple)) or not all(_is_int(d) for d in value):
            return "expected an int or a list of ints"
        if not value:
            return "an empty dim list is not allowed"
        return None
    if kind in ("shape", "ints"):
        ok = isinstance(value, (list, tuple)) and all(_is_int(d) for d in value)
        return None if ok else "expected a list of ints"
    if kind == "dtype":
        return None if value in TORCH_DTYPES else f"expected one of {sorted(TORCH_DTYPES)}"
    if kind == "str":
        return None if isinstance(value, str) else "expected a string"
    return f"unknown attribute kind {kind!r}"  # pragma: no cover - catalog bug


def check_attrs(spec: OpSpec, attrs: Mapping[str, Any]) -> None:
    unknown = sorted(set(attrs) - set(spec.attrs))
    if unknown:
        raise AttrError(
            f"unknown attribute {unknown[0]!r}; {spec.name} takes {sorted(spec.attrs) or 'none'}",
            unknown[0],
        )
    for name, attr in spec.attrs.items():
        if name not in attrs:
            raise AttrError(f"missing attribute {name!r} ({attr.kind})", name)
        problem = _check_value(attr.kind, attrs[name])
        if problem is None and attr.choices is not None and attrs[name] not in attr.choices:
            problem = f"expected one of {list(attr.choices)}"
        if problem is not None:
            raise AttrError(f"attribute {name!r}={attrs[name]!r}: {problem}", name)


# --------------------------------------------------------------- op spec
def _accept_any(shape: Shape) -> bool:
    return True


def _no_plan(draw: DrawFn, shape: Shape) -> Plan:
    return [], {}


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    category: str
    impl: Callable[[Sequence[torch.Tensor], Mapping[str, Any]], Any]
    infer: Callable[[Sequence[Shape], Mapping[str, Any]], list[Shape]]
    code: Callable[[Sequence[str], Mapping[str, Any]], str]
    min_arity: int = 1
    max_arity: int = 1
    attrs: Mapping[str, Attr] = dataclasses.field(default_factory=dict)
    accepts: Callable[[Shape], bool] = _accept_any
    plan: Callable[[DrawFn, Shape], Plan] = _no_plan
    dtype_rule: str = "promote"
    multi_output: bool = False
    differentiable: bool = True
    nondiff_inputs: frozenset[int] = frozenset()
    doc: str = ""
    # When the op returns its first input itself (``x.to(x.dtype)``,
    # ``flatten(x, d, d)``, an in-place op on ``x``): ``identity(shapes,
    # dtypes, attrs)``. The output then is a leaf exactly when the input is.
    identity: Callable[[Sequence[Shape], Sequence[str], Mapping[str, Any]], bool] | None = None
    # Whether the output is a newly allocated tensor that aliases nothing
    # (``fresh``): only those may be modified in place by an
    # ``inplace_first`` op. Views and split outputs never are.
    fresh_output: Callable[[Mapping[str, Any]], bool] | bool = True
    # The op modifies its first input in place: that input must be fresh and
    # require grad (so no leaf and no view of one is ever written to), and
    # no split/unbind view of it may exist (fuzz.ir.inplace_conflicts).
    inplace_first: bool = False
    # Generated about a quarter as often as the others.
    rare: bool = False
    # Several statements instead of one expression, for readable
    # reproducers: ``stmts(out_name, args, attrs) -> [line, ...]``; the
    # lines must bind ``out_name``.
    stmts: Callable[[str, Sequence[str], Mapping[str, Any]], list[str]] | None = None
    # Names of the fuzz.functions classes the rendered code uses.
    functions: tuple[str, ...] = ()

    def arity_text(self) -> str:
        if self.min_arity == self.max_arity:
            return str(self.min_arity)
        return f"{self.min_arity}..{self.max_arity}"

    def out_dtype(self, dtypes: Sequence[str], attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> str:
        """torch's type promotion for floating inputs: a 0-d tensor only
        counts when every input is 0-d (``float32[3] + float64[]`` is
        float32)."""
        if self.dtype_rule == "attr":
            return attrs["dtype"]
        if self.dtype_rule == "first":  # in-place ops: the written tensor's dtype
            return dtypes[0]
        idx = [j for j in range(len(dtypes)) if j not in self.nondiff_inputs] or list(range(len(dtypes)))
        if self.dtype_rule == "same":
            considered = [dtypes[j] for j in idx]
            if len(set(considered)) > 1:
                raise DTypeError(f"inputs must share a dtype, got {considered}")
            return considered[0]
        dimensioned = [j for j in idx if len(shapes[j]) > 0]
        considered = [dtypes[j] for j in (dimensioned or idx)]
        return "float64" if "float64" in considered else "float32"

    def run(self, tensors: Sequence[torch.Tensor], attrs: Mapping[str, Any]) -> Any:
        return self.impl(tensors, attrs)

    def is_identity(self, shapes: Sequence[Shape], dtypes: Sequence[str], attrs: Mapping[str, Any]) -> bool:
        return self.identity is not None and bool(self.identity(shapes, dtypes, attrs))

    def is_fresh(self, attrs: Mapping[str, Any]) -> bool:
        if self.category in ("view", "split"):
            return False
        return bool(self.fresh_output(attrs)) if callable(self.fresh_output) else bool(self.fresh_output)

    def statements(self, out: str, args: Sequence[str], attrs: Mapping[str, Any]) -> list[str]:
        """The op as code binding ``out`` (one line unless ``stmts`` is set)."""
        if self.stmts is not None:
            return self.stmts(out, args, attrs)
        return [f"{out} = {self.code(args, attrs)}"]


OPS: dict[str, OpSpec] = {}
#: op name -> the module that registered it (``fuzz.ops_math``, ...), for
#: :func:`order_catalog`.
REGISTERED_BY: dict[str, str] = {}


def register(spec: OpSpec) -> OpSpec:
    """Adds ``spec`` to the catalog (a name may be registered once),
    noting the module that called (the catalog's order is by module, see
    :func:`order_catalog`)."""
    if spec.name in OPS:
        raise ValueError(f"op {spec.name!r} is already registered")
    for attr in spec.attrs.values():
        if attr.kind not in ATTR_KINDS:
            raise ValueError(f"op {spec.name!r}: unknown attribute kind {attr.kind!r}")
    OPS[spec.name] = spec
    REGISTERED_BY[spec.name] = sys._getframe(1).f_globals.get("__name__", "?")
    return spec


def order_catalog(modules: Sequence[str]) -> None:
    """Puts :data:`OPS` in the order of ``modules`` (the op modules' names),
    each module's ops in the order it registered them, whatever order the
    modules were imported in (``import fuzz.ops_graph`` before ``fuzz.ops``
    registers its ops first). The strategies draw from this order.

    Raises:
        ValueError: an op was registered by a module not in ``modules``.
    """
    rank = {m: i for i, m in enumerate(modules)}
    stray = sorted(n for n in OPS if REGISTERED_BY[n] not in rank)
    if stray:
        raise ValueError(f"ops {stray} registered by modules not in the catalog's order {list(modules)}")
    position = {n: i for i, n in enumerate(OPS)}
    ordered = sorted(OPS.items(), key=lambda item: (rank[REGISTERED_BY[item[0]]], position[item[0]]))
    OPS.clear()
    OPS.update(ordered)


def get(name: str) -> OpSpec:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known: {sorted(OPS)}") from None


def _fmt(template: str) -> Callable[[Sequence[str], Mapping[str, Any]], str]:
    def code(args: Sequence[str], attrs: Mapping[str, Any]) -> str:
        return template.format(*args, args=", ".join(args), **{k: repr(v) for k, v in attrs.items()})

    return code


# ----------------------------------------------------------- shape rules
def norm_dim(dim: int, rank: int, *, extra: int = 0) -> int:
    """``dim`` in ``[-(rank+extra), rank+extra)`` made non-negative."""
    n = rank + extra
    if n == 0 or not -n <= dim < n:
        raise ShapeError(f"dim {dim} out of range for a rank-{rank} input")
    return dim % n


def norm_dims(dims: Any, rank: int) -> list[int]:
    if dims is None:
        return list(range(rank))
    if _is_int(dims):
        dims = [dims]
    out = [norm_dim(d, rank) for d in dims]
    if len(set(out)) != len(out):
        raise ShapeError(f"repeated dim in {list(dims)}")
    return out


def broadcast(*shapes: Shape) -> Shape:
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        sizes = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            raise ShapeError(f"shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _same(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    return [tuple(shapes[0])]


def _bcast(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    return [broadcast(*shapes)]


def _reduce_shape(shape: Shape, dims: Any, keepdim: bool) -> Shape:
    red = set(norm_dims(dims, len(shape))) if len(shape) else set()
    if dims is not None and not len(shape):
        raise ShapeError("a 0-d input takes dim=None")
    if keepdim:
        return tuple(1 if i in red else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in red)


def _reduce(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    return [_reduce_shape(shapes[0], attrs["dim"], attrs["keepdim"])]


def _matmul_shape(a: Shape, b: Shape) -> Shape:
    if not a or not b:
        raise ShapeError("matmul needs inputs of rank >= 1")
    if len(a) == 1 and len(b) == 1:
        if a[0] != b[0]:
            raise ShapeError(f"inner sizes differ: {a[0]} vs {b[0]}")
        return ()
    if len(b) == 1:
        if a[-1] != b[0]:
            raise ShapeError(f"inner sizes differ: {a[-1]} vs {b[0]}")
        return a[:-1]
    if len(a) == 1:
        if a[0] != b[-2]:
            raise ShapeError(f"inner sizes differ: {a[0]} vs {b[-2]}")
        return b[:-2] + (b[-1],)
    if a[-1] != b[-2]:
        raise ShapeError(f"inner sizes differ: {a[-1]} vs {b[-2]}")
    return broadcast(a[:-2], b[:-2]) + (a[-2], b[-1])


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _reshape_shape(shape: Shape, target: Sequence[int]) -> Shape:
    target = list(target)
    if target.count(-1) > 1:
        raise ShapeError("at most one -1 in a shape")
    if any(d < -1 for d in target):
        raise ShapeError(f"invalid size in {target}")
    known = _numel(tuple(d for d in target if d != -1))
    numel = _numel(shape)
    if -1 in target:
        if known == 0 or numel % known:
            raise ShapeError(f"cannot view {list(shape)} as {target}")
        target[target.index(-1)] = numel // known
    elif known != numel:
        raise ShapeError(f"cannot view {list(shape)} ({numel} elements) as {target}")
    return tuple(target)


# ------------------------------------------------------------ generators
# Hypothesis shrinks sampled_from to its first element and integers to their
# lower end, so the simplest choice comes first everywhere below.


def _shape_strategy(min_rank: int = 0, max_rank: int = MAX_RANK) -> st.SearchStrategy[Shape]:
    return st.lists(st.integers(1, MAX_DIM), min_size=min_rank, max_size=max_rank).map(tuple)


def draw_broadcast_partner(draw: DrawFn, shape: Shape) -> Shape:
    """A shape that broadcasts with ``shape`` (simplest: ``shape`` itself)."""
    out = []
    for d in shape:
        if d == 1:
            out.append(draw(st.sampled_from([1, 2, 3])))
        else:
            out.append(draw(st.sampled_from([d, 1])))
    if out and draw(st.booleans()):
        out = out[draw(st.integers(1, len(out))) :]  # fewer leading dims
    elif len(out) < MAX_RANK and draw(st.booleans()):
        out = [draw(st.integers(1, 3))] + out  # one more leading dim
    return tuple(out)


def draw_into_partner(draw: DrawFn, shape: Shape) -> Shape:
    """A shape that broadcasts *into* ``shape`` without growing it (each dim
    its size or 1, maybe fewer leading dims); simplest: ``shape`` itself."""
    out = [d if d == 1 else draw(st.sampled_from([d, 1])) for d in shape]
    if out and draw(st.booleans()):
        out = out[draw(st.integers(1, len(out))) :]
    return tuple(out)


def check_into(target: Shape, other: Shape, what: str = "operand") -> None:
    """Raises :class:`ShapeError` unless ``other`` broadcasts into ``target``."""
    try:
        ok = len(other) <= len(target) and broadcast(target, other) == tuple(target)
    except ShapeError:
        ok = False
    if not ok:
        raise ShapeError(f"{what} of shape {list(other)} does not broadcast into {list(target)}")


def _dims_attr(draw: DrawFn, rank: int, *, allow_none: bool = True) -> Any:
    """None (all dims), one dim, or a list of distinct dims."""
    if rank == 0:
        return None
    options = ["one", "list"] + (["none"] if allow_none else [])
    kind = draw(st.sampled_from(options))
    if kind == "none":
        return None
    if kind == "one":
        return draw(st.integers(0, rank - 1))
    return sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank)))


def _one_dim_plan(draw: DrawFn, shape: Shape) -> Plan:
    return [], {"dim": draw(st.integers(0, len(shape) - 1))}


def _rank_at_least(n: int) -> Callable[[Shape], bool]:
    return lambda shape: len(shape) >= n


def _rank_between(lo: int, hi: int) -> Callable[[Shape], bool]:
    return lambda shape: lo <= len(shape) <= hi


def _factor_shape(draw: DrawFn, numel: int) -> list[int]:
    factors = []
    n, p = numel, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    rank = draw(st.integers(1 if numel > 1 else 0, MAX_RANK))
    if rank == 0:
        return []
    dims = [1] * rank
    for f in factors:
        dims[draw(st.integers(0, rank - 1))] *= f
    return dims


def names() -> list[str]:
    return list(OPS)


def categories() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for spec in OPS.values():
        out.setdefault(spec.category, []).append(spec.name)
    return out
