"""Backward semantics under cagrad equal eager's, bit for bit.

Each case builds the same graph from the same seed twice and runs its
backward once with eager autograd and once under ``cagrad.enable("eager")``
(and ``aot_eager`` where the case is about the graph rather than the
runtime). The results compared are the leaves' ``.grad`` (None included) and
``autograd.grad``'s tuple; each case also checks that cagrad compiled it.
"""

from __future__ import annotations

import pytest
import torch

import cagrad

from .conftest import run_both, same


def leaves():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    c = torch.randn(3, 4)  # does not require grad
    return a, b, c


def assert_compiled():
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] >= 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_backward_fills_leaf_grads_and_leaves_others(backend):
    def build():
        a, b, c = leaves()
        ((a * b).sin() + c).sum().backward()
        return a.grad, b.grad, c.grad

    (ea, eb, ec), (ca, cb, cc) = run_both(build, backend)
    same(ea, ca)
    same(eb, cb)
    assert ec is None and cc is None
    assert_compiled()


def test_autograd_grad_returns_and_does_not_touch_grad():
    def build():
        a, b, c = leaves()
        h = a * b
        out = torch.autograd.grad(h.sin().sum(), [h, a, b])
        return (*out, a.grad, b.grad)

    expected, actual = run_both(build)
    for e, g in zip(expected, actual):
        same(e, g)
    assert actual[-1] is None and actual[-2] is None
    assert_compiled()


def test_autograd_grad_allow_unused_gives_none():
    def build():
        a, b, _ = leaves()
        return torch.autograd.grad((a * 2).sum(), [a, b], allow_unused=True)

    (ea, eb), (ca, cb) = run_both(build)
    same(ea, ca)
    assert eb is None and cb is None
    assert_compiled()


def test_autograd_grad_input_unreachable_from_root():
    def build():
        a, b, _ = leaves()
        return torch.autograd.grad((b * 2).sum(), [a], allow_unused=True)

    (e,), (c,) = run_both(build)
    assert e is None and c is None


def test_autograd_grad_materialize_grads():
    def build():
        a, b, _ = leaves()
        return torch.autograd.grad((a * 2).sum(), [a, b], materialize_grads=True)

    (ea, eb), (ca, cb) = run_both(build)
    same(ea, ca)
    same(eb, cb)


def test_backward_inputs_restricts_to_given_leaves():
    def build():
        a, b, _ = leaves()
        (a * b).exp().sum().backward(inputs=[b])
        return a.grad, b.grad

    (ea, eb), (ca, cb) = run_both(build)
    assert ea is None and ca is None
    same(eb, cb)
    assert_compiled()


def test_several_roots_and_a_root_given_twice():
    def build():
        a, b, _ = leaves()
        y1 = (a * b).sum()
        y2 = a.exp().mean()
        torch.autograd.backward([y1, y2, y1])
        return a.grad, b.grad

    expected, actual = run_both(build)
    for e, g in zip(expected, actual):
        same(e, g)
    assert_compiled()


def test_non_scalar_root_with_gradient():
    def build():
        a, b, _ = leaves()
        y = a * b
        y.backward(torch.linspace(-1, 1, 12).reshape(3, 4))
        return a.grad, b.grad

    expected, actual = run_both(build)
    for e, g in zip(expected, actual):
        same(e, g)
    assert_compiled()


def test_leaf_as_root_gets_a_copy_not_the_given_gradient():
    def build():
        a, _, _ = leaves()
        g = torch.ones(3, 4)
        a.backward(g)
        return a.grad, g, a.grad is g

    (eg, _, e_alias), (cg, g, c_alias) = run_both(build)
    same(eg, cg)
    assert e_alias is False and c_alias is False
    cg.mul_(3)
    assert torch.equal(g, torch.ones(3, 4)), "the caller's gradient was modified through .grad"


def test_retain_graph_then_second_backward_is_a_cache_hit():
    def build():
        a, b, _ = leaves()
        y = (a * b).exp().sum()
        y.backward(retain_graph=True)
        first = a.grad.clone()
        y.backward()
        return first, a.grad, b.grad

    expected, actual = run_both(build)
    for e, g in zip(expected, actual):
        same(e, g)
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 1


def test_existing_grad_is_accumulated_in_place():
    def build():
        a, b, _ = leaves()
        a.grad = torch.ones(3, 4)
        held = a.grad
        (a * b).sum().backward()
        return a.grad, held is a.grad

    (eg, e_same), (cg, c_same) = run_both(build)
    same(eg, cg)
    assert e_same and c_same


def test_gradients_of_two_leaves_do_not_share_storage():
    def build():
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        (a + b).sum().backward()
        a.grad.mul_(2)  # would leak into b.grad if they shared storage
        return a.grad, b.grad

    expected, actual = run_both(build)
    for e, g in zip(expected, actual):
        same(e, g)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 3).t(),
        lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.randn(4, 6)[:, ::2],
        lambda: torch.randn(1, 4).expand(3, 4),
    ],
    ids=["transposed", "channels_last", "strided_slice", "expanded"],
)
def test_grad_layout_follows_the_layout_contract(make):
    def build():
        p = make().requires_grad_()
        (p.exp() * 2).sum().backward()
        return p.grad, p.grad.stride()

    (eg, es), (cg, cs) = run_both(build)
    same(eg, cg)
    assert es == cs


