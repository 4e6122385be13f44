"""Scenarios of real (small) models: CNN, transformer layer, LSTM,
embedding. Registered on import (:mod:`golden_graphs` imports it); small
shapes so that each captures in well under a second on a laptop CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .scenarios import Backward, scenario


@scenario
def cnn_step() -> Backward:
    """Conv2d, BatchNorm2d (training), ReLU, MaxPool2d, Linear and cross-entropy."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 2 * 2, 3),
    )
    x = torch.randn(2, 2, 4, 4)
    return Backward(F.cross_entropy(net(x), torch.tensor([0, 2])))


@scenario
def transformer_layer() -> Backward:
    """nn.TransformerEncoderLayer(d_model=8, nhead=2, no dropout): attention, layer norm, feed-forward."""
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    x = torch.randn(2, 3, 8)
    return Backward(layer(x).pow(2).mean())


@scenario
def lstm_step() -> Backward:
    """nn.LSTM (1 layer, hidden 4, no biases) over 3 steps and a linear head: the fused RNN backward node."""
    # bias=False: with biases the two bias gradients are one value, and the
    # trace returns it once or twice depending on what ran before in the
    # process (a cagrad nondeterminism reported to the lead)
    lstm = torch.nn.LSTM(3, 4, batch_first=True, bias=False)
    head = torch.nn.Linear(4, 1)
    out, _ = lstm(torch.randn(2, 3, 3))
    return Backward(head(out[:, -1]).sum())


@scenario
def embedding_bag_model() -> Backward:
    """nn.Embedding(padding_idx=0) + mean over tokens + Linear: padding_idx and scale_grad_by_freq in the key."""
    emb = torch.nn.Embedding(12, 4, padding_idx=0)
    head = torch.nn.Linear(4, 2)
    tokens = torch.tensor([[0, 3, 5], [7, 7, 1]])
    return Backward(head(emb(tokens).mean(dim=1)).logsumexp(dim=-1).sum())
