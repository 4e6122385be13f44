"""Where a CUDA graph's inputs live: storage spans, overlaps, the addresses read in place.

A recorded graph (:class:`_Recorded`) reads each input either in place (at
the address it had when recorded) or from a buffer of its own that the
inputs are copied into before each replay; an expanded input (stride 0)
cannot be copied into, so its storage span is (:func:`_span`). Used by
:class:`cagrad.compile.cuda_graphs.CudaGraphed`; the rules are its module's
docstring's.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch


class _Recorded:
    __slots__ = (
        "graph", "buffers", "static", "outputs", "copies_device", "handed", "copies", "device", "frees", "next", "used",
        "addresses_by_data", "spans", "views",
    )

    def __init__(
        self, graph: Any, buffers: list, static: list[bool], outputs: list, device: int, addresses_by_data: bool = False,
        spans: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.graph = graph
        self.device = device  # the CUDA device index it was recorded on
        # some CUDA input holds integers or booleans: indices or a mask, which
        # kernels turn into addresses (see CudaGraphed.speculate)
        self.addresses_by_data = addresses_by_data
        # the allocator's device_frees count when its in-place addresses last
        # held its inputs (a replay or the recording), None where unknown
        self.frees: int | None = None
        self.next: _Recorded | None = None  # the graph replayed after it, last time
        self.used = 0  # CudaGraphed.replays at its last replay
        self.buffers = buffers  # per input: the buffer the graph reads, None if in place
        self.static = static  # per input: read in place
        self.outputs = outputs
        self.handed: list | None = None  # aliases of the outputs handed out after the last replay
        # the copies before each replay, one group per device of the
        # buffers: (buffers, input positions); each group is one
        # _foreach_copy_, a few kernel launches where per-input copy_
        # calls would launch one each (chain200: 200 inputs)
        # inputs whose elements share memory (an expanded tensor): the graph
        # reads a view of a buffer holding their storage span (_span)
        self.spans = spans or {}
        # (output index, input index, element offset from the buffer's
        # storage offset): outputs that are views of an input's buffer,
        # handed out as the same view of the caller's input (views_of_inputs)
        self.views = views_of_buffers(outputs, buffers, self.spans)
        groups: dict[Any, tuple[list, list[int]]] = {}
        for i, buf in enumerate(buffers):
            if buf is not None and i not in self.spans:
                bufs, at = groups.setdefault(buf.device, ([], []))
                bufs.append(buf)
                at.append(i)
        self.copies = list(groups.values())
        # some CUDA input is copied before each replay
        self.copies_device = any(device.type == "cuda" for device in groups) or any(
            flat.device.type == "cuda" for flat in self.spans.values()
        )

    def fill(self, inputs: list) -> bool:
        """Copies the inputs the graph does not read in place into its
        buffers; False, copying nothing of an overlapping input, where one
        has other strides than at the recording (its span would be another
        set of elements)."""
        for bufs, at in self.copies:
            torch._foreach_copy_(bufs, [inputs[i] for i in at])
        for i, flat in self.spans.items():
            t, view = inputs[i], self.buffers[i]
            if t.stride() != view.stride() or t.size() != view.size():
                return False
            flat.copy_(_span(t))
        return True


def views_of_buffers(outputs: list, buffers: list, spans: dict[int, torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(output index, input index, element offset)`` of each output whose
    storage is the buffer of a copied input (not a span): a view the graph
    made of that input (``CatBackward`` slicing a root gradient)."""
    by_storage = {
        _storage_address(b): i for i, b in enumerate(buffers) if b is not None and i not in spans and b.numel()
    }
    views = []
    for j, o in enumerate(outputs):
        if isinstance(o, torch.Tensor) and o.numel():
            i = by_storage.get(_storage_address(o))
            if i is not None:
                views.append((j, i, o.storage_offset() - buffers[i].storage_offset()))
    return views


def views_of_inputs(recorded: _Recorded, handed: list, inputs: list) -> list:
    """``handed`` (aliases of the graph's outputs) with each output that is
    a view of a copied input's buffer (:attr:`_Recorded.views`) replaced by
    the same view of the caller's input, where that input has the buffer's
    sizes, strides, dtype and device: eager's backward hands the leaf a view
    of the tensor it was given (a ``grad_tensors`` tensor), which its
    ``AccumulateGrad`` adopts as ``.grad``, sharing the caller's memory; a
    view of the graph's buffer would be a copy (same values and strides)."""
    out = list(handed)
    for j, i, offset in recorded.views:
        t, buf, o = inputs[i], recorded.buffers[i], recorded.outputs[j]
        if t is not buf and _fits(t, buf):
            out[j] = t.detach().as_strided(o.size(), o.stride(), t.storage_offset() + offset)
    return out


def _storage_address(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, computed from ``t``'s own: asking
    ``untyped_storage()`` would make a Python storage object that lives as
    long as the memory (torch preserves it) and counts as one more holder,
    so :func:`cagrad.native.reclaim_fn` could never move an output so
    touched."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _span(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t``'s storage from its first element to its last,
    as a flat tensor (shape ``(n,)``): every element a view with
    non-negative strides reads lies in it, at the same offsets from the
    first. Torch's strides are never negative."""
    n = 1 + sum((size - 1) * stride for size, stride in zip(t.size(), t.stride()))
    return t.as_strided((n,), (1,), t.storage_offset())


def _overlaps(t: torch.Tensor) -> bool:
    """Whether torch finds that elements of ``t`` share memory (a stride of
    0 over a dimension of size > 1: an ``expand``ed tensor), which makes
    ``t`` no destination for a copy (``assert_no_internal_overlap`` raises
    on exactly this answer, ``MemoryOverlap::Yes``; layouts it cannot judge,
    an ``unfold`` window, are copied into as they are)."""
    return torch._debug_has_internal_overlap(t) == 1


class _Mask:
    """Which inputs some graph reads in place, and a C-level reader of their
    addresses (a graph's key holds exactly those)."""

    __slots__ = ("static", "picks", "count")

    def __init__(self, static: list[bool]) -> None:
        self.static = tuple(static)
        at = [i for i, s in enumerate(static) if s]
        self.count = len(at)
        if len(at) >= 2:
            self.picks: Callable[[list[int]], tuple] = operator.itemgetter(*at)
        elif at:
            self.picks = lambda addresses, i=at[0]: (addresses[i],)
        else:
            self.picks = lambda addresses: ()


_data_ptr = torch.Tensor.data_ptr


def _params(inputs: list) -> list[bool]:
    """Which inputs are parameters (CUDA leaves that require grad): always
    read in place."""
    return [t.is_cuda and t.is_leaf and t.requires_grad for t in inputs]


def _in_place(inputs: list, params: list[bool], addresses: list[int], earlier: list[int] | None) -> list[bool]:
    """Which inputs a new graph reads in place: parameters, and CUDA inputs
    at the address they had in the ``earlier`` call."""
    earlier = earlier or [None] * len(inputs)
    return [t.is_cuda and (p or a == b) for t, p, a, b in zip(inputs, params, addresses, earlier)]


def _fits(t: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``t`` has ``buf``'s sizes, strides, dtype and device."""
    return (
        isinstance(t, torch.Tensor) and t.dtype == buf.dtype and t.device == buf.device
        and t.size() == buf.size() and t.stride() == buf.stride()
    )


def _key(size_key: tuple, addresses: list[int], mask: _Mask) -> tuple:
    """A graph's key: the sizes (and host values), and the addresses it reads in place."""
    return size_key, mask.static, mask.picks(addresses)
