"""Early replays: a guarded hit's CUDA graph replayed before its guard runs
(:meth:`cagrad.compile.cuda_graphs.CudaGraphed.speculate`).

The CPU tests drive the guess itself with stand-in graphs and allocator
counts; the CUDA tests check that gradients stay eager's when a guess is
used, when it is wasted (other sizes, other addresses, a guard miss), and
that no guess is made after the allocator gave memory back."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
from torch import nn

import cagrad
from cagrad import native
from cagrad.compile import cuda_graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _StandInGraph:
    """A ``torch.cuda.CUDAGraph`` stand-in that counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class _CudaBuffer(torch.Tensor):
    """A CPU tensor that says it is on CUDA (a stand-in graph's buffer)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def _recorded(copies: bool = False, host_copy: bool = False, by_data: bool = False) -> cuda_graphs._Recorded:
    if copies:
        buffers = [torch.zeros(1).as_subclass(_CudaBuffer)]
    elif host_copy:
        buffers = [torch.zeros(1)]  # a host input's buffer
    else:
        buffers = [None]
    return cuda_graphs._Recorded(_StandInGraph(), buffers, [buffers[0] is None], [], device=0, addresses_by_data=by_data)


@pytest.fixture
def allocator(monkeypatch):
    """The allocator's count of memory given back (``state["frees"]``), and
    a reclaim that succeeds unless ``state["views"]``."""
    state = {"frees": 5, "views": False}
    monkeypatch.setattr(native, "device_frees_fn", lambda: lambda device: state["frees"])
    monkeypatch.setattr(native, "reclaim_fn", lambda: lambda handed, owners: not state["views"])
    return state


def _graphed() -> cuda_graphs.CudaGraphed:
    return cuda_graphs.CudaGraphed(lambda *args: [])


def test_a_guess_needs_a_right_prediction_first(allocator) -> None:
    graphed, a = _graphed(), _recorded()
    assert not graphed.speculate({})  # nothing replayed yet
    graphed._observe(a)
    assert not graphed.speculate({})  # one replay: nothing predicted yet
    graphed._observe(a)  # a after a: the prediction was right
    assert graphed.speculate({})
    assert a.graph.replays == 1 and graphed.pending is a


def test_a_wasted_guess_stops_guessing_until_a_prediction_is_right(allocator) -> None:
    graphed, a = _graphed(), _recorded()
    graphed._observe(a)
    graphed._observe(a)
    assert graphed.speculate({})
    graphed.settle()  # the backward never called it (its guard missed)
    assert cagrad.counters["cudagraph_wasted_replays"] == 1
    assert cagrad.counters["cudagraph_early_replays"] == 0
    assert graphed.pending is None
    assert not graphed.speculate({})
    graphed._observe(a)
    assert graphed.speculate({})
    graphed.early = True  # what __call__ sets when the call picks the graph replayed early
    graphed.settle()
    assert cagrad.counters["cudagraph_early_replays"] == 1
    assert a.graph.replays == 2


def test_two_graphs_that_alternate_are_guessed_in_turn(allocator) -> None:
    graphed, a, b = _graphed(), _recorded(), _recorded()
    for r in (a, b, a):
        graphed._observe(r)
    assert not graphed.confident  # b after a was new
    graphed._observe(b)  # b after a, as the time before
    assert graphed.speculate({})
    assert graphed.pending is a and a.graph.replays == 1 and b.graph.replays == 0


def test_a_graph_that_copies_only_host_inputs_is_guessed(allocator) -> None:
    """Its host buffers hold the values it is keyed on since its last replay."""
    graphed, a = _graphed(), _recorded(host_copy=True)
    assert a.copies and not a.copies_device
    graphed._observe(a)
    graphed._observe(a)
    assert graphed.speculate({})


def test_a_copied_root_gradient_is_copied_before_the_early_replay(allocator) -> None:
    """The root gradients are known before the guard: a graph that copies
    one in is guessed, with the copy made first; another input to copy, or
    a gradient that does not fit the buffer, stops the guess."""
    graphed, a = _graphed(), _recorded(copies=True)
    graphed._observe(a)
    graphed._observe(a)
    assert not graphed.speculate({})  # the input it copies is not known yet
    assert not graphed.speculate({0: torch.ones(2).as_subclass(_CudaBuffer)})  # another shape
    assert a.graph.replays == 0
    grad = torch.full((1,), 7.0, requires_grad=True).as_subclass(_CudaBuffer)  # backward(gradient=g) with g requiring grad
    assert graphed.speculate({0: grad})
    assert a.graph.replays == 1 and a.buffers[0].item() == 7.0
    assert not a.buffers[0].requires_grad and a.buffers[0].grad_fn is None


def test_no_guess_for_a_graph_with_index_or_mask_inputs(allocator) -> None:
    """Before the guard, a recorded address may hold another tensor; read as
    indices (integers, booleans) its data would send kernels out of bounds.
    Such a graph is replayed only after its guard."""
    graphed, a = _graphed(), _recorded(by_data=True)
    graphed._observe(a)
    graphed._observe(a)
    assert graphed.confident and a.frees is not None
    assert not graphed.speculate({}) and a.graph.replays == 0


@pytest.mark.parametrize("case", ["memory_given_back", "graph_copies_inputs", "view_alive", "off"])
def test_no_guess_where_it_would_not_be_safe(allocator, monkeypatch, case) -> None:
    graphed = _graphed()
    r = _recorded(copies=case == "graph_copies_inputs")
    assert r.copies_device == (case == "graph_copies_inputs")
    r.handed = [torch.zeros(1)]
    graphed._observe(r)
    graphed._observe(r)
    if case == "memory_given_back":
        allocator["frees"] += 1  # an address the graph reads may be unmapped now
    elif case == "view_alive":
        allocator["views"] = True
    elif case == "off":
        monkeypatch.setattr(cuda_graphs, "EARLY_REPLAY", False)
    assert not graphed.speculate({})
    assert r.graph.replays == 0 and graphed.pending is None


def test_no_guess_without_the_allocator_count(monkeypatch) -> None:
    monkeypatch.setattr(native, "device_frees_fn", lambda: None)
    graphed, a = _graphed(), _recorded()
    graphed._observe(a)
    graphed._observe(a)
    assert a.frees is None and not graphed.speculate({})


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()


def _loss(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    return model(x).square().mean()


def _run(model: nn.Module, data: list, graphed: bool, loss_of=_loss, between=None) -> list[list]:
    """Backwards of ``loss_of(model, x, step)`` over ``data`` (CPU batches,
    copied into one CUDA buffer per batch size); each step's gradients, on
    the CPU. The weights do not change, and nothing on the GPU outlives a
    step, so the caching allocator gives each step's tensors the blocks of
    the step before (where the graphs read every input in place and a
    guess can be made)."""
    buffers = {n: torch.empty(n, 32, device="cuda") for n in {len(d) for d in data}}
    grads = []
    for step, batch in enumerate(data):
        if between is not None:
            between(step)
        x = buffers[len(batch)]
        x.copy_(batch)
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, x, step)
        if graphed:
            with cagrad.enable("inductor", mode="reduce-overhead"):
                loss.backward()
        else:
            loss.backward()
        del loss
        grads.append([None if p.grad is None else p.grad.cpu() for p in model.parameters()])
    return grads


def _compare(sizes, loss_of=_loss, between=None) -> None:
    """The gradients of an MLP under reduce-overhead are eager's, step by step."""
    # hooked graphs earlier tests left in reference cycles are collected
    # first: this test's backwards see the census they see when run alone
    gc.collect()
    torch.manual_seed(5)
    data = [torch.randn(n, 32) for n in sizes]
    model = _mlp()
    expected = _run(copy.deepcopy(model), data, False, loss_of)
    got = _run(model, data, True, loss_of, between)
    for step, (e, g) in enumerate(zip(expected, got)):
        for a, b in zip(e, g):
            if a is None:
                assert b is None, step
            else:
                torch.testing.assert_close(b, a, msg=lambda m: f"step {step}: {m}")


