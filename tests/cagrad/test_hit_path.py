"""The generated hit guards (cagrad.keys.hit_path): a guard makes hits cheaper,
never creates one. Every backward here is compared with eager autograd, and
the suite runs with CAGRAD_VERIFY_GUARDS=1, so each guarded hit is also
checked against the full collection."""

from __future__ import annotations

import contextlib
import gc
import logging

import pytest
import torch
import torch.nn as nn

import cagrad
from cagrad import engine, native

from ..models import loss_fn, mlp


@pytest.fixture(autouse=True, params=["program", "lines"])
def checks(request, monkeypatch):
    """Each test twice: the guards' structure walk and per-node checks as one
    C++ call each (cagrad.native.guard_program), and as Python lines (no C++
    walk or runner)."""
    gc.collect()  # graphs with node hooks that earlier tests left in cycles
    if request.param == "lines":
        monkeypatch.setattr(native, "collect_fn", lambda: None)
        monkeypatch.setattr(native, "walk_fn", lambda: None)
    elif native.collect_fn() is None or native.walk_fn() is None:
        pytest.skip("the C++ extension cannot be built here (no compiler)")
    return request.param


def _grads(fn, params, compiled, **enable):
    for p in params:
        p.grad = None
    if compiled:
        with cagrad.enable("eager", **enable):
            fn().backward()
    else:
        fn().backward()
    return [p.grad.clone() for p in params]


def _assert_same(fn, params, **enable):
    want = _grads(fn, params, False)
    got = _grads(fn, params, True, **enable)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
        assert torch.equal(torch.signbit(w), torch.signbit(g))


def test_a_training_loop_hits_through_the_guard():
    torch.manual_seed(0)
    model, batch = mlp()
    params = list(model.parameters())
    for step in range(4):
        x, y = batch(step)
        _assert_same(lambda: loss_fn(model(x), y), params)
    c = cagrad.counters
    assert (c["captures"], c["cache_hits"], c["guard_hits"], c["fallbacks"]) == (1, 3, 3, 0)


def test_a_root_gradient_that_requires_grad_hits_through_the_guard():
    """``backward(gradient=g)`` with ``g`` requiring grad: the full path lifts
    ``g`` detached, so its key is that of a plain ``g``; the guard accepts it
    the same way, and ``g`` stays a leaf with no gradient, as in eager."""
    torch.manual_seed(0)
    model, batch = mlp()
    params = list(model.parameters())
    for step in range(4):
        x, _ = batch(step)
        out = model(x)

        def root(compiled, step=step, out=out):
            g = torch.full_like(out, 0.5 + step).requires_grad_()
            for p in params:
                p.grad = None
            with cagrad.enable("eager") if compiled else contextlib.nullcontext():
                out.backward(g, retain_graph=not compiled)
            assert g.grad is None and g.is_leaf
            return [p.grad.clone() for p in params]

        want, got = root(False), root(True)
        for w, g in zip(want, got):
            assert torch.equal(w, g)
    c = cagrad.counters
    assert (c["captures"], c["cache_hits"], c["guard_hits"], c["fallbacks"]) == (1, 3, 3, 0)


def _counts():
    c = cagrad.counters
    return c["captures"], c["cache_hits"], c["guard_hits"]


def test_a_new_attribute_value_is_not_a_guarded_hit():
    x = torch.randn(4, 5, requires_grad=True)
    _assert_same(lambda: x.cumsum(0).sin().sum(), [x])
    _assert_same(lambda: x.cumsum(1).sin().sum(), [x])  # same structure, other dim
    assert _counts() == (2, 0, 0)
    _assert_same(lambda: x.cumsum(0).sin().sum(), [x])
    assert _counts() == (2, 1, 1)


@pytest.mark.parametrize("first, second", [(0.0, -0.0), (1.5, 2.5), (2.0, 2)])
def test_scalar_attributes_are_compared_as_the_key_writes_them(first, second):
    # LeakyReluBackward0 keeps negative_slope as an attribute (a key value):
    # -0.0 and 0.0 are equal floats but other gradients (their sign), and 2
    # and 2.0 are other key bytes: each is a capture of its own
    x = torch.randn(6, requires_grad=True)
    _assert_same(lambda: nn.functional.leaky_relu(x, first).sum(), [x])
    _assert_same(lambda: nn.functional.leaky_relu(x, second).sum(), [x])
    assert _counts() == (2, 0, 0)


def test_another_run_order_is_not_a_guarded_hit():
    x = torch.randn(5, requires_grad=True)

    def sin_first():
        a = x.sin()
        b = x.cos()
        return (a * b).sum()

    def cos_first():
        b = x.cos()
        a = x.sin()
        return (a * b).sum()

    _assert_same(sin_first, [x])
    _assert_same(cos_first, [x])  # same edges, other sequence numbers: other order
    _assert_same(sin_first, [x])
    assert _counts() == (2, 1, 1)


