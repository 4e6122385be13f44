"""cagrad/compile/backends.py: the call wrapper for graphs that read a lifted scalar
beside CUDA tensors (their end-to-end test needs a GPU:
tests/test_models_cuda.py::test_lifted_scalar_beside_cuda_tensors_compiles_under_inductor),
and the graphs a backend must not compile (empty tensors under inductor).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

import cagrad
from cagrad.compile import backends


def _graph(*devices_and_shapes):
    """A graph shaped like cagrad's: ``inputs[i]`` reads with fake values."""
    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    reads = []
    with FakeTensorMode():
        for i, (device, shape) in enumerate(devices_and_shapes):
            node = graph.call_function(operator.getitem, (inputs, i))
            node.meta["val"] = torch.empty(shape, device=device)
            reads.append(node)
    graph.output(reads)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(
    "inputs, expected",
    [
        ([("cuda", (4,)), ("cpu", ())], True),  # x * 0.25 on CUDA
        ([("cuda", (4,)), ("cpu", (1,))], False),  # a CPU tensor, not a scalar
        ([("cpu", (4,)), ("cpu", ())], False),  # CPU only: no .item() in the code
        ([("cuda", (4,)), ("cuda", ())], False),
    ],
)
def test_scalar_beside_cuda_is_read_from_the_fake_inputs(inputs, expected):
    assert backends._scalar_beside_cuda(_graph(*inputs)) is expected


def test_without_alias_check_turns_the_check_off_for_the_call_only():
    if not hasattr(functorch_config, "check_custom_op_aliasing"):
        pytest.skip("this torch has no check_custom_op_aliasing")
    seen = []
    wrapped = backends._WithoutAliasCheck(lambda *args: seen.append(functorch_config.check_custom_op_aliasing) or args)
    before = functorch_config.check_custom_op_aliasing
    assert wrapped(1, 2) == (1, 2)
    assert seen == [False] and functorch_config.check_custom_op_aliasing == before

    def boom(*args):
        raise ValueError("backend error")

    with pytest.raises(ValueError):
        backends._WithoutAliasCheck(boom)()
    assert functorch_config.check_custom_op_aliasing == before


def test_segments_keep_the_fake_values_of_their_inputs(monkeypatch):
    """A segmented graph's segments read their inputs through new nodes that
    carry the fake values (what _scalar_beside_cuda reads)."""
    graphs = []
    real = backends._scalar_beside_cuda
    monkeypatch.setattr(backends, "_scalar_beside_cuda", lambda gm: graphs.append(gm) or real(gm))
    cagrad.reset()
    x = torch.randn(4, requires_grad=True)
    y = x.sin() * 0.25
    calls: list = []
    # it reads a list (not a pure tensor function): an opaque call, two segments
    y.register_hook(lambda g: calls.append(1) or g * 2)
    with cagrad.enable("aot_eager"):
        (y * 3).sum().backward()
    assert cagrad.counters["fallbacks"] == 0 and len(graphs) == 2
    for gm in graphs:
        reads = [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.args[0], "name", "") == "inputs"]
        assert reads and all(isinstance(n.meta.get("val"), torch.Tensor) for n in reads)
    torch.testing.assert_close(x.grad, x.detach().cos() * 0.25 * 2 * 3)


def _empty_slice_grads(backend, device):
    """Gradients of a broadcast ``where`` whose result is sliced to nothing
    (``[..., 0:0:2]``) plus a term that keeps the backward non-trivial: the
    program of a campaign's crash (illegal memory access under inductor on
    the H100), reduced."""
    torch.manual_seed(0)
    x = torch.randn(2, 2, 5, 4, device=device, requires_grad=True)
    w = torch.randn(1, 1, 5, 4, device=device, requires_grad=True)
    loss = torch.where(x.sin() > 0, w, x)[:, :, :, 0:0:2].sum() + (x * w).sum()
    if backend is None:
        return torch.autograd.grad(loss, [x, w])
    with cagrad.enable(backend):
        return torch.autograd.grad(loss, [x, w])


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
)
def test_an_expanded_empty_tensor_keeps_a_graph_from_inductor(device):
    """Inductor may load element 0 of an expanded empty tensor, whose address
    torch makes null: such a backward runs in eager with the reason counted;
    aot_eager, which runs the aten ops, compiles it. Both give eager's
    gradients."""
    expected = _empty_slice_grads(None, device)
    got = _empty_slice_grads("inductor", device)
    assert dict(cagrad.counters["fallback_reasons"]) == {"empty_broadcast:inductor": 1}
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    cagrad.reset()
    got = _empty_slice_grads("aot_eager", device)
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["captures"] == 1
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_empty_broadcast_names_an_empty_tensor_with_every_stride_zero():
    """A static size 0 with every stride 0 is named; an empty tensor indexed
    by a nonzero stride (cuDNN's empty reserve, shape ``[0]``) and a
    non-empty expanded one are not."""
    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    with FakeTensorMode():
        vals = [torch.empty(0), torch.empty(1, 3).expand(4, 3), torch.empty(()).expand(2, 5, 0)]
    for i, val in enumerate(vals):
        node = graph.call_function(operator.getitem, (inputs, i))
        node.meta["val"] = val
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert backends._empty_broadcast(gm) == "getitem_2 (shape [2, 5, 0], strides [0, 0, 0])"
    gm.graph.erase_node(list(gm.graph.nodes)[-1])
    assert backends._empty_broadcast(gm) is None


