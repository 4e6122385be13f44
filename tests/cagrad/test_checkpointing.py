"""Non-reentrant and selective activation checkpointing under cagrad.

``torch.utils.checkpoint`` (``use_reentrant=False``) packs saved tensors with
``saved_tensors_hooks`` whose unpack recomputes the region once per backward,
keyed by ``torch._C._current_graph_task_id()``; selective checkpointing
(``create_selective_checkpoint_contexts``) also hands each saved op output to
the recomputation exactly once, and raises "Trying to backward an extra time"
on a second use. So cagrad must run such hooks once per backward, where eager
runs them: never while it collects a backward that may then fall back. Each
test runs one program in eager and under ``cagrad.enable(backend)`` and
compares the gradients (and errors), then cagrad's counters.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import cagrad

from .conftest import errors_under_both, run_both, same

BACKENDS = ["eager", "aot_eager"]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

P = CheckpointPolicy
POLICIES = {
    "recompute_addmm": (P.MUST_RECOMPUTE, P.PREFER_SAVE),
    "prefer_recompute_addmm": (P.PREFER_RECOMPUTE, P.MUST_SAVE),
    "save_addmm": (P.MUST_SAVE, P.PREFER_RECOMPUTE),
    "prefer_save_addmm": (P.PREFER_SAVE, P.MUST_RECOMPUTE),
}


def _context_fn(name: str):
    addmm_policy, other = POLICIES[name]

    def policy(ctx, op, *args, **kwargs):
        return addmm_policy if op == torch.ops.aten.addmm.default else other

    return functools.partial(create_selective_checkpoint_contexts, policy)


class Block(nn.Module):
    """(N, 4) -> (N, 4): linear, layer norm, relu, linear, tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.ln = nn.LayerNorm(8)
        self.l2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.ln(self.l1(x)))).tanh()


def _grads(module: nn.Module, *tensors: torch.Tensor) -> list:
    return [p.grad for p in module.parameters()] + [t.grad for t in tensors]


def _compiled(backwards: int) -> None:
    """Every backward ran compiled. A node behind checkpoint's saved-tensor
    hooks runs as it is; AddmmBackward0 returns mat2's gradient in mat2's
    column-major layout (eager's ``mm_mat2_backward``): the first backward
    hands it on as eager does and is traced again at its end assuming that
    layout (tests/cagrad/test_opaque_layouts.py); every backward after it
    hits."""
    c = cagrad.counters
    assert c["fallbacks"] == 0, dict(c["fallback_reasons"])
    assert c["deopts"] <= 1 and c["retraces"] == c["deopts"]
    assert c["captures"] == 1 and c["cache_hits"] == backwards - 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_selective_checkpoint(policy, backend):
    def build():
        lins = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        x = torch.randn(2, 4)
        for _ in range(3):
            out = checkpoint(lins, x, use_reentrant=False, context_fn=_context_fn(policy))
            out.sum().backward()
        return _grads(lins)

    expected, actual = run_both(build, backend)
    for e, a in zip(expected, actual):
        same(e, a)
    _compiled(3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_checkpoint_autograd_grad(backend):
    def build():
        block = Block()
        x = torch.randn(3, 4, requires_grad=True)
        out = []
        for _ in range(3):
            y = checkpoint(block, x, use_reentrant=False, context_fn=_context_fn("recompute_addmm"))
            out += torch.autograd.grad((y * x.sin()).sum(), [x, block.l1.weight])
        return out

    expected, actual = run_both(build, backend)
    for e, a in zip(expected, actual):
        same(e, a)
    _compiled(3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_checkpoint_second_backward_raises_eagers_error(backend):
    grads = []

    def build():
        torch.manual_seed(0)
        lins = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)])
        grads.append(_grads(lins))
        out = checkpoint(
            lins, torch.randn(2, 4), use_reentrant=False, context_fn=_context_fn("recompute_addmm")
        )
        loss = out.sum()
        loss.backward(retain_graph=True)
        loss.backward()

    errors = errors_under_both(build, backend)
    assert [type(e) for e in errors] == [RuntimeError, RuntimeError]
    assert str(errors[0]) == str(errors[1])
    assert "backward an extra time" in str(errors[0])
    for e, a in zip(*grads):  # the first backward's gradients, in both
        same(e, a)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_retain_graph_backward_twice(backend):
    def build():
        block = Block()
        x = torch.randn(3, 4, requires_grad=True)
        for _ in range(2):
            loss = checkpoint(block, x, use_reentrant=False).pow(2).sum()
            loss.backward(retain_graph=True)
            loss.backward()
        return _grads(block, x)

    expected, actual = run_both(build, backend)
    for e, a in zip(expected, actual):
        same(e, a)
    _compiled(4)


