"""Which output of its node a root gradient flows into is part of the key.

A root edge is ``(root.grad_fn, root.output_nr)``. Two backwards from roots
at different outputs of the same kind of multi-output node (``aminmax``'s
min then its max) walk the same nodes with the same metadata, so only the
root edge's ``input_nr`` tells them apart: a key without it hands the
second backward the graph captured for the first, and its gradient flows
out of the wrong output. Each case runs the backwards one after the other in
one cagrad state and compares every gradient with eager's, bit for bit (the
eager and aot_eager backends run eager's kernels), and checks that the
second backward was captured anew rather than hit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

import cagrad
from fuzz.ops_graph import AMINMAX

from .conftest import same

BACKENDS = ("eager", "aot_eager")


def _leaf(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g, dtype=torch.float64).requires_grad_()


def _grad_out(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.rand(t.shape, generator=g, dtype=t.dtype)


# op name -> (leaf shape, forward returning the outputs); every output
# listed is differentiable and all of an op's outputs share one shape
MULTI_OUTPUT: dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor], Sequence[torch.Tensor]]]] = {
    "aminmax": ((3, 4), lambda x: torch.aminmax(x, dim=0)),
    "var_mean": ((3, 4), lambda x: torch.var_mean(x, dim=1)),
    "std_mean": ((3, 4), lambda x: torch.std_mean(x, dim=0)),
    "unbind": ((3, 4), lambda x: torch.unbind(x, 0)),
    "split": ((6, 2), lambda x: torch.split(x, 2, 0)),
    "chunk": ((2, 6), lambda x: torch.chunk(x, 3, 1)),
    "linalg_qr": ((3, 3), lambda x: torch.linalg.qr(x)),
}
if not AMINMAX:  # torch 2.11: aminmax has no derivative (the fuzz catalog runs amin and amax instead)
    del MULTI_OUTPUT["aminmax"]


def _backward(op: str, roots_at: Sequence[int], form: str, seed: int = 1) -> list[torch.Tensor | None]:
    """Gradients w.r.t. the leaf of ``op``'s outputs ``roots_at`` (each with
    a seeded ``grad_output``), by ``autograd.grad`` or ``backward()``."""
    shape, forward = MULTI_OUTPUT[op]
    x = _leaf(shape, seed)
    outs = forward(x)
    roots = [outs[i] for i in roots_at]
    grads = [_grad_out(r, i) for i, r in zip(roots_at, roots)]
    if form == "grad":
        return list(torch.autograd.grad(roots, [x], grad_outputs=grads))
    torch.autograd.backward(roots, grads)
    return [x.grad]


def _check(op: str, sequence: Sequence[Sequence[int]], form: str, backend: str) -> None:
    expected = [_backward(op, roots_at, form) for roots_at in sequence]
    cagrad.reset()
    with cagrad.enable(backend):
        for roots_at, want in zip(sequence, expected):
            captures = cagrad.counters["captures"]
            got = _backward(op, roots_at, form)
            assert len(got) == len(want)
            for a, b in zip(want, got):
                same(a, b)
            assert cagrad.counters["captures"] == captures + 1, f"roots at {roots_at} hit another root's graph"
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["grad", "backward"])
@pytest.mark.parametrize("op", sorted(MULTI_OUTPUT))
def test_one_root_at_each_output(op: str, form: str, backend: str) -> None:
    _check(op, [[0], [1]], form, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["grad", "backward"])
@pytest.mark.parametrize("op", ["unbind", "split"])
def test_several_roots_at_different_outputs(op: str, form: str, backend: str) -> None:
    # with several roots a GraphRoot is in front and its edges name the
    # outputs; then single roots at outputs 2 and 0 of the same node
    _check(op, [[0, 1], [0, 2], [2, 1], [2], [0]], form, backend)


@pytest.mark.parametrize("form", ["grad", "backward"])
def test_a_root_back_at_its_first_output_hits(form: str) -> None:
    """The key still hits where the root edge is the same: roots at outputs
    0, 1, 0, 1 capture twice and hit twice (``backward()`` through the
    generated guards, which check the root's ``output_nr`` themselves)."""
    sequence = ([0], [1], [0], [1])
    expected = [_backward("var_mean", roots_at, form) for roots_at in sequence]
    with cagrad.enable("eager"):
        for roots_at, want in zip(sequence, expected):
            for a, b in zip(want, _backward("var_mean", roots_at, form)):
                same(a, b)
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["cache_hits"] == 2
    assert cagrad.counters["guard_hits"] == (2 if form == "backward" else 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["topk", "max_dim"])
def test_values_then_indices_root(op: str, backend: str) -> None:
    """``topk`` and ``max(dim)`` have one differentiable output (values); a
    root at the indices is rejected by eager, and cagrad raises eager's
    error after a capture at the values instead of running that graph."""

    def forward(x: torch.Tensor) -> Sequence[torch.Tensor]:
        return torch.topk(x, 2, dim=1) if op == "topk" else torch.max(x, dim=1)

    def run(i: int) -> list[torch.Tensor]:
        x = _leaf((3, 4), 1)
        out = forward(x)[i]
        return list(torch.autograd.grad([out], [x], grad_outputs=[torch.ones_like(out, dtype=torch.float64)]))

    want = run(0)
    with pytest.raises(RuntimeError) as eager_error:
        run(1)
    with cagrad.enable(backend):
        for a, b in zip(want, run(0)):
            same(a, b)
        with pytest.raises(RuntimeError) as cagrad_error:
            run(1)
    assert str(cagrad_error.value) == str(eager_error.value)
