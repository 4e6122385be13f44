"""Tensor hooks registered inside a torch.compile'd forward (``BackwardState``).

With compiled autograd on while Dynamo compiles a forward, a hook registered
on an intermediate tensor inside it (``y.register_hook(hook)``) is not put on
the tensor: Dynamo keeps it in a ``BackwardState`` input of the forward, and
AOTAutograd's backward graph calls it through
``call_hook_from_backward_state``. AOTAutograd cannot run that backward by
itself ("BackwardState requires CompiledAutograd"); cagrad inlines it and
runs each such hook as an opaque call on this backward's ``BackwardState``.

Every case is compared with eager autograd (the same function, uncompiled)
and with torch's own compiled autograd: gradients and the values the hooks
were called with.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo import compiled_autograd

import cagrad
import cagrad.run.interpreter
import cagrad.torch_compat as tc
from tests.cagrad.conftest import same_trace


def _compiler(gm: torch.fx.GraphModule):
    return torch.compile(gm, backend="eager", fullgraph=True)


@pytest.fixture(autouse=True)
def fresh_state():
    tc.uninstall()
    tc.reset()
    torch._dynamo.reset()
    yield
    tc.uninstall()
    tc.reset()
    torch._dynamo.reset()


@contextlib.contextmanager
def _torch_ca():
    """torch's own compiled autograd (Dynamo compiles forwards with it on)."""
    assert not tc.is_installed()
    with compiled_autograd._enable(_compiler):
        yield


@contextlib.contextmanager
def _cagrad_ca():
    """cagrad serving torch's compiled-autograd entry points."""
    torch._dynamo.reset()  # no forward compiled for torch's compiled autograd
    with tc.installed():
        with compiled_autograd._enable(_compiler):
            yield


def _run(fn, make_args, mode: str, steps: int = 1, forward_backend: str = "aot_eager"):
    """Runs ``fn(*make_args(step, trace)).backward()`` for each step, eagerly
    (``mode="eager"``), under torch's compiled autograd (``"torch"``) or under
    cagrad (``"cagrad"``); returns per step the leaves' grads and the hook trace."""
    torch.manual_seed(0)
    results = []
    ctx = {"eager": contextlib.nullcontext, "torch": _torch_ca, "cagrad": _cagrad_ca}[mode]()
    f = fn if mode == "eager" else torch.compile(fn, backend=forward_backend)
    with ctx:
        for step in range(steps):
            trace: list = []
            args = make_args(step, trace)
            f(*args).backward()
            leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            results.append(([a.grad for a in leaves], trace))
    return results


def _check_all(
    fn, make_args, steps: int = 1, forward_backend: str = "aot_eager", with_torch: bool = True
):
    """cagrad == eager == torch's compiled autograd (grads and hook traces);
    returns cagrad's results."""
    expected = _run(fn, make_args, "eager", steps)
    others = [_run(fn, make_args, "torch", steps, forward_backend)] if with_torch else []
    actual = _run(fn, make_args, "cagrad", steps, forward_backend)
    for other in (*others, actual):
        assert len(other) == len(expected)
        for (grads, trace), (exp_grads, exp_trace) in zip(other, expected):
            assert len(grads) == len(exp_grads)
            for g, e in zip(grads, exp_grads):
                torch.testing.assert_close(g, e)
            assert [label for label, _ in trace] == [label for label, _ in exp_trace]
            for (label, x), (_, y) in zip(trace, exp_trace):
                torch.testing.assert_close(x, y, msg=lambda m, label=label: f"{label}: {m}")
    return actual


def _leaves(step: int, trace: list):
    torch.manual_seed(step)
    return torch.randn(3, 4), torch.randn(4, 4, requires_grad=True), trace


def _state_hook_calls(gm: torch.fx.GraphModule) -> list:
    return [
        n.args[1]
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "backward_state_hook"
    ]


