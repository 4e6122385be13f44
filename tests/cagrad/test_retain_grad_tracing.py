"""``retain_grad`` gradients set after a whole graph instead of by opaque calls.

Where nothing of the user's runs during the backward (no opaque hook, node
or custom Function) and ``create_graph`` is off, a ``retain_grad`` tensor's
gradient becomes a graph output and its ``.grad`` is set after the graph as
eager's retains_grad hook sets it: a contiguous copy the first time, an
out-of-place sum after. Values, strides and storage sharing are compared with
eager autograd's.
"""

from __future__ import annotations

import torch

import cagrad

from .conftest import same


def _both(build):
    torch.manual_seed(0)
    expected = build()
    torch.manual_seed(0)
    with cagrad.enable("eager"):
        actual = build()
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    return expected, actual


def _same_grads(expected, actual):
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        same(e, a)
        if e is not None:
            assert e.stride() == a.stride()


def test_retained_gradients_are_set_after_one_whole_graph(captured):
    # h's gradient arrives transposed (through t = h.t()); eager stores a
    # contiguous copy; t's retained gradient is the one after its tensor hook
    def build():
        w = torch.randn(4, 6, requires_grad=True)
        out = []
        for _ in range(3):
            h = torch.randn(3, 4) @ w
            h.retain_grad()
            t = h.t().tanh()
            t.register_hook(lambda g: g * 2)
            t.retain_grad()
            (t * 3).sum().backward()
            out += [w.grad, h.grad, t.grad]
            w.grad = None
        return out

    expected, actual = _both(build)
    _same_grads(expected, actual)
    assert expected[1].is_contiguous() and not expected[1].t().is_contiguous()
    assert (cagrad.counters["captures"], cagrad.counters["cache_hits"]) == (1, 2)
    assert [e.num_segments for e in captured] == [1]
    assert not any(
        n.op == "call_function" and getattr(n.target, "__name__", "") == "retain_grad"
        for n in captured[0].graph_module.graph.nodes
    )


def test_a_second_backward_adds_out_of_place():
    # .grad exists (set by the user, non-contiguous): eager's hook replaces
    # it by old + new, a new tensor whose strides follow both
    def build():
        w = torch.randn(5, 3, requires_grad=True)
        h = w * 2
        h.retain_grad()
        y = h.exp().sum()
        y.backward(retain_graph=True)
        first = h.grad
        h.grad = torch.randn(3, 5).t()
        old = h.grad
        y.backward(retain_graph=True)
        assert h.grad is not old  # out of place
        second = h.grad
        y.backward()
        return [first, second, h.grad, w.grad]

    expected, actual = _both(build)
    _same_grads(expected, actual)
    assert cagrad.counters["cache_hits"] == 2


def test_a_retained_root_gets_a_copy_of_the_root_gradient():
    def build():
        x = torch.randn(4, 3, requires_grad=True)
        y = x.sin()
        y.retain_grad()
        g = torch.randn(3, 4).t()
        y.backward(g)
        copied = y.grad is not g and y.grad.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
        return [y.grad, x.grad], copied

    (expected, e_copied), (actual, a_copied) = _both(build)
    _same_grads(expected, actual)
    assert e_copied and a_copied


def test_a_retained_gradient_that_a_leaf_also_gets():
    # the view's gradient reaches w through ViewBackward: the retained .grad
    # is a copy, w.grad holds no memory of it (as in eager)
    def build():
        w = torch.randn(6, requires_grad=True)
        h = w.view(2, 3)
        h.retain_grad()
        (h * h).sum().backward()
        shares = h.grad.untyped_storage().data_ptr() == w.grad.untyped_storage().data_ptr()
        return [h.grad, w.grad], shares

    (expected, e_shares), (actual, a_shares) = _both(build)
    _same_grads(expected, actual)
    assert e_shares is a_shares is False


def test_a_tensor_that_gets_no_gradient_keeps_none():
    def build():
        x = torch.randn(3, requires_grad=True)
        a, b = (x * 2).split([1, 2])
        b.retain_grad()
        a.retain_grad()
        a.sum().backward()
        return [a.grad, b.grad, x.grad]

    expected, actual = _both(build)
    _same_grads(expected, actual)
    assert expected[1] is None


def test_under_create_graph_it_stays_an_opaque_call(captured):
    def build():
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        h.retain_grad()
        (h * h).sum().backward(create_graph=True)
        return [h.grad, x.grad]

    expected, actual = _both(build)
    _same_grads(expected, actual)
    assert [t.requires_grad for t in expected] == [t.requires_grad for t in actual]
    assert any(
        getattr(n.target, "__name__", "") == "retain_grad" for e in captured for n in e.graph_module.graph.nodes
    )


def test_beside_an_opaque_hook_it_stays_an_opaque_call(captured):
    seen = []

    def build():
        x = torch.randn(3, 2, requires_grad=True)
        h = x.t().exp()
        h.retain_grad()
        h.register_hook(lambda g: seen.append(g.clone()))
        h.sum().backward()
        return [h.grad, x.grad]

    expected, actual = _both(build)
    _same_grads(expected, actual)
    assert len(seen) == 2
    assert any(
        getattr(n.target, "__name__", "") == "retain_grad" for e in captured for n in e.graph_module.graph.nodes
    )
