"""DistributedDataParallel stacks on 2 ranks (each rank its own data):
default, ``static_graph``, ``find_unused_parameters``, ``no_sync()``,
python-reducer mode."""

from __future__ import annotations

import contextlib

import torch
import torch._dynamo
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harness.stacks.models import IN, OUT, mlp, mse
from harness.stacks.registry import register
from harness.stacks.stack import StackContext


class WithUnused(nn.Module):
    """An MLP beside a ``Linear(4, 4)`` that forward never calls."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.net = mlp(device)
        self.unused = nn.Linear(OUT, OUT).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _wrap(ctx: StackContext, module: nn.Module, **kwargs) -> DistributedDataParallel:
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, **kwargs)


def _train(ctx: StackContext, ddp: DistributedDataParallel, steps: int = 3, accumulate: int = 1) -> None:
    """``steps`` SGD steps; each accumulates ``accumulate`` backwards, all
    but the last under ``ddp.no_sync()``. Records the rank's grads after
    every backward and its params after every step."""
    model = ddp.module
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = ctx.generator(20)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = ctx.randn(5, IN, generator=g), ctx.randn(5, OUT, generator=g)
            sync = micro == accumulate - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = mse(ddp(x), y) / accumulate
                with ctx.engine():
                    loss.backward()
            ctx.record_grads(f"step{step}.micro{micro}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)


@register("ddp_default", "DDP around an MLP, 3 SGD steps on 2 ranks", world_size=2)
def ddp_default(ctx: StackContext) -> None:
    _train(ctx, _wrap(ctx, mlp(ctx.device)))


@register("ddp_static_graph", "DDP(static_graph=True), 3 SGD steps on 2 ranks", world_size=2)
def ddp_static_graph(ctx: StackContext) -> None:
    _train(ctx, _wrap(ctx, mlp(ctx.device), static_graph=True))


@register(
    "ddp_find_unused",
    "DDP(find_unused_parameters=True) with a parameter forward never uses, 3 SGD steps on 2 ranks",
    world_size=2,
)
def ddp_find_unused(ctx: StackContext) -> None:
    _train(ctx, _wrap(ctx, WithUnused(ctx.device), find_unused_parameters=True))


@register(
    "ddp_no_sync",
    "DDP: 2 backwards accumulated under no_sync(), then a synced one and an SGD step; 2 steps on 2 ranks",
    world_size=2,
)
def ddp_no_sync(ctx: StackContext) -> None:
    _train(ctx, _wrap(ctx, mlp(ctx.device)), steps=2, accumulate=3)


@register(
    "ddp_python_reducer",
    'DDP built with torch._dynamo.config.optimize_ddp = "python_reducer" (reduced in Python '
    "post-accumulate-grad hooks), 3 SGD steps on 2 ranks",
    world_size=2,
)
def ddp_python_reducer(ctx: StackContext) -> None:
    before = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"  # read by DDP's constructor
    try:
        ddp = _wrap(ctx, mlp(ctx.device))
    finally:
        torch._dynamo.config.optimize_ddp = before
    _train(ctx, ddp)
