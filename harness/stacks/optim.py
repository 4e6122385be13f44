"""Stacks of plain training loops: SGD steps, gradient accumulation with
AdamW, and mixed precision with a gradient scaler (CUDA)."""

from __future__ import annotations

import torch

from harness.stacks.models import IN, OUT, mlp, mse
from harness.stacks.registry import register
from harness.stacks.stack import StackContext

BATCH = 6


@register("mlp_sgd", "3-layer MLP, 3 steps of SGD (momentum 0.9) between backwards")
def mlp_sgd(ctx: StackContext) -> None:
    model = mlp(ctx.device, depth=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = ctx.generator(1)
    for step in range(3):
        x, y = ctx.randn(BATCH, IN, generator=g), ctx.randn(BATCH, OUT, generator=g)
        opt.zero_grad()
        loss = mse(model(x), y)
        with ctx.engine():
            loss.backward()
        ctx.record(f"step{step}.loss", loss.detach())
        ctx.record_grads(f"step{step}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)


@register("grad_accumulation", "4 micro-batches accumulated into .grad, then an AdamW step; 2 steps")
def grad_accumulation(ctx: StackContext) -> None:
    model = mlp(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    g = ctx.generator(2)
    for step in range(2):
        opt.zero_grad()
        for micro in range(4):
            x, y = ctx.randn(BATCH, IN, generator=g), ctx.randn(BATCH, OUT, generator=g)
            loss = mse(model(x), y) / 4
            with ctx.engine():
                loss.backward()
            ctx.record_grads(f"step{step}.micro{micro}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)


@register(
    "amp_grad_scaler",
    "torch.autocast(float16) forward, torch.amp.GradScaler scaled backward, unscale, SGD step; 3 steps",
    requires_cuda=True,
    skip_reason="needs CUDA (float16 autocast with torch.amp.GradScaler)",
    compute_dtype=torch.float16,
)
def amp_grad_scaler(ctx: StackContext) -> None:
    model = mlp(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(ctx.device.type, init_scale=2.0**10, growth_interval=1)
    g = ctx.generator(3)
    for step in range(3):
        x, y = ctx.randn(BATCH, IN, generator=g), ctx.randn(BATCH, OUT, generator=g)
        opt.zero_grad()
        with torch.autocast(ctx.device.type, dtype=torch.float16):
            loss = mse(model(x).float(), y)
        with ctx.engine():
            scaler.scale(loss).backward()
        ctx.record_grads(f"step{step}.scaled", model)
        scaler.unscale_(opt)
        ctx.record_grads(f"step{step}.unscaled", model)
        scaler.step(opt)
        scaler.update()
        ctx.record(f"step{step}.scale", scaler.get_scale())
        ctx.record_params(f"step{step}", model)
