"""Stacks with activation checkpointing (``torch.utils.checkpoint``):
reentrant, non-reentrant, and selective (SAC)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from harness.stacks.models import IN, OUT, block_net, mse
from harness.stacks.registry import register
from harness.stacks.stack import StackContext


def _train(ctx: StackContext, wrap, seed: int) -> None:
    """3 SGD steps of a 2-block :class:`~harness.stacks.models.BlockNet`
    whose blocks run through ``wrap(block, h)``."""
    model = block_net(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = ctx.generator(seed)
    for step in range(3):
        x, y = ctx.randn(6, IN, generator=g), ctx.randn(6, OUT, generator=g)
        opt.zero_grad()
        loss = mse(model(x, wrap), y)
        with ctx.engine():
            loss.backward()
        ctx.record_grads(f"step{step}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)


@register("checkpoint_nonreentrant", "2 residual blocks under checkpoint(use_reentrant=False), SGD; 3 steps")
def checkpoint_nonreentrant(ctx: StackContext) -> None:
    _train(ctx, lambda block, h: checkpoint(block, h, use_reentrant=False), seed=6)


@register(
    "checkpoint_reentrant",
    "2 residual blocks under checkpoint(use_reentrant=True) (a backward inside the backward), SGD; 3 steps",
)
def checkpoint_reentrant(ctx: StackContext) -> None:
    _train(ctx, lambda block, h: checkpoint(block, h, use_reentrant=True), seed=7)


def recompute_addmm(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The SAC policy: ``aten.addmm`` MUST_RECOMPUTE, every other op MUST_SAVE."""
    if op == torch.ops.aten.addmm.default:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


@register(
    "selective_checkpoint",
    "SAC: non-reentrant checkpoint with create_selective_checkpoint_contexts, aten.addmm MUST_RECOMPUTE; 3 steps",
)
def selective_checkpoint(ctx: StackContext) -> None:
    context_fn = functools.partial(create_selective_checkpoint_contexts, recompute_addmm)
    _train(ctx, lambda block, h: checkpoint(block, h, use_reentrant=False, context_fn=context_fn), seed=8)
