"""``torch.func`` and ``torch.autograd.functional`` inside ``cagrad.enable``.

Each transform is called in a forward (its result feeds the model), in a
loss (a gradient penalty: the transform differentiates with respect to the
data, the weights enter by closure) and inside a hook that runs during a
cagrad backward (a tensor hook, a node pre-hook), for three steps of one
leaf. Values are compared bitwise with eager autograd in float64. The
number of backwards eager runs is counted by a proxy engine of this file's
own (not cagrad's counters): a functorch transform's own backwards fall
back (``functorch_transform``), everything else compiles, and steps 2 and 3
hit the cache.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.autograd import functional as AF
from torch.autograd.variable import Variable

import cagrad
from cagrad import engine, native
from cagrad.autograd import run_context, transforms
from cagrad.hooks import hook_tracing

from .conftest import errors_under_both, same

DT = torch.float64
STEPS = 3
REASON = "functorch_transform"


def _f0(v):
    return (v.sin() * v).sum()


def _fv0(v):
    return v.sin() * v


def _cot(u):
    return u.detach().cos() + 1  # a constant cotangent, same in every run


# name -> (transform(f, fv, u), backwards it runs under a functorch
# transform per call, plain create_graph backwards it runs per call)
TRANSFORMS = {
    "grad": (lambda f, fv, u: torch.func.grad(f)(u), 1, 0),
    "vjp": (lambda f, fv, u: torch.func.vjp(fv, u)[1](_cot(u))[0], 1, 0),
    "jacrev": (lambda f, fv, u: torch.func.jacrev(fv)(u), 1, 0),
    "jacfwd": (lambda f, fv, u: torch.func.jacfwd(fv)(u), 0, 0),  # forward-mode AD: no backward
    "hessian": (lambda f, fv, u: torch.func.hessian(f)(u), 1, 0),  # jacfwd(jacrev(f))
    "vmap_grad": (lambda f, fv, u: torch.func.vmap(torch.func.grad(f))(torch.stack([u, 2 * u])), 1, 0),
    # torch.autograd.functional: autograd.grad(create_graph=True), one per
    # output element (jacobian), or once (vjp), twice (vhp: grad, then its vjp)
    "af_jacobian": (lambda f, fv, u: AF.jacobian(fv, u, create_graph=True), 0, 3),
    "af_hessian": (lambda f, fv, u: AF.hessian(f, u, create_graph=True), 0, 4),
    "af_vjp": (lambda f, fv, u: AF.vjp(fv, u, _cot(u), create_graph=True)[1], 0, 1),
    "af_vhp": (lambda f, fv, u: AF.vhp(f, u, _cot(u), create_graph=True)[1], 0, 2),
    # hvp: grad, then the double-vjp trick (two more); jvp: the trick alone
    "af_hvp": (lambda f, fv, u: AF.hvp(f, u, _cot(u), create_graph=True)[1], 0, 3),
    "af_jvp": (lambda f, fv, u: AF.jvp(fv, u, _cot(u), create_graph=True)[1], 0, 2),
    # vectorize=True: one autograd.grad of gradients batched by the legacy vmap
    "af_jacobian_vectorize": (lambda f, fv, u: AF.jacobian(fv, u, create_graph=True, vectorize=True), 1, 0),
}

W0 = torch.tensor([0.3, -1.2, 0.7], dtype=DT)
X = torch.tensor([1.5, 0.4, -0.9], dtype=DT)


def _as3(r):
    return r.reshape(-1, 3).sum(0)


def _forward(transform, w):
    u = w * X
    h = _as3(transform(_f0, _fv0, u))
    return (h * w).sum() + u.cos().sum()


def _loss(transform, w):
    # a gradient penalty: the transform differentiates the critic with
    # respect to its input; the weights reach it by closure
    def critic(v):
        return (v * w).tanh().sum()

    def critic_v(v):
        return (v * w).tanh() * v

    base = (w * X).sin().pow(2).sum()
    return base + 0.5 * _as3(transform(critic, critic_v, X)).pow(2).sum()


def _tensor_hook(transform, w):
    h = w.exp() * X
    h.register_hook(lambda g: g + _as3(transform(_f0, _fv0, g)).detach())
    return (h * h).sum()


def _node_hook(transform, w):
    h = w.exp() * X
    h.grad_fn.register_prehook(lambda gs: (gs[0] + _as3(transform(_f0, _fv0, gs[0])).detach(),))
    return (h * h).sum()


PLACEMENTS = {"forward": _forward, "loss": _loss, "tensor_hook": _tensor_hook, "node_hook": _node_hook}


class _CountingEngine:
    """torch's engine, counting ``run_backward`` calls."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def run_backward(self, *args, **kwargs):
        self.calls += 1
        return self.inner.run_backward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _steps(build, transform):
    """Three steps on one leaf: per step the loss and the leaf's .grad."""
    w = W0.clone().requires_grad_()
    out = []
    for _ in range(STEPS):
        w.grad = None
        loss = build(transform, w)
        loss.backward()
        out.append((loss.detach(), w.grad))
    return out


