"""Custom ``torch.autograd.Function`` s the fuzzer uses as ops.

Each class exercises one part of how the engine runs a Python backward
(``PyNode::apply``); :mod:`fuzz.ops` registers one op per class (category
``custom``). They are defined at module level, each standing alone (they
use only ``torch`` and ``once_differentiable``), so that
:mod:`fuzz.render` can copy their source into a reproducer and pickling or
importing ``fuzz.functions`` works too.

=====================  ====================================================
``SinScale``           ``save_for_backward`` of an input plus a float ctx
                       attribute (a non-tensor argument)
``MulAdd``             two inputs, backward looks at ``ctx.needs_input_grad``
``MaxWithIndex``       a differentiable output plus an integer one marked
                       non-differentiable
``SinCosPair``         two outputs, ``set_materialize_grads(False)``: the
                       backward gets ``None`` for an output that got no grad
``CubeOnce``           backward decorated with ``once_differentiable``
``DetachSecond``       returns ``None`` for its second input (which may
                       require grad; the forward only uses its sign)
``ExpSavedOutput``     saves its *output* for the backward
``RecomputeInBackward`` its backward runs ``torch.autograd.grad`` on a
                       small graph it builds there (a backward started
                       inside another)
=====================  ====================================================

Every backward is exact (``tests/fuzz`` runs ``gradcheck`` on each in
float64).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class SinScale(torch.autograd.Function):
    """``sin(x) * scale``; ``scale`` is a Python float kept on the ctx."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.sin(x) * scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.cos(x) * ctx.scale, None


class MulAdd(torch.autograd.Function):
    """``a * b + a`` for two tensors of one shape; only the gradients that
    ``ctx.needs_input_grad`` asks for are computed (None for the others)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b + a

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = grad * (b + 1) if ctx.needs_input_grad[0] else None
        grad_b = grad * a if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class MaxWithIndex(torch.autograd.Function):
    """``x.max(dim)`` as ``(values, indices)``; the int64 indices are marked
    non-differentiable (the backward still receives a gradient slot for
    them: zeros or None)."""

    @staticmethod
    def forward(ctx, x, dim):
        values, indices = torch.max(x, dim)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.dim = dim
        ctx.shape = x.shape
        return values, indices

    @staticmethod
    def backward(ctx, grad_values, grad_indices):
        (indices,) = ctx.saved_tensors
        grad = grad_values.new_zeros(ctx.shape)
        return grad.scatter(ctx.dim, indices.unsqueeze(ctx.dim), grad_values.unsqueeze(ctx.dim)), None


class SinCosPair(torch.autograd.Function):
    """``(sin(x), 2 * cos(x))`` with ``set_materialize_grads(False)``: a
    gradient that is not computed arrives as None, not as zeros."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return torch.sin(x), 2 * torch.cos(x)

    @staticmethod
    def backward(ctx, grad_sin, grad_cos):
        (x,) = ctx.saved_tensors
        grad = None
        if grad_sin is not None:
            grad = grad_sin * torch.cos(x)
        if grad_cos is not None:
            part = -2 * torch.sin(x) * grad_cos
            grad = part if grad is None else grad + part
        return grad


class CubeOnce(torch.autograd.Function):
    """``x ** 3`` with a ``once_differentiable`` backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class DetachSecond(torch.autograd.Function):
    """``2 * x + sign(y)``: ``y`` only contributes steps (its derivative is
    zero almost everywhere), so the backward returns None for ``y``: it gets
    no gradient through this node even when it requires grad."""

    @staticmethod
    def forward(ctx, x, y):
        return 2 * x + torch.sign(y)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad, None


class ExpSavedOutput(torch.autograd.Function):
    """``exp(clamp(x, -10, 10))`` that saves its output for the backward.

    The clamp runs inside the forward, so the backward is exact only inside
    (-10, 10); the fuzzer's values stay in [-1, 1] there."""

    @staticmethod
    def forward(ctx, x):
        out = torch.exp(x.clamp(-10, 10))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


class RecomputeInBackward(torch.autograd.Function):
    """``x * sin(x)``; the backward recomputes it from a detached copy of
    ``x`` under ``enable_grad`` and takes the gradient with an inner
    ``torch.autograd.grad`` (as activation checkpointing does)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sin(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            a = x.detach().requires_grad_()
            y = a * torch.sin(a)
            (gx,) = torch.autograd.grad(y, a, grad.detach())
        return gx


FUNCTIONS: dict[str, type[torch.autograd.Function]] = {
    cls.__name__: cls
    for cls in (
        SinScale, MulAdd, MaxWithIndex, SinCosPair, CubeOnce, DetachSecond, ExpSavedOutput, RecomputeInBackward
    )
}

__all__ = ["FUNCTIONS", *FUNCTIONS]
