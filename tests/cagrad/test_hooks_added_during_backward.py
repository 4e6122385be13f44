"""Hooks that user code registers while a backward runs (cagrad.hooks.added_hooks).

Eager's engine reads a node's hooks when it runs the node, so a hook that an
opaque hook or a custom Function's backward registers on a node that has not
run yet runs in the same backward. Each case is run under eager and under
cagrad (three backwards, a fresh graph each) and compared: the gradients and
the order of every hook call.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import cagrad

from .conftest import compiled_without_fallback


class _Double(torch.autograd.Function):
    """A custom Function whose backward registers a hook (set per test)."""

    on_backward: Callable[[], None] = staticmethod(lambda: None)

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        _Double.on_backward()
        return g * 2


def _program(case: str) -> tuple[list, torch.Tensor]:
    """Builds a graph w -> a -> b -> c, registers the case's hooks; runs its
    backward; returns the hook calls seen and ``w.grad``."""
    seen: list = []
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    v = torch.randn(4, requires_grad=True)
    a = w * 3 + v
    b = a.tanh() if case != "custom_function" else _Double.apply(a.tanh())
    c = b.exp()

    def post(tag):
        return lambda gi, go: seen.append((tag, gi[0].sum().item())) or (gi[0] + 100, *gi[1:])

    if case == "node_post_hook":
        c.register_hook(lambda g: a.grad_fn.register_hook(post("post a")) and None)
    elif case == "node_pre_hook":
        c.register_hook(lambda g: a.grad_fn.register_prehook(lambda go: seen.append("pre a") or (go[0] * 5,)) and None)
    elif case == "tensor_hook":
        c.register_hook(lambda g: a.register_hook(lambda ga: seen.append("tensor a") or ga - 7) and None)
    elif case == "retain_grad":
        c.register_hook(lambda g: a.retain_grad())
    elif case == "leaf_hook":
        c.register_hook(lambda g: w.register_hook(lambda gw: seen.append("leaf w") or gw * 0.5) and None)
    elif case == "post_accumulate":
        c.register_hook(lambda g: w.register_post_accumulate_grad_hook(lambda p: seen.append(("acc", p.grad.sum().item()))) and None)
    elif case == "from_node_pre_hook":
        # an opaque node pre-hook (it records) adds the post-hook
        b.grad_fn.register_prehook(lambda go: seen.append("pre b") or a.grad_fn.register_hook(post("post a")) and None)
    elif case == "custom_function":
        _Double.on_backward = staticmethod(lambda: a.grad_fn.register_hook(post("post a")) and None)
    elif case == "chain":
        # the hook added first adds another, which runs while the interpreter finishes
        def on_b(gi, go):
            seen.append("post b")
            a.grad_fn.register_hook(post("post a"))

        c.register_hook(lambda g: b.grad_fn.register_hook(on_b) and None)
    elif case == "already_ran":
        # registered on c's node after it ran: neither eager nor cagrad runs it
        b.register_hook(lambda g: c.grad_fn.register_hook(post("post c")) and None)
    else:  # pragma: no cover
        raise ValueError(case)
    c.sum().backward()
    grads = [w.grad, v.grad, a.grad if case == "retain_grad" else None]
    return seen, grads


CASES = [
    "node_post_hook", "node_pre_hook", "tensor_hook", "retain_grad", "leaf_hook", "post_accumulate",
    "from_node_pre_hook", "custom_function", "chain", "already_ran",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_hook_registered_during_the_backward_runs_as_in_eager(case: str, backend: str) -> None:
    for _ in range(3):
        expected = _program(case)
        with cagrad.enable(backend):
            actual = _program(case)
        assert actual[0] == expected[0]
        for got, want in zip(actual[1], expected[1]):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    compiled_without_fallback()
