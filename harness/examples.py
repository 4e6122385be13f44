"""A few small, hand-written programs: smoke tests of the oracle, and
examples of how to write a :class:`~harness.program.Program`.

Each ``*_program(...)`` returns a fresh Program; all build deterministically
from ``torch.manual_seed`` (the runner seeds before each build) and work on
any device and floating dtype.
"""

from __future__ import annotations

import torch

from harness.program import BackwardMode, CallableProgram, ProgramRun


def mlp_program(
    mode: BackwardMode = "backward", dtype: torch.dtype = torch.float32, batch: int = 4, width: int = 8
) -> CallableProgram:
    """Two-layer MLP (``linear -> tanh -> linear -> mse``).

    Leaves: ``w1 (width, width)``, ``b1 (width,)``, ``w2 (1, width)``,
    ``b2 (1,)``, the input ``x (batch, width)`` (``requires_grad=False``, so
    its ``.grad`` stays ``None``). Output: the scalar loss. In mode
    ``"grad"`` the inputs are the four parameters.
    """

    def build(device: torch.device) -> ProgramRun:
        kw = {"device": device, "dtype": dtype}
        w1 = torch.randn(width, width, **kw).requires_grad_()
        b1 = torch.randn(width, **kw).requires_grad_()
        w2 = torch.randn(1, width, **kw).requires_grad_()
        b2 = torch.randn(1, **kw).requires_grad_()
        x = torch.randn(batch, width, **kw)
        target = torch.randn(batch, 1, **kw)
        h = torch.tanh(torch.nn.functional.linear(x, w1, b1))
        loss = torch.nn.functional.mse_loss(torch.nn.functional.linear(h, w2, b2), target)
        params = [w1, b1, w2, b2]
        return ProgramRun(
            leaves=[*params, x], outputs=[loss], mode=mode, inputs=params if mode == "grad" else None
        )

    return CallableProgram(f"mlp[{mode},{str(dtype).removeprefix('torch.')}]", build)


def hooks_program(mode: BackwardMode = "backward") -> CallableProgram:
    """A chain with a leaf tensor hook, a non-leaf tensor hook that scales the
    grad by 2, and a post-accumulate-grad hook; each appends
    ``(tag, grad clone)`` to the trace. Leaves ``a (3, 4)``, ``b (4,)``."""

    def build(device: torch.device) -> ProgramRun:
        a = torch.randn(3, 4, device=device, requires_grad=True)
        b = torch.randn(4, device=device, requires_grad=True)
        trace: list = []
        a.register_hook(lambda g: trace.append(("a", g.clone())))
        if mode == "backward":
            b.register_post_accumulate_grad_hook(lambda t: trace.append(("b.post_acc", t.grad.clone())))
        mid = a.sin() * b

        def mid_hook(g: torch.Tensor) -> torch.Tensor:
            trace.append(("mid", g.clone()))
            return g * 2

        mid.register_hook(mid_hook)
        out = (mid.exp() + b).sum()
        return ProgramRun(
            leaves=[a, b], outputs=[out], mode=mode, inputs=[a, b] if mode == "grad" else None, trace=trace
        )

    return CallableProgram(f"hooks[{mode}]", build)


def unused_leaf_program(mode: BackwardMode = "backward") -> CallableProgram:
    """Leaves ``used (5,)``, ``unused (5,)`` (requires grad, not in the graph),
    ``frozen (5,)`` (no grad): only ``used`` gets a gradient; in mode
    ``"grad"`` result 1 is ``None`` (``allow_unused=True``)."""

    def build(device: torch.device) -> ProgramRun:
        used = torch.randn(5, device=device, requires_grad=True)
        unused = torch.randn(5, device=device, requires_grad=True)
        frozen = torch.randn(5, device=device)
        out = (used * frozen).cos().sum()
        return ProgramRun(
            leaves=[used, unused, frozen],
            outputs=[out],
            mode=mode,
            inputs=[used, unused] if mode == "grad" else None,
        )

    return CallableProgram(f"unused_leaf[{mode}]", build)


def backward_twice_program(retain_graph: bool | None = None) -> CallableProgram:
    """Runs the backward twice on one graph (``repeat=2``). Without
    ``retain_graph`` eager raises ``RuntimeError`` ("Trying to backward
    through the graph a second time") on the second run; with it the grads
    accumulate to twice the single-run values."""

    def build(device: torch.device) -> ProgramRun:
        w = torch.randn(3, 3, device=device, requires_grad=True)
        x = torch.randn(2, 3, device=device)
        out = (x @ w).sigmoid().sum()
        return ProgramRun(leaves=[w], outputs=[out], repeat=2, retain_graph=retain_graph)

    return CallableProgram(f"backward_twice[retain_graph={retain_graph}]", build)
