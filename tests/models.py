"""The real models the core tests train (shared with the benchmarks).

Each builder returns ``(model, make_batch)`` where ``make_batch(step)``
returns ``(inputs, target)`` for that step, deterministic in ``step``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def mlp() -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )
    return model, lambda s: (torch.randn(8, 16, generator=_gen(s)), torch.randn(8, 4, generator=_gen(s + 500)))


def cnn() -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )
    return model, lambda s: (torch.randn(4, 3, 12, 12, generator=_gen(s)), torch.randn(4, 5, generator=_gen(s + 500)))


def transformer() -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return model, lambda s: (torch.randn(2, 6, 16, generator=_gen(s)), torch.randn(2, 6, 16, generator=_gen(s + 500)))


class _LSTMHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def lstm() -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    return _LSTMHead(), lambda s: (torch.randn(3, 5, 8, generator=_gen(s)), torch.randn(3, 3, generator=_gen(s + 500)))


class _EmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(ids)))


def embedding() -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    return _EmbeddingModel(), lambda s: (
        torch.randint(0, 50, (4, 9), generator=_gen(s)),
        torch.randn(4, 9, 7, generator=_gen(s + 500)),
    )


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer, "lstm": lstm, "embedding": embedding}


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)