def _no_aot_opaque(gm: torch.fx.GraphModule) -> bool:
    return not any(
        n.op == "call_function" and getattr(n.target, "__name__", "") == "call_custom_function"
        for n in gm.graph.nodes
    )


def test_scaling_hook(captured: list) -> None:
    def fn(x, w, trace):
        y = x @ w
        y.register_hook(lambda g: g * 2)
        return y.sin().sum()

    _check_all(fn, _leaves, steps=2)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 1
    gm = captured[0].graph_module
    assert _state_hook_calls(gm) == ["hook0"]
    assert _no_aot_opaque(gm)  # inlined, not one opaque node


@pytest.mark.parametrize("returns", ["none", "grad"])
def test_observing_hook(returns: str) -> None:
    """A hook returning None leaves the gradient as it is (eager's rule).
    torch's compiled autograd (2.13) continues with None there and fails, so
    that variant is compared with eager only."""

    def fn(x, w, trace):
        y = x @ w
        if returns == "none":
            y.register_hook(lambda g: trace.append(("y", g.clone())))
        else:
            y.register_hook(lambda g: (trace.append(("y", g.clone())), g)[1])
        return (y * y).sum()

    results = _check_all(fn, _leaves, steps=2, with_torch=returns == "grad")
    assert [len(trace) for _, trace in results] == [1, 1]
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1


def test_two_hooks(captured: list) -> None:
    """Two tensors, and two hooks on one tensor (the second sees the first's
    result, as in eager)."""

    def fn(x, w, trace):
        y = x @ w
        y.register_hook(lambda g: g * 3)
        y.register_hook(lambda g: (trace.append(("y second", g.clone())), g)[1])
        z = y.tanh()
        z.register_hook(lambda g: (trace.append(("z", g.clone())), g + 1)[1])
        return (z * z).sum()

    results = _check_all(fn, _leaves, steps=2)
    assert [[label for label, _ in trace] for _, trace in results] == [["z", "y second"]] * 2
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1
    assert sorted(_state_hook_calls(captured[0].graph_module)) == ["hook0", "hook1", "hook2"]


def test_new_hook_each_forward_hits_the_cache(captured: list) -> None:
    """Each forward call makes a new hook (and BackwardState); a cache hit
    calls this call's hook, not the one the graph was traced with."""

    def fn(x, w, scale, trace):
        y = x @ w
        y.register_hook(lambda g: (trace.append(("y", g.clone())), g * scale)[1])
        return y.cos().sum()

    def make_args(step: int, trace: list):
        x, w, _ = _leaves(step, trace)
        return x, w, torch.tensor(float(step + 2)), trace

    steps = 3
    expected = _run(fn, make_args, "eager", steps)
    actual = _check_all(fn, make_args, steps)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == steps - 1
    for (grads, trace), (exp_grads, _) in zip(actual, expected):
        assert len(trace) == 1  # this call's hook, once
        torch.testing.assert_close(grads[0], exp_grads[0])
    # the scales differ per step, so equal grads mean each step's own hook ran
    assert not torch.allclose(actual[0][0][0], actual[1][0][0])


def test_retain_graph_calls_the_hook_per_backward() -> None:
    def fn(x, w, trace):
        y = x @ w
        y.register_hook(lambda g: (trace.append(("y", g.clone())), g * 2)[1])
        return y.sin().sum()

    traces = {}
    for mode in ("eager", "cagrad"):
        x, w, trace = _leaves(0, [])
        ctx = _cagrad_ca() if mode == "cagrad" else contextlib.nullcontext()
        f = torch.compile(fn, backend="aot_eager") if mode == "cagrad" else fn
        with ctx:
            out = f(x, w, trace)
            out.backward(retain_graph=True)
            out.backward()
        traces[mode] = (w.grad, trace)
    torch.testing.assert_close(traces["cagrad"][0], traces["eager"][0])
    assert len(traces["cagrad"][1]) == 2
    same_trace(traces["cagrad"][1], traces["eager"][1])
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


