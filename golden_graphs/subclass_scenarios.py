"""Scenarios with tensor subclasses: a ``TwoTensor`` leaf and a jagged
nested tensor leaf. Registered on import (:mod:`golden_graphs` imports it).
Their snapshots show a subclass lifted as its inner tensors (one graph input
each), keyed by class, flatten metadata and inner tensors, and traced
through its ``__torch_dispatch__``; the jagged tensor's nested int (``j1``)
is in no key byte: it goes to a static size slot as a structural marker
(``cagrad.keys.sizes.SizeInputs.nested_marker``), which a snapshot does not
store (its values are the size check's).
"""

from __future__ import annotations

import torch

from .scenarios import Backward, leaf, scenario


@scenario
def subclass_two_tensor_leaf() -> Backward:
    """a TwoTensor leaf through sin and mul: lifted as its two inner tensors, .grad rebuilt as a TwoTensor."""
    from torch.testing._internal.two_tensor import TwoTensor

    x = TwoTensor(torch.randn(3, 4), torch.randn(3, 4)).requires_grad_()
    return Backward((x.sin() * x).sum())


@scenario
def subclass_nested_jagged_leaf() -> Backward:
    """a jagged nested tensor leaf (lengths 2 and 4) through a Linear: values and offsets lifted, nested ints as markers."""
    x = torch.nested.nested_tensor(
        [torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged, requires_grad=True
    )
    w = leaf(5, 3)
    h = torch.nn.functional.linear(x, w)
    return Backward((h.relu() * h).values().sum())
