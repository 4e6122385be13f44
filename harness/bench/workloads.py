"""The benchmark workloads: each builds a model and returns a forward step.

A workload is ``build(device) -> Workload``; ``step()`` zeroes the
parameters' grads (set to None) and returns a scalar loss whose backward is
timed. Sizes follow issue 10's table: on CUDA the larger ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn


@dataclasses.dataclass
class Workload:
    """A model and its forward step.

    Attributes:
        model: the module (``torch.compile`` wraps it for that subject).
        step: ``step(model) -> loss`` (0-dim tensor).
        params: the tensors whose ``.grad`` the backward fills.
    """

    model: nn.Module
    step: Callable[[nn.Module], torch.Tensor]
    params: list[torch.Tensor]


def _module_workload(model: nn.Module, x: torch.Tensor) -> Workload:
    params = list(model.parameters())

    def step(m: nn.Module) -> torch.Tensor:
        for p in params:
            p.grad = None
        return m(x).float().square().mean()

    return Workload(model, step, params)


def mlp(device: str) -> Workload:
    width, batch = (1024, 256) if device == "cuda" else (256, 64)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return _module_workload(nn.Sequential(*layers).to(device), torch.randn(batch, width, device=device))


def _encoder(device: str, layers: int) -> Workload:
    d, batch, seq = (512, 16, 256) if device == "cuda" else (128, 8, 32)
    layer = nn.TransformerEncoderLayer(d, 8 if device == "cuda" else 4, 4 * d, dropout=0.0, batch_first=True)
    model = layer if layers == 1 else nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return _module_workload(model.to(device), torch.randn(batch, seq, d, device=device))


def transformer(device: str) -> Workload:
    return _encoder(device, 1)


def transformer6(device: str) -> Workload:
    return _encoder(device, 6)


def cnn(device: str) -> Workload:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )
    return _module_workload(model.to(device), torch.randn(16, 3, 32, 32, device=device))


class _Chain(nn.Module):
    def __init__(self, width: int, n: int, device: str) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.randn(width, device=device))
        self.n = n

    def forward(self, _: torch.Tensor) -> torch.Tensor:
        z = self.x
        for i in range(self.n):
            z = z.sin() if i % 2 else z * 1.01
        return z


def chain200(device: str) -> Workload:
    width = 4096 if device == "cuda" else 64
    return _module_workload(_Chain(width, 200, device), torch.empty(0, device=device))


WORKLOADS: dict[str, Callable[[str], Workload]] = {
    "mlp": mlp,
    "transformer": transformer,
    "transformer6": transformer6,
    "chain200": chain200,
    "cnn": cnn,
}