@cuda
def test_a_steady_loop_replays_early_with_eager_gradients() -> None:
    _compare([16] * 12)
    assert cagrad.counters["cudagraph_early_replays"] >= 4, cagrad.counters.snapshot()
    assert cagrad.counters["fallbacks"] == 0


@cuda
def test_guesses_wasted_on_other_sizes_and_addresses_leave_eager_gradients() -> None:
    """Batches of another size (the graph replayed early was recorded for the
    old one), and blocks held from two steps on that move the activations."""
    held = []

    def between(step):
        if step in (5, 18):
            held.append(torch.empty(1 << 18, device="cuda"))

    _compare([16] * 8 + [12] * 6 + [16] * 8, between=between)
    assert cagrad.counters["cudagraph_wasted_replays"] >= 1, cagrad.counters.snapshot()
    assert cagrad.counters["cudagraph_early_replays"] >= 1, cagrad.counters.snapshot()


@cuda
def test_a_guard_miss_after_an_early_replay_leaves_eager_gradients() -> None:
    """A step whose graph differs in structure (a detached layer) misses the
    guard after its early replay; the full path runs it."""

    def loss_of(m, x, step):
        h = m[1](m[0](x))
        h = h.detach() if step == 9 else h
        return m[4](m[3](m[2](h))).square().mean()

    _compare([16] * 12, loss_of)
    assert cagrad.counters["cudagraph_wasted_replays"] >= 1, cagrad.counters.snapshot()


