"""Ops that draw random numbers, and ops whose values decide sizes.

Random ops (category ``random``): the forward draws from the global
generator, so every subject must leave the random stream as eager leaves
it, and a checkpointed region replays the draws in the backward
(:mod:`fuzz.features_training`):

* ``dropout(x, p)``: ``torch.nn.functional.dropout(x, p, training=True)``
  (with ``p=0`` torch returns ``x`` itself and draws nothing);
* ``rand_mul(x)``: ``x * torch.rand_like(x)``;
* ``bernoulli_mask(x, p)``: ``x * torch.bernoulli(torch.full_like(x, p))``.

Data-dependent sizes (category ``dynamic``): the output has the input's
static shape, but inside, a tensor's size is a count of elements that pass
a test, so the backward graph's sizes change with the values (0 and 1
included), from one optimizer step to the next:

* ``nonzero_scatter(x, threshold)``: the elements of ``x`` above
  ``threshold`` (``nonzero`` then ``index_select``), squared, added back
  into zeros at their places (``index_add``);
* ``masked_select_scatter(x, threshold)``: ``masked_select`` of the
  elements above ``threshold``, their ``sin``, ``masked_scatter`` into zeros;
* ``moe(x[N, D], router[D, E], experts[E, D, D], top_k)``: a top-k router
  (``topk`` of ``x @ router``, softmax over the k picks) sends each token
  to ``top_k`` experts; each expert takes its tokens with ``index_select``
  (any count, 0 and 1 included), applies its ``[D, D]`` weight, and adds
  the weighted result back with ``index_add``.

All are ``rare`` (drawn a quarter as often as other ops).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from fuzz.op_spec import Attr, DrawFn, OpSpec, Plan, Shape, ShapeError, _same, register

PROBABILITIES = (0.5, 0.2, 0.0, 1.0)
THRESHOLDS = (0.0, 0.5, -0.5, 2.0)


def _dropout(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> torch.Tensor:
    return torch.nn.functional.dropout(t[0], a["p"], training=True)


def _bernoulli(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> torch.Tensor:
    return t[0] * torch.bernoulli(torch.full_like(t[0], a["p"]))


def _nonzero_scatter(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> torch.Tensor:
    flat = t[0].reshape(-1)
    idx = torch.nonzero(flat > a["threshold"]).squeeze(1)
    picked = flat.index_select(0, idx)
    return torch.zeros_like(flat).index_add(0, idx, picked * picked).reshape(t[0].shape)


def _nonzero_scatter_stmts(out: str, args: Sequence[str], a: Mapping[str, Any]) -> list[str]:
    x = args[0]
    return [
        f"{out}_flat = {x}.reshape(-1)",
        f"{out}_idx = torch.nonzero({out}_flat > {a['threshold']!r}).squeeze(1)  # size decided by the values",
        f"{out}_picked = {out}_flat.index_select(0, {out}_idx)",
        f"{out} = torch.zeros_like({out}_flat).index_add(0, {out}_idx, {out}_picked * {out}_picked).reshape({x}.shape)",
    ]


def _masked_select_scatter(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> torch.Tensor:
    mask = t[0] > a["threshold"]
    picked = torch.masked_select(t[0], mask)
    return torch.zeros_like(t[0]).masked_scatter(mask, picked.sin())


def _masked_select_scatter_stmts(out: str, args: Sequence[str], a: Mapping[str, Any]) -> list[str]:
    x = args[0]
    return [
        f"{out}_mask = {x} > {a['threshold']!r}",
        f"{out}_picked = torch.masked_select({x}, {out}_mask)  # size decided by the values",
        f"{out} = torch.zeros_like({x}).masked_scatter({out}_mask, {out}_picked.sin())",
    ]


def _moe(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> torch.Tensor:
    x, router, experts = t
    values, index = (x @ router).topk(a["top_k"], dim=-1)
    weights = values.softmax(-1)
    out = torch.zeros_like(x)
    for e in range(experts.shape[0]):
        token, slot = torch.nonzero(index == e, as_tuple=True)
        routed = x.index_select(0, token) @ experts[e]
        out = out.index_add(0, token, routed * weights[token, slot].unsqueeze(-1))
    return out


def _moe_stmts(out: str, args: Sequence[str], a: Mapping[str, Any]) -> list[str]:
    x, router, experts = args
    return [
        f"{out}_values, {out}_index = ({x} @ {router}).topk({a['top_k']!r}, dim=-1)  # top-k router",
        f"{out}_weights = {out}_values.softmax(-1)",
        f"{out} = torch.zeros_like({x})",
        f"for {out}_e in range({experts}.shape[0]):",
        f"    {out}_token, {out}_slot = torch.nonzero({out}_index == {out}_e, as_tuple=True)  # 0, 1, ... tokens",
        f"    {out}_routed = {x}.index_select(0, {out}_token) @ {experts}[{out}_e]",
        f"    {out} = {out}.index_add(0, {out}_token, {out}_routed * {out}_weights[{out}_token, {out}_slot].unsqueeze(-1))",
    ]


def _moe_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    x, router, experts = shapes
    if len(x) != 2:
        raise ShapeError(f"moe takes tokens of shape [N, D], got {list(x)}")
    d = x[1]
    if len(router) != 2 or router[0] != d:
        raise ShapeError(f"the router must be [D={d}, E], got {list(router)}")
    e = router[1]
    if tuple(experts) != (e, d, d):
        raise ShapeError(f"the experts must be [E={e}, D={d}, D={d}], got {list(experts)}")
    k = attrs["top_k"]
    if not 1 <= k <= e:
        raise ShapeError(f"top_k={k} must be in 1..E={e}")
    return [tuple(x)]


def _moe_plan(draw: DrawFn, shape: Shape) -> Plan:
    d = shape[1]
    e = draw(st.integers(1, 4))
    k = draw(st.integers(1, min(2, e)))
    return [(d, e), (e, d, d)], {"top_k": k}


def _p_plan(draw: DrawFn, shape: Shape) -> Plan:
    return [], {"p": draw(st.sampled_from(PROBABILITIES))}


def _threshold_plan(draw: DrawFn, shape: Shape) -> Plan:
    return [], {"threshold": draw(st.sampled_from(THRESHOLDS))}


register(
    OpSpec(
        name="dropout",
        category="random",
        impl=_dropout,
        infer=_same,
        code=lambda args, a: f"torch.nn.functional.dropout({args[0]}, {a['p']!r}, training=True)",
        attrs={"p": Attr("float", PROBABILITIES)},
        plan=_p_plan,
        # p=0 (or no element) returns the input itself, drawing nothing
        identity=lambda shapes, dtypes, a: a["p"] == 0.0 or 0 in shapes[0],
        rare=True,
        doc="dropout in training mode: draws a mask from the global generator",
    )
)
register(
    OpSpec(
        name="rand_mul",
        category="random",
        impl=lambda t, a: t[0] * torch.rand_like(t[0]),
        infer=_same,
        code=lambda args, a: f"{args[0]} * torch.rand_like({args[0]})",
        rare=True,
        doc="x * rand_like(x): draws from the global generator",
    )
)
register(
    OpSpec(
        name="bernoulli_mask",
        category="random",
        impl=_bernoulli,
        infer=_same,
        code=lambda args, a: f"{args[0]} * torch.bernoulli(torch.full_like({args[0]}, {a['p']!r}))",
        attrs={"p": Attr("float", PROBABILITIES)},
        plan=_p_plan,
        rare=True,
        doc="x * bernoulli(p): a random mask from the global generator",
    )
)
register(
    OpSpec(
        name="nonzero_scatter",
        category="dynamic",
        impl=_nonzero_scatter,
        infer=_same,
        code=lambda args, a: "; ".join(_nonzero_scatter_stmts("y", args, a)) + "; -> y",
        stmts=_nonzero_scatter_stmts,
        attrs={"threshold": Attr("float", THRESHOLDS)},
        plan=_threshold_plan,
        rare=True,
        doc="nonzero + index_select + index_add: a count decided by the values",
    )
)
register(
    OpSpec(
        name="masked_select_scatter",
        category="dynamic",
        impl=_masked_select_scatter,
        infer=_same,
        code=lambda args, a: "; ".join(_masked_select_scatter_stmts("y", args, a)) + "; -> y",
        stmts=_masked_select_scatter_stmts,
        attrs={"threshold": Attr("float", THRESHOLDS)},
        plan=_threshold_plan,
        rare=True,
        doc="masked_select + masked_scatter: a count decided by the values",
    )
)
register(
    OpSpec(
        name="moe",
        category="dynamic",
        impl=_moe,
        infer=_moe_infer,
        code=lambda args, a: f"moe({', '.join(args)}, top_k={a['top_k']!r})",
        stmts=_moe_stmts,
        min_arity=3,
        max_arity=3,
        attrs={"top_k": Attr("int")},
        accepts=lambda shape: len(shape) == 2,
        plan=_moe_plan,
        dtype_rule="same",
        rare=True,
        doc="top-k routing to experts: per-expert index_select / index_add of any count",
    )
)