def _clean_state():
    """Nothing a backward or a transform set is left on."""
    assert torch._C._functorch.peek_interpreter_stack() is None
    assert torch.is_grad_enabled()
    assert torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None
    assert torch._C._len_torch_dispatch_stack() == 0
    assert run_context.current() is None
    assert not getattr(engine._tls, "busy", False)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transform_matches_eager(name, placement, monkeypatch):
    transform, under_transform, plain = TRANSFORMS[name]
    build = PLACEMENTS[placement]
    counting = _CountingEngine(Variable._execution_engine)
    with monkeypatch.context() as m:
        m.setattr(Variable, "_execution_engine", counting)
        expected = _steps(build, transform)
    # the table's account of each transform's backwards is eager's
    assert counting.calls == STEPS * (1 + under_transform + plain)

    with cagrad.enable("eager"):
        actual = _steps(build, transform)
    _clean_state()
    for (el, eg), (al, ag) in zip(expected, actual):
        same(el, al)
        same(eg, ag)

    c = cagrad.counters
    if placement.endswith("hook"):
        # a backward inside a hook of a cagrad backward runs in eager, as
        # part of the hook (uncounted); the outer backward compiles and hits
        assert (c["backwards"], c["fallbacks"], c["captures"], c["cache_hits"]) == (STEPS, 0, 1, STEPS - 1)
        assert c["hooks_traced"] == 0
        return
    assert c["backwards"] == STEPS * (1 + under_transform + plain)
    assert c["fallbacks"] == STEPS * under_transform
    assert dict(c["fallback_reasons"]) == ({REASON: STEPS * under_transform} if under_transform else {})
    # the outer backward and each distinct plain backward are captured at
    # most once, then hit (af_hessian's rows of the Jacobian of the gradient
    # differ only in sizes, 1 among them: since sizes of 1 are traced as
    # symbols, one graph serves two of them, 4 captures where 5 were)
    assert c["captures"] <= 1 + plain
    assert c["captures"] + c["cache_hits"] == c["backwards"] - c["fallbacks"]


def test_fallback_leaves_nothing_behind(caplog):
    """The transform's backward falls back before anything is collected: no
    cache entry, no capture, nothing left on; one log line names the
    reason. The outer backward through its result then compiles and hits."""
    w = W0.clone().requires_grad_()
    with cagrad.enable("eager"):
        cache = engine._stack()[-1].cache
        with caplog.at_level(logging.INFO, logger="cagrad"):
            g = torch.func.grad(_f0)(w * X)
        lines = [r.getMessage() for r in caplog.records if REASON in r.getMessage()]
        assert len(lines) == 1 and "interpreter stack: Grad" in lines[0], lines
        assert (cagrad.counters["backwards"], cagrad.counters["fallbacks"], cagrad.counters["captures"]) == (1, 1, 0)
        assert cache.num_entries() == 0 and not cache.children and not cache.guards
        _clean_state()
        for step in range(2):
            w.grad = None
            if step:
                g = torch.func.grad(_f0)(w * X)
            (g * w).sum().backward()
            got = w.grad
    assert (cagrad.counters["captures"], cagrad.counters["cache_hits"]) == (1, 1)
    assert cagrad.counters["fallback_reasons"][REASON] == 2

    w2 = W0.clone().requires_grad_()
    (torch.func.grad(_f0)(w2 * X) * w2).sum().backward()
    same(w2.grad, got)


