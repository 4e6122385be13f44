"""Sparse COO gradients under cagrad, against eager autograd.

Eager's ``validate_outputs`` lets a sparse gradient through on any edge, and
``AccumulateGrad::accumulateGrad`` (torch/csrc/autograd/functions/
accumulate_grad.h) handles every dense/sparse mix: a first sparse gradient
becomes a new sparse ``.grad``; sparse into sparse and sparse into dense add
in place (``.grad`` stays the same object); dense into sparse replaces
``.grad`` with the dense sum. Each test runs one program in eager and under
``cagrad.enable(backend)`` and compares values, layouts, ``.grad`` identity
and the coalesced flag, then what cagrad's counters say: a sparse gradient
that only reaches ``.grad``, hooks or nodes run as they are is compiled; one
that a traced op would use is finished by the interpreter once, then falls
back (``non_strided_tensor``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import cagrad

from .conftest import run_both

BACKENDS = ["eager", "aot_eager"]

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks"),
    pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True"),
]


def _sparse(g: torch.Tensor, coalesce: bool = False) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 3) * g, (4, 3))
    return s.coalesce() if coalesce else s


class SparseFn(torch.autograd.Function):
    """``w (4, 3) -> w.sum()``; backward returns a sparse COO (4, 3) gradient
    (rows 0 and 2, uncoalesced)."""

    @staticmethod
    def forward(ctx, w):
        return w.sum() * 1.0

    @staticmethod
    def backward(ctx, g):
        return _sparse(g)


class CoalescedSparseFn(torch.autograd.Function):
    """As :class:`SparseFn`, with a coalesced gradient."""

    @staticmethod
    def forward(ctx, w):
        return w.sum() * 1.0

    @staticmethod
    def backward(ctx, g):
        return _sparse(g, coalesce=True)


def _state(t: torch.Tensor | None) -> tuple:
    """What eager and cagrad must agree on about a gradient."""
    if t is None:
        return (None,)
    if t.is_sparse:
        return (t.layout, t.is_coalesced(), t._nnz(), t.to_dense())
    return (t.layout, t.stride(), t)


def _assert_same(expected: list, actual: list) -> None:
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, tuple):
            assert len(e) == len(a), i
            for x, y in zip(e, a):
                if isinstance(x, torch.Tensor):
                    torch.testing.assert_close(x, y, rtol=0, atol=0)
                else:
                    assert x == y, (i, e, a)
        else:
            assert e == a, (i, e, a)


def _counts() -> dict:
    c = cagrad.counters
    return {k: c[k] for k in ("captures", "cache_hits", "fallbacks", "deopts", "nodes_forced_opaque")}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "fn", [SparseFn, CoalescedSparseFn], ids=["uncoalesced", "coalesced"]
)
def test_sparse_into_none_then_into_sparse_in_place(fn, backend):
    def build():
        w = torch.randn(4, 3, requires_grad=True)
        fn.apply(w).backward()
        first = w.grad
        out = [_state(w.grad)]
        fn.apply(w).backward()
        out += [_state(w.grad), w.grad is first]
        return out

    expected, actual = run_both(build, backend)
    _assert_same(expected, actual)
    assert expected[-1] is True  # eager adds sparse into sparse in place
    assert _counts() == {
        "captures": 1, "cache_hits": 1, "fallbacks": 0, "deopts": 0, "nodes_forced_opaque": 0
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_into_dense_in_place(backend):
    def build():
        w = torch.randn(4, 3, requires_grad=True)
        (w * 2).sum().backward()
        first = w.grad
        SparseFn.apply(w).backward()
        return [_state(w.grad), w.grad is first]

    expected, actual = run_both(build, backend)
    _assert_same(expected, actual)
    assert expected[-1] is True
    assert cagrad.counters["fallbacks"] == 0
    assert cagrad.counters["captures"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opaque", [False, True], ids=["whole_graph", "segmented"])
def test_dense_into_sparse_replaces_grad(backend, opaque):
    def build():
        w = torch.randn(4, 3, requires_grad=True)
        SparseFn.apply(w).backward()
        first = w.grad
        seen = []
        if opaque:  # accumulation as an opaque call inside the graph
            w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.layout))
        (w * 2).sum().backward()
        return [_state(w.grad), w.grad is first, tuple(seen)]

    expected, actual = run_both(build, backend)
    _assert_same(expected, actual)
    assert expected[1] is False and expected[0][0] is torch.strided
    assert cagrad.counters["fallbacks"] == 0
    assert cagrad.counters["captures"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_hooks_see_the_sparse_gradient(backend):
    def build():
        w = torch.randn(4, 3, requires_grad=True)
        seen = []
        w.register_hook(lambda g: seen.append(("tensor", g.layout)))
        w.register_post_accumulate_grad_hook(lambda p: seen.append(("post", p.grad.layout)))
        for _ in range(2):
            SparseFn.apply(w).backward()
        return [_state(w.grad), tuple(seen)]

    expected, actual = run_both(build, backend)
    _assert_same(expected, actual)
    assert _counts() == {
        "captures": 1, "cache_hits": 1, "fallbacks": 0, "deopts": 0, "nodes_forced_opaque": 0
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_grad_returns_the_sparse_gradient(backend):
    def build():
        w = torch.randn(4, 3, requires_grad=True)
        return [_state(torch.autograd.grad(SparseFn.apply(w), w)[0]) for _ in range(2)] + [
            _state(w.grad)
        ]

    expected, actual = run_both(build, backend)
    _assert_same(expected, actual)
    assert cagrad.counters["fallbacks"] == 0
    assert cagrad.counters["cache_hits"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_create_graph_replaces_sparse_grad(backend):
    def build():
        w = torch.randn(4, 3, requires_grad=True)
        SparseFn.apply(w).backward(create_graph=True)
        first = w.grad
        out = [_state(w.grad)]
        SparseFn.apply(w).backward(create_graph=True)
        out += [_state(w.grad), w.grad is first]
        return out

    expected, actual = run_both(build, backend)
    _assert_same(expected, actual)
    assert expected[-1] is False  # grad mode on: never in place
    assert cagrad.counters["fallbacks"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_embedding_compiled_with_its_node_opaque(backend):
    def build():
        emb = nn.Embedding(6, 3, sparse=True)
        idx = torch.tensor([1, 2, 1, 5])
        emb(idx).pow(2).sum().backward()
        first = emb.weight.grad
        out = [_state(emb.weight.grad)]
        emb(idx).pow(2).sum().backward()
        out += [_state(emb.weight.grad), emb.weight.grad is first]
        return out

    expected, actual = run_both(build, backend)
    _assert_same(expected, actual)
    assert expected[0][0] is torch.sparse_coo and expected[-1] is True
    assert _counts() == {
        "captures": 1, "cache_hits": 1, "fallbacks": 0, "deopts": 0, "nodes_forced_opaque": 1
    }
    assert dict(cagrad.counters["opaque_reasons"]) == {"non_strided_gradient:EmbeddingBackward0": 1}


def _into_traced_op(w):
    SparseFn.apply(w * 2).backward()  # MulBackward0 gets the sparse gradient


def _summed_with_dense(w):
    (SparseFn.apply(w) + (w * 3).sum()).backward()  # InputBuffer: sparse + dense


def _sparse_summed_with_dense(w):
    # SparseFn's node runs first (created last): the InputBuffer holds the
    # sparse gradient when the dense one arrives (dense + sparse is summed)
    ((w * 3).sum() + SparseFn.apply(w)).backward()


def _tied_embedding(w):
    idx = torch.tensor([1, 2, 1])
    (torch.nn.functional.embedding(idx, w, sparse=True).pow(2).sum() + (w * 2).sum()).backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "program", [_into_traced_op, _summed_with_dense, _sparse_summed_with_dense, _tied_embedding]
)
def test_sparse_gradient_used_by_a_traced_op_is_finished_then_falls_back(program, backend):
    def build():
        w = torch.randn(4, 3, requires_grad=True)
        out = []
        for _ in range(3):
            program(w)
            out.append(_state(w.grad))
        return out

    expected, actual = run_both(build, backend)
    _assert_same(expected, actual)
    # first backward: the graph assumed a strided gradient, the interpreter
    # finished it; the recapture and the one after fall back
    assert cagrad.counters["deopts"] == 1
    assert cagrad.counters["captures"] == 1
    assert dict(cagrad.counters["fallback_reasons"]) == {"non_strided_tensor": 2}
