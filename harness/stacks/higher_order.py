"""Stacks with higher-order gradients: gradient penalties by autograd.grad(create_graph=True),
by torch.func.grad, and a Jacobian penalty by torch.autograd.functional."""

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


@register(
    "func_grad_penalty",
    "WGAN-GP: torch.func.grad of the critic w.r.t. its input, backward of loss + penalty, SGD; 3 steps "
    "(the grad's own backward: eager, functorch_transform)",
    expect_compiled=False,
)
def func_grad_penalty(ctx: StackContext) -> None:
    model = mlp(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = ctx.generator(5)

    def critic(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    for step in range(3):
        x = ctx.randn(5, IN, generator=g)
        opt.zero_grad()
        with ctx.engine():
            input_grad = torch.func.grad(critic)(x)
        ctx.record(f"step{step}.input_grad", input_grad.detach())
        penalty = (input_grad.norm(dim=1) - 1).pow(2).mean()
        with ctx.engine():
            (model(x).mean() + 10 * penalty).backward()
        ctx.record_grads(f"step{step}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)


@register(
    "functional_jacobian",
    "contractive penalty: torch.autograd.functional.jacobian(model, x, create_graph=True), then backward of "
    "loss + its squared norm, SGD; 2 steps",
)
def functional_jacobian(ctx: StackContext) -> None:
    model = mlp(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = ctx.generator(6)
    for step in range(2):
        x, y = ctx.randn(1, IN, generator=g), ctx.randn(1, OUT, generator=g)
        opt.zero_grad()
        with ctx.engine():
            # one autograd.grad(create_graph=True) per output element
            jac = torch.autograd.functional.jacobian(model, x, create_graph=True)
        ctx.record(f"step{step}.jacobian", jac.detach())
        with ctx.engine():
            (mse(model(x), y) + 0.01 * jac.pow(2).sum()).backward()
        ctx.record_grads(f"step{step}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)
