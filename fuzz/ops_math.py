"""Catalog ops that compute: unary and binary elementwise ops, ``where``,
softmax, reductions and matrix products (see :mod:`fuzz.ops` for the
tame variants that keep float32 comparisons meaningful)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from fuzz.op_spec import (
    MAX_DIM,
    MAX_RANK,
    TORCH_DTYPES,
    Attr,
    AttrError,
    DrawFn,
    OpSpec,
    Plan,
    Shape,
    ShapeError,
    _bcast,
    _dims_attr,
    _fmt,
    _matmul_shape,
    _one_dim_plan,
    _rank_at_least,
    _rank_between,
    _reduce,
    _same,
    broadcast,
    draw_broadcast_partner,
    norm_dim,
    register,
)


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
