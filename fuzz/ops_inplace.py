"""In-place ops on views (category ``inplace_view``) and one in-place op on
an earlier value (category ``inplace``).

An ``inplace_view`` op never writes into a tensor anyone else holds: it
makes a fresh copy ``y`` of its first input (attribute ``fresh``:
``x.clone()`` or ``x * 1``), takes a view of ``y`` and modifies that view in
place::

    y = x.clone()
    y[:, 1:3:1].mul_(t)                 # slice_mul_
    y[:, 1:3:1].add_(t, alpha=-0.5)     # slice_add_
    y[1:2:1][torch.tensor([0])] = v     # index_put_view (index_put_ on a view)
    y[:, 0:2:1].masked_fill_(m > 0, c)  # masked_fill_view (m is not differentiated)
    y.view([6])[2].copy_(t)             # view_copy_ (t may have another dtype)
    y[0:2:1].scatter_(0, index, src)    # scatter_view

so the program stays valid: no leaf that requires grad and no tensor some
earlier op saved is ever modified. The op's value is ``y`` (the base, whose
``grad_fn`` is now ``CopySlices``), or with ``out_view`` the modified view
itself (whose ``grad_fn`` autograd regenerates from the base).

``mul_inplace`` (``x.mul_(t)``) does write into an earlier value: ``x`` must
be a fresh (non-view) op output that requires grad, never a leaf, and never
a tensor that ``split``/``unbind`` made views of (eager rejects those views
once their base is modified: :func:`fuzz.ir.inplace_conflicts`). When an
earlier op saved ``x`` for its backward, eager's backward raises ("modified
by an inplace operation") and so must every subject: an error-parity test.
It is ``rare``: generated a quarter as often as other ops.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from fuzz.op_spec import (
    Attr,
    AttrError,
    DrawFn,
    OpSpec,
    Plan,
    Shape,
    ShapeError,
    _factor_shape,
    _numel,
    _reshape_shape,
    check_into,
    draw_into_partner,
    norm_dim,
    register,
)

FRESH = ("clone", "mul")
_ALPHAS = (1.0, -0.5, 2.0)
_FILLS = (0.0, 0.5, -2.0)


# ------------------------------------------------------------------ helpers
def _fresh(x: torch.Tensor, a: Mapping[str, Any]) -> torch.Tensor:
    return x.clone() if a["fresh"] == "clone" else x * 1


def _fresh_code(x: str, a: Mapping[str, Any]) -> str:
    return f"{x}.clone()" if a["fresh"] == "clone" else f"{x} * 1"


def _slice_key(rank: int, a: Mapping[str, Any]) -> tuple:
    return (slice(None),) * (a["dim"] % rank) + (slice(a["start"], a["end"], a["step"]),)


def _slice_text(a: Mapping[str, Any]) -> str:
    return f"[{':, ' * a['dim']}{a['start']}:{a['end']}:{a['step']}]"


def _slice_shape(shape: Shape, a: Mapping[str, Any]) -> Shape:
    if not shape:
        raise ShapeError("a 0-d input has no slice")
    d = norm_dim(a["dim"], len(shape))
    if a["dim"] < 0:
        raise AttrError(f"dim must be >= 0 here, got {a['dim']}", "dim")
    if a["step"] < 1:
        raise AttrError(f"step must be >= 1, got {a['step']}", "step")
    if not 0 <= a["start"] < a["end"] <= shape[d]:
        raise ShapeError(f"slice {a['start']}:{a['end']} is not a non-empty range of size {shape[d]}")
    s = list(shape)
    s[d] = len(range(a["start"], a["end"], a["step"]))
    return tuple(s)


def _draw_slice(draw: DrawFn, shape: Shape) -> dict[str, Any]:
    dim = draw(st.integers(0, len(shape) - 1))
    size = shape[dim]
    start = draw(st.integers(0, size - 1))
    end = draw(st.integers(start + 1, size))
    return {"dim": dim, "start": start, "end": end, "step": draw(st.sampled_from([1, 2]))}


def _distinct_indices(draw: DrawFn, size: int) -> list[int]:
    k = draw(st.integers(1, size))
    return list(draw(st.permutations(range(size))))[:k]


def _check_indices(index: Any, size: int, what: str) -> None:
    if not index:
        raise AttrError("index must not be empty", "index")
    if len(set(index)) != len(index):
        raise AttrError(f"index {list(index)} has repeated entries", "index")
    bad = [i for i in index if not 0 <= i < size]
    if bad:
        raise ShapeError(f"index {bad[0]} out of range for size {size} of {what}")


_SLICE_ATTRS = {"dim": Attr("dim"), "start": Attr("int"), "end": Attr("int"), "step": Attr("int")}
_COMMON_ATTRS = {"fresh": Attr("str", choices=FRESH), "out_view": Attr("bool")}


def _register_slice_op(
    name: str,
    *,
    view_action: Callable[[torch.Tensor, Sequence[torch.Tensor], Mapping[str, Any]], None],
    action_code: Callable[[str, Sequence[str], Mapping[str, Any]], str],
    other_shape: Callable[[Shape, Mapping[str, Any]], Shape | None],
    plan_extra: Callable[[DrawFn, Shape], tuple[dict[str, Any], Shape | None]],
    extra_attrs: Mapping[str, Attr],
    doc: str,
    dtype_rule: str = "same",
    nondiff_inputs: frozenset[int] = frozenset(),
    exact_other: bool = False,
) -> None:
    """An op ``y = fresh(x); view = y[slice]; <action on view>``.

    ``other_shape(view_shape, attrs)`` is the shape the second input must
    broadcast into (None: the op takes no second input); ``plan_extra(draw,
    view_shape)`` draws the extra attributes and that shape; with
    ``exact_other`` the second input must have exactly that shape.
    """

    def impl(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> torch.Tensor:
        y = _fresh(t[0], a)
        view = y[_slice_key(y.dim(), a)]
        view_action(view, t[1:], a)
        return view if a["out_view"] else y

    def infer(shapes: Sequence[Shape], a: Mapping[str, Any]) -> list[Shape]:
        view = _slice_shape(shapes[0], a)
        target = other_shape(view, a)
        if target is not None:
            if len(shapes) < 2:
                raise ShapeError(f"{name} needs a second input")
            if exact_other and tuple(shapes[1]) != tuple(target):
                raise ShapeError(f"second input must have shape {list(target)}, got {list(shapes[1])}")
            check_into(target, shapes[1], "second input")
        return [view if a["out_view"] else tuple(shapes[0])]

    def plan(draw: DrawFn, shape: Shape) -> Plan:
        attrs: dict[str, Any] = {"fresh": draw(st.sampled_from(FRESH))}
        attrs.update(_draw_slice(draw, shape))
        view = _slice_shape(shape, attrs)
        extra, target = plan_extra(draw, view)
        attrs.update(extra)
        attrs["out_view"] = draw(st.booleans())
        if target is None:
            return [], attrs
        return [tuple(target) if exact_other else draw_into_partner(draw, target)], attrs

    def stmts(out: str, args: Sequence[str], a: Mapping[str, Any]) -> list[str]:
        if a["out_view"]:
            return [
                f"{out}_base = {_fresh_code(args[0], a)}",
                f"{out} = {out}_base{_slice_text(a)}",
                action_code(out, args[1:], a),
            ]
        return [f"{out} = {_fresh_code(args[0], a)}", action_code(f"{out}{_slice_text(a)}", args[1:], a)]

    def code(args: Sequence[str], a: Mapping[str, Any]) -> str:  # one-line form, for listings
        return "; ".join(stmts("y", args, a)) + "; -> y"

    register(
        OpSpec(
            name=name,
            category="inplace_view",
            impl=impl,
            infer=infer,
            code=code,
            min_arity=2,
            max_arity=2,
            attrs={**_COMMON_ATTRS, **_SLICE_ATTRS, **extra_attrs},
            accepts=lambda s: len(s) >= 1,
            plan=plan,
            dtype_rule=dtype_rule,
            nondiff_inputs=nondiff_inputs,
            fresh_output=lambda a: not a["out_view"],
            stmts=stmts,
            doc=doc,
        )
    )


# ---------------------------------------------------------------- the ops
_register_slice_op(
    "slice_mul_",
    view_action=lambda v, t, a: v.mul_(t[0]),
    action_code=lambda v, args, a: f"{v}.mul_({args[0]})",
    other_shape=lambda view, a: view,
    plan_extra=lambda draw, view: ({}, view),
    extra_attrs={},
    doc="y = fresh(x); y[slice].mul_(t)",
)
_register_slice_op(
    "slice_add_",
    view_action=lambda v, t, a: v.add_(t[0], alpha=a["alpha"]),
    action_code=lambda v, args, a: f"{v}.add_({args[0]}, alpha={a['alpha']!r})",
    other_shape=lambda view, a: view,
    plan_extra=lambda draw, view: ({"alpha": draw(st.sampled_from(_ALPHAS))}, view),
    extra_attrs={"alpha": Attr("float")},
    doc="y = fresh(x); y[slice].add_(t, alpha=alpha)",
)


def _index_put_shape(view: Shape, a: Mapping[str, Any]) -> Shape:
    _check_indices(a["index"], view[0], "dim 0 of the view")
    return (len(a["index"]),) + tuple(view[1:])


def _index_put_action(v: torch.Tensor, t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> None:
    index = torch.tensor(a["index"], dtype=torch.long, device=v.device)
    if a["accumulate"]:
        v.index_put_((index,), t[0], accumulate=True)
    else:
        v[index] = t[0]


def _index_put_code(v: str, args: Sequence[str], a: Mapping[str, Any]) -> str:
    index = f"torch.tensor({list(a['index'])!r}, device={args[0]}.device)"
    if a["accumulate"]:
        return f"{v}.index_put_(({index},), {args[0]}, accumulate=True)"
    return f"{v}[{index}] = {args[0]}"


def _index_put_plan(draw: DrawFn, view: Shape) -> tuple[dict[str, Any], Shape]:
    attrs = {"index": _distinct_indices(draw, view[0]), "accumulate": draw(st.booleans())}
    return attrs, _index_put_shape(view, attrs)


_register_slice_op(
    "index_put_view",
    view_action=_index_put_action,
    action_code=_index_put_code,
    other_shape=_index_put_shape,
    plan_extra=_index_put_plan,
    extra_attrs={"index": Attr("ints"), "accumulate": Attr("bool")},
    doc="y = fresh(x); y[slice][index] = v (index_put_ on a view; accumulate=True: index_put_(..., accumulate=True))",
)
_register_slice_op(
    "masked_fill_view",
    view_action=lambda v, t, a: v.masked_fill_(t[0] > 0, a["value"]),
    action_code=lambda v, args, a: f"{v}.masked_fill_({args[0]} > 0, {a['value']!r})",
    other_shape=lambda view, a: view,
    plan_extra=lambda draw, view: ({"value": draw(st.sampled_from(_FILLS))}, view),
    extra_attrs={"value": Attr("float")},
    doc="y = fresh(x); y[slice].masked_fill_(m > 0, value); m only picks",
    nondiff_inputs=frozenset({1}),
)


def _scatter_shape(view: Shape, a: Mapping[str, Any]) -> Shape:
    if a["sdim"] < 0:
        raise AttrError(f"sdim must be >= 0, got {a['sdim']}", "sdim")
    d = norm_dim(a["sdim"], len(view))
    _check_indices(a["index"], view[d], f"dim {d} of the view")
    s = list(view)
    s[d] = len(a["index"])
    return tuple(s)


def _scatter_action(v: torch.Tensor, t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> None:
    src = t[0]
    index = torch.tensor(a["index"], dtype=torch.long, device=v.device)
    index = index.reshape([-1] + [1] * (src.dim() - a["sdim"] - 1)).expand_as(src)
    v.scatter_(a["sdim"], index, src)


def _scatter_code(v: str, args: Sequence[str], a: Mapping[str, Any]) -> str:
    src, d = args[0], a["sdim"]
    index = (
        f"torch.tensor({list(a['index'])!r}, device={src}.device)"
        f".reshape([-1] + [1] * ({src}.dim() - {d} - 1)).expand_as({src})"
    )
    return f"{v}.scatter_({d}, {index}, {src})"


def _scatter_plan(draw: DrawFn, view: Shape) -> tuple[dict[str, Any], Shape]:
    d = draw(st.integers(0, len(view) - 1))
    attrs = {"sdim": d, "index": _distinct_indices(draw, view[d])}
    return attrs, _scatter_shape(view, attrs)


_register_slice_op(
    "scatter_view",
    view_action=_scatter_action,
    action_code=_scatter_code,
    other_shape=_scatter_shape,
    plan_extra=_scatter_plan,
    extra_attrs={"sdim": Attr("dim"), "index": Attr("ints")},
    doc="y = fresh(x); y[slice].scatter_(sdim, index, src); distinct indices along sdim",
    exact_other=True,
)


# y.view(shape)[k].copy_(t): a view of a view, and copy_ may change dtype
def _view_copy_shapes(shape: Shape, a: Mapping[str, Any]) -> tuple[Shape, Shape]:
    target = _reshape_shape(shape, a["shape"])
    if not target:
        raise ShapeError("the view needs rank >= 1 to be indexed")
    if not 0 <= a["index"] < target[0]:
        raise ShapeError(f"index {a['index']} out of range for size {target[0]}")
    return target, tuple(target[1:])


def _view_copy_impl(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> torch.Tensor:
    y = t[0].clone(memory_format=torch.contiguous_format)
    view = y.view(a["shape"])[a["index"]]
    view.copy_(t[1])
    return view if a["out_view"] else y


def _view_copy_infer(shapes: Sequence[Shape], a: Mapping[str, Any]) -> list[Shape]:
    _, view = _view_copy_shapes(shapes[0], a)
    check_into(view, shapes[1], "second input")
    return [view if a["out_view"] else tuple(shapes[0])]


def _view_copy_plan(draw: DrawFn, shape: Shape) -> Plan:
    target = _factor_shape(draw, _numel(shape))
    if not target:
        target = [1]
    attrs = {"shape": target, "index": draw(st.integers(0, target[0] - 1)), "out_view": draw(st.booleans())}
    return [draw_into_partner(draw, tuple(target[1:]))], attrs


def _view_copy_stmts(out: str, args: Sequence[str], a: Mapping[str, Any]) -> list[str]:
    fresh = f"{args[0]}.clone(memory_format=torch.contiguous_format)"
    if a["out_view"]:
        return [
            f"{out}_base = {fresh}",
            f"{out} = {out}_base.view({list(a['shape'])!r})[{a['index']}]",
            f"{out}.copy_({args[1]})",
        ]
    return [f"{out} = {fresh}", f"{out}.view({list(a['shape'])!r})[{a['index']}].copy_({args[1]})"]


register(
    OpSpec(
        name="view_copy_",
        category="inplace_view",
        impl=_view_copy_impl,
        infer=_view_copy_infer,
        code=lambda args, a: "; ".join(_view_copy_stmts("y", args, a)) + "; -> y",
        min_arity=2,
        max_arity=2,
        attrs={"shape": Attr("shape"), "index": Attr("int"), "out_view": Attr("bool")},
        plan=_view_copy_plan,
        dtype_rule="first",
        fresh_output=lambda a: not a["out_view"],
        stmts=_view_copy_stmts,
        doc="y = x.clone(contiguous); y.view(shape)[index].copy_(t); t may have another dtype",
    )
)


# x.mul_(t) on an earlier value: the rare error-parity op
def _mul_inplace_infer(shapes: Sequence[Shape], a: Mapping[str, Any]) -> list[Shape]:
    check_into(shapes[0], shapes[1], "second input")
    return [tuple(shapes[0])]


register(
    OpSpec(
        name="mul_inplace",
        category="inplace",
        impl=lambda t, a: t[0].mul_(t[1]),
        infer=_mul_inplace_infer,
        code=lambda args, a: f"{args[0]}.mul_({args[1]})",
        min_arity=2,
        max_arity=2,
        plan=lambda draw, s: ([draw_into_partner(draw, s)], {}),
        dtype_rule="same",
        identity=lambda shapes, dtypes, a: True,
        inplace_first=True,
        rare=True,
        doc="x.mul_(t) on an earlier fresh value (eager raises in backward when x was saved)",
    )
)
