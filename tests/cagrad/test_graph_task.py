"""GraphTask runs nodes in the eager engine's order.

The oracle is eager autograd itself: a node pre-hook on every node records
the order in which the engine runs them. The same program is built twice
(same seed), once to record eager's order and once for GraphTask, and the
two node-type sequences (with each node's position in discovery order) must
match, ties between AccumulateGrad nodes included.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from cagrad.autograd.graph_task import GraphTask
from tests.conftest import examples

UNARY = [torch.sin, torch.exp, torch.tanh, lambda t: t * 1.5, lambda t: t.sum(0, keepdim=True)]
BINARY = [torch.add, torch.mul, torch.sub, lambda a, b: a * 2 + b]


def _build(seed: int, steps: list[tuple[int, int, int]], n_leaves: int, n_roots: int):
    torch.manual_seed(seed)
    leaves = [torch.randn(3, 4, requires_grad=True) for _ in range(n_leaves)]
    values = list(leaves)
    for kind, i, j in steps:
        a = values[i % len(values)]
        if kind % 2 == 0:
            values.append(UNARY[kind // 2 % len(UNARY)](a).expand(3, 4))
        else:
            b = values[j % len(values)]
            values.append(BINARY[kind // 2 % len(BINARY)](a, b))
    roots = [values[-1 - k % len(values)].sum() for k in range(n_roots)]
    return leaves, values, roots


def _discovery_index(task):
    return {id(c.node): c.id for c in task.calls}


def _eager_order(roots, inputs=None):
    order = []
    seen = set()
    handles = []
    stack = [r.grad_fn for r in roots]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        handles.append(fn.register_prehook(lambda grads, fn=fn: order.append(fn)))
        stack.extend(f for f, _ in fn.next_functions)
    if inputs is None:
        torch.autograd.backward(roots)
    else:
        torch.autograd.grad(roots, inputs, allow_unused=True)
    # each hook holds its node: a cycle through C++ that gc cannot break, which
    # would leave a live node hook dict (and cagrad's census probing) behind
    for handle in handles:
        handle.remove()
    return order


@settings(max_examples=examples(60), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    steps=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=12),
    n_leaves=st.integers(1, 4),
    n_roots=st.integers(1, 3),
)
def test_order_matches_eager_backward(seed, steps, n_leaves, n_roots):
    _, _, roots = _build(seed, steps, n_leaves, n_roots)
    eager = _eager_order(roots)
    _, _, roots2 = _build(seed, steps, n_leaves, n_roots)
    task = GraphTask(roots2, (), accumulate_grad=True)
    ours = [c for c in task.order if c.node is not None]
    assert [type(n).__name__ for n in eager] == [c.name for c in ours]
    # same positions in the graph, not only the same types: compare the
    # discovery index of each node, computed on each graph independently
    task_eager = GraphTask(roots, (), accumulate_grad=True)
    idx = _discovery_index(task_eager)
    assert [idx[id(n)] for n in eager] == [c.id for c in ours]


@settings(max_examples=examples(40), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    steps=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 50), st.integers(0, 50)), min_size=2, max_size=12),
    n_leaves=st.integers(2, 4),
    pick=st.integers(0, 100),
)
def test_inputs_restriction_matches_eager_grad(seed, steps, n_leaves, pick):
    leaves, values, roots = _build(seed, steps, n_leaves, 1)
    inputs = [values[pick % len(values)], leaves[0]]
    eager = _eager_order(roots, inputs)
    leaves2, values2, roots2 = _build(seed, steps, n_leaves, 1)
    inputs2 = [values2[pick % len(values2)], leaves2[0]]
    task = GraphTask(roots2, inputs2, accumulate_grad=False)
    # the engine runs pre-hooks only on nodes it executes (needed ones)
    ours = [c.name for c in task.order if c.node is not None and c.needed]
    assert [type(n).__name__ for n in eager] == ours
