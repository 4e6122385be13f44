"""Ops for the graph features of :mod:`fuzz.ir_graph`.

* Multi-output ops whose outputs all require grad, so that a root can sit
  at output 1 of their backward node: ``var_mean`` (``VarMeanBackward0``;
  ``correction=0``) and ``aminmax`` (``AminmaxBackward0``), over one dim.
  Where torch has no derivative for ``aminmax`` (2.11) it runs as ``amin``
  and ``amax`` (:data:`AMINMAX`, :data:`SUBSTITUTIONS`), keeping its place
  in the catalog.
* Ops that keep the values of a ``(values, indices)`` pair, so a root's
  node has a non-differentiable output beside it: ``topk`` (``k`` largest
  along ``dim``) and ``max_dim`` (``torch.max(x, dim).values``).
* ``fn_inner_grad``: :class:`fuzz.functions.RecomputeInBackward`, a custom
  ``autograd.Function`` whose backward runs ``torch.autograd.grad`` on a
  graph it builds (category ``custom``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
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
    norm_dim,
    register,
)


def _drop_dim(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    d = norm_dim(attrs["dim"], len(s))
    if s[d] == 0:
        raise ShapeError(f"dim {d} is empty")
    return [s[:d] + s[d + 1 :]]


def _pair(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    return _drop_dim(shapes, attrs) * 2


def _topk_infer(shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> list[Shape]:
    s = shapes[0]
    d = norm_dim(attrs["dim"], len(s))
    k = attrs["k"]
    if not 1 <= k <= s[d]:
        raise ShapeError(f"k={k} must be in 1..{s[d]} (the size of dim {d})")
    return [s[:d] + (k,) + s[d + 1 :]]


def _topk_plan(draw: DrawFn, shape: Shape) -> Plan:
    d = draw(st.integers(0, len(shape) - 1))
    return [], {"dim": d, "k": draw(st.integers(1, shape[d]))}


register(
    OpSpec(
        name="var_mean",
        category="reduction",
        impl=lambda t, a: tuple(torch.var_mean(t[0], dim=a["dim"], correction=0)),
        infer=_pair,
        code=_fmt("torch.var_mean({0}, dim={dim}, correction=0)"),
        attrs={"dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_one_dim_plan,
        multi_output=True,
        doc="(var, mean) over dim: one node, two differentiable outputs",
    )
)


def _aminmax_differentiable() -> bool:
    """Whether this torch has a derivative for ``aminmax`` (torch 2.11 has
    none: its backward raises "derivative for aten::aminmax is not
    implemented"; 2.13 has ``AminmaxBackward0``)."""
    x = torch.ones(2, requires_grad=True)
    try:
        torch.aminmax(x, dim=0)[0].backward()
    except RuntimeError:
        return False
    return True


#: Whether ``torch.aminmax`` has a derivative here. Without one the op
#: ``aminmax`` stays in the catalog (so the op table, and so the programs a
#: seed generates, are the same on every torch) but runs, and renders, as
#: ``(torch.amin(x, dim), torch.amax(x, dim))``: the same values, and the
#: same gradients (each spreads the gradient evenly over the tied
#: extremes, as ``AminmaxBackward0`` does), from two nodes instead of one.
AMINMAX = _aminmax_differentiable()

#: Ops that run as an equivalent substitute on this torch: name -> what runs
#: instead and why (recorded in a campaign's report.json).
SUBSTITUTIONS: dict[str, str] = (
    {}
    if AMINMAX
    else {"aminmax": "torch.amin and torch.amax (this torch has no derivative for aminmax)"}
)


def _aminmax_impl(t: Sequence[torch.Tensor], a: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    if AMINMAX:
        return tuple(torch.aminmax(t[0], dim=a["dim"]))
    return torch.amin(t[0], dim=a["dim"]), torch.amax(t[0], dim=a["dim"])


def _aminmax_code(args: Sequence[str], attrs: Mapping[str, Any]) -> str:
    if AMINMAX:
        return f"torch.aminmax({args[0]}, dim={attrs['dim']!r})"
    return f"(torch.amin({args[0]}, dim={attrs['dim']!r}), torch.amax({args[0]}, dim={attrs['dim']!r}))"


register(
    OpSpec(
        name="aminmax",
        category="reduction",
        impl=_aminmax_impl,
        infer=_pair,
        code=_aminmax_code,
        attrs={"dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_one_dim_plan,
        multi_output=True,
        doc="(min, max) over dim: one node, two differentiable outputs "
        "(where torch has no derivative for aminmax: amin and amax, two nodes)",
    )
)
register(
    OpSpec(
        name="topk",
        category="reduction",
        impl=lambda t, a: torch.topk(t[0], a["k"], dim=a["dim"]).values,
        infer=_topk_infer,
        code=_fmt("torch.topk({0}, {k}, dim={dim}).values"),
        attrs={"dim": Attr("dim"), "k": Attr("int")},
        accepts=_rank_at_least(1),
        plan=_topk_plan,
        doc="topk values; its node's indices output is not differentiable",
    )
)
register(
    OpSpec(
        name="max_dim",
        category="reduction",
        impl=lambda t, a: torch.max(t[0], a["dim"]).values,
        infer=_drop_dim,
        code=_fmt("torch.max({0}, {dim}).values"),
        attrs={"dim": Attr("dim")},
        accepts=_rank_at_least(1),
        plan=_one_dim_plan,
        doc="max(dim) values; its node's indices output is not differentiable",
    )
)
register(
    OpSpec(
        name="fn_inner_grad",
        category="custom",
        impl=lambda t, a: F.RecomputeInBackward.apply(t[0]),
        infer=_same,
        code=_fmt("RecomputeInBackward.apply({0})"),
        functions=("RecomputeInBackward",),
        doc="custom Function: x * sin(x), backward runs torch.autograd.grad on a graph of its own",
    )
)