def test_gradient_penalty_training_loop_hits():
    """A training loop whose loss has a ``torch.func.grad`` gradient penalty
    (WGAN-GP style): parameters equal eager's after every step; the outer
    backward is captured once and hits after."""

    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(DT)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randn(5, 4, dtype=DT)
        params = []
        for _ in range(4):
            opt.zero_grad()

            def critic(x):
                return model(x).sum()

            penalty = (torch.func.grad(critic)(data).norm(dim=1) - 1).pow(2).mean()
            loss = model(data).mean() + 10 * penalty
            loss.backward()
            opt.step()
            params.append([p.detach().clone() for p in model.parameters()])
        return params

    expected = train()
    with cagrad.enable("eager"):
        actual = train()
    for e_step, a_step in zip(expected, actual):
        for e, a in zip(e_step, a_step):
            same(e, a)
    c = cagrad.counters
    assert (c["backwards"], c["captures"], c["cache_hits"]) == (8, 1, 3)
    assert dict(c["fallback_reasons"]) == {REASON: 4}


def test_wrapped_saved_tensor_found_by_collection(monkeypatch):
    """Without the check at the entry, the collection still finds the
    wrapped tensors of ``vjp_fn``'s graph (its level has exited: dead
    GradTrackingTensors) and falls back with the same reason."""
    monkeypatch.setattr(transforms, "check_call", lambda *args: None)
    u = W0.clone()
    expected = torch.func.vjp(_fv0, u)[1](_cot(u))[0]
    with cagrad.enable("eager"):
        actual = torch.func.vjp(_fv0, u)[1](_cot(u))[0]
    same(expected, actual)
    assert dict(cagrad.counters["fallback_reasons"]) == {REASON: 1}
    assert cagrad.counters["captures"] == 0


def test_dead_wrapper_root_takes_no_hit_guard(monkeypatch, caplog):
    """A transform's intermediate kept past its level (a dead
    GradTrackingTensor) used as a root with ``backward()``: eager runs it,
    even where a hit guard of a plain graph of the same structure exists
    (checked with the guards alone: their verification collects in full,
    which finds the wrapped tensors too)."""
    monkeypatch.setenv("CAGRAD_VERIFY_GUARDS", "0")

    def leaked():
        kept = []

        def f(t):
            kept.append((t.sin() * t, t))
            return t.sum()

        torch.func.grad(f)(W0.clone())
        return kept[0]

    g = torch.ones(3, dtype=DT)
    root, leaf = leaked()
    root.backward(g)
    expected = leaf.grad
    with cagrad.enable("eager"):
        for _ in range(2):  # captured, then hit through a guard
            w = W0.clone().requires_grad_()
            (w.sin() * w).backward(g)
        root, leaf = leaked()
        with caplog.at_level(logging.INFO, logger="cagrad"):
            root.backward(g)
    same(expected, leaf.grad)
    assert any("root 0 is a GradTrackingTensor (dead" in r.getMessage() for r in caplog.records)
    c = cagrad.counters
    assert (c["captures"], c["cache_hits"], c["guard_hits"]) == (1, 1, 1)
    # the transform's own backward, then the dead root's
    assert dict(c["fallback_reasons"]) == {REASON: 2}


