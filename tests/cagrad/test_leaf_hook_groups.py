"""The order in which a graph with only C++-hooked accumulations is cut
(:mod:`cagrad.capture.leaf_hook_groups`), on graphs built here. End to end
(DDP's reducer, gradients against eager's, segments per capture):
``test_distributed.py``'s ``grouped`` and ``per_leaf`` cases."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

import cagrad
from cagrad.capture import leaf_hook_groups, runtime_ops
from cagrad.capture.traced import OPAQUE_TARGETS

from .conftest import run_both, same


def _graph(grad_sizes, other_opaque=None, post_hooks=False, ddp_python=False):
    """inputs -> a chain of ops; after op k, leaf k's accumulation of its
    result (``grad_sizes[k]`` float32 elements, None: no traced value) and
    the leaf's C++ hooks, each read from ``hooks`` just before its call, as
    the capture writes them."""
    g = torch.fx.Graph()
    inputs, hooks = g.placeholder("inputs"), g.placeholder("hooks")
    g.placeholder("sizes")
    x = g.call_function(operator.getitem, (inputs, 0))
    ops = []
    for k, n in enumerate(grad_sizes):
        x = g.call_function(torch.ops.aten.sin.default, (x,))
        if n is not None:
            x.meta["val"] = torch.empty(n)
        ops.append(x)
        leaf = g.call_function(operator.getitem, (hooks, 2 * k))
        post = g.call_function(operator.getitem, (hooks, 99)) if post_hooks and k == 1 else None
        acc = g.call_function(runtime_ops.accumulate, (leaf, x, post))
        if ddp_python and post is not None:
            acc.meta["cagrad_ddp_python_hooks"] = True  # as the capture marks them
        if k == other_opaque:
            g.call_function(runtime_ops.tensor_pre_hooks, (leaf, x))
        cpp = g.call_function(operator.getitem, (hooks, 2 * k + 1))
        g.call_function(runtime_ops.cpp_post_hooks, (cpp,))
    g.output([x])
    return g, ops


def _kinds(order):
    """The order as letters: s (a tensor op), a (accumulate), h (C++
    hooks), p (tensor pre-hooks); item reads and placeholders left out."""
    letter = {
        torch.ops.aten.sin.default: "s",
        runtime_ops.accumulate: "a",
        runtime_ops.cpp_post_hooks: "h",
        runtime_ops.tensor_pre_hooks: "p",
    }
    return "".join(letter[n.target] for n in order if n.target in letter)


@pytest.fixture
def limit(monkeypatch):
    def set_to(value):
        monkeypatch.setenv("CAGRAD_LEAF_HOOK_GROUP_BYTES", str(value))

    return set_to


def test_accumulations_wait_until_their_gradients_reach_the_limit(limit):
    g, _ = _graph([10, 10, 10, 10, 10])  # 40 bytes each
    limit(80)
    order = leaf_hook_groups.ordered_nodes(g, OPAQUE_TARGETS)
    # groups of two gradients (80 bytes), the last one before the output
    assert _kinds(order) == "ss" + "ahah" + "ss" + "ahah" + "s" + "ah"
    assert order[-1].op == "output"
    _assert_topological(order)
    moved = [n for n in order if n.target in (runtime_ops.accumulate, runtime_ops.cpp_post_hooks)]
    assert moved == [n for n in g.nodes if n.target in (runtime_ops.accumulate, runtime_ops.cpp_post_hooks)]


def test_the_default_limit_puts_a_small_graphs_accumulations_last(monkeypatch):
    monkeypatch.delenv("CAGRAD_LEAF_HOOK_GROUP_BYTES", raising=False)
    assert leaf_hook_groups.group_bytes() == 1 << 20
    g, _ = _graph([10, 10, 10])
    assert _kinds(leaf_hook_groups.ordered_nodes(g, OPAQUE_TARGETS)) == "sss" + "ahahah"


def test_a_gradient_of_unknown_size_closes_its_group(limit):
    g, _ = _graph([10, None, 10, 10])
    limit(1000)
    assert _kinds(leaf_hook_groups.ordered_nodes(g, OPAQUE_TARGETS)) == "ss" + "ahah" + "ss" + "ahah"


def test_a_zero_limit_keeps_the_order(limit):
    g, _ = _graph([10, 10, 10], other_opaque=1)
    limit(0)
    assert leaf_hook_groups.ordered_nodes(g, OPAQUE_TARGETS) == list(g.nodes)


def test_an_accumulation_with_user_post_hooks_stays_and_others_wait_for_it(limit):
    # leaf 1's accumulation runs the user's post-accumulate-grad hook: it
    # stays where it is (A) and leaf 0's waits only up to it
    g, _ = _graph([10, 10, 10], post_hooks=True)
    limit(1000)
    order = leaf_hook_groups.ordered_nodes(g, OPAQUE_TARGETS)
    user = [n for n in g.nodes if n.target is runtime_ops.accumulate and n.args[2] is not None]
    assert _kinds(order) == "ss" + "ah" + "a" + "s" + "hah"
    accumulations = [n for n in order if n.target is runtime_ops.accumulate]
    assert accumulations[1] is user[0]


def test_accumulations_wait_but_never_pass_another_opaque_call(limit):
    # a tensor pre-hook (p: user code) after leaf 1's accumulation: leaf 0's
    # and leaf 1's wait for it and run just before it; leaf 1's C++ hooks,
    # after it in the graph, stay after it
    g, _ = _graph([10, 10, 10], other_opaque=1)
    limit(1000)
    order = leaf_hook_groups.ordered_nodes(g, OPAQUE_TARGETS)
    assert _kinds(order) == "ss" + "aha" + "p" + "s" + "hah"
    assert set(order) == set(g.nodes) and len(order) == len(g.nodes)


def test_ddp_python_reducer_hooks_move_with_their_accumulation(limit):
    # post-accumulate-grad hooks the collector found to be DDP's
    # python-reducer hooks only: movable, unlike the user's (above)
    g, _ = _graph([10, 10, 10], post_hooks=True, ddp_python=True)
    limit(1000)
    assert _kinds(leaf_hook_groups.ordered_nodes(g, OPAQUE_TARGETS)) == "sss" + "ahahah"


def test_a_users_post_accumulate_hook_keeps_its_place_end_to_end():
    # eager: p's accumulation runs before the r * q branch (created first,
    # lower sequence numbers); its hook scales q's storage (through .data:
    # no version bump), so r's gradient reads the scaled q. Moved after the
    # tensor ops, the hook would run too late: r.grad would differ
    def build():
        p, q, r = (torch.full((3,), v, requires_grad=True) for v in (1.0, 2.0, 3.0))

        def scale_q(t):
            q.data.mul_(10)

        p.register_post_accumulate_grad_hook(scale_q)
        ((r * q).sum() + (p * 3).sum()).backward()
        return r.grad

    expected, got = run_both(build)
    assert torch.equal(expected, torch.full((3,), 20.0))  # the scaled q
    same(got, expected)
    with cagrad.enable("eager"):
        same(build(), expected)  # a hit
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["captures"] == 1


def test_a_users_hook_sees_the_grads_eager_accumulated_before_it():
    # eager runs the p branch first (created last): p's accumulation comes
    # before the hook on t, which reads p.grad; the accumulation may wait,
    # but not past that hook
    def build():
        p, q, r = (torch.full((3,), v, requires_grad=True) for v in (1.0, 2.0, 3.0))
        seen = []
        t = r * q
        t.register_hook(lambda g: seen.append(None if p.grad is None else p.grad.clone()))
        (t.sum() + (p * 3).sum()).backward()
        return seen

    expected, got = run_both(build)
    assert len(expected) == 1 and torch.equal(expected[0], torch.full((3,), 3.0))
    with cagrad.enable("eager"):
        again = build()  # a hit
    for seen in (got, again):
        assert len(seen) == 1
        same(seen[0], expected[0])
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["captures"] == 1


@pytest.mark.parametrize("value", ["abc", "-1", "1.5"])
def test_a_malformed_limit_is_an_error_that_names_the_variable(limit, value):
    limit(value)
    with pytest.raises(ValueError, match="CAGRAD_LEAF_HOOK_GROUP_BYTES"):
        leaf_hook_groups.group_bytes()


def _assert_topological(order):
    seen = set()
    for node in order:
        assert all(a in seen for a in node.all_input_nodes), node
        seen.add(node)


def test_a_group_ends_before_an_item_read_of_a_tensor_ops_result(limit):
    """Only item reads of the placeholders (the graph's inputs, hooks,
    sizes) let a group wait past them; the read of a multi-result op's
    item is a tensor op like any other: the group runs before it."""
    g = torch.fx.Graph()
    inputs, hooks = g.placeholder("inputs"), g.placeholder("hooks")
    g.placeholder("sizes")
    x = g.call_function(operator.getitem, (inputs, 0))
    var_mean = g.call_function(torch.ops.aten.var_mean.correction, (x,))
    var = g.call_function(operator.getitem, (var_mean, 0))
    var.meta["val"] = torch.empty(10)  # 40 bytes: the limit
    leaf = g.call_function(operator.getitem, (hooks, 0))
    acc = g.call_function(runtime_ops.accumulate, (leaf, var, None))
    cpp = g.call_function(operator.getitem, (hooks, 1))
    post = g.call_function(runtime_ops.cpp_post_hooks, (cpp,))
    mean = g.call_function(operator.getitem, (var_mean, 1))
    out = g.call_function(torch.ops.aten.sin.default, (mean,))
    g.output([out])
    limit(40)
    order = leaf_hook_groups.ordered_nodes(g, OPAQUE_TARGETS)
    assert order[order.index(cpp) + 1 :] == [acc, post, mean, out, order[-1]]
    _assert_topological(order)
