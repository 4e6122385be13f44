"""Saved tensors are freed by a backward without retain_graph, as in eager.

A saved activation is referenced only by the autograd graph; its storage
dies when the graph releases it. ``StorageWeakRef`` watches the storage
without keeping it alive.
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import cagrad


def _graph_with_saved_activation():
    x = torch.randn(64, 64, requires_grad=True)
    h = x.exp()  # ExpBackward0 saves its result
    ref = StorageWeakRef(h.untyped_storage())
    y = h.sum()
    del h
    return x, y, ref


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_saved_tensors_freed_after_backward(backend):
    x, y, ref = _graph_with_saved_activation()
    assert not ref.expired()
    with cagrad.enable(backend):
        y.backward()
    assert cagrad.counters["captures"] == 1
    assert ref.expired(), "the saved activation outlived the backward"


def test_saved_tensors_freed_on_cache_hit():
    with cagrad.enable("eager"):
        _, y, _ = _graph_with_saved_activation()
        y.backward()
        x, y, ref = _graph_with_saved_activation()
        y.backward()
    assert cagrad.counters["cache_hits"] == 1
    assert ref.expired()


def test_retain_graph_keeps_saved_tensors():
    x, y, ref = _graph_with_saved_activation()
    with cagrad.enable("eager"):
        y.backward(retain_graph=True)
        assert not ref.expired()
        y.backward()
    assert ref.expired()


def test_eager_reference_frees_too():
    """The oracle for the tests above: eager frees the same storage."""
    x, y, ref = _graph_with_saved_activation()
    y.backward()
    assert ref.expired()


def _two_layers():
    torch.manual_seed(0)
    return torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)


def _step(lin1, lin2, x):
    """A loss whose saved activation ``h`` (saved by ``sin``) is needed
    only in the middle of the backward; returns it and ``h``'s weak ref."""
    h = lin1(x)
    ref = StorageWeakRef(h.untyped_storage())
    loss = lin2(h.sin()).square().sum()
    del h
    return loss, ref


def _grads(lin1, lin2):
    return [p.grad.clone() for p in (*lin1.parameters(), *lin2.parameters())]


def test_eager_frees_a_saved_activation_before_the_backward_ends():
    """The oracle for the next test: eager frees ``h`` once SinBackward0
    has run, before the first layer's AccumulateGrad runs."""
    lin1, lin2 = _two_layers()
    seen = []
    lin1.weight.register_post_accumulate_grad_hook(lambda p: seen.append(ref.expired()))
    loss, ref = _step(lin1, lin2, torch.randn(16, 32))
    loss.backward()
    assert seen == [True]


def _in_graph(frame) -> bool:
    """Whether ``frame`` runs a compiled graph's code: an FX GraphModule's
    generated ``forward`` (the eager backend) or inductor's output code."""
    name = frame.f_code.co_filename
    return name.startswith("<eval_with_key>") or "torchinductor" in name


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
@pytest.mark.parametrize("guarded", [True, False], ids=["guard_hit", "full_path_hit"])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_graph_frees_saved_activation_while_it_runs(backend, guarded, device, monkeypatch):
    """On a cache hit without retain_graph the graph holds the only
    reference to each saved tensor it reads and frees it after its last use
    (cagrad.compile.boxed), as eager frees it after SinBackward0: every call the
    graph's code makes is watched (``sys.setprofile``), and ``h`` must be
    alive at the first and gone at the last. The gradients are eager's."""
    import gc
    import sys

    from cagrad import compiled_backward

    gc.collect()  # hooks of earlier tests' dead graphs would keep guards off (cagrad.keys.hit_path)

    alive_at_call: list[bool] = []

    def watch(frame, event, _arg):
        caller = frame if event == "c_call" else frame.f_back if event == "call" else None
        if caller is not None and _in_graph(caller):
            alive_at_call.append(not ref.expired())

    xs = [torch.randn(16, 32, device=device) for _ in range(2)]
    lin1, lin2 = (m.to(device) for m in _two_layers())
    with cagrad.enable(backend):
        loss, ref = _step(lin1, lin2, xs[0])
        loss.backward()  # capture and first run: released after the call
        if not guarded:
            monkeypatch.setattr(compiled_backward.hit_path, "eligible_call", lambda call: False)
        lin1.zero_grad(set_to_none=True)
        lin2.zero_grad(set_to_none=True)
        loss, ref = _step(lin1, lin2, xs[1])
        sys.setprofile(watch)
        try:
            loss.backward()
        finally:
            sys.setprofile(None)
    assert cagrad.counters["cache_hits"] == 1
    assert cagrad.counters["guard_hits"] == (1 if guarded else 0)
    assert alive_at_call[0], "the saved activation was gone before the graph ran"
    assert not alive_at_call[-1], "the saved activation outlived its last use in the graph"
    lin1_eager, lin2_eager = (m.to(device) for m in _two_layers())
    _step(lin1_eager, lin2_eager, xs[1])[0].backward()
    torch.testing.assert_close(_grads(lin1, lin2), _grads(lin1_eager, lin2_eager))


