"""Which custom ``autograd.Function`` backwards are traced into the graph.

By default a custom Function's backward runs as an opaque call: the graph
is cut there and ``PyNode::apply``'s steps run in Python on real tensors
(:func:`cagrad.autograd.custom_function.apply`). A backward in the class
that :mod:`cagrad.hooks.hook_tracing` accepts for tensor hooks is instead
traced into the graph, those same steps included (materialized zeros, the
gradient count, None for non-tensor inputs, ``validate_outputs``), so the
backward compiles as one graph (torch's compiled autograd inlines such
backwards through Dynamo). The class, checked from the backward's code and
what it reads:

* ``backward`` is a plain function (a ``staticmethod``; not a classmethod,
  a callable object or a ``vjp``), and the node's ``apply`` is torch's; a
  backward wrapped by ``once_differentiable`` is its inner function, and
  only without ``create_graph`` (with it, eager's wrapper builds the
  error-raising graph: the backward runs opaque);
* its bytecode is in :mod:`~cagrad.hooks.hook_tracing`'s class (no stores
  to anything but locals, no ``with``/``try``, no nested function, no
  denied attribute: in-place or private methods, random sampling, I/O,
  ``torch.autograd``, ...), and it loads no dunder attribute
  (``ctx.__dict__``, ``ctx.__setattr__``);
* the globals, closure cells and defaults it reads are accepted values
  (modules of torch and math, their functions, constants);
* of the ctx it reads ``saved_tensors`` (lifted graph inputs, in the key as
  tensors), ``needs_input_grad`` and attributes the forward set in the
  ctx's ``__dict__`` whose values are accepted values or ``torch.Size``
  (whose length only is in the fingerprint: its values are size slots of
  the key, :func:`ctx_sizes`, so a new shape may be traced symbolically as a
  saved size is, instead of being a new key);
  any other ctx attribute or method (``saved_variables``, ``mark_dirty``,
  ``materialize_grads``, ...) or a ctx attribute holding a tensor that is
  not saved, a list or another object makes it opaque.

Writing ``ctx.foo = ...``, ``print``, a list ``append`` on a global, or any
other side effect is outside the class: such a backward runs opaque, every
backward, exactly as eager runs it.

The **fingerprint** (:func:`fingerprint`) goes into the node's CacheKey: the
hook fingerprint of the backward's code and the globals/closure/defaults it
reads, plus, per attribute name the code loads, the ctx's value under that
name (or that it has none). Every attribute name the code loads is looked up
on the ctx, whichever object it is loaded from in the code: a superset of
the ctx reads, so an alias of the ctx (``c = ctx``) is covered too. A
redefined class, a changed closure value or a changed ``ctx.scale``
therefore recaptures.

A few of torch's own Functions are accepted by name instead
(:data:`TORCH_FUNCTIONS`): DTensor's ``from_local``/``to_local`` and
``redistribute`` backwards, which read private attributes and build specs
(outside the class above) but only compute: torch.compile traces them too.
Their fingerprint is their backward's code and every attribute of the ctx
keyed as subclass metadata (the caller's ``metadata_bytes``:
:func:`cagrad.keys.subclasses.metadata_bytes`,
placements by value, the mesh by identity), with a number drawn per process
(those keys are process-local: never a disk hit in another process).

Tracing reads values only through the key, so it is valid only while no
other code of the user's that could change them runs before the node in
the backward (:meth:`cagrad.keys.compiled_node_args.Collector.collect`
decides that). A backward whose trace fails (it branches on a tensor value,
calls ``.item()``, returns what eager rejects, raises) runs opaque instead
(:class:`~cagrad.errors.NodeTraceFailed`), and raises eager's own error
there.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction, Function, once_differentiable

from . import hook_tracing

#: torch's own Functions whose backward is traced as it is (module, class
#: qualified name): they only compute, with DTensor's dispatch
TORCH_FUNCTIONS = frozenset(
    {
        ("torch.distributed.tensor._api", "_ToTorchTensor"),
        ("torch.distributed.tensor._api", "_FromTorchTensor"),
        ("torch.distributed.tensor._redistribute", "Redistribute"),
    }
)
_PROCESS = os.urandom(8)

#: ctx attributes (of its type) a traced backward may read
_CTX_READS = frozenset({"saved_tensors", "needs_input_grad"})

_ALLOWED = frozenset({"saved_tensors"})  # denied for hooks by its "save" prefix
_MISSING = object()
_ONCE_CODE = once_differentiable(lambda ctx: None).__code__


def _inner_of_once_differentiable(fn: types.FunctionType) -> Any:
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    cell = cells.get("fn")
    try:
        return None if cell is None else cell.cell_contents
    except ValueError:
        return None


def user_backward(node: Any, create_graph: bool) -> types.FunctionType | None:
    """The function to trace for custom Function node ``node`` (its ctx),
    or None where it must run opaque.

    Args:
        node: a ``BackwardCFunction`` of a user's ``autograd.Function``.
        create_graph: the backward records a graph of its own
            (``once_differentiable`` then runs as eager's wrapper).
    """
    cls = getattr(node, "_forward_cls", None)
    typ = type(node)
    if cls is None or any(
        getattr(typ, attr, None) is not getattr(BackwardCFunction, attr, None)
        for attr in ("apply", "apply_boxed")
    ):
        return None
    if getattr(cls, "vjp", Function.vjp) is not Function.vjp:
        return None
    if getattr(cls, "boxed_grads_call", False):
        return None
    fn = getattr(cls, "backward", None)
    if type(fn) is not types.FunctionType:
        return None
    if fn.__code__ is _ONCE_CODE:
        if create_graph:
            return None
        fn = _inner_of_once_differentiable(fn)
        if type(fn) is not types.FunctionType:
            return None
    return fn


def _ctx_value_text(v: Any) -> str | None:
    if isinstance(v, torch.Size):
        if not all(type(d) is int for d in v):
            return None  # a symbolic size (a ctx of a traced forward)
        return f"Size[{len(v)}]"  # the values: size slots (ctx_sizes)
    if isinstance(v, tuple) and type(v) is not tuple:
        return None  # a named tuple or another subclass
    return hook_tracing.object_text(v)


def _ctx_attr(node: Any, name: str) -> tuple[Any, Any]:
    """``(the ctx's own value, the type's attribute)`` under ``name``, each
    ``_MISSING`` where there is none; the own value is ``_MISSING`` too where
    the type's attribute is a data descriptor (which wins over it)."""
    on_type = inspect.getattr_static(type(node), name, _MISSING)
    if on_type is not _MISSING and hasattr(type(on_type), "__set__"):
        return _MISSING, on_type
    return node.__dict__.get(name, _MISSING), on_type


def _ctx_texts(node: Any, attr_names: tuple[str, ...]) -> list[str] | None:
    out = []
    for name in attr_names:
        value, on_type = _ctx_attr(node, name)
        if value is not _MISSING:
            text = _ctx_value_text(value)
            if text is None:
                return None
            out.append(f"{name}={text}")
        elif on_type is not _MISSING:
            if name not in _CTX_READS:
                return None  # a method or C attribute of the ctx
            if name == "needs_input_grad":
                text = hook_tracing.object_text(tuple(node.needs_input_grad))
                if text is None:
                    return None
                out.append(f"{name}={text}")
            else:
                out.append(name)  # the saved tensors: lifted, in the key as tensors
        else:
            out.append(f"{name}-")  # no such ctx attribute
    return out


def fingerprint(
    node: Any, create_graph: bool, metadata_bytes: Callable[[Any], bytes | None] | None = None
) -> bytes | None:
    """The fingerprint of a custom Function node whose backward this module
    accepts for tracing, else None.

    Args:
        node: the ``BackwardCFunction`` (the ctx).
        create_graph: see :func:`user_backward`.
        metadata_bytes: key bytes of a ctx value of one of
            :data:`TORCH_FUNCTIONS` (None: unkeyable); without it those
            run opaque.

    Returns:
        :data:`~cagrad.hooks.hook_tracing.FINGERPRINT_BYTES` bytes, equal
        for nodes whose backwards have the same code and read the same
        values (globals, closure, defaults, ctx attributes).
    """
    fn = user_backward(node, create_graph)
    if fn is None:
        return None
    cls = node._forward_cls
    if (cls.__module__, cls.__qualname__) in TORCH_FUNCTIONS:
        return None if metadata_bytes is None else _torch_function_fingerprint(node, fn, metadata_bytes)
    static = hook_tracing.analyze(fn.__code__, _ALLOWED)
    if static is None:
        return None
    if any(a.startswith("__") and a.endswith("__") for a in static.attr_names):
        return None
    parts = hook_tracing.outside_texts(fn, static)
    if parts is None:
        return None
    ctx = _ctx_texts(node, static.attr_names)
    if ctx is None:
        return None
    return hook_tracing.digest(static, [*parts, "ctx", *ctx])


def ctx_sizes(node: Any, create_graph: bool) -> list[tuple[str, torch.Size]]:
    """The ``torch.Size`` values among the ctx attributes that the backward
    of ``node`` reads, as ``(name, size)`` in the fingerprint's order: the
    key writes their values as size slots, and the trace reads them from
    those slots (:meth:`cagrad.capture.node_apply.NodeApplication.apply_custom`).
    Empty for a node :func:`fingerprint` does not accept, or one of
    :data:`TORCH_FUNCTIONS` (keyed whole)."""
    fn = user_backward(node, create_graph)
    if fn is None:
        return []
    cls = node._forward_cls
    if (cls.__module__, cls.__qualname__) in TORCH_FUNCTIONS:
        return []
    static = hook_tracing.analyze(fn.__code__, _ALLOWED)
    if static is None:
        return []
    out = []
    for name in static.attr_names:
        value, _ = _ctx_attr(node, name)
        if isinstance(value, torch.Size):
            out.append((name, value))
    return out


def _torch_function_fingerprint(
    node: Any, fn: types.FunctionType, metadata_bytes: Callable[[Any], bytes | None]
) -> bytes | None:
    h = hashlib.sha256(_PROCESS)
    h.update(f"{fn.__module__}.{fn.__qualname__}\0{torch.__version__}\0".encode())
    h.update(fn.__code__.co_code)
    own = node.__dict__
    for name in sorted(own):
        value = metadata_bytes(own[name])
        if value is None:
            return None
        h.update(f"\0{name}\0{len(value)}\0".encode())
        h.update(value)
    return h.digest()[: hook_tracing.FINGERPRINT_BYTES]