def test_two_nodes_that_became_one_are_not_a_guarded_hit():
    x = torch.randn(5, requires_grad=True)

    def two():
        a = x.sin()
        b = x.sin()
        return (a * b).sum()

    def one():
        a = x.sin()
        return (a * a).sum()

    _assert_same(two, [x])
    _assert_same(one, [x])
    assert _counts() == (2, 0, 0)


def test_another_edge_count_or_leaf_tie_is_not_a_guarded_hit():
    # CatBackward0 with two and three edges: the guard of the first unpacks
    # the second's edges, fails and leaves it to the full path (a capture)
    a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
    _assert_same(lambda: torch.cat([a, b]).sin().sum(), [a, b])
    _assert_same(lambda: torch.cat([a, b, c]).sin().sum(), [a, b, c])
    assert _counts() == (2, 0, 0)
    # three leaves' AccumulateGrad nodes tie on their sequence number: the
    # guard of the captured order still accepts the same graph
    _assert_same(lambda: torch.cat([a, b, c]).sin().sum(), [a, b, c])
    _assert_same(lambda: torch.cat([a, b]).sin().sum(), [a, b])
    assert _counts() == (2, 2, 2)


def test_a_hook_added_later_is_run_not_skipped():
    x = torch.randn(3, requires_grad=True)
    _assert_same(lambda: x.exp().sum(), [x])
    seen = []

    def fwd():
        y = x.exp()
        y.register_hook(lambda g: seen.append(1) or g * 3)
        return y.sum()

    _assert_same(fwd, [x])  # eager's run appends once, cagrad's once
    assert seen == [1, 1]
    assert cagrad.counters["guard_hits"] == 0


def test_a_leaf_hook_added_later_is_run_not_skipped():
    w = torch.randn(3, requires_grad=True)
    _assert_same(lambda: (w * 2).sum(), [w])
    handle = w.register_hook(lambda g: g + 1)
    try:
        _assert_same(lambda: (w * 2).sum(), [w])
    finally:
        handle.remove()
    assert cagrad.counters["guard_hits"] == 0
    _assert_same(lambda: (w * 2).sum(), [w])
    assert cagrad.counters["guard_hits"] == 1


def _hooked_graph(seed=0):
    """A graph kept alive with every kind of hook the census watches: a
    non-leaf tensor hook, retain_grad, Python pre- and post-hooks on a node,
    a leaf tensor hook and a post-accumulate-grad hook. Returns the loss,
    the leaf, the tensor that retains its grad, and what the hooks saw."""
    leaf = torch.randn(3, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    seen = []
    mid = leaf.cos()
    mid.register_hook(lambda g: seen.append("tensor") or g * 2)
    mid.retain_grad()
    out = mid.exp()
    out.grad_fn.register_prehook(lambda gs: seen.append("pre") or None)
    out.grad_fn.register_hook(lambda gi, go: seen.append("post") or None)
    leaf.register_hook(lambda g: seen.append("leaf") or g + 1)
    leaf.register_post_accumulate_grad_hook(lambda t: seen.append("acc"))
    return out.sum(), leaf, mid, seen


def test_hooks_on_another_graph_do_not_turn_the_guard_off():
    loss, leaf, mid, seen = _hooked_graph()
    x = torch.randn(3, requires_grad=True)
    for _ in range(3):
        _assert_same(lambda: x.exp().sin().sum(), [x])
    assert _counts() == (1, 2, 2)
    # the hooked graph itself: every hook runs, in eager's order, with eager's gradients
    e_loss, e_leaf, e_mid, e_seen = _hooked_graph()
    e_loss.backward()
    with cagrad.enable("eager"):
        loss.backward()
    assert seen == e_seen and sorted(seen) == ["acc", "leaf", "post", "pre", "tensor"]
    assert torch.equal(leaf.grad, e_leaf.grad)
    assert torch.equal(mid.grad, e_mid.grad)
    assert _counts()[2] == 2


@pytest.mark.parametrize("kind", ["tensor", "retain_grad", "prehook", "posthook", "leaf", "post_accumulate"])
def test_a_hook_on_the_guarded_graph_is_a_miss_while_others_are_live(kind):
    """With hooks live elsewhere the guard is tried, and it must find a hook
    on its own graph however it was registered."""
    keep = _hooked_graph()
    w = torch.randn(3, requires_grad=True)
    seen = []

    def fwd(hooked):
        mid = w.sin()
        out = mid.exp()
        if hooked:
            if kind == "tensor":
                mid.register_hook(lambda g: seen.append(1) or g * 3)
            elif kind == "retain_grad":
                mid.retain_grad()
                seen.append(mid)
            elif kind == "prehook":
                out.grad_fn.register_prehook(lambda gs: seen.append(1) or (gs[0] * 3,))
            elif kind == "posthook":
                out.grad_fn.register_hook(lambda gi, go: seen.append(1) or (gi[0] * 3,))
        return out.sum()

    _assert_same(lambda: fwd(False), [w])
    _assert_same(lambda: fwd(False), [w])
    assert _counts() == (1, 1, 1)
    # the leaf's hooks are the leaf's: registered once for both runs
    if kind == "leaf":
        w.register_hook(lambda g: seen.append(1) or g * 3)
    elif kind == "post_accumulate":
        w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.mul_(3)) and None)
    _assert_same(lambda: fwd(True), [w])  # eager's run, then cagrad's
    assert len(seen) == 2
    if kind == "retain_grad":
        assert torch.equal(seen[1].grad, seen[0].grad)
    assert _counts()[2] == 1
    del keep


