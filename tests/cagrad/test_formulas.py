"""Each Python formula computes what its C++ node computes, bit for bit.

The oracle is the C++ node itself: for every node of a formula's type in a
set of example graphs, the node's own ``apply`` and the formula (with the
node's saved sizes as plain ints) run on the same real gradients, and must
return bitwise-equal gradients (None where the node returns None). Every
registered formula must be exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cagrad.autograd import formulas
from cagrad.autograd.validate import real_metadata


def _examples():
    torch.manual_seed(0)
    x = torch.randn(5, 6, requires_grad=True)
    w = torch.randn(6, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    e = torch.randn(10, 4, requires_grad=True)
    xt = torch.randn(6, 5).t().requires_grad_()  # column-major
    one_zero = torch.ones(5, 6)
    one_zero[2, 3] = 0
    two_zeros = one_zero.clone()
    two_zeros[2, 5] = 0
    return [
        x.sum(),
        x.sum(1).exp().sum(),
        x.sum((0, 1), keepdim=True),
        x.sum(-1, keepdim=True).sum(),
        x.mean(),
        x.mean(0).sum(),
        x.mean((0, -1), keepdim=True).sum(),
        x[:1].expand(4, 6).sum(),
        x.view(30).sum(),
        (x @ w).sum(),
        x.reshape(6, 5).sum(),
        x[2].sum(),
        x[1:4:2, ::3].sum(),
        x[:, -2:].sum(),
        x.split(2)[1].sum() + x.split(2)[2].sum(),
        x.split([1, 5], 1)[0].sum(),
        x.split(2)[0].sum(),  # the last, shorter chunk (1 of 5 rows) gets no gradient: zeros of its size
        torch.ops.aten.slice.Tensor(x, 0, 1).sum(),  # end None (x[1:] saves int64 max instead)
        x[:, :1].squeeze(1).sum(),
        x[:1, :1].squeeze().sum(),
        x[:1].squeeze((0,)).sum(),
        x.diagonal(1).sum(),
        x.diagonal(-(1 << 63)).sum(),  # empty; the node hands INT64_MIN out as 1 << 63
        x.index_select(1, torch.tensor([0, 3, 3])).sum(),
        torch.cat([x, torch.randn(2, 6), x * 2]).sum(),
        torch.cat([torch.randn(5, 2), x], 1).sum(),
        torch.cat([torch.tensor([]), x.flatten()]).sum(),
        # an empty input requiring grad: legacy 1-D (0,) (skipped by cat, its
        # gradient zeros of size 0) and a 2-D (0, 6) (its slice of the gradient)
        torch.cat([torch.zeros(0, requires_grad=True), x]).sum(),
        torch.cat([torch.zeros(0, 6, requires_grad=True), x]).sum(),
        F.linear(x, w.t(), b).sum(),
        torch.addmm(b, x, w, beta=0.5, alpha=2.0).sum(),
        (xt @ torch.randn(6, 2)).sum(),
        (torch.randn(7, 5) @ xt).sum(),
        # mat2 of strides (0, 3): the second stride is the first size, the
        # first is not 1, so not column-major (the other product's layout)
        (torch.randn(5, 3) @ torch.randn(12, requires_grad=True).as_strided((3, 4), (0, 3))).sum(),
        F.layer_norm(x, (6,), torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)).sum(),
        F.layer_norm(x, (5, 6)).sum(),
        F.embedding(torch.tensor([[0, 2], [9, 2]]), e).sum(),
        F.embedding(torch.tensor([1, 1, 3]), e, padding_idx=1).sum(),
        (x.unsqueeze(0).expand(2, 5, 6) @ w).sum(),
        (x.view(1, 5, 6, 1) * 1).squeeze_().sum(),
        (x.view(1, 5, 6, 1) * 1).squeeze_(0).sum(),
        (x.view(1, 5, 6, 1) * 1).squeeze_((0, 3)).sum(),
        x.prod(),
        x.prod(1).sum(),
        x.prod(-2, keepdim=True).sum(),
        x[:1, :1].prod(),
        x[:, :1].prod(1).sum(),
        x[:1].prod(0).sum(),
        (x * one_zero).prod(),
        (x * two_zeros).prod(),
        (x * one_zero).prod(1).sum(),  # one row with a zero
        (x * two_zeros).prod(1, keepdim=True).sum(),  # one row with two
        (x * two_zeros).prod(0).sum(),
        (x[0, 0] * 1).prod(),  # 0-dim
        (x[0, 0] * 1).prod(0),
    ]


def _nodes(roots):
    seen, stack = set(), [r.grad_fn for r in roots]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        yield n
        stack.extend(f for f, _ in n.next_functions)


def _attr(node):
    def sym(attr):
        v = getattr(node, "_saved_" + attr)
        if isinstance(v, int) and v >= 1 << 63:
            return v - (1 << 64)
        if isinstance(v, tuple):
            return [x - (1 << 64) if x >= 1 << 63 else x for x in v]
        return v

    return sym


def test_formulas_match_the_cpp_nodes_bit_for_bit():
    roots = _examples()
    seen_types = set()
    for node in _nodes(roots):
        name = type(node).__name__
        if name not in formulas.FORMULAS:
            continue
        seen_types.add(name)
        torch.manual_seed(len(seen_types))
        grads = [
            None if md.shape is None else torch.randn(list(md.shape), dtype=md.dtype)
            for md in node._input_metadata
        ]
        with torch.no_grad():
            expected = node(*grads)
            expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
            actual = formulas.apply(
                name, node, grads, _attr(node), lambda i: real_metadata(*node.next_functions[i])
            )
        assert len(actual) == len(expected), name
        for i, (e, a) in enumerate(zip(expected, actual)):
            if node.next_functions[i][0] is None:
                continue  # never computed: the engine drops it
            assert (e is None) == (a is None), (name, i)
            if e is not None:
                torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m: f"{name} output {i}: {m}")
                assert a.stride() == e.stride(), (name, i, a.stride(), e.stride())
    missing = set(formulas.FORMULAS) - seen_types
    # _reshape_alias is only produced by internal decompositions, never by
    # eager reshape on a tensor requiring grad
    assert missing <= {"ReshapeAliasBackward0"}, missing


@pytest.mark.parametrize("undefined", [True])
def test_undefined_gradient_in_undefined_out(undefined):
    x = torch.randn(4, 3, requires_grad=True)
    node = x.sum(0).grad_fn
    out = formulas.apply(type(node).__name__, node, [None], _attr(node), lambda i: None)
    assert out == [None]


# -- end to end: the formulas traced with symbolic sizes, against eager ----------
def _split_last_chunk_unused(x):
    # 10 or 11 rows in chunks of 4: the last chunk (2 or 3 rows) gets no
    # gradient, so the formula builds its zeros from the size it derives
    a, b, _ = x.split(4)
    return (a.exp() * 2).sum() + b.sin().sum()


def _slice_without_end(x):
    return (torch.ops.aten.slice.Tensor(x, 0, 2) ** 2).sum()


def _index_select(x):
    return (x.index_select(0, torch.tensor([0, 2, 2])) * 3).sum()


@pytest.mark.parametrize("program", [_split_last_chunk_unused, _slice_without_end, _index_select])
def test_symbolic_formulas_match_eager_autograd(program):
    """Each program under ``dynamic=True`` (formulas traced with symbolic
    sizes; no node forced to run as it is) gives eager autograd's gradient."""
    import cagrad

    xs = [torch.randn(rows, 4, requires_grad=True) for rows in (10, 11)]
    expected = [torch.autograd.grad(program(x), x)[0] for x in xs]
    with cagrad.enable("eager", dynamic=True):
        actual = [torch.autograd.grad(program(x), x)[0] for x in xs]
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["nodes_forced_opaque"] == 0, dict(cagrad.counters["opaque_reasons"])
    assert cagrad.counters["captures"] >= 1


