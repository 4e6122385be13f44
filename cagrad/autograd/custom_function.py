"""Custom ``torch.autograd.Function`` backward nodes, run as eager runs them.

The engine calls a custom Function's backward through ``PyNode::apply``
(torch/csrc/autograd/python_function.cpp), which does more than the Python
``backward``:

* an undefined incoming gradient becomes zeros of the forward output's
  shape, dtype and device, unless ``ctx.set_materialize_grads(False)`` was
  called (or the output was non-differentiable and the internal
  ``_materialize_non_diff_grads`` is off); a non-tensor output's gradient
  stays None;
* the result must hold one gradient per forward input (extra trailing Nones
  are dropped); a non-tensor input must get None;
* the gradients of tensor inputs are handed along the node's edges.

Two facts it reads are not visible from Python: ``materialize_grads`` is a
write-only attribute, and the metadata of non-differentiable outputs (and
which forward inputs were tensors) lives only in C++. cagrad records them
when they are set: a ``materialize_grads`` property on ``BackwardCFunction``
keeps the value it writes, and ``Function.apply`` is wrapped to note the
forward's input kinds and output metadata on the ctx. A Function applied
before ``import cagrad`` (or one overriding ``apply``) has no record, and its
backward falls back to eager.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.autograd.function import BackwardCFunction, Function

from .. import internals
from . import run_context
from .validate import real_metadata, validate_outputs

_RECORD = "_cagrad_record"
_MATERIALIZE = "_cagrad_materialize_grads"

# torch <= 2.13 defines ``Function.apply`` as a Python classmethod; 2.14 as
# ``_FunctionBase``'s C classmethod descriptor. Both bind to a class through
# ``__get__(None, cls)``.
# (checked by cagrad.internals, "function_apply": install() does nothing
# where it is neither, and custom Function backwards fall back)
_apply_descriptor = Function.__dict__.get("apply")


def _original_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    return _apply_descriptor.__get__(None, cls)(*args, **kwargs)


_base_materialize = torch._C._FunctionBase.__dict__.get("materialize_grads")


@dataclasses.dataclass(frozen=True)
class OutputInfo:
    """One forward output, as ``VariableInfo`` keeps it."""

    differentiable: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclasses.dataclass(frozen=True)
class ForwardRecord:
    """What ``PyNode::apply`` needs that Python cannot read off the node.

    Attributes:
        is_variable_input: per forward input, whether it was a tensor.
        outputs: per forward output, its :class:`OutputInfo` (None for a
            non-tensor output).
    """

    is_variable_input: tuple[bool, ...]
    outputs: tuple[OutputInfo | None, ...]


def _get_materialize(self: Any) -> bool:
    return self.__dict__.get(_MATERIALIZE, True)


def _set_materialize(self: Any, value: bool) -> None:
    _base_materialize.__set__(self, value)
    self.__dict__[_MATERIALIZE] = bool(value)


def _flat_outputs(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _record(cls: type, args: tuple, out: Any) -> None:
    outputs = _flat_outputs(out)
    backward_cls = getattr(cls, "_backward_cls", None)
    ctx = None
    for o in outputs:
        if isinstance(o, torch.Tensor) and isinstance(o.grad_fn, backward_cls):
            ctx = o.grad_fn
            break
    if ctx is None:
        return  # nothing differentiable: no backward node
    infos = []
    for o in outputs:
        if isinstance(o, torch.Tensor):
            infos.append(OutputInfo(o.requires_grad, tuple(o.shape), o.dtype, o.device))
        else:
            infos.append(None)
    ctx.__dict__[_RECORD] = ForwardRecord(
        tuple(isinstance(a, torch.Tensor) for a in args), tuple(infos)
    )


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    out = _original_apply(cls, *args, **kwargs)
    if torch.is_grad_enabled() and not kwargs:
        try:
            # out of a TorchFunctionMode's sight: each attribute read would
            # reach a user's mode as a __get__ call eager never makes
            with torch._C.DisableTorchFunction():
                _record(cls, args, out)
        except Exception:  # noqa: BLE001 - a missing record only means a fallback
            pass
    return out


def install() -> None:
    """Puts the recording in place (idempotent). Call it through
    ``internals.guarded("function_apply", install)``: it needs both
    ``function_apply`` and ``materialize_grads``."""
    if not internals.ok("materialize_grads"):
        return
    if isinstance(BackwardCFunction.__dict__.get("materialize_grads"), property):
        return
    BackwardCFunction.materialize_grads = property(_get_materialize, _set_materialize)
    _apply.__doc__ = _apply_descriptor.__doc__
    Function.apply = classmethod(_apply)  # type: ignore[method-assign, assignment]


_BUFFERS = "input_grad_buffers"


def input_grad_buffers_owner() -> tuple[type | None, Any]:
    """The class in ``BackwardCFunction``'s MRO that defines
    ``input_grad_buffers`` and its descriptor (torch 2.15: a Python
    property of ``FunctionCtx``); ``(None, None)`` on a torch without it
    (2.14 and older)."""
    for klass in BackwardCFunction.__mro__:
        if _BUFFERS in klass.__dict__:
            return klass, klass.__dict__[_BUFFERS]
    return None, None


def install_input_grad_buffers() -> None:
    """Makes ``ctx.input_grad_buffers`` answer ``None`` for every forward
    input while cagrad runs that ctx's backward (idempotent; nothing where
    torch lacks the property). Call it through
    ``internals.guarded("input_grad_buffers", ...)``.

    torch 2.15's property (pytorch/pytorch#196491) hands a custom backward
    the engine's ``InputBuffer`` of an input where an earlier producer has
    filled one, so that the backward can add its gradient into it and
    return None. It reads the state of the ``GraphTask`` running the node;
    a backward cagrad runs has no such node in torch's engine, and the
    current ``GraphTask`` may be another backward's (a host ``GraphTask``
    of :mod:`cagrad.run.host`, an eager backward around cagrad's): its
    buffer, or an error, would not be eager's. An entry of ``None`` ("no
    earlier producer") is always allowed by the property's contract and
    makes the backward return that gradient, which cagrad then adds as the
    engine's ``InputBuffer`` does. Backwards torch's engine runs (eager,
    fallbacks) get torch's own answer.
    """
    owner, original = input_grad_buffers_owner()
    if owner is None or hasattr(getattr(original, "fget", None), "_cagrad_original"):
        return

    def fget(self: Any) -> Any:
        if run_context.running_custom(self):
            return (None,) * len(self.needs_input_grad)
        return original.__get__(self, type(self))

    fget._cagrad_original = original  # type: ignore[attr-defined]
    fget.__doc__ = original.__doc__
    setattr(owner, _BUFFERS, property(fget, doc=original.__doc__))


def record_of(node: Any) -> ForwardRecord | None:
    """The forward record of a custom Function node, or None if unknown."""
    record = node.__dict__.get(_RECORD)
    if record is None:
        return None
    # consistent with what the node itself shows
    if sum(record.is_variable_input) != len(node.next_functions):
        return None
    if len(record.outputs) != len(node._input_metadata):
        return None
    return record


def apply(
    node: Any,
    record: ForwardRecord,
    edges: Sequence[Any],
    grads: Sequence[Any],
    backward: Callable[[list], Any] | None = None,
    metadata: Callable[[Any, int], tuple] = real_metadata,
    output_shape: Callable[[int], Sequence[Any]] | None = None,
) -> list:
    """Runs the node's backward as ``PyNode::apply`` + ``validate_outputs`` do.

    Args:
        node: the ``BackwardCFunction`` (the ctx).
        record: its :func:`record_of`.
        edges: its ``next_functions``.
        grads: one incoming gradient (or None) per forward output.
        backward: runs the backward on the materialized gradients (default:
            the node's own ``apply``/``apply_boxed``); a trace passes one that
            inlines the backward's graph.
        metadata: target input metadata for ``validate_outputs``.
        output_shape: the shape of forward output ``i`` for materialized
            zeros (default: the recorded one); a trace with dynamic sizes
            passes symbolic ones.

    Returns:
        one gradient (or None) per edge.

    Raises:
        RuntimeError: eager's messages for a wrong number of gradients or a
            gradient for a non-tensor input; whatever the backward raises.
    """
    name = type(node).__name__
    materialize = node.__dict__.get(_MATERIALIZE, True)
    args = []
    for i, (g, info) in enumerate(zip(grads, record.outputs)):
        if g is None and materialize and info is not None:
            if info.differentiable or node._materialize_non_diff_grads:
                shape = info.shape if output_shape is None else output_shape(i)
                g = torch.zeros(shape, dtype=info.dtype, device=info.device)
        args.append(g)
    with run_context.grad_mode():
        if backward is not None:
            r = backward(args)
        elif getattr(node._forward_cls, "boxed_grads_call", False):
            # PyNode::apply hands such backwards (AOTAutograd's compiled
            # ones) the gradients as one mutable list
            with run_context.custom_backward(node):
                r = node.apply_boxed(list(args))
        else:
            with run_context.custom_backward(node):
                r = node.apply(*args)
    r = r if isinstance(r, tuple) else (r,)
    n_inputs = len(record.is_variable_input)
    if len(r) > n_inputs and all(x is None for x in r[n_inputs:]):
        r = r[:n_inputs]
    if len(r) != n_inputs:
        raise RuntimeError(
            f"function {name} returned an incorrect number of gradients "
            f"(expected {n_inputs}, got {len(r)})"
        )
    outs = []
    for i, (g, is_var) in enumerate(zip(r, record.is_variable_input)):
        if not is_var:
            if g is not None:
                raise RuntimeError(
                    f"function {name} returned a gradient different than None at position "
                    f"{i + 1}, but the corresponding forward input was not a Variable"
                )
            continue
        if g is not None and not isinstance(g, torch.Tensor):
            raise RuntimeError(f"expected Variable or None (got {type(g).__name__})")
        outs.append(g)
    return validate_outputs(name, edges, outs, metadata)


def aot_inline_info(node: Any) -> tuple[Any, Any, Any] | None:
    """``(bw_module, prologue, epilogue)`` of an AOTAutograd backward node
    whose graph can be inlined, or None (then it runs as it is).

    Inlining needs what torch's compiled autograd uses too (torch 2.13:
    ``CompiledFunction._bw_prologue_fn``/``_bw_epilogue_fn`` and the lazily
    compiled ``bw_module``), no tensor subclasses and no opaque objects. A
    backward state (see :func:`backward_state_of`) is supported when every
    use of it in the graph is a tensor hook call (see
    :func:`backward_state_hooks`).
    """
    cls = node._forward_cls
    if not hasattr(cls, "_aot_id"):
        return None
    prologue = getattr(cls, "_bw_prologue_fn", None)
    epilogue = getattr(cls, "_bw_epilogue_fn", None)
    if prologue is None and epilogue is None:
        prologue, epilogue = _functional_prologue_epilogue(cls)
    info = getattr(cls, "_lazy_backward_info", None)
    bw_module = getattr(info, "bw_module", None)
    if prologue is None or epilogue is None or bw_module is None:
        return None
    if getattr(cls, "maybe_subclass_metadata", None) is not None:
        return None
    state_hooks = backward_state_hooks(bw_module)
    if (backward_state_of(node) is None) != (state_hooks is None):
        return None
    if state_hooks is not None and state_hooks[1] is None:
        return None  # the state is used by something other than tensor hooks
    if getattr(node, "opaque_objects", None):
        return None
    return bw_module, prologue, epilogue


def _functional_prologue_epilogue(cls: Any) -> tuple[Any, Any]:
    """torch 2.11/2.12 have no generated ``_bw_prologue_fn``/``_bw_epilogue_fn``:
    their compiled autograd calls ``runtime_wrappers._backward_prologue_functional``
    and ``_backward_epilogue_functional`` with the class's metadata instead.
    Returns them with the generated functions' signatures, or ``(None, None)``."""
    rw = sys.modules.get("torch._functorch._aot_autograd.runtime_wrappers")
    prologue_fn = getattr(rw, "_backward_prologue_functional", None)
    epilogue_fn = getattr(rw, "_backward_epilogue_functional", None)
    metadata = getattr(cls, "metadata", None)
    if prologue_fn is None or epilogue_fn is None or metadata is None:
        return None, None
    subclass = getattr(cls, "maybe_subclass_metadata", None)

    def prologue(
        saved: Sequence[Any], symints: Sequence[Any], opaque: Sequence[Any], args: Sequence[Any]
    ) -> Any:
        return prologue_fn(saved, symints, opaque, metadata, subclass, *args)

    def epilogue(out: Any) -> Any:
        return epilogue_fn(metadata, subclass, out)

    return prologue, epilogue


