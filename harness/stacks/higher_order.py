"""A stack with a double backward: a gradient penalty."""

from __future__ import annotations

import torch

from harness.stacks.models import IN, OUT, mlp, mse
from harness.stacks.registry import register
from harness.stacks.stack import StackContext


@register(
    "double_backward",
    "gradient penalty: autograd.grad(create_graph=True), then backward of loss + penalty, SGD; 2 steps",
)
def double_backward(ctx: StackContext) -> None:
    model = mlp(ctx.device)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    g = ctx.generator(4)
    for step in range(2):
        x, y = ctx.randn(5, IN, generator=g), ctx.randn(5, OUT, generator=g)
        opt.zero_grad()
        loss = mse(model(x), y)
        with ctx.engine():
            grads = torch.autograd.grad(loss, params, create_graph=True)
        for (name, _), gr in zip(model.named_parameters(), grads):
            ctx.record(f"step{step}.first_grad.{name}", gr.detach())
        penalty = sum(gr.pow(2).sum() for gr in grads)
        with ctx.engine():
            (loss + 0.1 * penalty).backward()
        ctx.record_grads(f"step{step}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)
