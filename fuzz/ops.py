"""The op catalog: every op the fuzzer can put in a program.

Each :class:`OpSpec` knows

* its arity (``min_arity`` .. ``max_arity``) and its attribute schema
  (``attrs``: name -> :class:`Attr`), checked by :func:`check_attrs`;
* its shape rule ``infer(input_shapes, attrs) -> [output shape, ...]``
  (raises :class:`ShapeError`) and dtype rule (``promote``, ``same``: inputs
  must agree, or ``attr``: the ``dtype`` attribute);
* its torch implementation ``impl(tensors, attrs)``, and ``code(args,
  attrs)``: the same thing as a torch expression, for readable reproducers;
* how to generate it: ``accepts(first_shape)`` says whether a value of that
  shape can be its first input, and ``plan(draw, first_shape)`` draws the
  shapes its other inputs need plus its attributes (``draw`` is Hypothesis'
  draw function).

Ops that could blow values up use tame variants so that float32 comparisons
stay meaningful: ``log`` is ``log1p(|x|)``, ``sqrt`` is ``sqrt(|x| + 1)``,
``reciprocal`` is ``1 / (|x| + 1)``, ``div`` is ``x / (|y| + 1)``, ``exp``
clamps its input to [-10, 10] and ``pow`` takes small integer exponents.

New ops are added with :func:`register`; the IR, the strategies and the
interpreter only go through this table. Two families live in modules of
their own: :mod:`fuzz.ops_custom` (custom ``autograd.Function`` s from
:mod:`fuzz.functions`, category ``custom``) and :mod:`fuzz.ops_inplace`
(in-place ops on views of a fresh copy, category ``inplace_view``, and the
rare ``mul_inplace`` that writes into an earlier value, category
``inplace``). Hooks are not ops: they are a program-level list (see
:mod:`fuzz.ir`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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


def register(spec: OpSpec) -> OpSpec:
    """Adds ``spec`` to the catalog (a name may be registered once)."""
    if spec.name in OPS:
        raise ValueError(f"op {spec.name!r} is already registered")
    for attr in spec.attrs.values():
        if attr.kind not in ATTR_KINDS:
            raise ValueError(f"op {spec.name!r}: unknown attribute kind {attr.kind!r}")
    OPS[spec.name] = spec
    return spec


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


# ---------------------------------------------------------------- catalog
def _unary(name: str, fn: Callable[[torch.Tensor], torch.Tensor], code: str, doc: str = "") -> None:
    register(
        OpSpec(
            name=name,
            category="unary",
            impl=lambda t, a, fn=fn: fn(t[0]),
            infer=_same,
            code=_fmt(code),
            doc=doc,
        )
    )


_unary("neg", torch.neg, "torch.neg({0})")
_unary("exp", lambda x: torch.exp(x.clamp(-10, 10)), "torch.exp({0}.clamp(-10, 10))", "exp of x clamped to [-10, 10]")
_unary("log", lambda x: torch.log1p(x.abs()), "torch.log1p({0}.abs())", "log(|x| + 1)")
_unary("sqrt", lambda x: torch.sqrt(x.abs() + 1), "torch.sqrt({0}.abs() + 1)", "sqrt(|x| + 1)")
_unary("sin", torch.sin, "torch.sin({0})")
_unary("cos", torch.cos, "torch.cos({0})")
_unary("tanh", torch.tanh, "torch.tanh({0})")
_unary("sigmoid", torch.sigmoid, "torch.sigmoid({0})")
_unary("relu", torch.relu, "torch.relu({0})")
_unary("gelu", torch.nn.functional.gelu, "torch.nn.functional.gelu({0})")
_unary("silu", torch.nn.functional.silu, "torch.nn.functional.silu({0})")
_unary("abs", torch.abs, "torch.abs({0})")
_unary("reciprocal", lambda x: torch.reciprocal(x.abs() + 1), "torch.reciprocal({0}.abs() + 1)", "1 / (|x| + 1)")
_unary("clone", torch.clone, "torch.clone({0})")

register(
    OpSpec(
        name="pow",
        category="unary",
        impl=lambda t, a: torch.pow(t[0], a["exponent"]),
        infer=_same,
        code=_fmt("torch.pow({0}, {exponent})"),
        attrs={"exponent": Attr("int", choices=(2, 3))},
        plan=lambda draw, s: ([], {"exponent": draw(st.sampled_from([2, 3]))}),
    )
)
_SCALARS = (2.0, -1.0, 0.5, 3.0, -0.25)
register(
    OpSpec(
        name="mul_scalar",
        category="unary",
        impl=lambda t, a: torch.mul(t[0], a["scalar"]),
        infer=_same,
        code=_fmt("torch.mul({0}, {scalar})"),
        attrs={"scalar": Attr("float")},
        plan=lambda draw, s: ([], {"scalar": draw(st.sampled_from(_SCALARS))}),
    )
)
register(
    OpSpec(
        name="add_scalar",
        category="unary",
        impl=lambda t, a: torch.add(t[0], a["scalar"]),
        infer=_same,
        code=_fmt("torch.add({0}, {scalar})"),
        attrs={"scalar": Attr("float")},
        plan=lambda draw, s: ([], {"scalar": draw(st.sampled_from(_SCALARS))}),
    )
)


def _clamp_plan(draw: DrawFn, shape: Shape) -> Plan:
    return [], {"min": draw(st.sampled_from([-0.5, -1.0, -0.25])), "max": draw(st.sampled_from([0.5, 1.0, 0.25]))}


def _clamp_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    if attrs["min"] > attrs["max"]:
        raise AttrError(f"min {attrs['min']} > max {attrs['max']}", "min")
    return [shapes[0]]


register(
    OpSpec(
        name="clamp",
        category="unary",
        impl=lambda t, a: torch.clamp(t[0], a["min"], a["max"]),
        infer=_clamp_infer,
        code=_fmt("torch.clamp({0}, {min}, {max})"),
        attrs={"min": Attr("float"), "max": Attr("float")},
        plan=_clamp_plan,
    )
)
register(
    OpSpec(
        name="to_dtype",
        category="unary",
        impl=lambda t, a: t[0].to(TORCH_DTYPES[a["dtype"]]),
        infer=_same,
        code=lambda args, a: f"{args[0]}.to(torch.{a['dtype']})",
        attrs={"dtype": Attr("dtype")},
        plan=lambda draw, s: ([], {"dtype": draw(st.sampled_from(sorted(TORCH_DTYPES)))}),
        dtype_rule="attr",
        identity=lambda shapes, dtypes, a: dtypes[0] == a["dtype"],
        doc="x.to(dtype) returns x itself when the dtype is already dtype",
    )
)


def _one_dim_plan(draw: DrawFn, shape: Shape) -> Plan:
    return [], {"dim": draw(st.integers(0, len(shape) - 1))}


def _one_dim_same(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    norm_dim(attrs["dim"], len(shapes[0]))
    return [shapes[0]]


register(
    OpSpec(
        name="cumsum",
        category="unary",
        impl=lambda t, a: torch.cumsum(t[0], a["dim"]),
        infer=_one_dim_same,
        code=_fmt("torch.cumsum({0}, {dim})"),
        attrs={"dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_one_dim_plan,
    )
)
register(
    OpSpec(
        name="softmax",
        category="softmax",
        impl=lambda t, a: torch.softmax(t[0], a["dim"]),
        infer=_one_dim_same,
        code=_fmt("torch.softmax({0}, {dim})"),
        attrs={"dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_one_dim_plan,
    )
)
register(
    OpSpec(
        name="log_softmax",
        category="softmax",
        impl=lambda t, a: torch.log_softmax(t[0], a["dim"]),
        infer=_one_dim_same,
        code=_fmt("torch.log_softmax({0}, {dim})"),
        attrs={"dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_one_dim_plan,
    )
)


# binary elementwise, with broadcasting
def _binary_plan(draw: DrawFn, shape: Shape) -> Plan:
    return [draw_broadcast_partner(draw, shape)], {}


def _binary(name: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], code: str, doc: str = "") -> None:
    register(
        OpSpec(
            name=name,
            category="binary",
            impl=lambda t, a, fn=fn: fn(t[0], t[1]),
            infer=_bcast,
            code=_fmt(code),
            min_arity=2,
            max_arity=2,
            plan=_binary_plan,
            doc=doc,
        )
    )


_binary("add", torch.add, "torch.add({0}, {1})")
_binary("sub", torch.sub, "torch.sub({0}, {1})")
_binary("mul", torch.mul, "torch.mul({0}, {1})")
_binary("div", lambda x, y: torch.div(x, y.abs() + 1), "torch.div({0}, {1}.abs() + 1)", "x / (|y| + 1)")
_binary("maximum", torch.maximum, "torch.maximum({0}, {1})")
_binary("minimum", torch.minimum, "torch.minimum({0}, {1})")


def _where_plan(draw: DrawFn, shape: Shape) -> Plan:
    a = draw_broadcast_partner(draw, shape)
    return [a, draw_broadcast_partner(draw, broadcast(shape, a))], {}


register(
    OpSpec(
        name="where",
        category="where",
        impl=lambda t, a: torch.where(t[0] > 0, t[1], t[2]),
        infer=_bcast,
        code=_fmt("torch.where({0} > 0, {1}, {2})"),
        min_arity=3,
        max_arity=3,
        plan=_where_plan,
        nondiff_inputs=frozenset({0}),
        doc="where(c > 0, a, b): c only picks, gradients flow to a and b",
    )
)


# reductions
def _reduce_plan(draw: DrawFn, shape: Shape, *, allow_none: bool = True) -> Plan:
    return [], {"dim": _dims_attr(draw, len(shape), allow_none=allow_none), "keepdim": draw(st.booleans())}


def _reduction(name: str, fn: Callable[..., torch.Tensor], code_all: str, code_dim: str) -> None:
    def impl(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> torch.Tensor:
        if a["dim"] is None:
            out = fn(t[0])
            return out.reshape([1] * t[0].dim()) if a["keepdim"] else out
        return fn(t[0], dim=a["dim"], keepdim=a["keepdim"])

    def code(args: Sequence[str], a: Mapping[str, Any]) -> str:
        if a["dim"] is None:
            text = code_all.format(args[0])
            return f"{text}.reshape([1] * {args[0]}.dim())" if a["keepdim"] else text
        return code_dim.format(args[0], dim=repr(a["dim"]), keepdim=repr(a["keepdim"]))

    register(
        OpSpec(
            name=name,
            category="reduction",
            impl=impl,
            infer=_reduce,
            code=code,
            attrs={"dim": Attr("opt_dims"), "keepdim": Attr("bool")},
            plan=_reduce_plan,
        )
    )


_reduction("sum", torch.sum, "torch.sum({0})", "torch.sum({0}, dim={dim}, keepdim={keepdim})")
_reduction("mean", torch.mean, "torch.mean({0})", "torch.mean({0}, dim={dim}, keepdim={keepdim})")
_reduction("amax", torch.amax, "torch.amax({0})", "torch.amax({0}, dim={dim}, keepdim={keepdim})")
_reduction(
    "var",
    lambda x, **kw: torch.var(x, correction=0, **kw),
    "torch.var({0}, correction=0)",
    "torch.var({0}, dim={dim}, keepdim={keepdim}, correction=0)",
)


def _prod_plan(draw: DrawFn, shape: Shape) -> Plan:
    dim = draw(st.integers(0, len(shape) - 1)) if shape and draw(st.booleans()) else None
    return [], {"dim": dim, "keepdim": draw(st.booleans())}


register(
    OpSpec(
        name="prod",
        category="reduction",
        impl=lambda t, a: (
            torch.prod(t[0]).reshape([1] * t[0].dim()) if a["keepdim"] else torch.prod(t[0])
        )
        if a["dim"] is None
        else torch.prod(t[0], a["dim"], keepdim=a["keepdim"]),
        infer=_reduce,
        code=lambda args, a: (
            (f"torch.prod({args[0]}).reshape([1] * {args[0]}.dim())" if a["keepdim"] else f"torch.prod({args[0]})")
            if a["dim"] is None
            else f"torch.prod({args[0]}, {a['dim']!r}, keepdim={a['keepdim']!r})"
        ),
        attrs={"dim": Attr("opt_dim"), "keepdim": Attr("bool")},
        plan=_prod_plan,
    )
)
register(
    OpSpec(
        name="logsumexp",
        category="reduction",
        impl=lambda t, a: torch.logsumexp(t[0], a["dim"], keepdim=a["keepdim"]),
        infer=_reduce,
        code=_fmt("torch.logsumexp({0}, {dim}, keepdim={keepdim})"),
        attrs={"dim": Attr("dims"), "keepdim": Attr("bool")},
        accepts=_rank_at_least(1),
        plan=lambda draw, s: _reduce_plan(draw, s, allow_none=False),
    )
)


# matrix products
def _matmul_plan(draw: DrawFn, shape: Shape) -> Plan:
    k = shape[-1]
    n = draw(st.integers(1, MAX_DIM))
    kind = draw(st.sampled_from(["matrix", "vector", "batched"]))
    if kind == "vector":
        return [(k,)], {}
    if kind == "matrix" or len(shape) >= MAX_RANK:
        return [(k, n)], {}
    batch = shape[:-2] if len(shape) >= 2 else ()
    if batch:
        partner_batch = draw_broadcast_partner(draw, batch)
    else:
        partner_batch = (draw(st.integers(1, 3)),)
    partner_batch = partner_batch[-(MAX_RANK - 2):]
    return [partner_batch + (k, n)], {}


register(
    OpSpec(
        name="matmul",
        category="matmul",
        impl=lambda t, a: torch.matmul(t[0], t[1]),
        infer=lambda s, a: [_matmul_shape(s[0], s[1])],
        code=_fmt("torch.matmul({0}, {1})"),
        min_arity=2,
        max_arity=2,
        accepts=_rank_at_least(1),
        plan=_matmul_plan,
        dtype_rule="same",
    )
)


def _mm_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    a, b = shapes
    if len(a) != 2 or len(b) != 2:
        raise ShapeError("mm needs two 2-d inputs")
    return [_matmul_shape(a, b)]


def _bmm_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    a, b = shapes
    if len(a) != 3 or len(b) != 3:
        raise ShapeError("bmm needs two 3-d inputs")
    if a[0] != b[0]:
        raise ShapeError(f"batch sizes differ: {a[0]} vs {b[0]}")
    return [_matmul_shape(a, b)]


register(
    OpSpec(
        name="mm",
        category="matmul",
        impl=lambda t, a: torch.mm(t[0], t[1]),
        infer=_mm_infer,
        code=_fmt("torch.mm({0}, {1})"),
        min_arity=2,
        max_arity=2,
        accepts=_rank_between(2, 2),
        plan=lambda draw, s: ([(s[1], draw(st.integers(1, MAX_DIM)))], {}),
        dtype_rule="same",
    )
)
register(
    OpSpec(
        name="bmm",
        category="matmul",
        impl=lambda t, a: torch.bmm(t[0], t[1]),
        infer=_bmm_infer,
        code=_fmt("torch.bmm({0}, {1})"),
        min_arity=2,
        max_arity=2,
        accepts=_rank_between(3, 3),
        plan=lambda draw, s: ([(s[0], s[2], draw(st.integers(1, MAX_DIM)))], {}),
        dtype_rule="same",
    )
)


# views and shape ops
def _reshape_plan(draw: DrawFn, shape: Shape) -> Plan:
    return [], {"shape": _factor_shape(draw, _numel(shape))}


register(
    OpSpec(
        name="reshape",
        category="view",
        impl=lambda t, a: torch.reshape(t[0], a["shape"]),
        infer=lambda s, a: [_reshape_shape(s[0], a["shape"])],
        code=_fmt("torch.reshape({0}, {shape})"),
        attrs={"shape": Attr("shape")},
        plan=_reshape_plan,
    )
)
register(
    OpSpec(
        name="view",
        category="view",
        impl=lambda t, a: t[0].contiguous().view(a["shape"]),
        infer=lambda s, a: [_reshape_shape(s[0], a["shape"])],
        code=_fmt("{0}.contiguous().view({shape})"),
        attrs={"shape": Attr("shape")},
        plan=_reshape_plan,
        doc="x.contiguous().view(shape): a true view when x is contiguous",
    )
)


def _transpose_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = list(shapes[0])
    i, j = norm_dim(attrs["dim0"], len(s)), norm_dim(attrs["dim1"], len(s))
    s[i], s[j] = s[j], s[i]
    return [tuple(s)]


register(
    OpSpec(
        name="transpose",
        category="view",
        impl=lambda t, a: torch.transpose(t[0], a["dim0"], a["dim1"]),
        infer=_transpose_infer,
        code=_fmt("torch.transpose({0}, {dim0}, {dim1})"),
        attrs={"dim0": Attr("dim"), "dim1": Attr("dim")},
        accepts=_rank_at_least(2),
        plan=lambda draw, s: (
            [],
            {"dim0": draw(st.integers(0, len(s) - 1)), "dim1": draw(st.integers(0, len(s) - 1))},
        ),
    )
)


def _permute_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    dims = attrs["dims"]
    if sorted(norm_dim(d, len(s)) for d in dims) != list(range(len(s))):
        raise ShapeError(f"dims {dims} are not a permutation of range({len(s)})")
    return [tuple(s[norm_dim(d, len(s))] for d in dims)]


register(
    OpSpec(
        name="permute",
        category="view",
        impl=lambda t, a: t[0].permute(a["dims"]),
        infer=_permute_infer,
        code=_fmt("{0}.permute({dims})"),
        attrs={"dims": Attr("ints")},
        accepts=_rank_at_least(1),
        plan=lambda draw, s: ([], {"dims": list(draw(st.permutations(range(len(s)))))}),
    )
)


def _expand_plan(draw: DrawFn, shape: Shape) -> Plan:
    target = [draw(st.integers(1, 4)) if d == 1 else d for d in shape]
    if len(target) < MAX_RANK and draw(st.booleans()):
        target = [draw(st.integers(1, 3))] + target
    return [], {"shape": target}


def _expand_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s, target = shapes[0], list(attrs["shape"])
    if len(target) < len(s):
        raise ShapeError(f"cannot expand rank {len(s)} to rank {len(target)}")
    out = []
    for i, t in enumerate(target):
        j = i - (len(target) - len(s))
        if j < 0:
            if t < 1:
                raise ShapeError(f"new leading size {t} must be >= 1")
            out.append(t)
            continue
        if t == -1:
            t = s[j]
        if s[j] != 1 and t != s[j]:
            raise ShapeError(f"size {s[j]} of dim {j} cannot expand to {t}")
        out.append(t)
    return [tuple(out)]


register(
    OpSpec(
        name="expand",
        category="view",
        impl=lambda t, a: t[0].expand(a["shape"]),
        infer=_expand_infer,
        code=_fmt("{0}.expand({shape})"),
        attrs={"shape": Attr("shape")},
        plan=_expand_plan,
    )
)


def _slice_plan(draw: DrawFn, shape: Shape) -> Plan:
    dim = draw(st.integers(0, len(shape) - 1))
    size = shape[dim]
    start = draw(st.integers(0, size - 1))
    end = draw(st.integers(start + 1, size))
    step = draw(st.sampled_from([1, 2]))
    return [], {"dim": dim, "start": start, "end": end, "step": step}


def _slice_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = list(shapes[0])
    d = norm_dim(attrs["dim"], len(s))
    if attrs["step"] < 1:
        raise AttrError(f"step must be >= 1, got {attrs['step']}", "step")
    s[d] = len(range(*slice(attrs["start"], attrs["end"], attrs["step"]).indices(s[d])))
    return [tuple(s)]


def _slice_impl(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> torch.Tensor:
    index = (slice(None),) * (a["dim"] % t[0].dim()) + (slice(a["start"], a["end"], a["step"]),)
    return t[0][index]


def _slice_code(args: Sequence[str], a: Mapping[str, Any]) -> str:
    return f"{args[0]}[{':, ' * (a['dim'])}{a['start']}:{a['end']}:{a['step']}]"


register(
    OpSpec(
        name="slice",
        category="view",
        impl=_slice_impl,
        infer=_slice_infer,
        code=_slice_code,
        attrs={"dim": Attr("dim"), "start": Attr("int"), "end": Attr("int"), "step": Attr("int")},
        accepts=_rank_at_least(1),
        plan=_slice_plan,
    )
)


def _select_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    d = norm_dim(attrs["dim"], len(s))
    if not -s[d] <= attrs["index"] < s[d]:
        raise ShapeError(f"index {attrs['index']} out of range for size {s[d]}")
    return [s[:d] + s[d + 1 :]]


def _select_plan(draw: DrawFn, shape: Shape) -> Plan:
    dim = draw(st.integers(0, len(shape) - 1))
    return [], {"dim": dim, "index": draw(st.integers(0, shape[dim] - 1))}


register(
    OpSpec(
        name="select",
        category="view",
        impl=lambda t, a: t[0].select(a["dim"], a["index"]),
        infer=_select_infer,
        code=_fmt("{0}.select({dim}, {index})"),
        attrs={"dim": Attr("dim"), "index": Attr("int")},
        accepts=_rank_at_least(1),
        plan=_select_plan,
    )
)


def _unsqueeze_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    d = norm_dim(attrs["dim"], len(s), extra=1)
    return [s[:d] + (1,) + s[d:]]


register(
    OpSpec(
        name="unsqueeze",
        category="view",
        impl=lambda t, a: torch.unsqueeze(t[0], a["dim"]),
        infer=_unsqueeze_infer,
        code=_fmt("torch.unsqueeze({0}, {dim})"),
        attrs={"dim": Attr("dim")},
        accepts=_rank_between(0, MAX_RANK - 1),
        plan=lambda draw, s: ([], {"dim": draw(st.integers(0, len(s)))}),
    )
)


def _squeeze_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    d = norm_dim(attrs["dim"], len(s))
    return [s[:d] + s[d + 1 :] if s[d] == 1 else s]


register(
    OpSpec(
        name="squeeze",
        category="view",
        impl=lambda t, a: torch.squeeze(t[0], a["dim"]),
        infer=_squeeze_infer,
        code=_fmt("torch.squeeze({0}, {dim})"),
        attrs={"dim": Attr("dim")},
        accepts=lambda s: 1 in s,
        plan=lambda draw, s: ([], {"dim": draw(st.sampled_from([i for i, d in enumerate(s) if d == 1]))}),
        doc="squeeze(dim); a no-op when that dim is not of size 1, as in torch",
    )
)


def _flatten_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    a, b = norm_dim(attrs["start_dim"], len(s)), norm_dim(attrs["end_dim"], len(s))
    if a > b:
        raise ShapeError(f"start_dim {a} > end_dim {b}")
    return [s[:a] + (_numel(s[a : b + 1]),) + s[b + 1 :]]


def _flatten_plan(draw: DrawFn, shape: Shape) -> Plan:
    a = draw(st.integers(0, len(shape) - 1))
    return [], {"start_dim": a, "end_dim": draw(st.integers(a, len(shape) - 1))}


register(
    OpSpec(
        name="flatten",
        category="view",
        impl=lambda t, a: torch.flatten(t[0], a["start_dim"], a["end_dim"]),
        infer=_flatten_infer,
        code=_fmt("torch.flatten({0}, {start_dim}, {end_dim})"),
        attrs={"start_dim": Attr("dim"), "end_dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_flatten_plan,
        identity=lambda shapes, dtypes, a: norm_dim(a["start_dim"], len(shapes[0]))
        == norm_dim(a["end_dim"], len(shapes[0])),
        doc="flatten(x, d, d) returns x itself",
    )
)


def _flip_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    norm_dims(attrs["dims"], len(shapes[0]))
    return [shapes[0]]


register(
    OpSpec(
        name="flip",
        category="view",
        impl=lambda t, a: torch.flip(t[0], a["dims"]),
        infer=_flip_infer,
        code=_fmt("torch.flip({0}, {dims})"),
        attrs={"dims": Attr("ints")},
        accepts=_rank_at_least(1),
        plan=lambda draw, s: ([], {"dims": sorted(draw(st.sets(st.integers(0, len(s) - 1), min_size=1)))}),
        doc="flip copies (not a view) but reorders like one",
    )
)


def _diagonal_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    d1, d2 = norm_dim(attrs["dim1"], len(s)), norm_dim(attrs["dim2"], len(s))
    if d1 == d2:
        raise ShapeError("dim1 and dim2 must differ")
    off = attrs["offset"]
    n = min(s[d1], s[d2] - off) if off >= 0 else min(s[d1] + off, s[d2])
    rest = tuple(d for i, d in enumerate(s) if i not in (d1, d2))
    return [rest + (max(n, 0),)]


def _diagonal_plan(draw: DrawFn, shape: Shape) -> Plan:
    d1 = draw(st.integers(0, len(shape) - 1))
    d2 = draw(st.sampled_from([d for d in range(len(shape)) if d != d1]))
    off = draw(st.integers(-(shape[d1] - 1), shape[d2] - 1))
    return [], {"offset": off, "dim1": d1, "dim2": d2}


register(
    OpSpec(
        name="diagonal",
        category="view",
        impl=lambda t, a: torch.diagonal(t[0], a["offset"], a["dim1"], a["dim2"]),
        infer=_diagonal_infer,
        code=_fmt("torch.diagonal({0}, {offset}, {dim1}, {dim2})"),
        attrs={"offset": Attr("int"), "dim1": Attr("dim"), "dim2": Attr("dim")},
        accepts=_rank_at_least(2),
        plan=_diagonal_plan,
    )
)


def _index_select_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = list(shapes[0])
    d = norm_dim(attrs["dim"], len(s))
    index = attrs["index"]
    if not index:
        raise AttrError("index must not be empty", "index")
    bad = [i for i in index if not 0 <= i < s[d]]
    if bad:
        raise ShapeError(f"index {bad[0]} out of range for size {s[d]} of dim {d}")
    s[d] = len(index)
    return [tuple(s)]


def _index_select_plan(draw: DrawFn, shape: Shape) -> Plan:
    dim = draw(st.integers(0, len(shape) - 1))
    index = draw(st.lists(st.integers(0, shape[dim] - 1), min_size=1, max_size=4))
    return [], {"dim": dim, "index": index}


register(
    OpSpec(
        name="index_select",
        category="index",
        impl=lambda t, a: torch.index_select(
            t[0], a["dim"], torch.tensor(a["index"], dtype=torch.long, device=t[0].device)
        ),
        infer=_index_select_infer,
        code=_fmt("torch.index_select({0}, {dim}, torch.tensor({index}, device={0}.device))"),
        attrs={"dim": Attr("dim"), "index": Attr("ints")},
        accepts=_rank_at_least(1),
        plan=_index_select_plan,
        doc="repeated indices accumulate in the backward",
    )
)


# several tensors in, several tensors out
def _cat_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    first = shapes[0]
    d = norm_dim(attrs["dim"], len(first))
    total = 0
    for s in shapes:
        if len(s) != len(first) or any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != d):
            raise ShapeError(f"{list(s)} and {list(first)} differ outside dim {d}")
        total += s[d]
    return [first[:d] + (total,) + first[d + 1 :]]


def _cat_plan(draw: DrawFn, shape: Shape) -> Plan:
    dim = draw(st.integers(0, len(shape) - 1))
    others = []
    for _ in range(draw(st.integers(1, 2))):
        s = list(shape)
        s[dim] = draw(st.sampled_from([shape[dim], 1, 2, 3]))
        others.append(tuple(s))
    return others, {"dim": dim}


register(
    OpSpec(
        name="cat",
        category="join",
        impl=lambda t, a: torch.cat(list(t), a["dim"]),
        infer=_cat_infer,
        code=lambda args, a: f"torch.cat([{', '.join(args)}], {a['dim']!r})",
        min_arity=1,
        max_arity=4,
        attrs={"dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_cat_plan,
    )
)


def _stack_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    first = shapes[0]
    if any(s != first for s in shapes):
        raise ShapeError(f"stack needs equal shapes, got {[list(s) for s in shapes]}")
    d = norm_dim(attrs["dim"], len(first), extra=1)
    return [first[:d] + (len(shapes),) + first[d:]]


register(
    OpSpec(
        name="stack",
        category="join",
        impl=lambda t, a: torch.stack(list(t), a["dim"]),
        infer=_stack_infer,
        code=lambda args, a: f"torch.stack([{', '.join(args)}], {a['dim']!r})",
        min_arity=1,
        max_arity=4,
        attrs={"dim": Attr("dim")},
        accepts=_rank_between(0, MAX_RANK - 1),
        plan=lambda draw, s: ([s] * draw(st.integers(1, 2)), {"dim": draw(st.integers(0, len(s)))}),
    )
)


def _split_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    d = norm_dim(attrs["dim"], len(s))
    size = attrs["split_size"]
    if size < 1:
        raise AttrError(f"split_size must be >= 1, got {size}", "split_size")
    return [s[:d] + (min(size, s[d] - start),) + s[d + 1 :] for start in range(0, s[d], size)]


def _split_plan(draw: DrawFn, shape: Shape) -> Plan:
    dim = draw(st.sampled_from([i for i, d in enumerate(shape) if d >= 2]))
    return [], {"dim": dim, "split_size": draw(st.integers(1, shape[dim] - 1))}


register(
    OpSpec(
        name="split",
        category="split",
        impl=lambda t, a: tuple(torch.split(t[0], a["split_size"], a["dim"])),
        infer=_split_infer,
        code=_fmt("torch.split({0}, {split_size}, {dim})"),
        attrs={"dim": Attr("dim"), "split_size": Attr("int")},
        accepts=lambda s: any(d >= 2 for d in s),
        plan=_split_plan,
        multi_output=True,
    )
)


def _unbind_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    d = norm_dim(attrs["dim"], len(s))
    return [s[:d] + s[d + 1 :]] * s[d]


register(
    OpSpec(
        name="unbind",
        category="split",
        impl=lambda t, a: tuple(torch.unbind(t[0], a["dim"])),
        infer=_unbind_infer,
        code=_fmt("torch.unbind({0}, {dim})"),
        attrs={"dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_one_dim_plan,
        multi_output=True,
    )
)


# custom autograd.Functions and in-place ops on views live in modules of
# their own; importing them registers their ops here.
from fuzz import ops_custom as _ops_custom  # noqa: E402,F401
from fuzz import ops_inplace as _ops_inplace  # noqa: E402,F401


def names() -> list[str]:
    return list(OPS)


def categories() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for spec in OPS.values():
        out.setdefault(spec.category, []).append(spec.name)
    return out