# -- BackwardState ----------------------------------------------------------
#
# A tensor hook registered inside a torch.compile'd forward while compiled
# autograd is on (Dynamo reads ``compiled_autograd.compiled_autograd_enabled``)
# is not registered on the tensor: Dynamo stores the hook as an attribute of a
# ``BackwardState`` that the forward receives as an input, AOTAutograd keeps it
# on the ctx (``ctx._compiled_autograd_backward_state``), and the backward
# graph gets it as its last placeholder, used only as the ``bw_state`` of
# ``trace_wrapped`` calls whose ``fn`` is
# ``torch._dynamo.external_utils.call_hook_from_backward_state`` (the hook is
# ``getattr(bw_state, hook_name)``). AOTAutograd's own backward refuses to
# run such a graph ("BackwardState requires CompiledAutograd"); torch's
# compiled autograd passes the state as the graph's last argument after the
# prologue's ``[*symints, *saved, *grads]`` (``proxy_call_aot_backward``).

_TRACE_WRAPPED_MODULE = "torch._dynamo._trace_wrapped_higher_order_op"
_HOOK_KWARGS = frozenset(("fn", "bw_state", "hook_name"))
# bw_module -> what backward_state_hooks found (names only: no reference back
# to the module, which is the weak key)
_state_hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_UNSET = object()


