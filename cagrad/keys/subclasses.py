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
name, the flatten metadata ``ctx`` (constants: None, bools, ints, floats,
strings, dtypes, devices, sizes, tuples, named tuples, dataclass instances
field by field, lists and dicts with string keys of those; a
``DeviceMesh`` as the object itself; any other hashable value with an
``__eq__`` of its own, such as DTensor's placements since torch 2.13, as
the number of its equality class, see :class:`Interned`), the outer
tensor's requires_grad, dtype, device, rank and its sizes, strides and
offset (size slots that stay static), then each inner tensor by name, as
any lifted tensor is keyed. An
inner value that is not a tensor (DTensor's ``device_mesh``, an opaque
object since torch 2.13) is kept in the spec as it is and keyed by
identity. A jagged nested tensor (``torch.nested`` with
``layout=torch.jagged``) is such a subclass: its values, offsets and
cached sequence-length tensors are its inner tensors, and the nested ints
of its outer sizes and strides are keyed by structure, not by name (which
nested tensors share offsets: :meth:`cagrad.keys.sizes.SizeInputs.nested_marker`).
What the key cannot pin raises :class:`~cagrad.errors.Unsupported`
(reason ``tensor_subclass``).

Equal metadata is taken to mean equal dispatch: torch.compile's guards on a
subclass input compare ``ctx`` with ``==`` as well
(``torch/_subclasses/meta_utils.py``, ``torch/_guards.py``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .. import internals
from ..errors import Unsupported
from .cache_key import KeyWriter
from .sizes import is_nested_int

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


class Interned:
    """Numbers values by equality (``__eq__``/``__hash__``) or identity.

    ``index(v)`` is the same number for equal values and another for values
    that differ; the table keeps the first value of each class alive, so an
    identity number is never handed to a later object at the same address.
    Numbers are per process: graphs keyed with them are never stored on
    disk (subclass graphs are not).

    Example::

        >>> n = Interned()
        >>> n.index(("Shard", 0)) == n.index(("Shard", 0))
        True
    """

    def __init__(self) -> None:
        self._by_value: dict[Any, int] = {}
        self._by_id: dict[int, tuple[Any, int]] = {}

    def index(self, v: Any) -> int:
        """The number of ``v``'s equality class.

        Raises:
            TypeError: ``v`` is not hashable.
        """
        n = self._by_value.get(v)
        if n is None:
            n = self._by_value[v] = len(self._by_value) + len(self._by_id)
        return n

    def identity(self, v: Any) -> int:
        """The number of the object ``v`` itself."""
        held = self._by_id.get(id(v))
        if held is None:  # (held objects stay alive: their ids are not reused)
            held = self._by_id[id(v)] = (v, len(self._by_value) + len(self._by_id))
        return held[1]


_INTERNED = Interned()


@dataclasses.dataclass(frozen=True)
class Opaque:
    """An inner value of a subclass that is not a tensor (DTensor's
    ``device_mesh``): rebuilt as this very object."""

    value: Any


@dataclasses.dataclass(frozen=True)
class SubclassSpec:
    """How to rebuild one subclass tensor from its flattened inner tensors.

    Attributes:
        cls: the subclass.
        ctx: its flatten metadata (a value :func:`_write_ctx` keys).
        names: the inner tensors' attribute names, in flatten order.
        inner: per name, the spec of an inner tensor that is a subclass
            itself, None for a plain one (one flat entry), or an
            :class:`Opaque` for a value that is not a tensor (no entry).
        size, stride: the outer tensor's sizes and strides (ints, and a
            jagged tensor's nested ints).
    """

    cls: type
    ctx: Any
    names: tuple[str, ...]
    inner: tuple[SubclassSpec | Opaque | None, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]


def metadata_bytes(value: Any) -> bytes | None:
    """The key bytes of ``value`` as flatten metadata is keyed
    (:func:`_write_ctx`), or None where it cannot be keyed (the custom
    Functions of :data:`cagrad.hooks.backward_tracing.TORCH_FUNCTIONS` key
    their ctx so)."""
    w = KeyWriter()
    try:
        _write_ctx(w, value)
    except Unsupported:
        return None
    return w.getvalue()


def _write_ctx(w: KeyWriter, ctx: Any) -> None:
    """Key bytes of a subclass's flatten metadata, or of a value of that
    kind (DTensor's specs, placements, meshes), as the module docstring
    describes.

    Raises:
        Unsupported: ``unkeyable_attribute`` for a value without value
            equality and a hash, or a dict with keys that are not strings.
    """
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
    elif isinstance(ctx, tuple) and hasattr(type(ctx), "_fields"):
        w.tag(b"<")
        w.text(class_name(type(ctx)))
        w.size(len(ctx))
        for v in ctx:
            _write_ctx(w, v)
    elif dataclasses.is_dataclass(ctx) and not isinstance(ctx, type):
        fields = dataclasses.fields(ctx)
        w.tag(b"@")
        w.text(class_name(type(ctx)))
        w.size(len(fields))
        for f in fields:
            w.text(f.name)
            _write_ctx(w, getattr(ctx, f.name))
    elif _is_device_mesh(ctx):
        _write_identity(w, ctx)
    else:
        try:
            w.value(ctx)
        except Unsupported:
            _write_by_equality(w, ctx)


def _is_device_mesh(v: Any) -> bool:
    # a device mesh is keyed as the object itself: a DTensor rebuilt after
    # the graph must carry the mesh eager's would (meshes compare equal by
    # their ranks and names, and may still differ in their process groups)
    module = sys.modules.get("torch.distributed.device_mesh")
    mesh_cls = getattr(module, "DeviceMesh", None) if module is not None else None
    return mesh_cls is not None and isinstance(v, mesh_cls)


def _write_identity(w: KeyWriter, v: Any) -> None:
    w.tag(b"o")
    w.text(class_name(type(v)))
    w.size(_INTERNED.identity(v))


def _write_by_equality(w: KeyWriter, v: Any) -> None:
    cls = type(v)
    if isinstance(v, torch.Tensor) or cls.__eq__ is object.__eq__ or cls.__hash__ is None:
        # (a tensor's == is elementwise and its hash its identity)
        raise Unsupported("unkeyable_attribute", f"a {cls.__name__} without value equality and a hash")
    try:
        n = _INTERNED.index(v)
    except Exception as e:  # noqa: BLE001 - a hash or == of the user's that raises
        raise Unsupported("unkeyable_attribute", f"a {cls.__name__} that cannot be hashed or compared ({e})") from e
    w.tag(b"=")
    w.text(class_name(cls))
    w.size(n)


def flatten(t: torch.Tensor, what: str, out: list[torch.Tensor]) -> SubclassSpec | None:
    """Appends ``t``'s plain tensors to ``out`` (``t`` itself if it is not a
    wrapper subclass: returns None), else returns its spec.

    Raises:
        Unsupported: a subclass whose outer sizes are not ints or nested
            ints.
    """
    if not is_wrapper_subclass(t):
        out.append(t)
        return None
    names, ctx = t.__tensor_flatten__()
    inner: list[SubclassSpec | Opaque | None] = []
    for name in names:
        value = getattr(t, name)
        if isinstance(value, torch.Tensor):
            inner.append(flatten(value, f"{what}.{name}", out))
        else:
            inner.append(Opaque(value))
    size, stride = _outer_geometry(t, what)
    return SubclassSpec(type(t), ctx, tuple(names), tuple(inner), size, stride)


def _outer_geometry(t: torch.Tensor, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    size, stride = tuple(t.shape), tuple(t.stride())
    if not all(type(v) is int or is_nested_int(v) for v in (*size, *stride)):
        raise Unsupported("tensor_subclass", f"{what} is a {type(t).__name__} with symbolic sizes or strides")
    return size, stride


def write_subclass(w: KeyWriter, t: torch.Tensor, what: str, write_inner: Any) -> tuple[int, ...]:
    """Key bytes of a subclass tensor; ``write_inner(w, inner, what)`` keys
    each inner tensor (the caller's plain-tensor writer). Returns the outer
    sizes, strides and offset, for the caller's static size slots.

    Outer sizes and strides may hold nested ints (a jagged nested tensor's
    ``j1``); the caller's size slots key them by structure
    (:meth:`cagrad.keys.sizes.SizeInputs.nested_marker`).

    Raises:
        Unsupported: ``tensor_subclass`` for a subclass that is not a
            traceable wrapper subclass (a C++ nested tensor included), a
            class defined inside a function (its name does not identify
            it), flatten metadata that is not a constant, symbolic outer
            sizes other than nested ints; ``non_strided_tensor`` for a
            layout other than strided and jagged; ``internal:nested_ints``
            for a jagged one where torch's nested ints are not as cagrad
            expects.
    """
    cls = type(t)
    jagged = getattr(torch, "jagged", None)
    if not is_wrapper_subclass(t):
        raise Unsupported(
            "tensor_subclass",
            f"{what} is a {cls.__name__} (no __torch_dispatch__ with __tensor_flatten__/__tensor_unflatten__)",
        )
    if "<locals>" in cls.__qualname__:
        raise Unsupported("tensor_subclass", f"{what} is a {cls.__qualname__}, a class defined inside a function")
    if t.layout is not torch.strided:
        if jagged is None or t.layout is not jagged:
            raise Unsupported("non_strided_tensor", f"{what} is a {cls.__name__} with layout {t.layout}")
        internals.require("nested_tensors")
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
        w.text(name)
        if isinstance(value, torch.Tensor):
            write_inner(w, value, f"{what}.{name}")
        else:
            # an opaque object (DTensor's device mesh): this object itself
            _write_identity(w, value)
    return (*size, *stride, t.storage_offset())


def build(spec: SubclassSpec, flat: Sequence[torch.Tensor], i: int) -> tuple[torch.Tensor, int]:
    """The subclass tensor of ``spec`` from ``flat[i:]``; returns it and the
    index after its last flat tensor."""
    inner = {}
    for name, sub in zip(spec.names, spec.inner):
        if sub is None:
            inner[name] = flat[i]
            i += 1
        elif isinstance(sub, Opaque):
            inner[name] = sub.value
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
    :attr:`cagrad.capture.traced.Traced.output_specs`), and per output
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
