"""Saved tensors are freed by a backward without retain_graph, as in eager.

A saved activation is referenced only by the autograd graph; its storage
dies when the graph releases it. ``StorageWeakRef`` watches the storage
without keeping it alive.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.multiprocessing.reductions import StorageWeakRef

import cagrad
from fuzz.functions import DetachSecond
from harness.lifetimes import collector_paused


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
    # inductor writes its code under its cache folder (TORCHINDUCTOR_CACHE_DIR
    # where set, as .ci/run sets it)
    return name.startswith(("<eval_with_key>", cache_dir()))


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


def _three_backwards(one, compiled: str | None) -> None:
    """Calls ``one()`` three times, in eager or under ``cagrad.enable(compiled)``
    (a capture, then two cache hits)."""
    if compiled is None:
        for _ in range(3):
            one()
        return
    with cagrad.enable(compiled):
        for _ in range(3):
            one()


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

    _three_backwards(one, compiled)
    return alive


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_segmented_backward_drops_a_gradient_after_its_last_reader(backend):
    cagrad.reset()
    assert _intermediate_gradient_alive_at_the_leaf(None) == [False] * 3
    assert _intermediate_gradient_alive_at_the_leaf(backend) == [False] * 3
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["cache_hits"] == 2


def _saved_activations_alive_at_each_layer(compiled: str | None, layers: int = 4) -> list[tuple[bool, ...]]:
    """Per weight, when its gradient is accumulated (its post-accumulate-grad
    hook): which layers' saved activations are still alive. Layer ``k``
    computes ``h_k = exp(h_{k-1} @ w_k)``: ``ExpBackward0`` saves ``h_k``,
    and layer ``k + 1``'s ``MmBackward0`` saves it too. Eager releases a
    node's saved tensors right after it ran, so at ``w_k``'s hook the
    activations of layers ``k`` and up are gone and the earlier ones are
    alive. The hooks cut a compiled backward into segments and opaque calls,
    as DDP's reducer hooks do."""
    seen: list[tuple[bool, ...]] = []
    torch.manual_seed(0)
    ws = [torch.randn(32, 32).mul_(0.1).requires_grad_() for _ in range(layers)]

    def one():
        refs = []
        h = torch.randn(8, 32)
        for w in ws:
            h = (h @ w).exp()
            refs.append(StorageWeakRef(h.untyped_storage()))
        loss = h.sum()
        del h
        handles = [w.register_post_accumulate_grad_hook(lambda _: seen.append(tuple(not r.expired() for r in refs)))
                   for w in ws]
        loss.backward()
        for handle in handles:
            handle.remove()
        for w in ws:
            w.grad = None

    _three_backwards(one, compiled)
    return seen


