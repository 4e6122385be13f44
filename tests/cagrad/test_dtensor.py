"""DTensor backwards on a one-rank gloo mesh (cagrad.keys.subclasses).

A DTensor is a wrapper subclass: cagrad lifts its local tensor, keys its
placements and metadata by value and its device mesh by identity, traces
its ``__torch_dispatch__`` (sharding propagation, then the local op), and
rebuilds a DTensor gradient after the graph. Every ``.grad`` is compared
with eager autograd run on copies of the same inputs: class, placements,
the mesh object, local values bit for bit and local strides. Two ranks are
the ``tensor_parallel`` stack (tests/harness/test_stacks.py).
"""

from __future__ import annotations


import pytest
import torch

import cagrad

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
dtensor = pytest.importorskip("torch.distributed.tensor")
Shard, Replicate = dtensor.Shard, dtensor.Replicate


@pytest.fixture(scope="module")
def mesh():
    # one rank: an in-process store, no port (suite workers run side by side)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dtensor.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _leaf(mesh, value, placements):
    return dtensor.distribute_tensor(value.clone(), mesh, placements).requires_grad_(True)


def _same_grad(actual, expected):
    assert type(actual) is type(expected)
    assert actual.placements == expected.placements
    assert actual.device_mesh is expected.device_mesh
    assert actual.shape == expected.shape and actual.stride() == expected.stride()
    a, e = actual.to_local(), expected.to_local()
    assert a.stride() == e.stride()
    torch.testing.assert_close(a, e, rtol=0, atol=0)


def _program(x, w):
    return ((x.sin() * x) @ w).sum()


def _compare(mesh, x_placements, backend="eager", steps=3, w_mesh=None):
    """``steps`` backwards of :func:`_program` in eager and under cagrad, on
    fresh leaves from the same values; the last step accumulates two."""
    for step in range(steps):
        torch.manual_seed(step)
        xv, wv = torch.randn(4, 3), torch.randn(3, 5)
        pairs = []
        for _ in range(2):
            pairs.append((_leaf(mesh, xv, x_placements), _leaf(w_mesh or mesh, wv, [Replicate()])))
        (ex, ew), (cx, cw) = pairs
        for _ in range(2 if step == steps - 1 else 1):
            _program(ex, ew).backward()
            with cagrad.enable(backend):
                _program(cx, cw).backward()
        _same_grad(cx.grad, ex.grad)
        _same_grad(cw.grad, ew.grad)


