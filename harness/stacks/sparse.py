"""A stack with sparse gradients: ``nn.Embedding(sparse=True)``."""

from __future__ import annotations

import torch
from torch import nn

from harness.stacks.models import OUT, mse
from harness.stacks.registry import register
from harness.stacks.stack import StackContext

VOCAB, DIM = 20, 8


@register(
    "sparse_embedding",
    "nn.Embedding(20, 8, sparse=True) -> Linear -> Tanh -> Linear, SGD; sparse .grad compared as such; 3 steps",
)
def sparse_embedding(ctx: StackContext) -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"emb": nn.Embedding(VOCAB, DIM, sparse=True), "fc1": nn.Linear(DIM, 16), "fc2": nn.Linear(16, OUT)}
    ).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = ctx.generator(5)
    for step in range(3):
        ids = torch.randint(0, VOCAB, (6, 3), generator=g).to(ctx.device)  # repeated ids included
        y = ctx.randn(6, OUT, generator=g)
        opt.zero_grad()
        h = model["emb"](ids).mean(1)
        loss = mse(model["fc2"](torch.tanh(model["fc1"](h))), y)
        with ctx.engine():
            loss.backward()
        ctx.record_grads(f"step{step}", model)
        opt.step()
        ctx.record_params(f"step{step}", model)
