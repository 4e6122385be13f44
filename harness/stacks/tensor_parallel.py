"""A tensor-parallel stack on 2 ranks: a 3-Linear MLP whose second Linear
is column-wise and last row-wise (``torch.distributed.tensor.parallel``),
so that their parameters are DTensors and the backward's gradients DTensors
too; the first Linear stays a plain module, so the gradient of the
column-wise layer's input is all-reduced in the backward (a collective in
the graph). Grads and params are recorded as each rank's local shard."""

from __future__ import annotations

import torch

from harness.stacks.models import IN, OUT, mlp, mse
from harness.stacks.registry import register
from harness.stacks.stack import StackContext


@register(
    "tensor_parallel",
    "MLP: plain Linear, then ColwiseParallel / RowwiseParallel Linears (DTensor parameters; "
    "an all-reduce in the backward), 3 SGD steps on 2 ranks",
    world_size=2,
)
def tensor_parallel(ctx: StackContext) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = parallelize_module(mlp(ctx.device, depth=3), mesh, {"2": ColwiseParallel(), "4": RowwiseParallel()})
    # foreach=False: the multi-tensor step (the default on CUDA) rejects a
    # device group of plain and DTensor parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    # the same batches on every rank: a tensor-parallel input is replicated
    g = torch.Generator().manual_seed(40)
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(5, IN, generator=g).to(ctx.device)
        y = torch.randn(5, OUT, generator=g).to(ctx.device)
        loss = mse(model(x), y)
        with ctx.engine():
            loss.backward()
        ctx.record_grads(f"step{step}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)
