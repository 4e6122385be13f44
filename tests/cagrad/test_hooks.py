"""Hooks of every kind run under cagrad as under eager: same calls, same order.

Each case builds the same program twice; hooks append ``(label, grad)`` to a
trace. Under cagrad the backward must compile (no fallback), give eager's
gradients bit for bit, and produce eager's trace (which hook, in which order,
with which gradient). Cases torch's own compiled autograd supports are also
run against it.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import cagrad

from .conftest import check_traced as check, compiled_without_fallback, errors_under_both, same


def test_tensor_hooks_on_a_non_leaf_run_in_order_and_replace_the_grad():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        h.register_hook(lambda g: tr.append(("first", g)))
        h.register_hook(lambda g: g * 3)
        h.register_hook(lambda g: tr.append(("after_scale", g)))
        (h * 2).sum().backward()
        return [x.grad]

    trace = check(build)
    torch.testing.assert_close(trace[1][1], trace[0][1] * 3)


def test_hooks_on_two_outputs_of_one_node_run_in_registration_order():
    def build(tr):
        x = torch.randn(4, requires_grad=True)
        a, b = x.split(2)
        b.register_hook(lambda g: tr.append(("b", g)))
        a.register_hook(lambda g: tr.append(("a", g)))
        (a.exp().sum() + b.sin().sum()).backward()
        return [x.grad]

    trace = check(build)
    assert [label for label, _ in trace] == ["b", "a"]


def test_tensor_hook_runs_on_an_undefined_gradient():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        a, b = x.split([1, 2])
        b.register_hook(lambda g: tr.append(("b", g)))
        a.sum().backward()
        return [x.grad]

    trace = check(build)
    assert trace == [("b", None)]


def test_leaf_hook_and_post_accumulate_grad_hook():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        x.register_hook(lambda g: g + 1)
        x.register_post_accumulate_grad_hook(lambda p: tr.append(("post_acc", p.grad.clone())))
        x.exp().sum().backward()
        return [x.grad]

    check(build)


def test_post_accumulate_hook_sees_grad_of_other_leaves_in_eager_order():
    def build(tr):
        w1 = torch.randn(3, requires_grad=True)
        w2 = torch.randn(3, requires_grad=True)
        for name, w in (("w1", w1), ("w2", w2)):
            w.register_post_accumulate_grad_hook(
                lambda p, name=name: tr.append((name, None if w2.grad is None else w2.grad.clone()))
            )
        (w1.exp() * w2).sum().backward()
        return [w1.grad, w2.grad]

    check(build)


def test_retain_grad_on_non_leaves():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        h.retain_grad()
        k = h * 2
        k.retain_grad()
        (k * h).sum().backward()
        return [x.grad, h.grad, k.grad]

    check(build)


def test_node_pre_and_post_hooks():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        h.grad_fn.register_prehook(lambda go: (go[0] * 7,))
        h.grad_fn.register_hook(lambda gi, go: tr.append(("post", gi[0])))
        h.sum().backward()
        return [x.grad]

    check(build)


def test_post_hook_replacing_grads():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        y = x * x
        y.grad_fn.register_hook(lambda gi, go: (gi[0] * 0.5, gi[1] * 2.0))
        y.sum().backward()
        return [x.grad]

    check(build)


def test_module_full_backward_hook_and_pre_hook():
    def build(tr):
        m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        m[0].register_full_backward_hook(lambda mod, gi, go: tr.append(("hook0", go[0])))
        m[2].register_full_backward_pre_hook(lambda mod, go: tr.append(("pre2", go[0])))
        m(torch.randn(5, 3, requires_grad=True)).sum().backward()
        return [p.grad for p in m.parameters()]

    check(build)


def test_hooks_on_autograd_grad_inputs():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        h.register_hook(lambda g: tr.append(("h", g)))
        return list(torch.autograd.grad((h * 2).sum(), [h, x]))

    check(build)


def test_a_new_lambda_each_step_is_a_cache_hit_and_runs_the_new_hook():
    seen = []

    def step(i):
        torch.manual_seed(i)
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        h.register_hook(lambda g: seen.append(i) or g * (i + 1))
        h.sum().backward()
        return x.grad

    expected = [step(i) for i in range(3)]
    seen.clear()
    with cagrad.enable("eager"):
        actual = [step(i) for i in range(3)]
    for e, a in zip(expected, actual):
        same(e, a)
    assert seen == [0, 1, 2]
    assert cagrad.counters["captures"] == 1 and cagrad.counters["cache_hits"] == 2


def test_hook_registered_before_enable_is_seen():
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    h = x.exp()
    h.register_hook(lambda g: g * 5)
    y = h.sum()
    with cagrad.enable("eager"):
        y.backward()
    torch.testing.assert_close(x.grad, 5 * x.exp(), rtol=0, atol=0)
    compiled_without_fallback()


def test_removed_hook_does_not_run():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        handle = h.register_hook(lambda g: tr.append(("removed", g)))
        h.register_hook(lambda g: tr.append(("kept", g)))
        handle.remove()
        h.sum().backward()
        return [x.grad]

    assert [label for label, _ in check(build)] == ["kept"]


def test_hook_that_removes_itself_runs_once():
    def build(tr):
        outs = []
        x = torch.randn(3, requires_grad=True)
        for _ in range(2):
            h = x.exp()
            handle = None

            def once(g, tr=tr):
                tr.append(("once", g))
                handle.remove()

            handle = h.register_hook(once)
            h.sum().backward()
            outs.append(x.grad.clone())
        return outs

    check(build)


@pytest.mark.parametrize(
    "bad, phrase",
    [
        (lambda g: torch.ones(4), "changed the size"),
        (lambda g: g.double(), "changed the type"),
        (lambda g: "not a tensor", "expected Variable"),
    ],
    ids=["size", "dtype", "type"],
)
def test_hook_errors_match_eager(bad, phrase):
    def build():
        x = torch.randn(3, requires_grad=True)
        y = x * 2
        y.register_hook(bad)
        y.sum().backward()

    errors = errors_under_both(build)
    assert len(errors) == 2
    assert type(errors[0]) is type(errors[1])
    assert phrase in str(errors[0]) and phrase in str(errors[1])


def test_hook_exception_propagates():
    with cagrad.enable("eager"):
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        h.register_hook(lambda g: (_ for _ in ()).throw(ValueError("from the hook")))
        with pytest.raises(ValueError, match="from the hook"):
            h.sum().backward()


def test_post_hook_returning_none_is_finished_by_the_interpreter():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        y = x.exp()
        # it records its call, so it runs opaque (a pure one is traced,
        # test_node_hook_tracing.py, and needs no deopt)
        y.grad_fn.register_hook(lambda gi, go: tr.append(("post", gi[0])) or (None,))
        ((x * 2) + y).sum().backward()
        return [x.grad]

    check(build)
    assert cagrad.counters["deopts"] == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_hooks_match_torch_compiled_autograd(backend):
    """The peer: torch's own compiled autograd gives the same trace."""
    from torch._dynamo import compiled_autograd

    def build(tr):
        x = torch.randn(3, 4, requires_grad=True)
        h = x.tanh()
        h.register_hook(lambda g: g * 2)
        x.register_hook(lambda g: tr.append(("leaf", g)))
        (h @ h.t()).sum().backward()
        return [x.grad]

    torch.manual_seed(0)
    trace_ca: list = []
    torch._dynamo.reset()
    with compiled_autograd._enable(functools.partial(torch.compile, backend=backend)):
        expected = build(trace_ca)
    torch.manual_seed(0)
    trace_ours: list = []
    with cagrad.enable(backend):
        actual = build(trace_ours)
    torch.testing.assert_close(actual[0], expected[0])
    assert [label for label, _ in trace_ours] == [label for label, _ in trace_ca]
    compiled_without_fallback()
