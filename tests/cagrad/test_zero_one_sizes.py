"""Sizes that are 0 or 1 at some steps, where eager's backward branches on
a size of 1: the graph traced with a symbol for them must never take the
general branch where eager takes the size-1 one.

Slots that changed since the first capture are traced with symbols that
may be 0 or 1 (:mod:`cagrad.capture.shape_env`); the decisions that differ
at 1 (``at::sum_to`` reducing a dimension of size 1, ``squeeze``,
broadcasting) must be guards of the variant, so that a size of 1 gets a
graph of its own where it needs one. Every step compares the gradients and
the ``.grad`` strides with eager's.
"""

from __future__ import annotations

import pytest
import torch

import cagrad

from .conftest import same

# the first capture is static, the second (at the second size) traces n as
# a symbol: at 1, then at 2 (where the general branch is eager's)
SIZES = [[3, 1, 0, 2, 1, 3, 0], [3, 2, 1, 0, 1, 3, 0, 2]]


def _steps(program, sizes) -> list[list]:
    out = []
    for step, n in enumerate(sizes):
        torch.manual_seed(step)
        leaves, loss = program(n)
        loss.backward()
        out.append([(t.grad.clone(), t.grad.stride()) for t in leaves])
    return out


def _check(program, sizes) -> None:
    expected = _steps(program, sizes)
    cagrad.reset()
    with cagrad.enable("eager"):
        got = _steps(program, sizes)
    for step, (e_step, g_step) in enumerate(zip(expected, got)):
        for (e, e_strides), (g, g_strides) in zip(e_step, g_step):
            same(e, g)
            assert g_strides == e_strides, (step, sizes[step], e_strides, g_strides)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


def _expand(n: int):
    """``x`` (1, 4) expanded to (n, 4) and read through a transpose: its
    gradient is ``at::sum_to`` of a transposed (n, 4) gradient, which eager
    sums over dimension 0 for n != 1 (a contiguous result) and hands on as
    it is for n == 1 (strides (1, 1), which ``.grad`` keeps)."""
    x = torch.randn(1, 4, requires_grad=True)
    w = torch.randn(4, n)
    return [x], (x.expand(n, 4).t() * w).sum()


@pytest.mark.parametrize("sizes", SIZES)
def test_expand_of_a_size_that_is_sometimes_one(sizes):
    _check(_expand, sizes)


def _broadcast(n: int):
    """``p`` (n, 4) times ``q`` (k, 4), with k == n at even steps of n and
    k == 1 at odd ones: ``q``'s gradient is summed over dimension 0 exactly
    when k is 1 and n is not (the engine's ``validate_outputs``)."""
    k = n if n % 2 == 0 else 1
    p = torch.randn(n, 4, requires_grad=True)
    q = torch.randn(k, 4, requires_grad=True)
    return [p, q], (p * q).pow(2).sum()


@pytest.mark.parametrize("sizes", [[2, 3, 1, 0, 4, 1, 2, 5, 0, 1], [2, 4, 3, 1, 0, 5, 6, 1]])
def test_broadcast_between_sizes_that_are_sometimes_one(sizes):
    _check(_broadcast, sizes)


def _row_weights(n: int):
    """``h`` (n, 6) times a weight column ``c`` (n, 1): ``c``'s gradient is
    summed over dimension 1 only (``(n, 6) -> (n, 1)``), the mixture of
    experts' routing weight; n is 1 or 0 at some steps."""
    h = torch.randn(n, 6, requires_grad=True)
    c = torch.randn(n, 1, requires_grad=True)
    return [h, c], (h * c).sin().sum()


@pytest.mark.parametrize("sizes", SIZES)
def test_column_weights_of_a_size_that_is_sometimes_one(sizes):
    _check(_row_weights, sizes)


def _squeeze(n: int):
    """``x`` (n, 1, 4) squeezed at dimension 0 (a no-op unless n == 1) and
    at dimension 1: ``SqueezeBackward1`` unsqueezes the gradient back where
    the size was 1."""
    x = torch.randn(n, 1, 4, requires_grad=True)
    y = x.squeeze(0).squeeze(-2)
    w = torch.randn(y.shape)
    return [x], (y * w).sum()


@pytest.mark.parametrize("sizes", SIZES)
def test_squeeze_of_a_size_that_is_sometimes_one(sizes):
    _check(_squeeze, sizes)


