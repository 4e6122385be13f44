"""FSDP2 stacks on 2 ranks: ``fully_shard`` on each Linear and on the root,
with and without ``reshard_after_forward``, and with gradient accumulation.
Grads and params are recorded as each rank's local shard."""

from __future__ import annotations

import torch
from torch import nn

from harness.stacks.models import IN, OUT, mlp, mse
from harness.stacks.registry import register
from harness.stacks.stack import StackContext


def _shard(ctx: StackContext, reshard_after_forward: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = mlp(ctx.device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _train(ctx: StackContext, model: nn.Module, steps: int = 3, accumulate: int = 1) -> None:
    """``steps`` SGD steps of ``accumulate`` backwards each; gradient sync
    (reduce-scatter) only on the last backward of a step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = ctx.generator(30)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            if accumulate > 1:
                model.set_requires_gradient_sync(micro == accumulate - 1)
            x, y = ctx.randn(5, IN, generator=g), ctx.randn(5, OUT, generator=g)
            loss = mse(model(x), y) / accumulate
            with ctx.engine():
                loss.backward()
            ctx.record_grads(f"step{step}.micro{micro}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)


@register(
    "fsdp2", "FSDP2 fully_shard per Linear and root, reshard_after_forward=True, 3 SGD steps on 2 ranks", world_size=2
)
def fsdp2(ctx: StackContext) -> None:
    _train(ctx, _shard(ctx, reshard_after_forward=True))


@register("fsdp2_no_reshard", "FSDP2 as fsdp2 with reshard_after_forward=False", world_size=2)
def fsdp2_no_reshard(ctx: StackContext) -> None:
    _train(ctx, _shard(ctx, reshard_after_forward=False))


@register(
    "fsdp2_grad_accumulation",
    "FSDP2: 2 backwards without gradient sync, then a synced one and an SGD step; 2 steps on 2 ranks",
    world_size=2,
)
def fsdp2_grad_accumulation(ctx: StackContext) -> None:
    _train(ctx, _shard(ctx, reshard_after_forward=True), steps=2, accumulate=3)
