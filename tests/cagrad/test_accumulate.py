"""cagrad's Python AccumulateGrad (cagrad.autograd.accumulate) against eager's.

Each case runs eager autograd on a leaf and records what its AccumulateGrad
did: whether it made the arriving gradient ``.grad`` without a copy (a
tensor hook on the leaf sees that gradient's address and strides), and the
``.grad`` it left. ``accumulate_grad`` is then handed a gradient with the
same strides, which no other tensor holds, and must do the same.
"""

from __future__ import annotations

import pytest
import torch

from cagrad.autograd.accumulate import accumulate_grad

pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")

# leaves whose strides are not the contiguous ones of a shape without a
# size-1 dim (so the layout contract is checked stride by stride) and with a
# stride above 256: CPython caches small ints, so only a larger stride tells
# comparing strides by value from comparing them by identity
STEAL_CASES = {
    "size_one_dim": (lambda: torch.zeros(2, 1, 300), lambda w: w * 2),
    "transposed": (lambda: torch.zeros(2, 300).t(), lambda w: w * w.detach()),
    "permuted_with_size_one_dim": (lambda: torch.zeros(3, 1, 300).transpose(0, 2), lambda w: w * w.detach()),
    # the arriving gradient is contiguous, the leaf transposed: copied
    "transposed_contiguous_gradient": (lambda: torch.zeros(2, 300).t(), lambda w: w * 2),
}


def _eager(make, op) -> tuple[bool, tuple, torch.Tensor]:
    """(stolen, the arriving gradient's strides, the leaf's .grad) in eager."""
    w = make().requires_grad_()
    seen = []
    w.register_hook(lambda g: seen.append((g.data_ptr(), g.stride())) or None)
    op(w).sum().backward()
    (ptr, stride), = seen
    return w.grad.data_ptr() == ptr, stride, w.grad


@pytest.mark.parametrize("case", sorted(STEAL_CASES))
def test_a_gradient_becomes_grad_without_a_copy_exactly_where_eager_steals_it(case):
    make, op = STEAL_CASES[case]
    stolen, stride, expected = _eager(make, op)
    assert stolen == (case != "transposed_contiguous_gradient")  # the cases do what they say
    leaf = make().requires_grad_()
    grad = torch.empty_strided(expected.shape, stride).copy_(expected)
    accumulate_grad(leaf, grad, stealable=True, create_graph=False)
    assert (leaf.grad is grad) == stolen
    assert leaf.grad.stride() == expected.stride()
    torch.testing.assert_close(leaf.grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_create_graph_sums_into_an_existing_grad_out_of_place(sparse):
    """``create_graph=True``: a second gradient is added to ``.grad`` out of
    place (a new, differentiable ``.grad``), as eager's backward does."""
    torch.manual_seed(0)
    g1, g2 = torch.randn(4, 3), torch.randn(4, 3)
    if sparse:
        g1 = g1.to_sparse()
        g2 = g2.to_sparse()
    ref = torch.zeros(4, 3, requires_grad=True)
    ref.backward(g1, create_graph=True)
    first = ref.grad
    ref.backward(g2, create_graph=True)
    assert ref.grad is not first

    leaf = torch.zeros(4, 3, requires_grad=True)
    accumulate_grad(leaf, g1, stealable=False, create_graph=True)
    first = leaf.grad
    accumulate_grad(leaf, g2, stealable=False, create_graph=True)
    assert leaf.grad is not first
    assert leaf.grad.layout == ref.grad.layout
    e, a = ref.grad, leaf.grad
    if sparse:
        e, a = e.to_dense(), a.to_dense()
    torch.testing.assert_close(a, e, rtol=0, atol=0)
    torch.testing.assert_close(a, (g1 + g2).to_dense() if sparse else g1 + g2, rtol=0, atol=0)
