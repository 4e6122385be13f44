"""Backwards that run under a functorch transform, which cagrad leaves to eager.

``torch.func.grad``, ``vjp``, ``jacrev``, ``hessian`` and ``vmap`` of those
call ``torch.autograd.grad`` on tensors wrapped once per transform level
(a ``GradTrackingTensor`` per ``grad`` level, a ``BatchedTensor`` per
``vmap`` level) while functorch's interpreter stack is active; the
functions they return (``vjp``'s ``vjp_fn``) may call it later on wrappers
whose level has exited ("dead" wrappers). ``torch.autograd.functional``
with ``vectorize=True`` and ``autograd.grad(..., is_grads_batched=True)``
pass gradients batched by the legacy ``torch._vmap_internals._vmap``. Such
a backward cannot be traced on fake tensors as a plain one is, and torch's
own compiled autograd does not compile it either: functorch's
``_autograd_grad`` (``torch/_functorch/eager_transforms.py``) enters
``torch._dynamo.compiled_autograd._disable()`` around it.

:func:`check_active` finds an active transform when the backward enters
cagrad; :func:`check_call` finds wrapped roots, root gradients and inputs
before anything is collected (a backward whose roots are not
:func:`plain` never takes a hit guard: it is collected in full), and
:func:`check_tensor` finds a wrapped tensor that reaches the collection
anyway (a saved tensor or a leaf). Nothing is traced before them. Both raise
:class:`~cagrad.errors.Unsupported` with reason :data:`REASON`, so the
whole backward runs in eager autograd, counted and logged as every
fallback is. The transform's result at the outer level is a plain
autograd graph, which cagrad compiles as any other (docs/torch-func.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import Unsupported

REASON = "functorch_transform"  #: the fallback reason slug

_F = torch._C._functorch
# one C call each (about 50 ns for the stack, 160 ns per tensor on this
# project's CPU machine)
_transforms_active = torch._C._are_functorch_transforms_active
_is_wrapped = _F.is_functorch_wrapped_tensor
_is_legacy_batched = _F.is_legacy_batchedtensor


def describe(t: torch.Tensor) -> str | None:
    """What kind of functorch tensor ``t`` is (``"GradTrackingTensor
    (dead: its transform has returned)"``, ``"BatchedTensor (level 2)"``,
    ``"legacy BatchedTensor ..."``), or None for a tensor no transform
    wrapped."""
    if _is_legacy_batched(t):
        return "legacy BatchedTensor (torch._vmap_internals._vmap)"
    if not _is_wrapped(t):
        return None
    if _F.is_gradtrackingtensor(t):
        kind = "GradTrackingTensor"
    elif _F.is_batchedtensor(t):
        kind = "BatchedTensor"
    elif _F.is_functionaltensor(t):
        kind = "FunctionalTensorWrapper"
    else:
        kind = "functorch-wrapped tensor"
    if _F.is_dead_tensor_wrapper(t):
        return f"{kind} (dead: its transform has returned)"
    return f"{kind} (level {_F.maybe_get_level(t)})"


def _active_detail() -> str:
    stack = _F.get_interpreter_stack() or []
    names = [str(i.key()).rsplit(".", 1)[-1] for i in stack]
    return "backward inside a functorch transform (interpreter stack: " + ", ".join(names) + ")"


def check_active() -> None:
    """Raises Unsupported(:data:`REASON`) while a functorch interpreter is
    active in this thread (a ``torch.func`` transform, ``torch.vmap``);
    one C call, about 50 ns."""
    if _transforms_active():
        raise Unsupported(REASON, _active_detail())


def plain(tensors: Sequence[Any]) -> bool:
    """Whether no item of ``tensors`` is a functorch-wrapped tensor (live or
    dead) or a legacy batched tensor; about 250 ns a tensor. Items that are
    not tensors count as plain."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and (_is_wrapped(t) or _is_legacy_batched(t)):
            return False
    return True


def check_call(tensors: Sequence[Any], grad_tensors: Sequence[Any], inputs: Sequence[Any]) -> None:
    """Raises Unsupported(:data:`REASON`) for a backward under a transform.

    Args:
        tensors: the roots, as ``ImperativeEngine.run_backward`` gets them.
        grad_tensors: their gradients (None items are skipped: eager
            raises about them later).
        inputs: ``autograd.grad``'s inputs (``GradientEdge`` items are
            skipped).

    Raises:
        Unsupported: a functorch interpreter is active in this thread
            (:func:`check_active`), or a root, root gradient or input is a
            functorch-wrapped tensor, live or dead, or a legacy batched
            tensor; the detail names which.
    """
    check_active()
    for what, group in (("root", tensors), ("root gradient", grad_tensors), ("input", inputs)):
        for i, t in enumerate(group):
            if isinstance(t, torch.Tensor) and (_is_wrapped(t) or _is_legacy_batched(t)):
                raise Unsupported(REASON, f"{what} {i} is a {describe(t)}")


def check_tensor(t: torch.Tensor, what: str) -> None:
    """Raises Unsupported(:data:`REASON`) if ``t`` (named ``what`` in the
    detail: "saved tensor self of MulBackward0", ...) is a functorch-wrapped
    or legacy batched tensor."""
    if _is_wrapped(t) or _is_legacy_batched(t):
        raise Unsupported(REASON, f"{what} is a {describe(t)}")
