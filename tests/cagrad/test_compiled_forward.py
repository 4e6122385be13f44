"""Backward through torch.compile'd forwards (``CompiledFunctionBackward``).

AOTAutograd turns a compiled forward region into one custom autograd Function
whose backward is an FX graph. cagrad inlines that graph into its own trace
(so one compiled backward covers eager and compiled regions), keeps it an
opaque call when it cannot be inlined, and forces a node whose tracing fails
to run opaque instead of dropping the whole backward to eager. Every result is
compared with eager autograd on an uncompiled copy of the same model.
"""

from __future__ import annotations

import copy

import pytest
import torch

import cagrad
from cagrad.capture import aot_backward
from cagrad.autograd import custom_function
from tests.models import MODELS, loss_fn

AOT_CALL = "call_custom_function"


def _opaque_calls(graph_module: torch.fx.GraphModule) -> list[str]:
    """Names of the runtime calls (opaque nodes) a captured graph makes."""
    return [
        n.target.__name__
        for n in graph_module.graph.nodes
        if n.op == "call_function" and getattr(n.target, "__module__", "") == "cagrad.capture.runtime_ops"
    ]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train_steps(name: str, forward_backend: str, backward_backend: str, steps: int = 3):
    """Runs ``steps`` steps of model ``name`` compiled with ``forward_backend``
    and backward under cagrad; checks each step's grads against eager on a
    deep copy."""
    torch.manual_seed(0)
    model, make_batch = MODELS[name]()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=forward_backend)
    for step in range(steps):
        x, y = make_batch(step)
        model.zero_grad()
        reference.zero_grad()
        loss_fn(reference(x), y).backward()
        loss = loss_fn(compiled(x), y)
        with cagrad.enable(backward_backend):
            loss.backward()
        for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} step {step} {pname}: {m}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_model_backward_is_inlined(name: str, captured: list) -> None:
    """aot_eager forward + aot_eager backward: right grads, one capture, the
    compiled region's backward graph inlined (no opaque custom-function call)."""
    _train_steps(name, "aot_eager", "aot_eager")
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 2
    assert len(captured) == 1
    assert AOT_CALL not in _opaque_calls(captured[0].graph_module)


def _two_regions():
    torch.manual_seed(0)
    lin1 = torch.nn.Linear(8, 16)
    lin2 = torch.nn.Linear(16, 4)

    def f(x):
        h = torch.relu(lin1(x))
        torch._dynamo.graph_break()
        return (lin2(h).sin() * h.sum(-1, keepdim=True)).sum()

    params = [*lin1.parameters(), *lin2.parameters()]
    return f, params


def test_graph_break_dynamic_batch_one_capture(captured: list) -> None:
    """Two compiled regions (a graph break between them), a batch size that
    changes every step, forward and cagrad both dynamic: both regions'
    backward graphs are inlined, and after one recapture every batch size
    hits. The recapture is duck sizing's: the first batch (4) equals
    ``lin2``'s 4 outputs, so the first graph shares one symbol between them;
    batch 5 separates them, and 6 and 7 reuse that graph."""
    f, params = _two_regions()
    compiled = torch.compile(f, backend="aot_eager", dynamic=True)
    for batch in (4, 5, 6, 7):
        x = torch.randn(batch, 8)
        for p in params:
            p.grad = None
        f(x).backward()
        expected = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        with cagrad.enable("aot_eager", dynamic=True):
            compiled(x).backward()
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-6)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["recompiles_shape"] == 1
    assert cagrad.counters["cache_hits"] == 2
    assert all(AOT_CALL not in _opaque_calls(c.graph_module) for c in captured)


def test_not_inlinable_backward_runs_opaque(monkeypatch, captured: list) -> None:
    """When a compiled region's backward cannot be inlined (backward state,
    subclasses, ...) it runs as one opaque call, grads unchanged."""
    monkeypatch.setattr(custom_function, "aot_inline_info", lambda node: None)
    _train_steps("mlp", "aot_eager", "eager")
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1
    assert AOT_CALL in _opaque_calls(captured[0].graph_module)


def test_trace_failure_forces_the_node_opaque(monkeypatch, captured: list) -> None:
    """A node whose tracing fails is retried as an opaque call (counted with
    its reason) instead of sending the whole backward to eager; the next
    backward hits the cache entry that remembers it."""

    def broken(self, target, args, kwargs):
        raise RuntimeError("cannot trace this op")

    monkeypatch.setattr(aot_backward._AotBackward, "call_function", broken)
    _train_steps("mlp", "aot_eager", "eager")
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["nodes_forced_opaque"] == 1
    assert cagrad.counters["opaque_reasons"] == {"trace_failed:CompiledFunctionBackward": 1}
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 2
    assert AOT_CALL in _opaque_calls(captured[0].graph_module)


def test_hooks_on_compiled_module_parameters() -> None:
    """Parameter hooks and a post-accumulate-grad hook on a compiled module
    run with the gradients eager gives them."""

    def run(use_cagrad: bool) -> tuple[list, list]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, make_batch = MODELS["mlp"]()
        seen: list = []
        params = list(model.parameters())
        params[0].register_hook(lambda g: g * 2)
        params[1].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        compiled = torch.compile(model, backend="aot_eager") if use_cagrad else model
        x, y = make_batch(0)
        loss = loss_fn(compiled(x), y)
        if use_cagrad:
            with cagrad.enable("aot_eager"):
                loss.backward()
        else:
            loss.backward()
        return [p.grad for p in params], seen

    (eg, eseen), (cg, cseen) = run(False), run(True)
    for a, b in zip(eg, cg):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert len(eseen) == len(cseen) == 1
    torch.testing.assert_close(cseen[0], eseen[0], rtol=1e-5, atol=1e-6)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


@pytest.mark.inductor
def test_inductor_forward_and_backward() -> None:
    """Inductor on both sides (one model: the compiles take seconds)."""
    _train_steps("mlp", "inductor", "inductor", steps=2)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1


def test_backward_inside_a_compiled_function() -> None:
    """``loss.backward()`` inside a torch.compile'd step: Dynamo does not
    trace into cagrad (the call graph-breaks) and cagrad runs the backward."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)

    def step(x):
        loss = lin(x).sin().sum()
        loss.backward()
        return loss

    x = torch.randn(3, 4)
    step(x)
    expected = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    with cagrad.enable("eager"):
        torch.compile(step, backend="aot_eager")(x)
    for p, e in zip(lin.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-6)
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


def test_compiles_inside_enable_are_not_user_backwards() -> None:
    """AOTAutograd traces its joint graph with ``autograd.grad`` (on
    FakeTensors, under anomaly mode); compiling a forward inside
    ``cagrad.enable`` must not count that as a backward or a fallback."""
    lin = torch.nn.Linear(4, 4)
    f = torch.compile(lambda x: lin(x).sin().sum(), backend="aot_eager", dynamic=True)
    with cagrad.enable("eager"):
        f(torch.randn(3, 4)).backward()
    assert cagrad.counters["backwards"] == 1
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