def test_mixed_dtypes_and_broadcasting():
    def build():
        a = torch.randn(3, 1, requires_grad=True)
        b = torch.randn(1, 4, dtype=torch.float64, requires_grad=True)
        ((a * b).tanh() + a).sum().backward()
        return a.grad, b.grad

    expected, actual = run_both(build)
    for e, g in zip(expected, actual):
        same(e, g)
    assert expected[0].dtype == torch.float32
    assert_compiled()


def test_leaf_whose_requires_grad_was_turned_off_is_left_alone():
    def build():
        a, b, _ = leaves()
        y = (a * b).sum()
        a.requires_grad_(False)
        y.backward()
        return a.grad, b.grad

    (ea, eb), (ca, cb) = run_both(build)
    assert ea is None and ca is None
    same(eb, cb)


def test_float64_and_inputs_of_integer_dtype_in_the_graph():
    def build():
        w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
        idx = torch.tensor([0, 2, 2, 4])
        w[idx].pow(2).sum().backward()
        return (w.grad,)

    (e,), (c,) = run_both(build)
    same(e, c)
    assert_compiled()


def test_cache_hit_for_same_structure_with_new_values():
    def step(seed):
        torch.manual_seed(seed)
        a, b, _ = leaves()
        (a * b).sin().sum().backward()
        return a.grad

    expected = [step(s) for s in range(3)]
    with cagrad.enable("eager"):
        actual = [step(s) for s in range(3)]
    for e, g in zip(expected, actual):
        same(e, g)
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 2


@pytest.mark.parametrize(
    "variant",
    [
        lambda x: x.sum(0),
        lambda x: x.sum(1),
        lambda x: x.sum(),
        lambda x: x.mean(1, keepdim=True),
        lambda x: x[1:].sum(0),
        lambda x: x.t().reshape(-1)[:5],
    ],
    ids=["sum0", "sum1", "sumall", "mean1k", "slice", "view"],
)
def test_different_attributes_are_different_graphs(variant):
    """The same op with another baked attribute (dim, slice, size) must not
    hit a graph traced for the first one: each variant runs after all the
    others were captured, and must still equal eager."""
    variants = [lambda x: x.sum(0), lambda x: x.sum(1), lambda x: x.sum(), lambda x: x.mean(1, keepdim=True),
                lambda x: x[1:].sum(0), lambda x: x.t().reshape(-1)[:5]]

    def build(fn):
        torch.manual_seed(0)
        x = torch.randn(4, 4, requires_grad=True)
        out = fn(x.exp())
        out.backward(torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape))
        return x.grad

    expected = build(variant)
    with cagrad.enable("eager"):
        for v in variants:
            build(v)
        actual = build(variant)
    same(expected, actual)
    assert cagrad.counters["captures"] == len(variants)


@pytest.mark.parametrize("dynamic, captures", [(False, 2), (True, 1)])
def test_shape_change_with_right_gradients(dynamic, captures):
    """dynamic=False: a new size is one more capture (with the changed sizes
    as symbols); dynamic=True: sizes are symbols from the start."""

    def step(n):
        torch.manual_seed(n)
        w = torch.randn(4, 3, requires_grad=True)
        x = torch.randn(n, 4)
        (x @ w).relu().sum().backward()
        return w.grad

    sizes = [2, 2, 5, 2, 5, 7]
    expected = [step(n) for n in sizes]
    with cagrad.enable("eager", dynamic=dynamic):
        actual = [step(n) for n in sizes]
    for e, g in zip(expected, actual):
        same(e, g)
    assert cagrad.counters["captures"] == captures
    assert cagrad.counters["cache_hits"] == len(sizes) - captures
    assert cagrad.counters["recompiles_shape"] == captures - 1


def test_integer_root_gradient_is_cast_as_eager_casts_it():
    def build():
        x = torch.randn(3, requires_grad=True)
        (x * 2).exp().backward(torch.arange(3))
        return (x.grad,)

    (e,), (c,) = run_both(build)
    same(e, c)
    assert e.dtype == torch.float32


def test_batch_norm_with_update_is_compiled():
    """BatchNormWithUpdateBackward0 keeps a ``bool retain_variables`` Python
    cannot see (bookkeeping of its saved tensors' release, not an input of
    its formula): the node is traced into the graph (not run as it is, an
    opaque ``call_node``, for hidden state) and the gradients equal eager's."""

    def forward():
        x = torch.randn(4, 3, 5, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        y = torch.ops.aten._batch_norm_with_update(x, w, b, torch.zeros(3), torch.ones(3), 0.1, 1e-5)[0]
        assert type(y.grad_fn).__name__ == "BatchNormWithUpdateBackward0"
        return (y * y).sum(), (x, w, b)

    def build():
        loss, inputs = forward()
        return torch.autograd.grad(loss, inputs)

    expected, actual = run_both(build)
    for e, a in zip(expected, actual):
        same(e, a)
    assert_compiled()
    loss, inputs = forward()
    graph = cagrad.capture(loss, inputs=inputs).graph_module.graph
    calls = [getattr(n.target, "__name__", "") for n in graph.nodes if n.op == "call_function"]
    assert "call_node" not in calls, calls