@cuda
def test_no_early_replay_after_the_allocator_gave_memory_back() -> None:
    """``empty_cache`` with a freed block: the next backward must not read
    the recorded addresses before its guard (they may be unmapped)."""
    early = []

    def between(step):
        early.append(cagrad.counters["cudagraph_early_replays"])
        if step == 8:
            torch.empty(64 << 20, device="cuda").fill_(0)  # a segment of its own, freed at once
            torch.cuda.empty_cache()

    _compare([16] * 12, between=between)
    early.append(cagrad.counters["cudagraph_early_replays"])
    assert early[8] > early[7], early  # steady before
    assert early[9] == early[8], early  # step 8 ran after memory went back: no guess


@cuda
def test_a_graph_that_reads_indices_replays_only_after_its_guard() -> None:
    """``index_select``'s backward scatters through its saved indices: the
    graph replays (the indices at the address it read them from, checked by
    the guard's lookup) but never early, and the gradients are eager's."""
    index = torch.tensor([0, 3, 3, 7, 1], device="cuda")

    def loss_of(m, x, step):
        return m(x).index_select(1, index).square().mean()

    _compare([16] * 12, loss_of)
    c = cagrad.counters
    assert c["cudagraph_replays"] >= 6 and c["guard_hits"] >= 6, c.snapshot()
    assert c["cudagraph_early_replays"] == 0 and c["cudagraph_wasted_replays"] == 0, c.snapshot()


@cuda
def test_a_root_gradient_that_requires_grad_is_copied_for_early_replays() -> None:
    """``backward(gradient=g)`` with another ``g`` every step, one that
    requires grad: the ``g`` s are allocated before the loop (so each step's
    is at a new address, which the graph must copy in, while the
    allocator, which allocates nothing for them in the loop, keeps the
    activations where they were; rows of one block would not do: their
    storage offsets are sizes of the key). The early replays copy it first,
    the gradients are eager's, and ``g`` stays a plain leaf with no
    gradient."""
    gc.collect()
    torch.manual_seed(5)
    model = _mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32, device="cuda")
    steps = 10
    roots = [torch.full((16, 8), 0.5 + k, device="cuda", requires_grad=True) for k in range(steps)]

    def step(m: nn.Module, graphed: bool, k: int) -> list:
        m.zero_grad(set_to_none=True)
        out = m(x)
        g = roots[k]
        with cagrad.enable("inductor", mode="reduce-overhead") if graphed else contextlib.nullcontext():
            out.backward(g)
        assert g.grad is None and g.grad_fn is None and g.is_leaf
        return [p.grad.cpu() for p in m.parameters()]

    for k in range(steps):
        expected, got = step(reference, False, k), step(model, True, k)
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a, msg=lambda m: f"step {k}: {m}")
    assert cagrad.counters["cudagraph_early_replays"] >= 3, cagrad.counters.snapshot()


def _graphs_at(graphed: cuda_graphs.CudaGraphed, size_key: tuple, statics: list[tuple], used: list[int]) -> list:
    """Stand-in graphs at ``size_key``, one per mask (inputs read in place),
    with their last-replay stamps; the masks registered as a recording would."""
    out = []
    for i, (static, stamp) in enumerate(zip(statics, used)):
        r = _recorded()
        r.used = stamp
        mask = cuda_graphs._Mask(list(static))
        graphed.graphs[cuda_graphs._key(size_key, [1000 + i] * len(static), mask)] = r
        masks = graphed.masks.setdefault(size_key, [])
        if all(m.static != mask.static for m in masks):
            masks.append(mask)
        out.append(r)
    return out


def test_a_new_layout_evicts_the_least_recently_replayed_graph(monkeypatch) -> None:
    """At LAYOUT_GRAPHS graphs for one tuple of sizes, room for a graph of a
    new layout is made by evicting the least recently replayed graph, never
    the one that fits the call nor the one that copies most (it fits any
    call); every reference to the evicted graph goes."""
    assert cuda_graphs.LAYOUT_GRAPHS == 3
    graphed = _graphed()
    size_key = (16,)
    copying, old, recent = _graphs_at(graphed, size_key, [(True, False), (True, True), (True, True)], [9, 1, 8])
    recent.next = old
    graphed.last = old
    assert graphed._room(size_key, keep=copying)
    assert old not in graphed.graphs.values() and len(graphed.graphs) == 2
    assert recent.next is None and graphed.last is None
    assert cagrad.counters["cudagraph_evictions"] == 1
    # the in-place mask stays while a graph still reads that way
    assert [m.static for m in graphed.masks[size_key]] == [(True, False), (True, True)]
    # below the bound: room without evicting
    assert graphed._room(size_key, keep=copying) and len(graphed.graphs) == 2
    # only the graph that fits and the copying one: nothing to evict
    only = _graphed()
    fits, fallback = _graphs_at(only, size_key, [(True, True), (False, False)], [5, 6])
    _graphs_at(only, (8,), [(True, True)], [1])  # another size: not evicted for this one
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 3)
    assert not only._room(size_key, keep=fits)
    assert len(only.graphs) == 3