def test_is_grads_batched_falls_back():
    """``autograd.grad(is_grads_batched=True)``: legacy batched gradients."""
    u = W0.clone().requires_grad_()
    y = _fv0(u)
    eye = torch.eye(3, dtype=DT)
    expected = torch.autograd.grad(y, u, eye, retain_graph=True, is_grads_batched=True)[0]
    with cagrad.enable("eager"):
        actual = torch.autograd.grad(y, u, eye, is_grads_batched=True)[0]
    same(expected, actual)
    assert dict(cagrad.counters["fallback_reasons"]) == {REASON: 1}
    assert cagrad.counters["captures"] == 0


@pytest.mark.parametrize(
    "hook",
    [
        lambda g: g + torch.func.jacrev(torch.sin)(g).sum(0),
        lambda g: g + torch.vmap(torch.sin)(g),
    ],
    ids=["func_jacrev", "vmap"],
)
def test_hook_calling_a_transform_runs_opaque(hook):
    """A hook that calls a transform is not traced into the graph (its
    backward would run on fake tensors): it runs as it is, and the
    backward still compiles, then hits."""
    assert hook_tracing.fingerprint(hook) is None

    def build():
        w = W0.clone().requires_grad_()
        h = w.exp()
        h.register_hook(hook)
        (h * X).sum().backward()
        return w.grad

    expected = build()
    with cagrad.enable("eager"):
        actual = [build() for _ in range(2)]
    for a in actual:
        same(expected, a)
    c = cagrad.counters
    assert (c["hooks_traced"], c["fallbacks"], c["captures"], c["cache_hits"]) == (0, 0, 1, 1)


def test_native_extension_loads_inside_a_transform(monkeypatch):
    """The extension's first load, inside ``torch.func.grad`` or ``vmap``,
    passes every self-test (they run in a thread of their own)."""
    if native.load() is None:
        pytest.skip("cagrad's C++ extension cannot be built here")
    loaded = []

    def f(x):
        monkeypatch.setattr(native, "_native", None)
        loaded.append(native.load())
        return x.sin().sum()

    torch.func.grad(f)(W0.clone())
    torch.func.vmap(f)(torch.stack([W0, X]))
    for got in loaded:
        assert got is not None
        missing = [k for k in ("metadata", "hookless", "sole", "collect", "walk") if getattr(got, k) is None]
        assert not missing, missing


def test_error_eager_raises_is_eager_own():
    """``vjp_fn`` called twice without ``retain_graph``: the second call
    raises eager's error, from eager's engine, under cagrad too."""

    def build():
        u = W0.clone()
        _, vjp_fn = torch.func.vjp(_fv0, u)
        vjp_fn(_cot(u), retain_graph=False)
        vjp_fn(_cot(u), retain_graph=False)

    errors = errors_under_both(build)
    assert len(errors) == 2 and type(errors[0]) is type(errors[1]), errors
    assert str(errors[0]) == str(errors[1])
    assert "backward through the graph a second time" in str(errors[0])
    assert dict(cagrad.counters["fallback_reasons"]) == {REASON: 2}


def test_capture_and_explain_raise_unsupported_under_a_transform():
    """``cagrad.capture`` and ``cagrad.explain`` of a backward a transform
    would run raise ``cagrad.Unsupported`` with the reason, as documented
    for a backward cagrad would not compile; nothing is traced."""
    reasons = []

    def f(x):
        y = _f0(x)
        for call in (lambda: cagrad.capture(y, inputs=x), lambda: cagrad.explain(y, inputs=x)):
            with pytest.raises(cagrad.Unsupported) as e:
                call()
            reasons.append(e.value.reason)
            assert "interpreter stack: Grad" in e.value.detail
        return y

    torch.func.grad(f)(W0.clone())
    # a dead wrapper as the root, outside any transform
    u = W0.clone()
    kept = []
    torch.func.grad(lambda t: kept.append(_fv0(t)) or t.sum())(u)
    with pytest.raises(cagrad.Unsupported) as e:
        cagrad.capture(kept[0], torch.ones(3, dtype=DT))
    reasons.append(e.value.reason)
    assert reasons == [REASON] * 3
    assert cagrad.counters["captures"] == 0