@pytest.mark.parametrize("release", ["extension", "python"])
def test_a_second_backward_raises_eagers_error(release, monkeypatch):
    """Saved tensors are released by the engine's own
    ``Node::release_variables`` (the C++ extension), or slot by slot in
    Python where it cannot be built; either way a second backward raises
    the error eager raises."""
    from cagrad import native
    from cagrad.autograd import _hook_counts

    if release == "python":
        monkeypatch.setattr(native, "_native", False)
    elif _hook_counts.release_fn() is None:
        import os
        import shutil

        if shutil.which(os.environ.get("CXX", "c++")):
            pytest.fail("a C++ compiler is installed but the cagrad extension did not build")
        pytest.skip("no C++ compiler: the extension cannot be built")
    x, y, ref = _graph_with_saved_activation()
    _, y_eager, _ = _graph_with_saved_activation()
    y_eager.backward()
    with pytest.raises(RuntimeError) as eager_error:
        y_eager.backward()
    with cagrad.enable("eager"):
        y.backward()
        assert ref.expired()
        with pytest.raises(RuntimeError) as error:
            y.backward()
    assert str(error.value).split(".")[0] == str(eager_error.value).split(".")[0]
    assert "backward through the graph a second time" in str(error.value)


def test_a_copied_gradient_keeps_eagers_strides_for_odd_leaf_layouts():
    # .grad copied for a leaf whose strides are not the contiguous ones
    # although is_contiguous() holds (a size-1 dim with another stride, an
    # empty tensor), and for a plain one: eager's copy (a leaf's backward
    # with a gradient the caller still holds, so never stolen) against
    # cagrad's accumulate_grad told the gradient may not be stolen
    from cagrad.autograd.accumulate import accumulate_grad

    for shape, stride in [((3, 1, 4), (4, 99, 1)), ((0, 5), (1, 7)), ((2, 3), (3, 1)), ((2, 3), (1, 2))]:
        grad = torch.randn(shape)
        ref = torch.empty_strided(shape, stride).requires_grad_()
        ref.backward(grad)
        leaf = torch.empty_strided(shape, stride).requires_grad_()
        accumulate_grad(leaf, grad, stealable=False, create_graph=False)
        assert leaf.grad is not grad
        assert leaf.grad.stride() == ref.grad.stride(), shape
        assert torch.equal(leaf.grad, ref.grad)


def _intermediate_gradient_alive_at_the_leaf(compiled: str | None) -> list[bool]:
    """Per backward: whether the gradient an observing hook saw on ``h`` is
    still alive when the leaf's hook runs. ``h``'s gradient is read by
    ``h``'s node only; after it ran, eager holds it no more. The hooks
    cut a compiled backward into segments and opaque calls (the run's
    values by name, cagrad.capture.segments.run)."""
    alive = []

    def one():
        x = torch.randn(64, 64, requires_grad=True)
        h = x.exp()
        refs = []
        h.register_hook(lambda g: refs.append(StorageWeakRef(g.untyped_storage())) or None)
        x.register_hook(lambda g: alive.append(not refs[0].expired()) or None)
        (h.sin() * 2).sum().backward()

    if compiled is None:
        for _ in range(3):
            one()
    else:
        with cagrad.enable(compiled):
            for _ in range(3):
                one()
    return alive


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_segmented_backward_drops_a_gradient_after_its_last_reader(backend):
    cagrad.reset()
    assert _intermediate_gradient_alive_at_the_leaf(None) == [False] * 3
    assert _intermediate_gradient_alive_at_the_leaf(backend) == [False] * 3
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["cache_hits"] == 2