def _sum_to_size(n: int):
    """A custom Function's backward sums a (3, 4) gradient with
    ``sum_to_size`` to ``b``'s shape, (1, 4) for n of 0 or 1 and (3, 4)
    else."""

    class SumTo(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.shape = b.shape
            return a * b.sum()

        @staticmethod
        def backward(ctx, g):
            return g, g.sum_to_size(ctx.shape)

    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(1 if n <= 1 else 3, 4, requires_grad=True)
    return [a, b], SumTo.apply(a, b).sum()


@pytest.mark.parametrize("sizes", SIZES)
def test_sum_to_size_in_a_custom_backward(sizes):
    _check(_sum_to_size, sizes)


def test_a_split_whose_number_of_outputs_follows_a_size():
    """``x.split(1)`` of n elements has n outputs, the number of inputs of
    its ``SplitBackward0``, which a node post hook sees as its
    ``grad_outputs``; no key field records it (the contiguity guards of
    the trace pinned n, and a trace with a node of several inputs still
    records them)."""
    seen: dict[str, list] = {"eager": [], "cagrad": []}

    def run(n: int, trace: list) -> torch.Tensor:
        x = torch.randn(n, requires_grad=True)
        parts = (x * 2).split(1)
        parts[0].grad_fn.register_hook(lambda gi, go: trace.append(len(go)))
        parts[0].sum().backward()
        return x.grad

    sizes = [3, 5, 4, 6, 2, 6]
    torch.manual_seed(0)
    expected = [run(n, seen["eager"]) for n in sizes]
    cagrad.reset()
    torch.manual_seed(0)
    with cagrad.enable("eager"):
        got = [run(n, seen["cagrad"]) for n in sizes]
    assert seen["cagrad"] == seen["eager"] == sizes
    for e, g in zip(expected, got):
        same(e, g)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


# sizes of 0: the dynamic capture (at the second size) traces n as a symbol
# at 0 in the first list, at 2 in the second (0 comes later)
ZERO_SIZES = [[2, 0, 3, 0, 1, 4, 0], [3, 2, 0, 1, 0, 5]]


def _strided_leaf(n: int):
    """A leaf ``t`` (n, 3) with strides (6, 2) (every other column of an
    (n, 6) tensor): not dense for n >= 2, so its ``.grad`` is a contiguous
    copy of the gradient; with no element it is dense, and eager's
    ``AccumulateGrad`` gives ``.grad`` its strides (6, 2)."""
    t = torch.randn(n, 6)[:, ::2].detach().requires_grad_()
    w = torch.randn(n, 3)
    return [t], (t * w).sum()


@pytest.mark.parametrize("sizes", ZERO_SIZES)
def test_a_leaf_whose_grad_layout_differs_at_zero(sizes):
    _check(_strided_leaf, sizes)


def _prod_over_rows(n: int):
    """``x`` (n, 3) multiplied over its rows: the traced ``ProdBackward1``
    formula (``cagrad.autograd.formulas``) branches on ``x`` having no
    element (a guard on the symbol: with sympy's ``positive`` assumption it
    would be decided False without one); ``y``'s gradient is the product
    over no row at 0, ones."""
    x = torch.randn(n, 3, requires_grad=True)
    y = torch.randn(2, 3, requires_grad=True)
    return [x, y], (x.prod(0) * y).sum()


@pytest.mark.parametrize("sizes", ZERO_SIZES)
def test_a_traced_formula_that_branches_on_no_element(sizes):
    _check(_prod_over_rows, sizes)


def _gapped_saved_tensors(n: int):
    """``x[:, :3]`` (strides (5, 1)) and a row expanded to (n, 3) (strides
    (0, 1)) saved for backward: the storage-size formula of their fakes is
    not 0 at n == 0 (``cagrad.capture.shape_env``: it is answered without a
    guard); the transposed leaf ``t`` of (n, 3) has strides (1, max(n, 1))."""
    x = torch.randn(n, 5, requires_grad=True)
    r = torch.randn(1, 3, requires_grad=True)
    t = torch.randn(3, n).t().detach().requires_grad_()
    a, b = x[:, :3], r.expand(n, 3)
    return [x, r, t], (a * b * t).sum() + (a.exp() * t).sum()


@pytest.mark.parametrize("sizes", ZERO_SIZES)
def test_saved_tensors_with_gaps_and_zero_strides_at_zero(sizes):
    _check(_gapped_saved_tensors, sizes)


def _gather(n: int):
    """``gather`` with an index of n rows: its backward's ``scatter_add``
    checks the index's dtype and shape only where it is not empty (queries
    answered without a guard: they only decide whether checks run)."""
    x = torch.randn(4, 3, requires_grad=True)
    idx = torch.randint(4, (n, 3))
    return [x], (x.gather(0, idx) * torch.randn(n, 3)).sum()


@pytest.mark.parametrize("sizes", ZERO_SIZES)
def test_gather_with_an_index_that_is_sometimes_empty(sizes):
    _check(_gather, sizes)