@pytest.mark.parametrize("retain_graph", [False, True])
def test_keep_graph_is_answered_for_the_running_backward(retain_graph):
    # AOTAutograd's lazily compiled backward asks it (saved tensors used
    # once, donated buffers); torch's engine answers True outside a backward
    def build():
        x = torch.randn(3, requires_grad=True)
        seen = []
        y = x.exp()
        y.register_hook(
            lambda g: seen.append(torch._C._autograd._get_current_graph_task_keep_graph())
        )
        y.sum().backward(retain_graph=retain_graph)
        return seen

    expected, actual = run_both(build)
    assert expected == actual == [retain_graph]
    assert cagrad.counters["fallbacks"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_checkpoint_around_a_compiled_module(backend):
    # the region's backward is an AOTAutograd node whose saved tensors the
    # checkpoint's hooks hold: cagrad runs it as it is, unpacking them once
    def build():
        torch._dynamo.reset()
        if torch.cuda.is_available():
            # on a GPU host torch.compile initializes CUDA, and checkpoint
            # refuses a device initialized inside its forward (eager too)
            torch.cuda.init()
        lins = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
        compiled = torch.compile(lins, backend="aot_eager")
        x = torch.randn(2, 4, requires_grad=True)
        for _ in range(3):
            out = checkpoint(compiled, x, use_reentrant=False, context_fn=_context_fn("save_addmm"))
            out.sum().backward()
        return _grads(lins, x)

    expected, actual = run_both(build, backend)
    for e, a in zip(expected, actual):
        same(e, a)
    _compiled(3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_checkpoint_inside_a_compiled_function(backend):
    def build():
        torch._dynamo.reset()
        lins = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
        fn = torch.compile(
            lambda t: checkpoint(
                lins, t, use_reentrant=False, context_fn=_context_fn("save_addmm")
            ),
            backend="aot_eager",
        )
        x = torch.randn(2, 4, requires_grad=True)
        for _ in range(3):
            fn(x).sum().backward()
        return _grads(lins, x)

    expected, actual = run_both(build, backend)
    for e, a in zip(expected, actual):
        same(e, a)
    _compiled(3)


class _OddLayoutBlock(nn.Module):
    """(N, 4) -> (N, 4): Block with its first weight a leaf stored
    transposed (strides (1, 8)), so eager's ``.grad`` copies into that layout."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.block.l1.weight = nn.Parameter(torch.randn(4, 8).t())

    def forward(self, x):
        return self.block(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_reentrant_checkpoint_hits_from_the_second_backward(backend):
    """``checkpoint(..., use_reentrant=False)`` (what transformers'
    ``gradient_checkpointing_enable()`` uses by default): the first backward
    deopts on AddmmBackward0's column-major gradient and is traced again at
    its end; the second and every later one hit. Gradients, and every
    ``.grad``'s strides, are eager's."""
    backwards = 5

    def build():
        model = _OddLayoutBlock()
        x = torch.randn(3, 4, requires_grad=True)
        out = []
        for _ in range(backwards):
            checkpoint(model, x, use_reentrant=False).pow(2).sum().backward()
            grads = _grads(model, x)
            out.append([(g.clone(), g.stride()) for g in grads])
        return out

    expected, actual = run_both(build, backend)
    for e_step, a_step in zip(expected, actual):
        for (e, e_strides), (a, a_strides) in zip(e_step, a_step):
            same(e, a)
            assert a_strides == e_strides
    assert expected[0][0][1] == (1, 8)  # the transposed leaf's .grad keeps its layout
    c = cagrad.counters
    assert c["fallbacks"] == 0, dict(c["fallback_reasons"])
    assert c["captures"] == 1 and c["deopts"] == 1 and c["retraces"] == 1
    assert c["cache_hits"] == backwards - 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_reentrant_checkpoints_inner_backwards_run_through_cagrad(backend):
    """``checkpoint(..., use_reentrant=True)`` is a custom Function whose
    backward recomputes the region and calls ``torch.autograd.backward`` on
    it. That inner backward is the user's too: cagrad captures it once and
    hits after, beside the outer one (two graphs, two backwards a step).
    Gradients and ``.grad`` strides are eager's."""
    steps = 3

    def build():
        model = _OddLayoutBlock()
        x = torch.randn(3, 4, requires_grad=True)
        out = []
        for _ in range(steps):
            checkpoint(model, x, use_reentrant=True).pow(2).sum().backward()
            out.append([(g.clone(), g.stride()) for g in _grads(model, x)])
        return out

    expected, actual = run_both(build, backend)
    for e_step, a_step in zip(expected, actual):
        for (e, e_strides), (a, a_strides) in zip(e_step, a_step):
            same(e, a)
            assert a_strides == e_strides
    c = cagrad.counters
    assert c["fallbacks"] == 0, dict(c["fallback_reasons"])
    assert c["backwards"] == 2 * steps
    assert c["captures"] == 2 and c["cache_hits"] == 2 * steps - 2