def test_without_the_hook_reader_live_hooks_turn_every_guard_off(monkeypatch):
    from cagrad.autograd import _hook_counts

    monkeypatch.setattr(_hook_counts, "counts_fn", lambda: None)
    monkeypatch.setattr(native, "hookless_fn", lambda: None)
    # without the reader the census is the only check: hooked tensors an
    # earlier test left alive (seen on torch 2.11 with CUDA, where gc did
    # not free them) would keep every guard off, so the census starts empty
    from cagrad.hooks import hooks_census

    for name in ("_node_hook_dicts", "_tensor_hook_dicts", "_retaining_tensors"):
        monkeypatch.setattr(hooks_census, name, hooks_census._LiveDicts())
    gc.collect()
    x = torch.randn(3, requires_grad=True)
    _assert_same(lambda: x.exp().sin().sum(), [x])
    _assert_same(lambda: x.exp().sin().sum(), [x])
    assert _counts() == (1, 1, 1)
    keep = _hooked_graph()
    _assert_same(lambda: x.exp().sin().sum(), [x])
    assert _counts() == (1, 2, 1)  # a hit, through the full collection
    del keep
    gc.collect()
    _assert_same(lambda: x.exp().sin().sum(), [x])
    assert _counts() == (1, 3, 2)


@pytest.mark.parametrize(
    "dynamic, counts",
    [
        # symbolic from the capture at 2: 5 and 7 are guarded hits
        (True, (1, 2, 2)),
        # static capture at 2; 5 fails its size check and captures the
        # symbolic graph; 7 is a guarded hit of that one
        (None, (2, 1, 1)),
    ],
)
def test_new_sizes_hit_a_dynamic_graph_through_the_guard(dynamic, counts):
    lin = nn.Linear(4, 3)
    params = list(lin.parameters())
    for n in (2, 5, 7):
        x = torch.randn(n, 4)
        _assert_same(lambda: lin(x).tanh().sum(), params, dynamic=dynamic)
    assert _counts() == counts


def test_new_sizes_of_a_static_graph_recapture_after_the_guard():
    lin = nn.Linear(4, 3)
    params = list(lin.parameters())
    for n in (2, 2, 5, 5):
        x = torch.randn(n, 4)
        _assert_same(lambda: lin(x).tanh().sum(), params, dynamic=False)
    # 2: capture, guarded hit; 5: the guard accepts the structure, no variant
    # the sizes: a capture; then a guarded hit of the new variant
    assert _counts() == (2, 2, 2)


def test_retain_graph_and_the_second_backward_error_are_eagers():
    x = torch.randn(4, requires_grad=True)
    with cagrad.enable("eager"):
        x.sin().sum().backward()  # capture
        loss = x.sin().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        assert cagrad.counters["guard_hits"] == 2
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    assert torch.allclose(x.grad, 3 * x.detach().cos())


def test_a_saved_tensor_modified_in_place_raises_eagers_error():
    x = torch.randn(4, requires_grad=True)
    with cagrad.enable("eager"):
        (x * 1.0).sin().sum().backward()
        y = x * 1.0
        z = y.sin()
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()


def test_the_guard_source_is_logged(caplog, checks):
    x = torch.randn(3, requires_grad=True)
    cagrad.set_logs(guards=True)
    try:
        with caplog.at_level(logging.DEBUG, logger="cagrad.guards"), cagrad.enable("eager"):
            x.sin().sum().backward()
    finally:
        cagrad.set_logs()
    text = caplog.text
    assert "def guard(roots, grads, counts):" in text
    # SinBackward0's saved input, lifted: an instruction of the program
    # (listed), or a line of Python
    if checks == "program":
        assert "# n1._saved_self: Tensor key=" in text and "if not _collect(N, " in text
        assert "# n0 -> n1 (SinBackward0, input 0)" in text and "= _walk((n0,), " in text
    else:
        assert "x = n1._saved_self" in text and "_collect" not in text
        assert "= n0.next_functions" in text and "_walk" not in text


