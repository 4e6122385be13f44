"""Layouts the trace assumes: dense strides in a given dimension order, and
the (shape, dtype, device, strides) an opaque call is assumed to return
(:data:`Spec`, :func:`spec_of`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..autograd.accumulate import dense_strides
from ..autograd.walk import Layout

# what an opaque call is assumed to return: (shape, dtype, device, stride)
Spec = tuple[tuple[Any, ...], torch.dtype, torch.device, tuple[Any, ...]]



def contiguous_strides(shape: Sequence[Any]) -> tuple[Any, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch computes them)."""
    strides = []
    acc: Any = 1
    for s in reversed(shape):
        strides.append(acc)
        acc = acc * torch.sym_max(s, 1)
    return tuple(reversed(strides))


def dimension_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dimensions from the outermost (largest stride) to the
    innermost. A dimension of one element right inside another of the same
    stride (dense strides in this order give it that stride, as ``t`` has);
    other ties in index order."""
    stride, shape = t.stride(), t.shape
    return tuple(sorted(range(t.dim()), key=lambda d: (-stride[d], shape[d] == 1, d)))


def strides_in_order(shape: Sequence[Any], order: Sequence[int]) -> tuple[Any, ...]:
    """The strides of a dense tensor of ``shape`` whose dimensions, from the
    outermost, are ``order`` (a permutation, :func:`dimension_order`; the
    identity gives :func:`contiguous_strides`)."""
    strides: list[Any] = [None] * len(shape)
    acc: Any = 1
    for d in reversed(order):
        strides[d] = acc
        acc = acc * torch.sym_max(shape[d], 1)
    return tuple(strides)


def spec_of(value: Any) -> Spec | None:
    if value is None:
        return None
    if isinstance(value, Layout):
        # learnt from a run (BackwardWalk's profile): the real layout
        spec = spec_of(value.expected)
        if spec is None or sorted(value.order) != list(range(len(spec[0]))):
            return spec
        return (spec[0], spec[1], spec[2], strides_in_order(spec[0], value.order))
    if isinstance(value, torch.Tensor):
        # what an opaque call returning "this gradient, maybe replaced" is
        # assumed to return: this layout if it is dense (a copy into it is
        # always possible), else the contiguous one
        shape, stride = tuple(value.shape), tuple(value.stride())
        if not (value.is_contiguous() or dense_strides(shape, stride)):
            stride = contiguous_strides(shape)
        return (shape, value.dtype, value.device, stride)
    # (shape, dtype, device): the engine's promise for a gradient on an edge
    shape, dtype, device = value
    shape = tuple(shape)
    return (shape, dtype, device, contiguous_strides(shape))
