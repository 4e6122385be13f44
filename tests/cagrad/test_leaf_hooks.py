"""Guarded hits of graphs whose only hooks are C++ post hooks on leaves
(:mod:`cagrad.keys.leaf_hooks`; DDP's reducer, run end to end in
``test_distributed.py``).

Which graphs get such a guard is read from a real collected backward; what
the guard accepts is checked with a stand-in census, whose hooks each case
sets, against the objects the full collection would append."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cagrad.keys import collection
from cagrad.errors import Unsupported
from cagrad.hooks import cpp_hooks
from cagrad.hooks.hooks_census import Census, FoundHooks
from cagrad.keys import hit_path, leaf_hooks
from cagrad.run.guarded import GuardedBackward


def _collected(loss: torch.Tensor):
    return collection.collect_backward([loss], [torch.ones_like(loss)], [], True, census=Census())


def test_a_graph_without_hooks_lists_its_leaves_in_the_collectors_order() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    collected = _collected(model(torch.randn(5, 4)).sum())
    plan = leaf_hooks.plan(collected)
    assert isinstance(plan, leaf_hooks.LeafHooks)
    order = collected.run_order()
    leaves = [pos for pos, n in enumerate(order) if type(n).__name__ == "AccumulateGrad"]
    assert plan.hooked == () and sorted(plan.plain) == leaves and len(leaves) == 4
    objects = plan.collect(order, Census())
    assert len(objects) == len(collected.collector.objects) == 4
    assert all(a is b for a, b in zip(objects, collected.collector.objects))
    assert {id(p) for p in model.parameters()} == {id(v) for v in objects}


def test_hooks_of_the_users_have_no_such_guard() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: g * 2)
    assert isinstance(leaf_hooks.plan(_collected(y.exp().sum())), str)

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    assert isinstance(leaf_hooks.plan(_collected(Twice.apply(x).sum())), str)
    w = torch.randn(3, requires_grad=True)
    w.register_post_accumulate_grad_hook(lambda p: None)
    assert isinstance(leaf_hooks.plan(_collected((w * x).sum())), str)


class _Leaf:
    def __init__(self) -> None:
        self.variable = torch.zeros(1)


class _Census:
    """Stands in for a Census: the hooks each node has, and whether the
    C++ hook lists agree."""

    counts = None  # no C++ reader: collect() reads the leaves' hooks through the census

    def __init__(self, found: dict, invisible: bool = False) -> None:
        self.found = found
        self.invisible = invisible

    def hooks_of(self, node, is_leaf_sink):
        assert is_leaf_sink
        return self.found.get(id(node))

    def check_invisible(self, node, found, runs, name):
        if self.invisible:
            raise Unsupported("invisible_hooks", name)


def _found(cpp_post=(), post_accumulate=None) -> FoundHooks:
    return FoundHooks([], [], None, None, post_accumulate, tuple(cpp_post))


# run order: GraphRoot-less root node, a hooked leaf, a plain leaf
_PLAN = leaf_hooks.LeafHooks(hooked=((1, 2),), plain=(2,), objects=((1, False), (1, True), (2, False)))


@pytest.fixture
def graph(monkeypatch):
    hooks = (object(), object())
    order = [object(), _Leaf(), _Leaf()]
    registered: dict[int, tuple] = {}
    monkeypatch.setattr(cpp_hooks, "post_hooks_of", lambda v: registered.get(id(v), ()))
    return order, hooks, registered


def test_the_captured_hooks_give_the_collectors_objects(graph) -> None:
    order, hooks, _ = graph
    got = _PLAN.collect(order, _Census({id(order[1]): _found(hooks)}))
    assert got is not None and len(got) == 3
    assert got[0] is order[1].variable and got[1] == hooks and got[2] is order[2].variable


@pytest.mark.parametrize(
    "case", ["one hook fewer", "one hook more", "no hooks", "a post-accumulate hook", "hooks the census misses"]
)
def test_other_hooks_on_a_hooked_leaf_are_a_miss(graph, case) -> None:
    order, hooks, _ = graph
    found = {
        "one hook fewer": _found(hooks[:1]),
        "one hook more": _found((*hooks, object())),
        "no hooks": None,
        "a post-accumulate hook": _found(hooks, post_accumulate={0: lambda p: None}),
        "hooks the census misses": _found(hooks),
    }[case]
    census = _Census({} if found is None else {id(order[1]): found}, invisible=case == "hooks the census misses")
    assert _PLAN.collect(order, census) is None


def test_a_plain_leaf_that_gained_a_cpp_hook_is_a_miss(graph) -> None:
    order, hooks, registered = graph
    registered[id(order[2].variable)] = (object(),)
    assert _PLAN.collect(order, _Census({id(order[1]): _found(hooks)})) is None


class _CountingCensus(_Census):
    """A census with a C++ hook reader (``counts``): it reports ``n`` C++
    post hooks and no other hook on every leaf (the tuple of
    ``cagrad.autograd._hook_counts`` for that case, written out)."""

    def __init__(self, n: int) -> None:
        super().__init__({})
        self.counts = lambda node, is_leaf_sink: (0, (), (), 0, (), n, (), 0, None)


def test_cpp_hooks_cagrad_does_not_know_are_a_miss_read_in_cpp(graph) -> None:
    """The C++ reader counts two post hooks on the hooked leaf, but cagrad
    knows only one of them (the other was added from C++ by something
    else, in place of one of the reducer's): the guard misses, and the full
    path finds the invisible hook; with both known, it gives both."""
    order, hooks, registered = graph
    registered[id(order[1].variable)] = hooks[:1]
    assert _PLAN.collect(order, _CountingCensus(2)) is None
    registered[id(order[1].variable)] = hooks
    got = _PLAN.collect(order, _CountingCensus(2))
    assert got is not None and got[1] == hooks
    assert _PLAN.collect(order, _CountingCensus(3)) is None


def test_a_guarded_backward_reads_as_the_collected_one() -> None:
    """What the segmented runtime reads of a guarded hit (:class:`GuardedBackward`):
    the lifted tensors with their saved-tensor slots, and the GraphTask built
    on first use, in the collected backward's run order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    loss = model(torch.randn(5, 4)).sum()
    grad = torch.ones_like(loss)
    collected = collection.collect_backward([loss], [grad], [], True, census=Census())
    order = tuple(collected.run_order())
    position = {id(n): pos for pos, n in enumerate(order)}
    args = collected.collector.args
    slots = [(position[id(node)], attr, index) for node, attr, index in args.slots[1:]]
    call = collection.BackwardCall([loss], [grad], False, False, (), False, True)
    hit = hit_path.Hit(list(args.tensors), list(collected.collector.sizes.values), order)
    guarded = GuardedBackward(call, hit, slots, list(collected.collector.objects), False)
    assert guarded.collector.args.slots == args.slots and guarded.collector.args.tensors is hit.tensors
    assert guarded.run_order() is order and guarded.collector.releases == []
    assert [c.node for c in guarded.task.order] == list(order)
    assert all(guarded.will_execute(n) for n in order if n is not None)
    with pytest.raises(RuntimeError, match="lifted"):
        GuardedBackward(call, hit, slots[1:], [], False)


@pytest.fixture
def process_group():
    """A process group of one (gloo, an in-memory store), unless one runs."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()


@pytest.fixture
def ddp(process_group):
    """A DDP Linear: its reducer's C++ post hooks are on both parameters'
    AccumulateGrad."""
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Linear(4, 3))


def _step(model, compiled: bool) -> list:
    import cagrad

    for p in model.parameters():
        p.grad = None
    loss = model(torch.arange(8.0).reshape(2, 4)).square().sum()
    if compiled:
        with cagrad.enable("eager"):
            loss.backward()
    else:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("case", ["none", "tensor hook", "node post hook", "post-accumulate hook"])
def test_a_hook_added_to_a_ddp_leaf_is_a_miss_read_in_cpp(ddp, case) -> None:
    """The C++ reader's check of a hooked leaf (``counts`` is set): any hook
    but the reducer's makes the guard miss, and the full path runs it."""
    import cagrad

    if Census().counts is None:
        pytest.skip("no C++ compiler: hooked leaves get no guard")
    cagrad.reset()
    for _ in range(2):
        _step(ddp, True)
    assert (cagrad.counters["captures"], cagrad.counters["guard_hits"]) == (1, 1)
    weight = ddp.module.weight
    seen = []
    if case == "tensor hook":
        weight.register_hook(lambda g: seen.append(1) or g * 2)
    elif case == "node post hook":
        acc = weight.view_as(weight).grad_fn.next_functions[0][0]
        acc.register_hook(lambda gi, go: seen.append(1) or None)
    elif case == "post-accumulate hook":
        weight.register_post_accumulate_grad_hook(lambda p: seen.append(1) or None)
    got = _step(ddp, True)
    want = _step(ddp, False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert len(seen) == (0 if case == "none" else 2)
    assert cagrad.counters["guard_hits"] == (2 if case == "none" else 1)


def test_a_plain_graph_is_guarded_beside_ddp_and_misses_once_its_leaves_gain_cpp_hooks(process_group) -> None:
    """A graph without hooked leaves is tried while the reducer's hooks are
    live: its guard's own check of hook lists finds C++ hooks its leaves
    gained (here by wrapping its module in DDP after the capture)."""
    import cagrad

    if Census().counts is None:
        pytest.skip("no C++ compiler: no guard is tried while C++ hooks are live")
    torch.manual_seed(0)
    other = nn.parallel.DistributedDataParallel(nn.Linear(4, 3))  # C++ hooks live in the process
    plain = nn.Linear(4, 3)
    cagrad.reset()
    for _ in range(2):
        got = _step(plain, True)
    assert (cagrad.counters["captures"], cagrad.counters["guard_hits"]) == (1, 1)
    for a, b in zip(got, _step(plain, False)):
        assert torch.equal(a, b)
    wrapped = nn.parallel.DistributedDataParallel(plain)  # reducer hooks on plain's leaves now
    got = _step(plain, True)
    for a, b in zip(got, _step(plain, False)):
        assert torch.equal(a, b)
    assert cagrad.counters["guard_hits"] == 1
    del other, wrapped
