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



def test_nodes_saved_in_more_hook_scopes_than_kept_run_their_hooks(monkeypatch):
    """More scopes of saved-tensor hooks than the intervals cagrad keeps: the
    oldest two are merged, and the nodes saved in every scope still run their
    unpack hooks as in eager (a survivor of the mutation run,
    docs/mutation-testing.md: the merged interval put out of order made a
    node of the third-oldest scope look hook-free, and no check noticed)."""
    from cagrad.autograd import saved_variables

    monkeypatch.setattr(saved_variables, "_MAX_INTERVALS", 4)  # merges after 4 scopes, not 256

    def build(tr):
        saved_variables._intervals.clear()  # this run's scopes are the oldest

        def unpacker(k):
            def unpack(t):
                tr.append((f"unpack {k}", t))
                return t

            return unpack

        xs = [torch.randn(3, requires_grad=True) for _ in range(7)]
        ys = []
        for k, x in enumerate(xs):
            torch.ones(1, requires_grad=True).exp()  # a node between two scopes keeps their intervals apart
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, unpacker(k)):
                ys.append(x.exp())
        sum(y.sum() for y in ys).backward()
        return [x.grad for x in xs]

    trace = check(build)
    assert sorted(kind for kind, _ in trace) == [f"unpack {k}" for k in range(7)]


def test_a_saved_tensor_list_with_hooks_unpacks_when_its_node_runs():
    """IndexBackward0 saves its index tensors as a list: with foreign hooks on
    them the node runs as it is, so their unpack hook runs when eager runs
    it, after the later ExpBackward0's, not while the backward is collected
    (a survivor of the mutation run, docs/mutation-testing.md: slots of
    saved tensor lists left unclaimed made the node traceable, its indices
    read, hooks run, at collection)."""

    def build(tr):
        x = torch.randn(4, 3, requires_grad=True)
        idx = torch.tensor([0, 2, 2])

        def unpacker(label):
            def unpack(t):
                tr.append((label, t))
                return t

            return unpack

        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, unpacker("unpack index")):
            y = x[idx, idx]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, unpacker("unpack exp")):
            z = y.exp()
        z.sum().backward()
        return [x.grad]

    trace = check(build)
    assert [label for label, _ in trace] == ["unpack exp", "unpack index", "unpack index"]


def test_node_saved_in_an_outer_scope_after_an_inner_one_runs_its_hooks():
    """Nested scopes of saved-tensor hooks: the inner one closes first, so
    the outer interval is added over it; a node saved in the outer scope
    after the inner one closed still runs its unpack hook as in eager (a
    survivor of the mutation run, docs/mutation-testing.md: an interval
    merge that kept the inner interval beside the outer one hid that node)."""
    from cagrad.autograd import saved_variables

    def build(tr):
        saved_variables._intervals.clear()  # this run's scopes only

        def unpacker(k):
            def unpack(t):
                tr.append((f"unpack {k}", t))
                return t

            return unpack

        x = torch.randn(3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, unpacker("outer")):
            a = x.exp()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, unpacker("inner")):
                b = a.sin()
            c = b.exp() * a.cos()  # saved after the inner scope closed
            d = c.tanh()
        d.sum().backward()
        return [x.grad]

    trace = check(build)
    assert sorted(kind for kind, _ in trace).count("unpack outer") >= 4