def _scatter_graph(target, result_shape, source, device, accumulate=None):
    """``target(result, ..., source)`` with fake values: the result of
    ``result_shape`` on ``device``, ``source`` built from a fake tensor."""
    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    with FakeTensorMode():
        zeros = torch.zeros(result_shape, device=device)
        src = source(device)
        index = torch.zeros(src.shape[-1], dtype=torch.long, device=device)
        reads = []
        for i, val in enumerate((zeros, index, src)):
            node = graph.call_function(operator.getitem, (inputs, i))
            node.meta["val"] = val
            reads.append(node)
        if target is torch.ops.aten.index_put.default:
            args = (reads[0], [reads[1]], reads[2], accumulate)
            val = target(zeros, [index], src, accumulate)
        else:
            dim = len(result_shape) - 1
            args = (reads[0], dim, reads[1], reads[2])
            val = target(zeros, dim, index, src)
    out = graph.call_function(target, args)
    out.meta["val"] = val
    graph.output([out])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _expanded(device):
    return torch.ones((), device=device).expand(1, 1, 3)


@pytest.mark.parametrize(
    "target, result_shape, source, device, accumulate, named",
    [
        # the backward of index_select on a one-element leaf, on CUDA
        (torch.ops.aten.index_add.default, (1, 1, 1), _expanded, "cuda", None, True),
        (torch.ops.aten.index_add.default, (1, 1, 1), _expanded, "cpu", None, False),  # CPU inductor is right
        # a source inductor may compute in the kernel from a broadcast value
        # (a traced hook's scale of the expanded gradient) looks dense here
        (torch.ops.aten.index_add.default, (1, 1, 1), lambda d: torch.ones(1, 1, 3, device=d), "cuda", None, True),
        (torch.ops.aten.index_add.default, (1, 1, 2), _expanded, "cuda", None, False),  # two elements: right
        (torch.ops.aten.index_add_.default, (1, 1, 1), _expanded, "cuda", None, True),  # in place
        (torch.ops.aten.index_put.default, (1,), lambda d: torch.ones((), device=d).expand(3), "cuda", True, True),
        (torch.ops.aten.index_put.default, (1,), lambda d: torch.ones((), device=d).expand(3), "cuda", False, False),
    ],
)
def test_one_element_scatter_names_an_add_into_one_cuda_element(
    target, result_shape, source, device, accumulate, named
):
    gm = _scatter_graph(target, result_shape, source, device, accumulate)
    found = backends._one_element_scatter(gm)
    assert (found is not None) is named, found
    if named:
        with pytest.raises(cagrad.Unsupported) as err:
            backends.check_graph("inductor", gm)
        assert err.value.reason == "one_element_scatter_add:inductor"
        backends.check_graph("aot_eager", gm)  # the eager kernels add once per element


def _index_select_grad(backend, device, scale_hook=False):
    """The programs of the campaign's failures (seed 41, H100): index_select
    of a 1x1x1 leaf with index [0, 0, 0], summed (d(loss)/dx = 3); with
    ``scale_hook``, transposed and with a traceable hook that doubles the
    gradient of the index_select (6)."""
    x = torch.rand(1, 1, 1, device=device, requires_grad=True)
    y = torch.index_select(x, 2, torch.tensor([0, 0, 0], device=device))
    if scale_hook:
        y.register_hook(lambda g: g * 2)
        y = y.transpose(2, 0)
    loss = y.sum()
    if backend is None:
        loss.backward()
    else:
        with cagrad.enable(backend):
            loss.backward()
    return x.grad


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
)
@pytest.mark.parametrize("scale_hook", [False, True])
def test_index_select_of_one_element_gets_eagers_gradient_under_inductor(device, scale_hook):
    """On CUDA the graph falls back with its reason (inductor's kernel gives
    4.0 for 3.0); on CPU inductor compiles it. Both give eager's value."""
    cagrad.reset()
    want = 6.0 if scale_hook else 3.0
    assert _index_select_grad(None, device, scale_hook).item() == want
    got = _index_select_grad("inductor", device, scale_hook)
    assert got.item() == want
    if device == "cuda":
        assert dict(cagrad.counters["fallback_reasons"]) == {"one_element_scatter_add:inductor": 1}
    else:
        assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["captures"] == 1
