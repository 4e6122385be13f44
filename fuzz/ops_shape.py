"""Catalog ops that move elements: views and shape ops (reshape, transpose,
permute, expand, slicing, squeezing, flip, diagonal), ``index_select``, and
the joins and splits (``cat``, ``stack``, ``split``, ``unbind``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from fuzz.op_spec import (
    MAX_RANK,
    Attr,
    AttrError,
    DrawFn,
    OpSpec,
    Plan,
    Shape,
    ShapeError,
    _factor_shape,
    _fmt,
    _numel,
    _one_dim_plan,
    _rank_at_least,
    _rank_between,
    _reshape_shape,
    norm_dim,
    norm_dims,
    register,
)


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
