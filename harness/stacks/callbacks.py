"""A stack whose hooks queue engine callbacks
(``Variable._execution_engine.queue_callback``)."""

from __future__ import annotations

import torch

from harness.stacks.models import IN, OUT, mlp, mse
from harness.stacks.registry import register
from harness.stacks.stack import StackContext


def queue(cb) -> None:
    """``Variable._execution_engine.queue_callback(cb)``, the engine looked
    up at call time as torch's own callers do (an engine like cagrad's is
    swapped in there while its context is open)."""
    torch.autograd.Variable._execution_engine.queue_callback(cb)


@register(
    "queue_callback",
    "a tensor hook queues a callback that records and halves .grads after the backward "
    "and queues a second one; 3 SGD steps",
)
def queue_callback(ctx: StackContext) -> None:
    model = mlp(ctx.device)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = ctx.generator(9)
    for step in range(3):
        events: list[str] = []

        def second(step=step, events=events) -> None:
            events.append("second")
            w = params["0.weight"]
            ctx.record(f"step{step}.second.0.weight", w.grad)
            with torch.no_grad():
                w.grad.add_(1.0)

        def first(step=step, events=events) -> None:
            # runs after the whole backward: every .grad is final
            events.append("first")
            for name, p in params.items():
                ctx.record(f"step{step}.in_callback.{name}", p.grad)
            with torch.no_grad():
                params["2.weight"].grad.mul_(0.5)
            queue(second)  # queued from a callback: runs after this one

        def hook(grad: torch.Tensor, events=events) -> None:
            events.append("hook")
            queue(first)

        x, y = ctx.randn(5, IN, generator=g), ctx.randn(5, OUT, generator=g)
        opt.zero_grad()
        h = model[0](x)
        h.register_hook(hook)
        loss = mse(model[2](model[1](h)), y)
        with ctx.engine():
            loss.backward()
        ctx.record(f"step{step}.events", list(events))
        ctx.record_grads(f"step{step}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)
