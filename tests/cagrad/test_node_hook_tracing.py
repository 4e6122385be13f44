"""Node pre- and post-hooks traced into the graph (cagrad.hooks.hook_tracing).

A node pre-hook (``grad_fn.register_prehook``: ``hook(grad_outputs)``) or
post-hook (``grad_fn.register_hook``: ``hook(grad_inputs, grad_outputs)``)
that passes the same purity check as a traced tensor hook is recorded into
the graph where eager's engine calls it; its fingerprint is in the node's
key. Impure ones stay opaque calls and run on every backward. Gradients are
compared with eager autograd's bit for bit; hook orders are checked through
hooks whose composition does not commute, so any other order gives other
numbers.
"""

from __future__ import annotations

import pytest
import torch

import cagrad
from cagrad.capture.traced import OPAQUE_TARGETS

from .conftest import same, same_with_side_effects


def _opaque_calls(events) -> list[str]:
    """Names of the opaque runtime calls in the captured (whole) graphs."""
    return [
        n.target.__name__
        for e in events
        for n in e.graph_module.graph.nodes
        if n.op == "call_function" and n.target in OPAQUE_TARGETS
    ]


def _steps(register, steps: int = 3, sizes=(4, 4, 4)):
    """Runs ``steps`` backwards of ``((x @ w).tanh() * 2).sin().sum()``;
    ``register(step, h, t, w)`` adds hooks (``h = x @ w``, ``t = h.tanh()``).
    Returns w's gradient of each step."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    grads = []
    for step in range(steps):
        x = torch.randn(sizes[step % len(sizes)], 8)
        h = x @ w
        t = h.tanh()
        handles = register(step, h, t, w) or []  # hooks on w and its node stay
        (t * 2).sin().sum().backward()
        for handle in handles:
            handle.remove()
        grads.append(w.grad)
        w.grad = None
    return grads


def _check(register, compiler, steps: int = 3, sizes=(4, 4, 4)):
    expected = _steps(register, steps, sizes)
    with cagrad.enable(compiler):
        actual = _steps(register, steps, sizes)
    for a, b in zip(expected, actual):
        same(a, b)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


def _accumulate_grad(t: torch.Tensor):
    """The AccumulateGrad node of the leaf that ``t``'s grad_fn reaches first."""
    fn = t.grad_fn
    while type(fn).__name__ != "AccumulateGrad":
        fn = next(f for f, _ in fn.next_functions if f is not None)
    return fn


