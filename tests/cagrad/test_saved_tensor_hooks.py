"""Saved-tensor hooks and checkpointing under cagrad.

Nodes whose saved tensors carry pack/unpack hooks that are not cagrad's run
as they are inside the compiled graph, so each unpack hook runs once, when
eager would run it. Results and the unpack trace must equal eager's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .conftest import check_traced as check


def test_saved_tensors_hooks_unpack_once_each():
    def build(tr):
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 2, requires_grad=True)

        def pack(t):
            return t * 1

        def unpack(t):
            tr.append(("unpack", t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = (x.exp() @ w).tanh()
        y.sum().backward()
        return [x.grad, w.grad]

    trace = check(build)
    assert len(trace) >= 3


def test_save_on_cpu():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        with torch.autograd.graph.save_on_cpu():
            y = x.exp().sin()
        y.sum().backward()
        return [x.grad]

    check(build)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint(use_reentrant):
    def build(tr):
        lin = nn.Linear(4, 4)
        x = torch.randn(3, 4, requires_grad=True)
        out = checkpoint(lambda t: lin(t).relu() * 2, x, use_reentrant=use_reentrant)
        (out * out).sum().backward()
        return [x.grad, lin.weight.grad, lin.bias.grad]

    check(build)