def _eager_grad_requires_grad(op, data: torch.Tensor) -> bool:
    x = data.clone().requires_grad_()
    (g,) = torch.autograd.grad(op(x), x, torch.ones_like(op(x)), create_graph=True)
    return g.requires_grad


PROD_CASES = {
    "all": (lambda x: x.prod(), (2, 3)),
    "all_of_one": (lambda x: x.prod(), (1, 1)),
    "dim_of_three": (lambda x: x.prod(1), (2, 3)),
    "dim_of_two": (lambda x: x.prod(0, keepdim=True), (2, 3)),
    "dim_of_one": (lambda x: x.prod(1), (3, 1)),
    "last_dim_of_one": (lambda x: x.prod(-1, keepdim=True), (2, 1)),
}


@pytest.mark.parametrize("name", sorted(PROD_CASES))
def test_prod_runs_as_is_exactly_where_eager_depends_on_the_data(name):
    """Under ``create_graph`` a prod node must run as it is exactly where
    whether eager's gradient requires grad depends on the data (found here
    by running eager on data with and without a zero): a traced graph
    cannot reproduce that, and elsewhere the node is traced."""
    op, shape = PROD_CASES[name]
    torch.manual_seed(0)
    plain = torch.rand(shape) + 0.5
    zeros = torch.zeros(shape)
    data_dependent = _eager_grad_requires_grad(op, plain) != _eager_grad_requires_grad(op, zeros)
    x = plain.clone().requires_grad_()
    node = op(x).grad_fn
    assert formulas.runs_as_is(node, type(node).__name__) == data_dependent
