"""Tensor subclasses a backward compiles: wrapper subclasses, flattened.

A *traceable wrapper subclass* (``torch.testing._internal.two_tensor.
TwoTensor``, ...) has a ``__torch_dispatch__`` of its own and the flatten
protocol: ``t.__tensor_flatten__()`` gives ``(names, ctx)``, the attribute
names of its inner tensors and a metadata object, and
``cls.__tensor_unflatten__(inner, ctx, outer_size, outer_stride)`` rebuilds
it. cagrad lifts such a tensor as its inner tensors (each a graph input of
its own, a plain tensor a backend can compile) and rebuilds the subclass
from their fakes before the trace, so the trace runs the subclass's
``__torch_dispatch__`` (the proxy mode hands a tensor it has no proxy for
back to its subclass) and records the ops it does on the inner tensors. A
gradient the graph returns as a subclass (a subclass leaf's) is returned as
its inner tensors and rebuilt after the graph ran (:func:`rebuild`).

The key (:func:`write_subclass`) holds the class by module and qualified
name, the flatten metadata ``ctx`` (constants only: None, bools, ints,
floats, strings, dtypes, devices, tuples, lists and dicts with string keys
of those), the outer tensor's requires_grad, dtype, device, rank and its
sizes, strides and offset (size slots that stay static), then each inner
tensor by name, as any lifted tensor is keyed. What the key cannot pin
raises :class:`~cagrad.errors.Unsupported` (reason ``tensor_subclass``, or
``nested_tensor`` for a jagged layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import Unsupported
from .cache_key import KeyWriter

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NO_DISPATCH = torch.Tensor.__torch_dispatch__


def is_wrapper_subclass(t: torch.Tensor) -> bool:
    """Whether ``t``'s class implements ``__torch_dispatch__`` and both
    halves of the flatten protocol (a plain tensor or a FakeTensor: no)."""
    cls = type(t)
    if cls in _PLAIN_TENSOR_TYPES:
        return False
    return (
        callable(getattr(cls, "__tensor_flatten__", None))
        and callable(getattr(cls, "__tensor_unflatten__", None))
        and getattr(cls, "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH
    )


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclasses.dataclass(frozen=True)
class SubclassSpec:
    """How to rebuild one subclass tensor from its flattened inner tensors.

    Attributes:
        cls: the subclass.
        ctx: its flatten metadata (constants only).
        names: the inner tensors' attribute names, in flatten order.
        inner: per name, the spec of an inner tensor that is a subclass
            itself, or None for a plain one (one flat entry).
        size, stride: the outer tensor's sizes and strides (ints).
    """

    cls: type
    ctx: Any
    names: tuple[str, ...]
    inner: tuple[SubclassSpec | None, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _write_ctx(w: KeyWriter, ctx: Any) -> None:
    if isinstance(ctx, dict):
        w.tag(b"{")
        w.size(len(ctx))
        if not all(isinstance(k, str) for k in ctx):
            raise Unsupported("unkeyable_attribute", "a dict with keys that are not strings")
        for k in sorted(ctx):
            w.text(k)
            _write_ctx(w, ctx[k])
    elif type(ctx) in (tuple, list):
        w.tag(b"(" if type(ctx) is tuple else b"[")
        w.size(len(ctx))
        for v in ctx:
            _write_ctx(w, v)
    else:
        w.value(ctx)


def flatten(t: torch.Tensor, what: str, out: list[torch.Tensor]) -> SubclassSpec | None:
    """Appends ``t``'s plain tensors to ``out`` (``t`` itself if it is not a
    wrapper subclass: returns None), else returns its spec.

    Raises:
        Unsupported: an inner value that is not a tensor, or a subclass
            whose outer sizes are not ints.
    """
    if not is_wrapper_subclass(t):
        out.append(t)
        return None
    names, ctx = t.__tensor_flatten__()
    inner = []
    for name in names:
        value = getattr(t, name)
        if not isinstance(value, torch.Tensor):
            raise Unsupported("tensor_subclass", f"{what}.{name} is a {type(value).__name__}, not a tensor")
        inner.append(flatten(value, f"{what}.{name}", out))
    size, stride = _outer_geometry(t, what)
    return SubclassSpec(type(t), ctx, tuple(names), tuple(inner), size, stride)


def _outer_geometry(t: torch.Tensor, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    size, stride = tuple(t.shape), tuple(t.stride())
    if not all(type(v) is int for v in (*size, *stride)):
        raise Unsupported("tensor_subclass", f"{what} is a {type(t).__name__} with symbolic sizes or strides")
    return size, stride


def write_subclass(w: KeyWriter, t: torch.Tensor, what: str, write_inner: Any) -> tuple[int, ...]:
    """Key bytes of a subclass tensor; ``write_inner(w, inner, what)`` keys
    each inner tensor (the caller's plain-tensor writer). Returns the outer
    sizes, strides and offset, for the caller's static size slots.

    Raises:
        Unsupported: ``tensor_subclass`` for a subclass that is not a
            traceable wrapper subclass, a class defined inside a function
            (its name does not identify it), flatten metadata that is not a
            constant, symbolic outer sizes; ``nested_tensor`` for a jagged
            layout; ``non_strided_tensor`` for another non-strided layout.
    """
    cls = type(t)
    jagged = getattr(torch, "jagged", None)
    if jagged is not None and t.layout is jagged:
        raise Unsupported("nested_tensor", f"{what} is a nested tensor (layout torch.jagged)")
    if not is_wrapper_subclass(t):
        raise Unsupported(
            "tensor_subclass",
            f"{what} is a {cls.__name__} (no __torch_dispatch__ with __tensor_flatten__/__tensor_unflatten__)",
        )
    if "<locals>" in cls.__qualname__:
        raise Unsupported("tensor_subclass", f"{what} is a {cls.__qualname__}, a class defined inside a function")
    if t.layout is not torch.strided:
        raise Unsupported("non_strided_tensor", f"{what} is a {cls.__name__} with layout {t.layout}")
    size, stride = _outer_geometry(t, what)
    names, ctx = t.__tensor_flatten__()
    w.tag(b"S" if not t.requires_grad else b"R")
    w.text(class_name(cls))
    try:
        _write_ctx(w, ctx)
    except Unsupported as e:
        raise Unsupported(
            "tensor_subclass",
            f"{what}: the flatten metadata of {cls.__name__} ({type(ctx).__name__}) "
            f"is not a constant cagrad can key ({e.detail})",
        ) from e
    w.dtype(t.dtype)
    w.device(t.device)
    w.size(len(size))
    w.size(len(names))
    for name in names:
        value = getattr(t, name)
        if not isinstance(value, torch.Tensor):
            raise Unsupported("tensor_subclass", f"{what}.{name} is a {type(value).__name__}, not a tensor")
        w.text(name)
        write_inner(w, value, f"{what}.{name}")
    return (*size, *stride, t.storage_offset())


def build(spec: SubclassSpec, flat: Sequence[torch.Tensor], i: int) -> tuple[torch.Tensor, int]:
    """The subclass tensor of ``spec`` from ``flat[i:]``; returns it and the
    index after its last flat tensor."""
    inner = {}
    for name, sub in zip(spec.names, spec.inner):
        if sub is None:
            inner[name] = flat[i]
            i += 1
        else:
            inner[name], i = build(sub, flat, i)
    return spec.cls.__tensor_unflatten__(inner, spec.ctx, spec.size, spec.stride), i


def unflatten(
    groups: Sequence[tuple[int, SubclassSpec]], slots: Sequence[Any], fakes: Sequence[torch.Tensor]
) -> list[tuple[Any, torch.Tensor]]:
    """``(slot, fake)`` per lifted tensor as the collector read it, from the
    flat fakes of the graph inputs: the inner fakes of each subclass
    (``TensorArgs.groups``) rebuilt into a fake subclass. The rebuilt tensor
    has no proxy of its own: the proxy mode hands every op on it to its
    ``__torch_dispatch__``, which works on the inner fakes. Not
    requires_grad: the trace runs under no_grad, and a ``create_graph``
    backward with a subclass falls back."""
    by_start = dict(groups)
    out: list[tuple[Any, torch.Tensor]] = []
    i = 0
    while i < len(fakes):
        spec = by_start.get(i)
        if spec is None:
            out.append((slots[i], fakes[i]))
            i += 1
            continue
        outer, j = build(spec, fakes, i)
        out.append((slots[i], outer))
        i = j
    return out


def rebuild(
    specs: Sequence[SubclassSpec | None], flat: Sequence[torch.Tensor], stealable: Sequence[bool]
) -> tuple[list[torch.Tensor], list[bool]]:
    """The graph's outputs, a subclass rebuilt where ``specs`` has one (see
    :attr:`cagrad.capture.compiler.Traced.output_specs`), and per output
    whether it may become a ``.grad`` uncopied: a rebuilt subclass where
    each of its inner tensors may (``stealable``, per flat output)."""
    out = []
    steal = []
    i = 0
    for spec in specs:
        if spec is None:
            out.append(flat[i])
            steal.append(stealable[i])
            i += 1
        else:
            t, j = build(spec, flat, i)
            out.append(t)
            steal.append(all(stealable[i:j]))
            i = j
    return out, steal
