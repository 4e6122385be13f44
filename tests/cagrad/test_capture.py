"""cagrad.capture traces without running, and its graph computes eager's
gradients when called on the lifted inputs."""

from __future__ import annotations

import torch

import cagrad
from cagrad.compile.variants import trace
from cagrad.keys.collection import collect_backward

from .conftest import same


def _mlp_loss(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return net, net(torch.randn(5, 4)).pow(2).mean()


def test_capture_runs_nothing_and_frees_nothing():
    net, loss = _mlp_loss()
    cap = cagrad.capture(loss)
    assert all(p.grad is None for p in net.parameters())
    assert cagrad.counters["captures"] == 0 and cagrad.counters["backwards"] == 0
    loss.backward()  # the graph is intact
    assert all(p.grad is not None for p in net.parameters())
    assert isinstance(cap.graph_module, torch.fx.GraphModule)


def test_one_cache_key_per_node_in_engine_order():
    _, loss = _mlp_loss()
    cap = cagrad.capture(loss)
    names = [k.node_type for k in cap.cache_keys]
    assert names[0] == "MeanBackward0"
    assert names.count("AccumulateGrad") == 4
    assert names.count("AddmmBackward0") == 2
    assert cap.task_key.node_type == "GraphTask"
    assert all(isinstance(k.key, bytes) and k.key for k in cap.cache_keys)


def test_same_structure_same_keys_other_structure_other_keys():
    _, a = _mlp_loss(0)
    _, b = _mlp_loss(1)  # other values, same structure
    ka = cagrad.capture(a).cache_keys
    kb = cagrad.capture(b).cache_keys
    assert ka == kb
    x = torch.randn(3, 4, requires_grad=True)
    k0 = cagrad.capture(x.sum(0).exp().sum()).cache_keys
    k1 = cagrad.capture(x.sum(1).exp().sum()).cache_keys
    assert [k.node_type for k in k0] == [k.node_type for k in k1]
    assert k0 != k1


def test_captured_graph_computes_eager_gradients():
    net, loss = _mlp_loss()
    grads = torch.autograd._make_grads((loss,), (None,), is_grads_batched=False)
    collected = collect_backward((loss,), grads, (), accumulate_grad=True)
    traced = trace(collected)
    inputs = [collected.collector.args.tensors[i] for i in traced.input_indices]
    with torch.no_grad():
        outs = traced.graph_module(inputs, [], [], [], [])
    loss.backward()
    by_leaf = {id(collected.task.order[pos].node.variable): outs[i] for pos, i in traced.leaf_outputs}
    for p in net.parameters():
        same(by_leaf[id(p)], p.grad)


def test_create_graph_capture_is_what_a_create_graph_backward_compiles():
    """capture(create_graph=True) gives the node keys and graph that
    ``autograd.grad(..., create_graph=True)`` under cagrad compiles (seen by
    an on_capture listener); its task key and graph differ from the plain
    capture's."""
    from cagrad import events
    from golden_graphs.normalize import graph_text

    def build():
        torch.manual_seed(0)
        x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        return x, (x.tanh() * w * x).sum()

    x, y = build()
    cap = cagrad.capture(y, inputs=[x], create_graph=True)
    plain = cagrad.capture(y, inputs=[x])
    seen = []
    events.on_capture.append(seen.append)
    try:
        with cagrad.enable("eager"):
            x2, y2 = build()
            (g,) = torch.autograd.grad(y2, x2, create_graph=True)
    finally:
        events.on_capture.remove(seen.append)
    (event,) = seen
    assert g.requires_grad
    assert event.cache_keys == cap.cache_keys
    assert graph_text(event.graph_module) == graph_text(cap.graph_module)
    # the task key alone says create_graph (its first byte, the tag c)
    assert cap.task_key.key == b"c" + plain.task_key.key and cap.cache_keys == plain.cache_keys
    assert "aten.detach" in graph_text(plain.graph_module)
    assert "aten.detach" not in graph_text(cap.graph_module)