def _counts():
    c = cagrad.counters
    return c["captures"], c["cache_hits"], c["fallbacks"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("placements", [[Shard(0)], [Replicate()]], ids=["shard0", "replicate"])
def test_dtensor_backward_compiles(mesh, backend, placements):
    _compare(mesh, placements, backend)
    assert _counts() == (1, 3, 0), dict(cagrad.counters)


def test_other_placements_recapture(mesh):
    # the placements are in the key: a Shard(0) leaf and a Replicate leaf
    # take graphs of their own (the weight's gradient is Partial for one,
    # Replicate for the other), and each hits its own (each call runs two
    # backwards)
    for placements in ([Shard(0)], [Replicate()], [Shard(0)], [Replicate()]):
        _compare(mesh, placements, steps=1)
    assert _counts() == (2, 6, 0), dict(cagrad.counters)


def test_another_mesh_object_recaptures(mesh):
    # a second mesh over the same ranks compares equal to the first; the
    # gradient eager builds carries the leaf's own mesh object, so cagrad
    # keys meshes by identity
    other = dtensor.init_device_mesh("cpu", (1,))
    assert other is not mesh
    _compare(mesh, [Shard(0)], steps=1)
    _compare(other, [Shard(0)], steps=1, w_mesh=other)
    _compare(mesh, [Shard(0)], steps=1)
    assert _counts() == (2, 4, 0), dict(cagrad.counters)


def test_matches_torch_compiled_autograd(mesh):
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    torch.manual_seed(0)
    xv, wv = torch.randn(4, 3), torch.randn(3, 5)
    tx, tw = _leaf(mesh, xv, [Shard(0)]), _leaf(mesh, wv, [Replicate()])
    cx, cw = _leaf(mesh, xv, [Shard(0)]), _leaf(mesh, wv, [Replicate()])
    with ca._enable(torch.compile(backend="eager", fullgraph=True)):
        _program(tx, tw).backward()
    torch._dynamo.reset()
    with cagrad.enable("eager"):
        _program(cx, cw).backward()
    # values only: on torch 2.11 torch's compiled autograd gives the weight a
    # Replicate gradient where eager gives Partial(sum) (cagrad gives eager's,
    # test_dtensor_backward_compiles)
    for actual, expected in ((cx.grad, tx.grad), (cw.grad, tw.grad)):
        torch.testing.assert_close(actual.full_tensor(), expected.full_tensor(), rtol=0, atol=0)
    assert _counts() == (1, 0, 0)


def _key(t):
    from cagrad.keys.cache_key import KeyWriter
    from cagrad.keys.subclasses import write_subclass

    w = KeyWriter()
    write_subclass(w, t, "x", lambda w_, inner, what: w_.size(inner.dim()))
    return w.getvalue()


def test_key_tells_placements_apart_by_value(mesh):
    # Partial and Replicate leaves differ only in their placements (no shard
    # order either way); equal placements built apart key the same
    v = torch.randn(4, 3)

    def leaf(p):
        return dtensor.DTensor.from_local(v, mesh, [p]).detach().requires_grad_(True)

    keys = [_key(leaf(p)) for p in (dtensor.Partial(), Replicate(), dtensor.Partial("max"), dtensor.Partial())]
    assert keys[0] == keys[3]
    assert len({keys[0], keys[1], keys[2]}) == 3


@pytest.mark.parametrize("grad_placements", [None, [Replicate()], [dtensor.Partial()]], ids=["none", "rep", "partial"])
def test_to_local_backward_is_traced_with_its_grad_placements(mesh, grad_placements):
    # DTensor's to_local backward (a torch Function, traced by name) builds
    # the gradient's placements from its ctx: each value is a graph of its
    # own with eager's placements
    def run(gp, x):
        y = x.to_local(grad_placements=gp)
        (y.cos() * y).sum().backward()

    torch.manual_seed(0)
    v = torch.randn(4, 3)
    for gp in (None, grad_placements, grad_placements):
        ex, cx = _leaf(mesh, v, [Replicate()]), _leaf(mesh, v, [Replicate()])
        run(gp, ex)
        with cagrad.enable("eager"):
            run(gp, cx)
        _same_grad(cx.grad, ex.grad)
    assert cagrad.counters["custom_functions_traced"] >= 1
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["graph_segments"] == cagrad.counters["captures"]
    assert cagrad.counters["captures"] == (1 if grad_placements is None else 2), dict(cagrad.counters)


def test_tensor_parallel_mlp_is_one_graph(mesh):
    # ColwiseParallel / RowwiseParallel on one rank: the from_local, to_local
    # and redistribute backwards traced, the whole backward one graph
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from harness.stacks.models import mlp

    plan = {"2": ColwiseParallel(), "4": RowwiseParallel()}
    models = [parallelize_module(mlp(torch.device("cpu"), depth=3), mesh, plan) for _ in range(2)]
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        models[0](x).pow(2).mean().backward()
        with cagrad.enable("aot_eager"):
            models[1](x).pow(2).mean().backward()
    for (name, e), (_, c) in zip(models[0].named_parameters(), models[1].named_parameters()):
        if isinstance(e.grad, dtensor.DTensor):
            _same_grad(c.grad, e.grad)
        else:
            torch.testing.assert_close(c.grad, e.grad, rtol=0, atol=0, msg=name)
    assert _counts() == (1, 2, 0), dict(cagrad.counters)
    assert cagrad.counters["graph_segments"] == 1
