"""What cagrad does not compile yet runs in eager, counted, with its reason.

Every case checks three things: the gradients equal eager's, the backward
was counted in ``fallbacks``, and the reason is the documented slug.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import cagrad

from .conftest import run_both, same


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _tensor_hook():
    x = torch.randn(3, requires_grad=True)
    h = x.exp()
    h.register_hook(lambda g: g * 3)
    h.sum().backward()
    return x.grad


def _leaf_hook():
    x = torch.randn(3, requires_grad=True)
    x.register_hook(lambda g: g + 1)
    x.exp().sum().backward()
    return x.grad


def _retain_grad():
    x = torch.randn(3, requires_grad=True)
    h = x.exp()
    h.retain_grad()
    h.sum().backward()
    return h.grad


def _node_post_hook():
    x = torch.randn(3, requires_grad=True)
    h = x.exp()
    h.grad_fn.register_hook(lambda gi, go: (gi[0] * 5,))
    h.sum().backward()
    return x.grad


def _node_pre_hook():
    x = torch.randn(3, requires_grad=True)
    h = x.exp()
    h.grad_fn.register_prehook(lambda go: (go[0] * 7,))
    h.sum().backward()
    return x.grad


def _post_accumulate_hook():
    x = torch.randn(3, requires_grad=True)
    seen = []
    x.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x.exp().sum().backward()
    return seen[0]


def _module_full_backward_hook():
    m = nn.Linear(3, 2)
    m.register_full_backward_hook(lambda mod, gi, go: None)
    m(torch.randn(4, 3, requires_grad=True)).sum().backward()
    return m.weight.grad


def _custom_function():
    x = torch.randn(3, requires_grad=True)
    Double.apply(x.exp()).sum().backward()
    return x.grad


def _create_graph():
    x = torch.randn(3, requires_grad=True)
    (g,) = torch.autograd.grad(x.pow(3).sum(), x, create_graph=True)
    g.sum().backward()
    return x.grad


def _saved_tensors_hooks():
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t):
        y = x.exp().sum()
    y.backward()
    return x.grad


def _checkpoint_non_reentrant():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    checkpoint(lambda t: lin(t).relu(), x, use_reentrant=False).sum().backward()
    return x.grad


def _inplace_on_view():
    x = torch.randn(4, 3, requires_grad=True)
    y = x * 1
    y[1:].mul_(2)
    y.sum().backward()
    return x.grad


def _cat_with_two_nograd_inputs():
    x = torch.randn(2, 3, requires_grad=True)
    a, b = torch.randn(1, 3), torch.randn(3, 3)
    y = torch.cat([a, x, b]).exp()
    y.backward(torch.arange(18.0).reshape(6, 3))
    return x.grad


def _anomaly_mode():
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.detect_anomaly(check_nan=False):
        x.exp().sum().backward()
    return x.grad


CASES = {
    "tensor_hook": (_tensor_hook, "hooks"),
    "leaf_hook": (_leaf_hook, "hooks"),
    "retain_grad": (_retain_grad, "hooks"),
    "node_post_hook": (_node_post_hook, "hooks"),
    "node_pre_hook": (_node_pre_hook, "hooks"),
    "post_accumulate_grad_hook": (_post_accumulate_hook, "hooks"),
    "module_full_backward_hook": (_module_full_backward_hook, "custom_function"),
    "custom_function": (_custom_function, "custom_function"),
    "create_graph": (_create_graph, "create_graph"),
    "saved_tensors_hooks": (_saved_tensors_hooks, "saved_tensors_hooks"),
    "checkpoint": (_checkpoint_non_reentrant, "saved_tensors_hooks"),
    "inplace_on_view": (_inplace_on_view, "unsupported_node:CopySlices"),
    "cat_hidden_sizes": (_cat_with_two_nograd_inputs, "hidden_state:CatBackward0"),
    "anomaly_mode": (_anomaly_mode, "anomaly_mode"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_unsupported_case_falls_back_with_reason(name):
    build, reason = CASES[name]
    expected, actual = run_both(build)
    same(expected, actual)
    reasons = cagrad.counters["fallback_reasons"]
    assert cagrad.counters["fallbacks"] >= 1
    assert reason in reasons, dict(reasons)


def test_cat_with_one_nograd_input_compiles():
    def build():
        x = torch.randn(2, 3, requires_grad=True)
        y = torch.randn(2, 3, requires_grad=True)
        a = torch.randn(1, 3)
        out = torch.cat([x, a, y]).exp()
        out.backward(torch.arange(15.0).reshape(5, 3))
        return x.grad, y.grad

    expected, actual = run_both(build)
    for e, g in zip(expected, actual):
        same(e, g)
    assert cagrad.counters["fallbacks"] == 0


def test_a_removed_hook_no_longer_forces_a_fallback():
    def build():
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        handle = h.register_hook(lambda g: g * 3)
        handle.remove()
        h.sum().backward()
        return x.grad

    expected, actual = run_both(build)
    same(expected, actual)
    assert cagrad.counters["fallbacks"] == 0


def test_fallback_verdict_is_cached_and_counted_each_time():
    with cagrad.enable("eager"):
        for _ in range(3):
            x = torch.randn(4, 3, requires_grad=True)
            y = x * 1
            y[1:].mul_(2)
            y.sum().backward()
    assert cagrad.counters["fallbacks"] == 3
    assert cagrad.counters["captures"] == 0
