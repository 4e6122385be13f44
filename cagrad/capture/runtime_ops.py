"""Opaque operations: what the engine does between nodes, on real tensors.

A captured graph records these as calls, not as traced ops; they run in
Python with the current backward's objects (hook dicts, nodes, leaves, passed
in the graph's ``hooks`` list), so a cache hit runs the hooks registered now.
Each follows the eager engine's code, named per function below, including its
checks and their messages (torch/csrc/autograd/python_hook.cpp, engine.cpp,
functions/accumulate_grad.h).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import native
from ..autograd import custom_function, run_context
from ..autograd.accumulate import accumulate_grad
from ..autograd.validate import validate_outputs

Grad = torch.Tensor | None


def hook_name(hook: Any) -> str:
    """The name eager uses for a hook in its error messages."""
    name = getattr(hook, "__name__", None)
    return name if isinstance(name, str) else "<unknown>"


def _check_single(original: Grad, result: Any, hook: Any) -> None:
    # check_single_result + check_variable_result in python_hook.cpp
    if result is None:
        return
    if original is None:
        raise RuntimeError("can't replace a None gradient with a non-None value")
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"expected Variable, but hook returned '{type(result).__name__}'")
    if result.dtype != original.dtype or result.device.type != original.device.type or (
        result.layout != original.layout
    ):
        raise RuntimeError(
            f"hook '{hook_name(hook)}' has changed the type of value "
            f"(was {original.type()} got {result.type()})"
        )
    if result.shape != original.shape:
        raise RuntimeError(f"hook '{hook_name(hook)}' has changed the size of value")


def _check_tuple(original: tuple, result: Any, hook: Any) -> None:
    # check_result in python_hook.cpp
    if not isinstance(result, tuple):
        raise TypeError(f"expected tuple, but hook returned '{type(result).__name__}'")
    if len(result) != len(original):
        raise RuntimeError(
            f"hook '{hook_name(hook)}' has returned an incorrect number of values "
            f"(got {len(result)}, but expected {len(original)})"
        )
    for o, r in zip(original, result):
        _check_single(o, r, hook)


def _call_hooks(hooks: Mapping[Any, Callable[..., Any]], args: list, check: Callable) -> bool:
    # _call_hooks in python_hook.cpp: the hooks present when the call starts
    # run in order; each non-None result (other than the argument itself)
    # replaces the first argument for the hooks after it
    modified = False
    for hook in list(hooks.values()):
        res = hook(*args)
        if res is None or res is args[0]:
            continue
        check(args[0], res, hook)
        args[0] = res
        modified = True
    return modified


def tensor_pre_hooks(hooks: Mapping[Any, Callable], grad: Grad) -> Grad:
    """``PyFunctionTensorPreHook``: a tensor's hooks on its incoming gradient.

    Raises:
        RuntimeError / TypeError: eager's messages for a hook that changes the
            gradient's size, type or device, or replaces a None gradient.
    """
    args = [grad]
    _call_hooks(hooks, args, _check_single)
    return args[0]


def _check_traceable(original: Grad, result: Any, hook: Any) -> None:
    _check_single(original, result, hook)
    if result is not None and result.device != original.device:
        # eager compares device types only; a trace keeps the exact device
        raise RuntimeError(f"hook '{hook_name(hook)}' has moved the gradient to {result.device}")


def traced_tensor_pre_hooks(hooks: Mapping[Any, Callable], grad: Grad) -> Grad:
    """:func:`tensor_pre_hooks` as a trace runs them (on fakes, recording
    their ops, :mod:`cagrad.hooks.hook_tracing`): the same calls and checks,
    and a result on another device index rejected too (the trace then runs
    the hooks opaque, where eager's own rule applies)."""
    args = [grad]
    _call_hooks(hooks, args, _check_traceable)
    return args[0]


def _check_tuple_traceable(original: tuple, result: Any, hook: Any) -> None:
    _check_tuple(original, result, hook)
    for o, r in zip(original, result):
        if r is not None and o is not None and r.device != o.device:
            raise RuntimeError(f"hook '{hook_name(hook)}' has moved a gradient to {r.device}")


def traced_node_pre_hooks(hooks: Mapping[Any, Callable], grads: Sequence[Grad]) -> list[Grad]:
    """:func:`node_pre_hooks` as a trace runs them (see
    :func:`traced_tensor_pre_hooks`)."""
    args = [tuple(grads)]
    _call_hooks(hooks, args, _check_tuple_traceable)
    return list(args[0])


def traced_node_post_hooks(
    hooks: Mapping[Any, Callable], grad_inputs: Sequence[Grad], grad_outputs: Sequence[Grad]
) -> list[Grad]:
    """:func:`node_post_hooks` as a trace runs them (see
    :func:`traced_tensor_pre_hooks`)."""
    args = [tuple(grad_inputs), tuple(grad_outputs)]
    _call_hooks(hooks, args, _check_tuple_traceable)
    return list(args[0])


def retain_grad(tensor_ref: weakref.ref, grad: Grad) -> None:
    """The ``retains_grad`` hook of a non-leaf tensor (``Tensor.retain_grad``).

    The first gradient is stored as a contiguous copy, later ones are added
    out of place; nothing happens once the tensor is gone.
    """
    t = tensor_ref()
    if t is None or grad is None:
        return
    with run_context.grad_mode():
        if t.grad is None:
            t.grad = grad.clone() if grad.is_sparse else grad.clone(memory_format=torch.contiguous_format)
        else:
            t.grad = t.grad + grad


def node_pre_hooks(hooks: Mapping[Any, Callable], grads: Sequence[Grad]) -> list[Grad]:
    """``PyFunctionPreHook``: ``hook(grad_outputs) -> new grad_outputs | None``."""
    args = [tuple(grads)]
    _call_hooks(hooks, args, _check_tuple)
    return list(args[0])


def node_post_hooks(
    hooks: Mapping[Any, Callable], grad_inputs: Sequence[Grad], grad_outputs: Sequence[Grad]
) -> list[Grad]:
    """``PyFunctionPostHook``: ``hook(grad_inputs, grad_outputs) -> new grad_inputs | None``."""
    args = [tuple(grad_inputs), tuple(grad_outputs)]
    _call_hooks(hooks, args, _check_tuple)
    return list(args[0])


def post_accumulate_grad_hooks(hooks: Mapping[Any, Callable], variable: torch.Tensor) -> None:
    """``PyFunctionTensorPostAccGradHooks``: ``hook(param)`` after ``.grad`` is set.

    Raises:
        RuntimeError: if a hook returns something other than None.
    """
    for hook in list(hooks.values()):
        if hook(variable) is not None:
            raise RuntimeError("Tensor post accumulate grad hooks should return None.")


def accumulate(variable: torch.Tensor, grad: Grad, post_hooks: Mapping | None, stealable: bool = False) -> None:
    """``AccumulateGrad::apply``: into ``.grad``, then post-accumulate hooks.

    As in eager, the hooks run even when nothing is accumulated (no gradient
    arrived, or the leaf no longer requires grad); only the error for a leaf
    moved into the graph interior, raised for a defined gradient, stops them.
    The gradient is copied into a fresh ``.grad`` unless ``stealable``
    (:func:`accumulate_handed` proved that nothing else holds it).
    """
    if grad is not None:
        if variable.grad_fn is not None:
            raise RuntimeError("leaf variable has been moved into the graph interior")
        if variable.requires_grad:
            accumulate_grad(variable, grad, stealable=stealable)
    if post_hooks:
        post_accumulate_grad_hooks(post_hooks, variable)


def accumulate_handed(args: list, overlapping: set[int] | None = None) -> None:
    """:func:`accumulate` on ``args`` (``[variable, grad, post_hooks]``),
    which the caller hands over with the last reference it held to the
    gradient: the list is emptied. As eager's AccumulateGrad adopts a
    gradient that no one else holds (its ``use_count``), the gradient then
    becomes ``.grad`` without a copy where the C++ extension finds that
    nothing else holds it (:func:`cagrad.native.sole_fn`: a hook that kept
    it or a view of it make it a copy) and its ``id`` is not in
    ``overlapping`` (a compiled segment's output over memory another output
    of it has, which eager would have made apart)."""
    variable, post_hooks = args[0], args[2]
    box = [args[1]]
    args.clear()
    sole = native.sole_fn()
    stealable = sole is not None and sole(box) and (overlapping is None or id(box[0]) not in overlapping)
    accumulate(variable, box.pop(), post_hooks, stealable)


def cpp_post_hooks(hooks: Sequence[Callable[[], Any]]) -> None:
    """Post-hooks added from C++ to a leaf's AccumulateGrad (DDP's
    ``Reducer::autograd_hook``, see :mod:`cagrad.hooks.cpp_hooks`), in order. They
    read the leaf's ``.grad`` and return their inputs unchanged."""
    for hook in hooks:
        hook()


def call_node(node: Any, grads: Sequence[Grad]) -> list[Grad]:
    """Runs a C++ node as the engine does: its ``apply``, then ``validate_outputs``."""
    with run_context.grad_mode():
        out = node(*grads)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return validate_outputs(type(node).__name__, node.next_functions, outs)


def call_custom_function(node: Any, grads: Sequence[Grad]) -> list[Grad]:
    """Runs a custom Function's backward as ``PyNode::apply`` does.

    Raises:
        RuntimeError: if the forward was not recorded (applied before
            ``import cagrad``), and eager's errors (see
            :func:`cagrad.autograd.custom_function.apply`).
    """
    record = custom_function.record_of(node)
    if record is None:
        raise RuntimeError(f"cagrad has no forward record for {type(node).__name__}")
    return custom_function.apply(node, record, node.next_functions, grads)


def backward_state_hook(bw_state: Any, name: str, grad: torch.Tensor) -> torch.Tensor:
    """A tensor hook registered inside a torch.compile'd forward, as the
    inlined AOT backward graph calls it.

    Under compiled autograd Dynamo does not register such a hook on the
    tensor: it keeps it as attribute ``name`` of the forward's
    ``BackwardState`` and the backward graph calls it through
    ``call_hook_from_backward_state`` (see
    :func:`cagrad.autograd.custom_function.backward_state_hooks`). It runs here on
    the real gradient, with this backward's ``BackwardState``, and its result
    is checked like a tensor hook's (``check_single_result``); the graph
    continues with a gradient of the same shape, dtype and device.

    Returns:
        the hook's result, or ``grad`` if it returned None.

    Raises:
        RuntimeError / TypeError: eager's messages for a hook that changes the
            gradient's size or type; a change of device index is refused too
            (the compiled graph goes on with the original device).
    """
    hook = getattr(bw_state, name)
    result = hook(grad)
    if result is None or result is grad:
        return grad
    _check_single(grad, result, hook)
    if result.device != grad.device:
        raise RuntimeError(
            f"hook '{hook_name(hook)}' has changed the device of value "
            f"(was {grad.device} got {result.device})"
        )
    return result
