"""Tensor hooks traced into the graph (cagrad.hooks.hook_tracing).

A hook that is a pure tensor function of its gradient is traced like a
backward formula, so the backward compiles as one graph; the hook's
fingerprint (code, and the values of what it reads) is in the key, so a
hook recreated every step hits and a changed closure value recaptures.
Every case compares gradients with eager autograd's, bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch

import cagrad
from cagrad.capture import runtime_ops
from cagrad.hooks.hook_tracing import FINGERPRINT_BYTES, fingerprint

from .conftest import same, same_with_side_effects

SCALE = 2.0  # read as a global by a hook below


class Recorder:
    """compiler_fn that keeps each GraphModule it is given and runs it."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs=None):
        self.graphs.append(gm)
        return gm

    def opaque_hook_calls(self) -> int:
        """Opaque hook calls left in whole graphs (segments have none)."""
        return sum(
            n.target is runtime_ops.tensor_pre_hooks
            for gm in self.graphs
            for n in gm.graph.nodes
            if n.op == "call_function"
        )


def _steps(make_hooks, steps: int = 3, sizes=(4, 4, 4)):
    """Runs ``steps`` backwards of a small model whose intermediate ``h`` and
    leaf ``w`` get the hooks ``make_hooks(step)`` returns (``(h_hook,
    w_hook)``, either None); returns w's gradients."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    grads = []
    for step in range(steps):
        x = torch.randn(sizes[step % len(sizes)], 8)
        h = (x @ w).tanh()
        h_hook, w_hook = make_hooks(step)
        handles = []
        if h_hook is not None:
            handles.append(h.register_hook(h_hook))
        if w_hook is not None:
            handles.append(w.register_hook(w_hook))
        h.sin().sum().backward()
        for handle in handles:
            handle.remove()
        grads.append(w.grad)
        w.grad = None
    return grads


def _check(make_hooks, compiler, steps: int = 3, sizes=(4, 4, 4)):
    expected = _steps(make_hooks, steps, sizes)
    with cagrad.enable(compiler):
        actual = _steps(make_hooks, steps, sizes)
    for a, b in zip(expected, actual):
        same(a, b)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


def test_pure_hooks_are_traced_into_one_graph_per_capture():
    rec = Recorder()

    def hooks(step):
        return (lambda g: g * 3, lambda g: torch.clamp(g, -0.05, 0.05))

    _check(hooks, rec)
    # one capture; the graph is whole: no opaque hook call, no segments
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 2
    assert len(rec.graphs) == 1
    assert rec.opaque_hook_calls() == 0
    assert cagrad.counters["hooks_traced"] == 2
    targets = {n.target for n in rec.graphs[0].graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.clamp.default in targets


def test_hook_recreated_each_step_hits_and_a_changed_closure_value_recaptures():
    # the lambda is a new object every step; its closure value s alternates
    def hooks(step):
        s = 2.0 + step % 2
        return (lambda g: g * s, None)

    _check(hooks, Recorder(), steps=4)
    # s = 2, 3, 2, 3: two graphs, two hits; a key without the closure value
    # would hit the first graph at step 1 and scale by 2 instead of 3
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["cache_hits"] == 2


def test_a_changed_global_recaptures():
    global SCALE

    def hook(g):
        return g * SCALE

    rec = Recorder()
    try:
        expected, actual = [], []
        for scale in (2.0, 5.0):
            SCALE = scale
            expected += _steps(lambda step: (hook, None), steps=1)
            with cagrad.enable(rec):
                actual += _steps(lambda step: (hook, None), steps=1)
    finally:
        SCALE = 2.0
    for a, b in zip(expected, actual):
        same(a, b)
    assert len(rec.graphs) == 2
    assert rec.opaque_hook_calls() == 0


def test_default_argument_values_are_part_of_the_fingerprint():
    def hooks(step):
        return (lambda g, k=float(step + 1): g * k, None)

    _check(hooks, Recorder(), steps=3)
    assert cagrad.counters["captures"] == 3


def test_a_hook_with_side_effects_stays_opaque_and_runs_on_every_backward():
    seen: list[torch.Tensor] = []
    rec = Recorder()

    def hooks(step):
        return (lambda g: seen.append(g.clone()), lambda g: g * 2)

    same_with_side_effects(lambda: _steps(hooks), seen, rec)
    # user code runs during the backward, so no hook is traced: both run
    # opaque, between segments compiled one by one
    assert cagrad.counters["hooks_traced"] == 0
    assert len(rec.graphs) >= 2


def test_a_hook_that_branches_on_a_value_runs_opaque():
    def hooks(step):
        return (lambda g: g * 2 if g.sum() > 0 else g, None)

    rec = Recorder()
    _check(hooks, rec)
    assert cagrad.counters["hooks_opaque"] >= 1
    assert len(rec.graphs) >= 2  # cut into segments at the opaque call


def test_a_traced_hook_that_changes_the_size_raises_eagers_error():
    def build():
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        h.register_hook(lambda g: g[:2])
        h.sum().backward()

    with pytest.raises(RuntimeError, match="has changed the size of value") as eager:
        build()
    with cagrad.enable("eager"), pytest.raises(RuntimeError, match="has changed the size of value") as ours:
        build()
    assert str(ours.value) == str(eager.value)


def test_hooks_returning_none_leave_the_gradient():
    _check(lambda step: (lambda g: None, lambda g: None), Recorder())
    assert cagrad.counters["hooks_traced"] == 2


@pytest.mark.parametrize("accumulate_at_end", [True, False])
def test_a_traced_hook_on_a_tensor_that_gets_no_gradient(accumulate_at_end):
    # eager calls the hook with None; the leaves' gradients must still arrive
    # (with retain_grad under create_graph, an opaque call, the graph
    # accumulates in order)
    def build():
        torch.manual_seed(0)
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        a, b = (x * w).split([1, 2])
        b.register_hook(lambda g: None if g is None else g * 2)
        if not accumulate_at_end:
            a.retain_grad()
        a.sum().backward(create_graph=not accumulate_at_end)
        return x.grad, w.grad

    expected = build()
    with cagrad.enable("eager"):
        actual = build()
    for e, a in zip(expected, actual):
        same(e, a)
    assert cagrad.counters["fallbacks"] == 0
    assert cagrad.counters["hooks_traced"] == 1


def test_a_hook_that_fails_on_a_missing_gradient_raises_eagers_error():
    def build():
        x = torch.randn(3, requires_grad=True)
        a, b = (x * 2).split([1, 2])
        b.register_hook(lambda g: g * 2)  # None * 2: TypeError in eager
        a.sum().backward()

    with pytest.raises(TypeError) as eager:
        build()
    with cagrad.enable("eager"), pytest.raises(TypeError) as ours:
        build()
    assert str(ours.value) == str(eager.value)


def test_hooks_reading_symbolic_sizes_follow_the_batch():
    # batch sizes change: the hook's g.shape[0] is a symbol in the trace
    def hooks(step):
        return (lambda g: g / g.shape[0], None)

    _check(hooks, Recorder(), steps=4, sizes=(4, 6, 9, 6))


def test_a_user_hook_that_registers_a_hook_during_backward_is_seen():
    # an opaque hook adds a hook to w while the backward runs; the traceable
    # hook already on w must not be traced with the old dict's contents
    def build():
        torch.manual_seed(0)
        w = torch.randn(4, requires_grad=True)
        h = w.exp()
        w.register_hook(lambda g: g * 2)

        def adds_a_hook(g):
            w.register_hook(lambda g: g + 100)

        h.register_hook(adds_a_hook)
        h.sum().backward()
        return w.grad

    expected = build()
    with cagrad.enable("eager"):
        actual = build()
    same(expected, actual)
    assert cagrad.counters["hooks_traced"] == 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_named_backends_compile_a_hooked_backward_once(backend):
    def hooks(step):
        return (lambda g: g * 0.5, lambda g: g.clamp(-1, 1))

    expected = _steps(hooks)
    with cagrad.enable(backend):
        actual = _steps(hooks)
    for a, b in zip(expected, actual):
        torch.testing.assert_close(a, b)
    assert cagrad.counters["backend_compiles"] == 1
    assert cagrad.counters["hooks_traced"] == 2


def test_torch_compiled_autograd_agrees_on_a_traced_hook():
    from torch._dynamo import compiled_autograd

    def hooks(step):
        return (lambda g: g * 3, lambda g: g.clamp(-0.05, 0.05))

    with cagrad.enable("eager"):
        ours = _steps(hooks, steps=2)
    torch._dynamo.reset()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        theirs = _steps(hooks, steps=2)
    torch._dynamo.reset()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


# -- which hooks are accepted ------------------------------------------------

_LIST: list = []


def _appends(g):
    _LIST.append(g)


def _in_place(g):
    g += 1
    return g


def _prints(g):
    print(g)


def _all_reduce(g):
    torch.distributed.all_reduce(g)


def _pure(g):
    return torch.nn.functional.normalize(g, dim=-1) * SCALE


class _Scaler:
    def hook(self, g):
        return g * 2


@pytest.mark.parametrize(
    "hook",
    [
        _appends,
        _in_place,
        _prints,
        _all_reduce,
        lambda g: g.mul_(2),
        lambda g: g.item(),
        lambda g: torch.rand_like(g) * g,
        lambda g: torch.nn.functional.dropout(g),
        lambda g: [x for x in g],
        (lambda t: (lambda g: g * t))(torch.ones(1)),  # a tensor in the closure
        functools.partial(lambda g, s: g * s, s=2),
        _Scaler().hook,
        lambda g: g.data,
        lambda g: g.register_hook(print),
    ],
)
def test_impure_or_opaque_hooks_are_not_accepted(hook):
    assert fingerprint(hook) is None


def test_pure_hooks_are_accepted_with_fingerprints_that_follow_their_values():
    def scaled(s):
        return lambda g: g * s

    a, b, c = fingerprint(scaled(2.0)), fingerprint(scaled(2.0)), fingerprint(scaled(3.0))
    assert a is not None and len(a) == FINGERPRINT_BYTES
    assert a == b != c
    assert fingerprint(_pure) is not None
    assert fingerprint(lambda g: torch.clamp(g, -1, 1)) != fingerprint(lambda g: torch.clamp(g, -2, 1))


_FINGERPRINT_SCRIPT = """
import torch
from cagrad.hooks.hook_tracing import fingerprint
scale = 2.5
def hook(g, s=3):
    return g * scale + torch.sin(g) * s
print(fingerprint(hook).hex(), fingerprint(lambda g: g * 2).hex())
"""


def test_fingerprints_are_the_same_in_every_process():
    """No address, id or hash seed reaches a fingerprint: two interpreters
    with other hash seeds give the same bytes (golden snapshots store
    fingerprints as tokens, so this is where their bytes are pinned)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    runs = [
        subprocess.run(
            [sys.executable, "-c", _FINGERPRINT_SCRIPT], capture_output=True, text=True, check=True,
            env=dict(os.environ, PYTHONPATH=root, PYTHONHASHSEED=seed),
        ).stdout.split()
        for seed in ("1", "2")
    ]  # fmt: skip
    assert runs[0] == runs[1] and len(runs[0]) == 2 and runs[0][0] != runs[0][1]
    assert all(len(bytes.fromhex(fp)) == FINGERPRINT_BYTES for fp in runs[0])