def test_pure_node_pre_and_post_hooks_trace_into_one_graph(captured):
    def register(step, h, t, w):
        t.grad_fn.register_prehook(lambda go: (go[0] * 3,))
        t.grad_fn.register_hook(lambda gi, go: (gi[0] + go[0],))
        h.grad_fn.register_hook(lambda gi, go: None)  # leaves the gradients
        return [_accumulate_grad(h).register_prehook(lambda go: (go[0].clamp(-0.5, 0.5),))]

    _check(register, "eager")
    assert (cagrad.counters["captures"], cagrad.counters["cache_hits"]) == (1, 2)
    assert [e.num_segments for e in captured] == [1]
    assert _opaque_calls(captured) == []
    assert cagrad.counters["hooks_traced"] == 4
    targets = {n.target for n in captured[0].graph_module.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.clamp.default in targets


def test_order_of_mixed_tensor_and_node_hooks_is_eagers(captured):
    # affine hooks with distinct constants: every other order of the calls
    # (or a hook left out or run twice) gives other gradients
    def register(step, h, t, w):
        fn = t.grad_fn
        fn.register_hook(lambda gi, go: (gi[0] * 5 + go[0],))
        fn.register_prehook(lambda go: (go[0] + 3,))
        t.register_hook(lambda g: g * 2)
        fn.register_prehook(lambda go: (go[0] * 0.5,))
        fn.register_hook(lambda gi, go: (gi[0] - 7,))
        t.register_hook(lambda g: g - 1)
        h.register_hook(lambda g: g * 0.25)
        h.grad_fn.register_prehook(lambda go: (go[0] + 11,))
        return [
            w.register_hook(lambda g: g * 3),
            _accumulate_grad(h).register_prehook(lambda go: (go[0] - 13,)),
        ]

    _check(register, "eager")
    assert [e.num_segments for e in captured] == [1]
    assert _opaque_calls(captured) == []
    assert cagrad.counters["cache_hits"] == 2


def test_order_of_recording_hooks_is_eagers():
    # the same hooks, recording their calls (impure: they run opaque)
    def run(log):
        def register(step, h, t, w):
            fn = t.grad_fn

            def rec(label, value=None):
                def hook(*args):
                    log.append(label)
                    return value(*args) if value is not None else None

                return hook

            fn.register_hook(rec("post1", lambda gi, go: (gi[0] * 5 + go[0],)))
            fn.register_prehook(rec("pre1", lambda go: (go[0] + 3,)))
            t.register_hook(rec("tensor1", lambda g: g * 2))
            fn.register_prehook(rec("pre2"))
            fn.register_hook(rec("post2", lambda gi, go: (gi[0] - 7,)))
            h.grad_fn.register_prehook(rec("pre_h"))
            return [_accumulate_grad(h).register_prehook(rec("pre_acc"))]

        return _steps(register)

    eager_log: list[str] = []
    expected = run(eager_log)
    ours: list[str] = []
    with cagrad.enable("eager"):
        actual = run(ours)
    for a, b in zip(expected, actual):
        same(a, b)
    assert ours == eager_log
    assert eager_log[:7] == ["tensor1", "pre1", "pre2", "post1", "post2", "pre_h", "pre_acc"]
    assert cagrad.counters["hooks_traced"] == 0


def test_a_node_hook_with_a_side_effect_stays_opaque_and_runs_every_backward(captured):
    seen: list[torch.Tensor] = []

    def register(step, h, t, w):
        t.grad_fn.register_hook(lambda gi, go: seen.append(gi[0].clone()))
        h.grad_fn.register_prehook(lambda go: (go[0] * 2,))  # pure

    same_with_side_effects(lambda: _steps(register), seen)
    # the impure hook is an opaque call; the pure one beside it is not traced
    # either (the opaque hook could change its dict: Collector.finish)
    assert _opaque_calls(captured) == ["node_post_hooks", "node_pre_hooks", "accumulate"]
    assert cagrad.counters["hooks_traced"] == 0
    assert cagrad.counters["cache_hits"] == 2  # the side effect ran on hits too


def test_a_changed_closure_value_recaptures(captured):
    def register(step, h, t, w):
        s = 2.0 + step % 2
        t.grad_fn.register_hook(lambda gi, go: (gi[0] * s,))
        h.grad_fn.register_prehook(lambda go, k=float(step % 2): (go[0] + k,))

    _check(register, "eager", steps=4)
    # s = 2, 3, 2, 3: two graphs, two hits; a key without the closure values
    # would hit the first graph at step 1 and scale by 2 instead of 3
    assert (cagrad.counters["captures"], cagrad.counters["cache_hits"]) == (2, 2)
    assert _opaque_calls(captured) == []


def test_node_hooks_reading_symbolic_sizes_follow_the_batch():
    def register(step, h, t, w):
        t.grad_fn.register_prehook(lambda go: (go[0] / go[0].shape[0],))

    _check(register, "eager", steps=4, sizes=(4, 6, 9, 6))


def test_a_post_hook_that_drops_a_gradient():
    # (None,) for TanhBackward's input: nothing reaches w, as in eager
    def build():
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        v = torch.randn(3, requires_grad=True)
        t = (w * 2).tanh()
        t.grad_fn.register_hook(lambda gi, go: (None,))
        (t * v).sum().backward()
        return w.grad, v.grad

    expected = build()
    with cagrad.enable("eager"):
        actual = build()
    for e, a in zip(expected, actual):
        same(e, a)
    assert expected[0] is None
    assert cagrad.counters["fallbacks"] == 0 and cagrad.counters["hooks_traced"] == 1


@pytest.mark.parametrize(
    "kind, hook, error",
    [
        ("pre", lambda go: (go[0][:1],), RuntimeError),  # changed size
        ("pre", lambda go: (go[0], go[0]), RuntimeError),  # number of values
        ("pre", lambda go: [go[0]], TypeError),  # not a tuple
        ("post", lambda gi, go: (gi[0].double(),), RuntimeError),  # changed type
        ("post", lambda gi, go: gi[0], TypeError),  # not a tuple
    ],
)
def test_a_node_hook_that_returns_what_eager_rejects_raises_eagers_error(kind, hook, error):
    def build():
        x = torch.randn(3, requires_grad=True)
        t = x.exp()
        if kind == "pre":
            t.grad_fn.register_prehook(hook)
        else:
            t.grad_fn.register_hook(hook)
        t.sum().backward()

    with pytest.raises(error) as eager:
        build()
    with cagrad.enable("eager"), pytest.raises(error) as ours:
        build()
    assert str(ours.value) == str(eager.value)


def test_a_hook_that_removes_itself_runs_once_as_in_eager():
    def build(calls):
        torch.manual_seed(0)
        w = torch.randn(4, requires_grad=True)
        t = (w * 3).tanh()
        handle = None

        def once(go):
            calls.append(1)
            handle.remove()
            return (go[0] * 10,)

        handle = t.grad_fn.register_prehook(once)
        grads = []
        for _ in range(3):
            t.sum().backward(retain_graph=True)
            grads.append(w.grad)
            w.grad = None
        return grads

    eager_calls: list = []
    expected = build(eager_calls)
    calls: list = []
    with cagrad.enable("eager"):
        actual = build(calls)
    for e, a in zip(expected, actual):
        same(e, a)
    assert len(calls) == len(eager_calls) == 1


def _registers_during_backward(with_a_pure_hook: bool):
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    h = w * 3
    t = h.tanh()
    if with_a_pure_hook:
        h.grad_fn.register_hook(lambda gi, go: (gi[0] * 2, gi[1]))

    def adds_a_hook(g):
        h.grad_fn.register_hook(lambda gi, go: (gi[0] + 100, gi[1]))

    t.register_hook(adds_a_hook)
    t.sum().backward()
    return w.grad


def test_a_node_hook_registered_during_backward_runs():
    # an opaque tensor hook adds a post-hook to a node that runs later in the
    # same backward, whose hook dict holds a pure hook: eager runs both, so
    # the dict must not be traced with the contents the key saw
    expected = _registers_during_backward(True)
    with cagrad.enable("eager"):
        actual = _registers_during_backward(True)
    same(expected, actual)
    assert cagrad.counters["hooks_traced"] == 0


def test_a_node_hook_registered_during_backward_on_a_node_without_hooks_runs():
    # the node had no hook dict when the key was read: the compiled graph has
    # no step for it, so the interpreter finishes that backward with the
    # hook (cagrad.hooks.added_hooks), every time
    for step in range(3):
        expected = _registers_during_backward(False)
        with cagrad.enable("eager"):
            actual = _registers_during_backward(False)
        same(expected, actual)
    assert cagrad.counters["deopts"] == 3 and cagrad.counters["fallbacks"] == 0


def test_torch_compiled_autograd_agrees_on_traced_node_hooks():
    from torch._dynamo import compiled_autograd

    def register(step, h, t, w):
        t.grad_fn.register_prehook(lambda go: (go[0] * 3,))
        t.grad_fn.register_hook(lambda gi, go: (gi[0] + go[0],))

    with cagrad.enable("eager"):
        ours = _steps(register, steps=2)
    assert cagrad.counters["hooks_traced"] == 2
    torch._dynamo.reset()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        theirs = _steps(register, steps=2)
    torch._dynamo.reset()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


# -- hooks that run before any opaque code of the user's ----------------------


def test_pure_hooks_before_the_first_opaque_hook_stay_traced(captured):
    # t's tensor hook and node hooks run before h's impure hook: traced;
    # w's pure hook runs after it (the impure hook could have changed its
    # dict): opaque. The side effect runs on all 3 backwards.
    seen: list[torch.Tensor] = []

    def register(step, h, t, w):
        t.register_hook(lambda g: g * 2)
        t.grad_fn.register_prehook(lambda go: (go[0] + 1,))
        t.grad_fn.register_hook(lambda gi, go: (gi[0] * 3,))
        h.register_hook(lambda g: seen.append(g.clone()))
        return [w.register_hook(lambda g: g - 1)]

    same_with_side_effects(lambda: _steps(register), seen)
    assert (cagrad.counters["captures"], cagrad.counters["cache_hits"]) == (1, 2)
    assert cagrad.counters["hooks_traced"] == 3
    assert _opaque_calls(captured) == ["tensor_pre_hooks", "tensor_pre_hooks", "accumulate"]


def test_a_later_opaque_hook_that_removes_an_earlier_traced_one_takes_effect_next_backward():
    # eager: the pure pre-hook runs in the first backward, then the impure
    # hook that runs after it removes it; the next backwards run without it
    def build():
        torch.manual_seed(0)
        w = torch.randn(4, requires_grad=True)
        h = w * 3
        t = h.tanh()
        handle = t.grad_fn.register_prehook(lambda go: (go[0] * 10,))

        def removes(g):
            handle.remove()

        h.register_hook(removes)
        grads = []
        for _ in range(3):
            t.sum().backward(retain_graph=True)
            grads.append(w.grad)
            w.grad = None
        return grads

    expected = build()
    with cagrad.enable("eager"):
        actual = build()
    for e, a in zip(expected, actual):
        same(e, a)
    assert not torch.equal(expected[0], expected[1])
    # traced in the first backward only: its dict is empty after that
    assert cagrad.counters["hooks_traced"] == 1
    assert cagrad.counters["captures"] == 2


def test_pure_hooks_before_a_custom_function_stay_traced():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def build():
        torch.manual_seed(0)
        w = torch.randn(4, requires_grad=True)
        t = Twice.apply(w).tanh()
        t.register_hook(lambda g: g + 1)
        t.grad_fn.register_hook(lambda gi, go: (gi[0] * 0.5,))
        t.sum().backward()
        return w.grad

    expected = build()
    with cagrad.enable("eager"):
        actual = build()
    same(expected, actual)
    assert cagrad.counters["fallbacks"] == 0
    assert cagrad.counters["hooks_traced"] == 2


def test_an_opaque_tensor_hook_changes_a_later_dict_of_the_same_node():
    # a's and b's hooks both run at SplitBackward0, a's first (registered
    # first); a's impure hook (the third in its dict) adds a hook to b's
    # dict, which eager then runs
    def build():
        torch.manual_seed(0)
        x = torch.randn(4, requires_grad=True)
        a, b = (x * 2).split([2, 2])

        def adds(g):
            b.register_hook(lambda g: g + 100)

        a.register_hook(lambda g: g * 2)  # pure, in the same dict as adds
        a.register_hook(lambda g: g - 1)
        a.register_hook(adds)
        b.register_hook(lambda g: g * 3)
        (a.sin() + b.cos()).sum().backward()
        return x.grad

    expected = build()
    with cagrad.enable("eager"):
        actual = build()
    same(expected, actual)
    assert cagrad.counters["fallbacks"] == 0
    assert cagrad.counters["hooks_traced"] == 0