_NO_GRAD_CALLS: list[int] = []


class _NoGrad(torch.autograd.Function):
    """Identity whose backward gives no gradient: cagrad's graph assumed one,
    so the interpreter finishes the backward from there (a deopt). Its
    backward has a side effect, so it runs opaque rather than traced
    (cagrad.hooks.backward_tracing)."""

    @staticmethod
    def forward(ctx, v):
        return v.clone()

    @staticmethod
    def backward(ctx, g):
        _NO_GRAD_CALLS.append(1)
        return None


def test_hooked_backward_finished_by_the_interpreter(monkeypatch) -> None:
    interpreted = []
    original = cagrad.run.interpreter.Interpreter.apply_aot

    def spy(self, pos, call, plan, inputs):
        interpreted.append(call.name)
        return original(self, pos, call, plan, inputs)

    monkeypatch.setattr(cagrad.run.interpreter.Interpreter, "apply_aot", spy)

    def fn(x, w, trace):
        y = x @ w
        y.register_hook(lambda g: (trace.append(("y", g.clone())), g * 2)[1])
        return y.sin().sum()

    results = {}
    for mode in ("eager", "cagrad"):
        torch.manual_seed(0)
        x, w, trace = _leaves(0, [])
        v = torch.randn((), requires_grad=True)
        ctx = _cagrad_ca() if mode == "cagrad" else contextlib.nullcontext()
        f = torch.compile(fn, backend="aot_eager") if mode == "cagrad" else fn
        with ctx:
            for _ in range(2):
                w.grad = None
                trace.clear()
                # _NoGrad runs before the compiled region's backward
                (f(x, w, trace) + _NoGrad.apply(v)).backward()
        results[mode] = (w.grad, v.grad, list(trace))
    torch.testing.assert_close(results["cagrad"][0], results["eager"][0])
    assert results["cagrad"][1] is None and results["eager"][1] is None
    same_trace(results["cagrad"][2], results["eager"][2])
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["deopts"] == 1  # then the graph is traced assuming None
    assert interpreted == ["CompiledFunctionBackward"]


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (lambda g: g[:1], "has changed the size of value"),
        (lambda g: g.sum(), "has changed the size of value"),
        (lambda g: g.double(), "has changed the type of value"),
    ],
    ids=["slice", "sum", "dtype"],
)
def test_hook_changing_the_gradient_raises(hook, message: str) -> None:
    def fn(x, w, trace):
        y = x @ w
        y.register_hook(hook)
        return y.sin().sum()

    x, w, trace = _leaves(0, [])
    with pytest.raises(RuntimeError, match=message):
        fn(x, w, trace).backward()  # eager's tensor-hook check
    w.grad = None
    with _cagrad_ca():
        out = torch.compile(fn, backend="aot_eager")(x, w, trace)
        with pytest.raises(RuntimeError, match=f"hook '<lambda>' {message}"):
            out.backward()
    assert w.grad is None


@pytest.mark.inductor
def test_inductor_forward() -> None:
    def fn(x, w, trace):
        y = x @ w
        y.register_hook(lambda g: (trace.append(("y", g.clone())), g * 2)[1])
        return y.sin().sum()

    _check_all(fn, _leaves, steps=2, forward_backend="inductor")
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1


def test_changing_batch_size() -> None:
    """Dynamic sizes: the forward is recompiled dynamic, cagrad's graph with
    symbolic sizes; the hook's assumed result follows the symbolic shape."""

    def fn(x, w, trace):
        y = x @ w
        y.register_hook(lambda g: (trace.append(("y", g.clone())), g * 2)[1])
        return y.sin().sum()

    def make_args(step: int, trace: list):
        torch.manual_seed(step)
        return torch.randn(2 + step, 4), torch.randn(4, 4, requires_grad=True), trace

    _check_all(fn, make_args, steps=4)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["cache_hits"] >= 1