def test_verification_catches_a_guard_that_lifts_the_wrong_tensors(monkeypatch):
    x = torch.randn(3, requires_grad=True)
    with cagrad.enable("eager"):
        x.sin().sum().backward()
    [guard] = engine.cache_for("eager", None).guards
    real = guard.fn

    def wrong(roots, grads, counts):
        got = real(roots, grads, counts)
        tensors, values, order = got
        return [t.clone() for t in tensors], values, order

    monkeypatch.setattr(guard, "fn", wrong)
    monkeypatch.setenv("CAGRAD_VERIFY_GUARDS", "1")
    with cagrad.enable("eager"), pytest.raises(RuntimeError, match="other lifted tensors"):
        x.sin().sum().backward()


def test_a_graph_after_checkpointing_elsewhere_still_takes_the_guard():
    # checkpointing pushes saved-tensor hooks: graphs built outside it are
    # still guarded, graphs built inside it are not (their slots are claimed)
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(4, requires_grad=True)
    for _ in range(2):
        with cagrad.enable("eager"):
            checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    assert cagrad.counters["guard_hits"] == 0
    _assert_same(lambda: x.cos().exp().sum(), [x])
    _assert_same(lambda: x.cos().exp().sum(), [x])
    assert cagrad.counters["guard_hits"] == 1


def test_graphs_that_cannot_be_guarded_still_hit_in_full():
    x = torch.randn(3, requires_grad=True)
    for _ in range(3):
        with cagrad.enable("eager"):
            (g,) = torch.autograd.grad(x.sin().sum(), [x])
        assert torch.equal(g, x.detach().cos())
    assert _counts() == (1, 2, 0)


def test_the_cpp_readers_agree_with_torchs_input_metadata_and_saved_tensors():
    from cagrad import native
    from cagrad.autograd.graph_task import GraphTask

    fns = native.metadata_fns()
    if fns is None:
        pytest.skip("the C++ extension cannot be built here (no compiler)")
    metadata_key, metadata, tensor_key, tensor = fns[:4]
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    loss = layer.double()(x).sum() + x.float().square().sum()
    seen: dict = {}
    for call in GraphTask([loss], [], True).order:
        node = call.node
        if node is None:
            continue
        for nr, m in enumerate(node._input_metadata):
            key = metadata_key(node, nr)
            sizes: list = []
            assert key is not None and metadata(node, nr, key, sizes)
            assert sizes == list(m.shape)
            # one key per (dtype, device, rank), as torch reports them
            assert seen.setdefault(key, (m.dtype, m.device, len(m.shape))) == (m.dtype, m.device, len(m.shape))
            assert not metadata(node, nr, key ^ 1, sizes) and sizes == list(m.shape)
        assert metadata_key(node, len(node._input_metadata)) is None
        for attr in dir(node):
            x = getattr(node, attr) if attr.startswith("_saved_") else None
            if isinstance(x, torch.Tensor):  # a saved tensor, read as the Python attributes read it
                key = tensor_key(x, type(x))
                values: list = []
                assert key is not None and tensor(x, type(x), key, values)
                assert values == [*x.shape, *x.stride(), x.storage_offset()]
                keys = seen.setdefault("tensors", {})
                meta = (x.dtype, x.device, x.dim(), x.requires_grad)
                assert keys.setdefault(key, meta) == meta
    tensors = seen.pop("tensors")
    assert len({dtype for dtype, _, _ in seen.values()}) == 2 and len({rank for _, _, rank in seen.values()}) >= 3
    assert len({meta[0] for meta in tensors.values()}) == 2 and len({meta[3] for meta in tensors.values()}) == 2


def test_two_captured_leaves_that_are_one_leaf_now_are_not_a_guarded_hit():
    # captured: two leaves, whose AccumulateGrad nodes tie in sequence number
    # (all AccumulateGrad nodes have the largest). Then one leaf in both
    # places: the structure and every attribute match the captured graph, and
    # only the distinct-nodes check (C++: order(); Python: a set of ids)
    # tells one node from two
    a = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    _assert_same(lambda: (a * 2 + b * 3).sum(), [a, b])
    _assert_same(lambda: (a * 2 + a * 3).sum(), [a])
    assert _counts() == (2, 0, 0)
    _assert_same(lambda: (a * 2 + b * 3).sum(), [a, b])
    _assert_same(lambda: (a * 2 + a * 3).sum(), [a])
    assert _counts() == (2, 2, 2)
