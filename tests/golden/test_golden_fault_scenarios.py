"""The fault-class scenarios pin eager's behaviour, checked against eager."""

from __future__ import annotations

import torch

import cagrad
from cagrad.api import backward_arguments
from cagrad.keys.collection import collect_backward
from golden_graphs import scenarios


def test_ready_queue_ties_runs_accumulate_grads_in_eagers_order():
    """The run order of ready_queue_ties's tied AccumulateGrads (what its
    snapshot pins) is the order eager's post-accumulate-grad hooks fire in."""
    bw = scenarios.build("ready_queue_ties")
    outs, grads, ins = backward_arguments(bw.outputs, bw.grad_outputs, bw.inputs)
    task = collect_backward(outs, grads, ins, accumulate_grad=True).task
    accumulates = [c for c in task.order if type(c.node).__name__ == "AccumulateGrad"]
    leaves = [c.node.variable for c in accumulates]
    assert len(leaves) == 7
    # the ties are not popped in discovery order: a first-come tie-break differs
    assert [c.id for c in accumulates] != sorted(c.id for c in accumulates)
    fired: list[torch.Tensor] = []
    for t in leaves:
        t.register_post_accumulate_grad_hook(fired.append)
    torch.autograd.backward(outs, grads)
    assert [id(t) for t in fired] == [id(t) for t in leaves]


def test_multi_output_post_hooks_see_the_outputs_eager_computes():
    """In grad_inputs_one_output_of_multi_output_node, the node post hooks'
    arguments in the captured graph are None exactly where eager's nodes
    hand their post hooks None (outputs for nodes that do not run)."""
    bw = scenarios.build("grad_inputs_one_output_of_multi_output_node")
    graph = cagrad.capture(bw.outputs, bw.grad_outputs, bw.inputs).graph_module.graph
    captured = [
        [a is None for a in n.args[1]]
        for n in graph.nodes
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "node_post_hooks"
    ]
    seen: list[list[bool]] = []
    stack, visited = [bw.outputs.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in visited:
            continue
        visited.add(fn)
        if type(fn).__name__ in ("AddmmBackward0", "MmBackward0"):
            fn.register_hook(lambda grad_inputs, grad_outputs: seen.append([g is None for g in grad_inputs]))
        stack.extend(f for f, _ in fn.next_functions)
    torch.autograd.grad(bw.outputs, bw.inputs)
    assert captured == seen == [[False, True], [True, True, False]]
