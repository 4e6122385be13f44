"""Ops that apply the custom ``autograd.Function`` s of :mod:`fuzz.functions`.

One op per Function (category ``custom``), named ``fn_<what>``; the rendered
code calls ``<Class>.apply(...)`` and :mod:`fuzz.render` copies the class
source into the reproducer (``OpSpec.functions``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from fuzz import functions as F
from fuzz.op_spec import (
    Attr,
    DrawFn,
    OpSpec,
    Plan,
    Shape,
    ShapeError,
    _fmt,
    _one_dim_plan,
    _rank_at_least,
    _same,
    check_into,
    draw_into_partner,
    norm_dim,
    register,
)

_SCALES = (2.0, -0.5, 1.5)


def _same_shapes(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    if any(s != shapes[0] for s in shapes):
        raise ShapeError(f"inputs must have one shape, got {[list(s) for s in shapes]}")
    return [tuple(shapes[0])]


def _into_first(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    check_into(shapes[0], shapes[1], "second input")
    return [tuple(shapes[0])]


def _max_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    d = norm_dim(attrs["dim"], len(s))
    return [s[:d] + s[d + 1 :]]


def _into_plan(draw: DrawFn, shape: Shape) -> Plan:
    return [draw_into_partner(draw, shape)], {}


register(
    OpSpec(
        name="fn_sin_scale",
        category="custom",
        impl=lambda t, a: F.SinScale.apply(t[0], a["scale"]),
        infer=_same,
        code=_fmt("SinScale.apply({0}, {scale})"),
        attrs={"scale": Attr("float")},
        plan=lambda draw, s: ([], {"scale": draw(st.sampled_from(_SCALES))}),
        functions=("SinScale",),
        doc="custom Function: save_for_backward + a float ctx attribute",
    )
)
register(
    OpSpec(
        name="fn_mul_add",
        category="custom",
        impl=lambda t, a: F.MulAdd.apply(t[0], t[1]),
        infer=_same_shapes,
        code=_fmt("MulAdd.apply({0}, {1})"),
        min_arity=2,
        max_arity=2,
        plan=lambda draw, s: ([s], {}),
        dtype_rule="same",
        functions=("MulAdd",),
        doc="custom Function: two inputs, ctx.needs_input_grad",
    )
)
register(
    OpSpec(
        name="fn_max",
        category="custom",
        impl=lambda t, a: F.MaxWithIndex.apply(t[0], a["dim"])[0],
        infer=_max_infer,
        code=_fmt("MaxWithIndex.apply({0}, {dim})[0]"),
        attrs={"dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_one_dim_plan,
        functions=("MaxWithIndex",),
        doc="custom Function: values plus int64 indices marked non-differentiable (values kept)",
    )
)
register(
    OpSpec(
        name="fn_sin_cos",
        category="custom",
        impl=lambda t, a: tuple(F.SinCosPair.apply(t[0])),
        infer=lambda s, a: [tuple(s[0]), tuple(s[0])],
        code=_fmt("SinCosPair.apply({0})"),
        multi_output=True,
        functions=("SinCosPair",),
        doc="custom Function: two outputs, set_materialize_grads(False)",
    )
)
register(
    OpSpec(
        name="fn_cube",
        category="custom",
        impl=lambda t, a: F.CubeOnce.apply(t[0]),
        infer=_same,
        code=_fmt("CubeOnce.apply({0})"),
        functions=("CubeOnce",),
        doc="custom Function: once_differentiable backward",
    )
)
register(
    OpSpec(
        name="fn_detach_second",
        category="custom",
        impl=lambda t, a: F.DetachSecond.apply(t[0], t[1]),
        infer=_into_first,
        code=_fmt("DetachSecond.apply({0}, {1})"),
        min_arity=2,
        max_arity=2,
        plan=_into_plan,
        functions=("DetachSecond",),
        doc="custom Function: 2x + sign(y), backward returns None for y",
    )
)
register(
    OpSpec(
        name="fn_exp_saved_out",
        category="custom",
        impl=lambda t, a: F.ExpSavedOutput.apply(t[0]),
        infer=_same,
        code=_fmt("ExpSavedOutput.apply({0})"),
        functions=("ExpSavedOutput",),
        doc="custom Function: saves its output",
    )
)
