"""Registering an IR program's hooks on its built tensors.

:func:`register_hooks` registers each :class:`~fuzz.ir.Hook` of a program,
in list order, after the forward has run. Every hook function records a
trace event ``(hook.label, value)`` with copies of the gradients it sees
(``None`` stays ``None``), so that later in-place updates by the engine
cannot change what was recorded; the harness compares the trace, order
included, with eager's. :mod:`fuzz.render` writes the same functions out as
plain code; keep the two in step (``tests/fuzz`` checks they agree).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from fuzz.features_graph import inner_grad_hook
from fuzz.ir import Hook


def _copy(g: Any) -> Any:
    return None if g is None else g.detach().clone()


def _copies(gs: Any) -> tuple:
    return tuple(_copy(g) for g in gs)


def queue_callback(callback: Any) -> None:
    """``queue_callback`` on the running backward's engine (eager's or cagrad's)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _pure_hook(action: str, arg: Any) -> Any:
    # reads nothing but its gradient and the number ``arg``: traceable
    if action == "pure_scale":

        def fn(g):
            return None if g is None else g * arg

    else:

        def fn(g):
            return None if g is None else g + arg

    return fn


def tensor_hook(trace: list, hook: Hook) -> Any:
    label, action, arg = hook.label, hook.action, hook.arg
    if action == "inner_grad":
        return inner_grad_hook(trace, hook)
    if action.startswith("pure_"):
        fn = _pure_hook(action, arg)
        fn.__name__ = hook.name
        return fn

    def fn(g):
        seen = _copy(g)
        trace.append((label, seen))
        if action == "callback":
            queue_callback(lambda: trace.append((f"{label} callback", seen)))
            return None
        if action == "warn":
            warnings.warn(f"{label} saw a gradient", UserWarning, stacklevel=1)
            return None
        if g is None or action == "observe":
            return None
        if action == "scale":
            return g * arg
        if action == "shift":
            return g + arg
        return torch.zeros_like(g)  # zero

    fn.__name__ = hook.name
    return fn


def _pure_node_hook(arg: Any, post: bool) -> Any:
    # multiplies each gradient it gets (a pre-hook's grad_outputs, a
    # post-hook's grad_inputs) by the number ``arg`` and reads nothing else;
    # a loop, not a comprehension (nested code), so that cagrad traces it
    # (cagrad.hooks.hook_tracing). fuzz.render writes the same code.
    if post:

        def fn(grad_inputs, grad_outputs):
            out = ()
            for g in grad_inputs:
                out = out + ((None if g is None else g * arg),)
            return out

        return fn

    def fn(grad_outputs):
        out = ()
        for g in grad_outputs:
            out = out + ((None if g is None else g * arg),)
        return out

    return fn


def pre_hook(trace: list, hook: Hook) -> Any:
    label, action, arg = hook.label, hook.action, hook.arg
    if action == "pure_scale":
        fn = _pure_node_hook(arg, post=False)
        fn.__name__ = hook.name
        return fn

    def fn(grad_outputs):
        trace.append((label, _copies(grad_outputs)))
        if action == "observe":
            return None
        return tuple(None if g is None else g * arg for g in grad_outputs)

    fn.__name__ = hook.name
    return fn


def post_hook(trace: list, hook: Hook) -> Any:
    label, action, arg = hook.label, hook.action, hook.arg
    if action == "pure_scale":
        fn = _pure_node_hook(arg, post=True)
        fn.__name__ = hook.name
        return fn

    def fn(grad_inputs, grad_outputs):
        trace.append((label, (_copies(grad_inputs), _copies(grad_outputs))))
        if action == "observe" or not grad_inputs:
            return None
        if action == "scale":
            return tuple(None if g is None else g * arg for g in grad_inputs)
        drop = arg % len(grad_inputs)  # drop: that grad input becomes None
        return tuple(None if i == drop else g for i, g in enumerate(grad_inputs))

    fn.__name__ = hook.name
    return fn


def post_accumulate_hook(trace: list, hook: Hook) -> Any:
    label, action = hook.label, hook.action

    def fn(p):
        trace.append((label, _copy(p.grad)))
        if action == "callback":
            queue_callback(lambda: trace.append((f"{label} callback", _copy(p.grad))))

    fn.__name__ = hook.name
    return fn


def register_hooks(hooks: tuple[Hook, ...], values: Mapping[str, torch.Tensor], trace: list) -> list[torch.Tensor]:
    """Registers ``hooks`` on ``values`` (by reference); returns the tensors
    that ``retain_grad()`` was called on, in hook order."""
    retained: list[torch.Tensor] = []
    for hook in hooks:
        t = values[hook.target]
        if hook.kind == "tensor":
            t.register_hook(tensor_hook(trace, hook))
        elif hook.kind == "retain_grad":
            t.retain_grad()
            retained.append(t)
        elif hook.kind == "pre":
            t.grad_fn.register_prehook(pre_hook(trace, hook))
        elif hook.kind == "post":
            t.grad_fn.register_hook(post_hook(trace, hook))
        elif hook.kind == "post_accumulate":
            t.register_post_accumulate_grad_hook(post_accumulate_hook(trace, hook))
        else:  # pragma: no cover - validate() rejects other kinds
            raise ValueError(f"unknown hook kind {hook.kind!r}")
    return retained