@pytest.mark.parametrize("release", ["extension", "python"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_segmented_backward_frees_each_nodes_saved_tensors_once_past_it(backend, release, monkeypatch):
    from cagrad import native

    cagrad.reset()
    eager = _saved_activations_alive_at_each_layer(None)
    # w_4 is accumulated first: layers 1-3 alive; w_1 last: none
    assert eager[:4] == [(True, True, True, False), (True, True, False, False),
                         (True, False, False, False), (False, False, False, False)]
    if release == "python":
        monkeypatch.setattr(native, "_native", False)
    assert _saved_activations_alive_at_each_layer(backend) == eager
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["cache_hits"] == 2


def _adoptions(compiled: str | None, keep: bool) -> list[tuple[bool, bool]]:
    """Per backward: whether ``w.grad`` is the very gradient ``w``'s hook saw
    (adopted, no copy), and whether a gradient the hook kept still holds the
    values it was handed. The hook (not traceable: it appends to a list)
    cuts a compiled backward into segments and opaque calls; with ``keep``
    it also holds on to the gradient, so eager copies it into ``.grad``."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    out = []

    def one():
        seen, kept = [], []

        def hook(g):
            seen.append(g.data_ptr())
            if keep:
                kept.append((g, g.clone()))

        handle = w.register_hook(hook)
        (x @ w).tanh().sum().backward()
        handle.remove()
        adopted = w.grad.data_ptr() == seen[0]
        intact = all(torch.equal(g, copy) for g, copy in kept)
        out.append((adopted, intact))

    _three_backwards(one, compiled)
    return out


@pytest.mark.parametrize("keep", [False, True], ids=["free", "kept_by_a_hook"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_segmented_backward_adopts_a_gradient_into_grad_as_eager_does(backend, keep):
    """Eager's AccumulateGrad makes a gradient no one else holds ``.grad``
    without a copy, and copies one that a hook kept; the later backwards
    then add in place into ``.grad``, which must leave the kept one alone."""
    from cagrad import native

    if native.sole_fn() is None:
        pytest.skip("no C++ extension: a segmented run copies every gradient")
    cagrad.reset()
    eager = _adoptions(None, keep)
    # the first backward adopts or copies; the next ones add into .grad
    assert eager == [(not keep, True), (False, True), (False, True)]
    assert _adoptions(backend, keep) == eager
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["cache_hits"] == 2


class _SavesItsResult(torch.autograd.Function):
    """exp, saving its result with ``ctx.save_for_backward``: under cagrad
    a custom Function's node runs as PyNode would (an opaque call), and its
    saved tensors are released by the run, not lifted into the graph."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def _custom_saved_alive_at_the_first_layer(compiled: str | None) -> list[bool]:
    """Per backward: whether the tensor the custom Function saved is still
    alive at ``w1``'s post-accumulate-grad hook, after that node ran (and
    the ``MmBackward0`` that saved the same tensor). Eager releases a
    PyNode's saved tensors right after it ran."""
    seen: list[bool] = []
    torch.manual_seed(0)
    w1 = torch.randn(32, 32).mul_(0.1).requires_grad_()
    w2 = torch.randn(32, 32).mul_(0.1).requires_grad_()

    def one():
        h = _SavesItsResult.apply(torch.randn(8, 32) @ w1)
        ref = StorageWeakRef(h.untyped_storage())
        loss = (h @ w2).sum()
        del h
        handle = w1.register_post_accumulate_grad_hook(lambda _: seen.append(not ref.expired()))
        loss.backward()
        handle.remove()
        w1.grad = w2.grad = None

    _three_backwards(one, compiled)
    return seen


def test_a_segmented_backward_frees_a_custom_functions_saved_tensors_once_past_it():
    """The nodes run as they are (cagrad.run.runtime._PastNodes' calls) are
    released as the run goes past them too, not only at its end."""
    cagrad.reset()
    assert _custom_saved_alive_at_the_first_layer(None) == [False] * 3
    assert _custom_saved_alive_at_the_first_layer("eager") == [False] * 3
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["cache_hits"] == 2


def _leaves_of_a_program(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    return x, w


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_dynamic_capture_keeps_no_tensor_of_its_program(backend):
    """The backward at a second size is traced and compiled with symbols;
    cagrad's ShapeEnv kept the frames it was asked from during the backend's
    compile, their locals the collected backward, and so the program's
    leaves and lifted tensors for as long as the graph stayed cached (found
    by harness.lifetimes; aot_eager only). Eager frees them with the
    program: here, with Python's cyclic collector off."""
    refs = []
    with collector_paused():
        for rows in (4, 5, 6):
            x, w = _leaves_of_a_program(rows)
            refs.append((StorageWeakRef(x.untyped_storage()), StorageWeakRef(w.untyped_storage())))
            with cagrad.enable(backend):
                (x @ w).sin().sum().backward()
            del x, w
            assert all(r.expired() for pair in refs for r in pair), f"a program's leaves outlived it at {rows} rows"
    assert cagrad.counters["captures"] == 2  # static, then symbolic


def test_a_resumed_backward_leaves_no_reference_cycle():
    """A node pre-hook on a custom Function: the run deopts and the
    interpreter finishes it; its hook-registration callback referred to the
    interpreter, which holds the runtime objects (the leaves among them), a
    cycle only Python's cyclic collector freed (found by harness.lifetimes).
    Eager frees the leaves when the program drops them."""
    with collector_paused():
        x = torch.rand(2, dtype=torch.float64, requires_grad=True)
        y = torch.rand((), dtype=torch.float64, requires_grad=True)
        out = DetachSecond.apply(x, y)
        seen = []
        out.grad_fn.register_prehook(lambda grads: seen.append(len(grads)))
        refs = [StorageWeakRef(x.untyped_storage()), StorageWeakRef(y.untyped_storage())]
        with cagrad.enable("eager"):
            out.sum().backward()
        del x, y, out
        assert seen == [1]
        assert all(r.expired() for r in refs), "the leaves are held in a reference cycle"


def test_a_checkpointed_backward_leaves_no_reference_cycle():
    """A non-reentrant checkpoint: claiming a slot that carries checkpoint's
    pack hooks fails, and the error kept by the claim held its traceback,
    whose frames refer to the claim's (and every caller's, the loss and the
    leaf in their locals): a cycle only Python's cyclic collector freed
    (found by harness.lifetimes). Eager frees them when the program drops
    them."""
    with collector_paused():
        x = torch.rand(3, 4, 4, 2, requires_grad=True)
        out = torch.utils.checkpoint.checkpoint(lambda t: torch.logsumexp(t, [0], keepdim=True), x, use_reentrant=False)
        loss = out.sum()
        refs = [StorageWeakRef(x.untyped_storage()), StorageWeakRef(loss.untyped_storage())]
        with cagrad.enable("eager"):
            loss.backward()
        assert x.grad is not None
        del x, out, loss
        assert all(r.expired() for r in refs), "the leaf or the loss is held in a reference cycle"