def backward_state_of(node: Any) -> Any:
    """The ``BackwardState`` of an AOTAutograd backward node, or None."""
    return getattr(node, "_compiled_autograd_backward_state", None)


def _trace_wrapped_kwargs(target: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The keyword arguments a call in an AOT backward graph hands to Dynamo's
    ``trace_wrapped`` op (its ``fn`` included), or None if it is no such call.

    In the graph the call's target is the ``self_invoke`` closure that
    ``trace_wrapped``'s proxy-mode rule records (keeping ``fn`` and the other
    static kwargs in its closure, ``bw_state`` as a node kwarg); a graph may
    also name the op or ``trace_wrapped`` itself.
    """
    module = sys.modules.get(_TRACE_WRAPPED_MODULE)
    if module is None:
        return None
    if target is getattr(module, "_trace_wrapped_op", None) or target is getattr(
        module, "trace_wrapped", None
    ):
        return dict(kwargs)
    if getattr(target, "__module__", None) != _TRACE_WRAPPED_MODULE:
        return None
    if getattr(target, "__name__", None) != "self_invoke":
        return None
    code = getattr(target, "__code__", None)
    closure = getattr(target, "__closure__", None) or ()
    if code is None:
        return None
    cell = dict(zip(code.co_freevars, closure)).get("kwargs")
    if cell is None:
        return None
    try:
        static = cell.cell_contents
    except ValueError:
        return None
    if not isinstance(static, dict):
        return None
    return {**kwargs, **static}


def _call_hook_fn() -> Any:
    external_utils = sys.modules.get("torch._dynamo.external_utils")
    return getattr(external_utils, "call_hook_from_backward_state", None)


def backward_state_hooks(bw_module: Any) -> tuple[str, dict[str, str] | None] | None:
    """Where an AOT backward graph uses a ``BackwardState`` input.

    Returns:
        None if the graph takes no ``BackwardState``; else the name of its
        placeholder and ``{graph node name: hook name}`` of its uses, or
        ``(name, None)`` when it cannot be inlined: the state is not the
        graph's last placeholder (torch's calling convention), or some use
        is not a ``trace_wrapped`` call of ``call_hook_from_backward_state``
        on one tensor (module hooks, ...).
    """
    try:
        found = _state_hooks.get(bw_module, _UNSET)
    except TypeError:  # not weakly referenceable
        return _find_state_hooks(bw_module)
    if found is _UNSET:
        found = _find_state_hooks(bw_module)
        _state_hooks[bw_module] = found
    return found


def _find_state_hooks(bw_module: Any) -> tuple[str, dict[str, str] | None] | None:
    graph = getattr(bw_module, "graph", None)
    if graph is None:
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    state_type = getattr(
        sys.modules.get("torch.fx.experimental._backward_state"), "BackwardState", None
    )
    if state_type is None:
        return None
    is_state = [isinstance(n.meta.get("val"), state_type) for n in placeholders]
    if not any(is_state):
        return None
    ph = placeholders[-1]
    if sum(is_state) != 1 or not is_state[-1]:
        return ph.name, None
    call_hook = _call_hook_fn()
    hooks: dict[str, str] = {}
    for user in ph.users:
        kwargs = (
            _trace_wrapped_kwargs(user.target, dict(user.kwargs))
            if user.op == "call_function"
            else None
        )
        if (
            kwargs is None
            or call_hook is None
            or set(kwargs) != _HOOK_KWARGS
            or kwargs["fn"] is not call_hook
            or kwargs["bw_state"] is not ph
            or not isinstance(kwargs["hook_name"], str)
            or len(user.args) != 1
            or not isinstance(user.args[0], torch.fx.Node)
        ):
            return ph.name, None
        hooks[user.name] = kwargs["hook_name"]
    return ph.name, hooks
