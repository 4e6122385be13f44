"""Small seeded models and losses shared by the stacks (float32 throughout)."""

from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, OUT = 8, 16, 4


def mlp(device: torch.device, seed: int = 0, depth: int = 2) -> nn.Sequential:
    """``Linear(8, 16) -> Tanh -> [Linear(16, 16) -> Tanh] * (depth - 2) ->
    Linear(16, 4)``, float32, weights from ``torch.manual_seed(seed)``; maps
    ``(N, 8)`` to ``(N, 4)``. The caller's global RNG state is left as the
    seed leaves it."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN, HIDDEN), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.Tanh()]
    layers.append(nn.Linear(HIDDEN, OUT))
    return nn.Sequential(*layers).to(device)


class Block(nn.Module):
    """``x + Linear(Tanh(Linear(x)))`` on ``(N, 16)``: a residual block whose
    linears run ``aten.addmm``."""

    def __init__(self, width: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class BlockNet(nn.Module):
    """``Linear(8, 16)``, ``blocks`` :class:`Block` s, ``Linear(16, 4)``;
    ``wrap(block, h)`` (default: call it) runs each block, so that a stack
    can checkpoint them. Maps ``(N, 8)`` to ``(N, 4)``."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, wrap=None) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) if wrap is None else wrap(block, h)
        return self.out(h)


def block_net(device: torch.device, seed: int = 0, blocks: int = 2) -> BlockNet:
    """A :class:`BlockNet` from ``torch.manual_seed(seed)`` on ``device``."""
    torch.manual_seed(seed)
    return BlockNet(blocks).to(device)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, a 0-d tensor."""
    return (out - target).pow(2).mean()
