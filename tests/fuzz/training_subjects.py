"""Deliberately wrong subjects for the training features (tests only).

* ``SkipsOptimizerStep``: eager autograd under which ``SGD.step`` and
  ``Adam.step`` do nothing: every gradient is right, the parameters never
  move (only the per-step parameter observations can tell).
* ``DrawsAfterBackward``: eager autograd that draws one number from the
  global CPU generator after every ``torch.autograd.backward``: the stream
  after the first backward differs (kind ``state``).
* ``RecomputeForgetsRng``: eager autograd under which
  ``torch.set_rng_state`` does nothing, so a checkpointed region's
  recomputation draws new random numbers instead of replaying the
  forward's (and the stream is not put back afterwards).
* ``BrokenIndexAdd``: eager autograd that adds 1 to every leaf ``.grad``
  after a backward whose graph holds an ``IndexAddBackward0`` node (the
  data-dependent-size ops route through ``index_add``).
* ``ReplacesGrad``: eager autograd that, after every backward, puts a copy
  of each leaf's ``.grad`` in its place: the same values and strides in
  another tensor, as a compiled autograd that writes a new ``.grad``
  instead of adding into the one it found would leave.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

import harness
from harness.program import ProgramRun, run_backward


class SkipsOptimizerStep(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("skips_step[eager]")

    @contextlib.contextmanager
    def active(self):
        def skip(self, closure=None):
            return None

        with mock.patch.object(torch.optim.SGD, "step", skip), mock.patch.object(torch.optim.Adam, "step", skip):
            yield


class DrawsAfterBackward(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("draws_after_backward[eager]")

    @contextlib.contextmanager
    def active(self):
        original = torch.autograd.backward

        def drawing(*args, **kwargs):
            out = original(*args, **kwargs)
            torch.rand(())
            return out

        with mock.patch.object(torch.autograd, "backward", drawing):
            yield


class RecomputeForgetsRng(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("recompute_forgets_rng[eager]")

    @contextlib.contextmanager
    def active(self):
        with mock.patch.object(torch, "set_rng_state", lambda state: None):
            yield


def _graph_has(outputs, name: str) -> bool:
    from harness.subjects import graph_nodes

    return any(type(n).__name__ == name for n in graph_nodes(outputs))


class BrokenIndexAdd(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("broken[index_add]")

    def run(self, run: ProgramRun):
        original = torch.autograd.backward

        def patched(tensors, *args, **kwargs):
            hit = _graph_has(list(tensors) if isinstance(tensors, (list, tuple)) else [tensors], "IndexAddBackward0")
            out = original(tensors, *args, **kwargs)
            if hit:
                with torch.no_grad():
                    for leaf in run.leaves:
                        if leaf.grad is not None:
                            leaf.grad.add_(1)
            return out

        with mock.patch.object(torch.autograd, "backward", patched):
            return run_backward(run)


class ReplacesGrad(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("replaces_grad[eager]")

    def run(self, run: ProgramRun):
        original = torch.autograd.backward

        def patched(tensors, *args, **kwargs):
            out = original(tensors, *args, **kwargs)
            for leaf in run.leaves:
                if leaf.grad is not None:
                    leaf.grad = leaf.grad.clone()
            return out

        with mock.patch.object(torch.autograd, "backward", patched):
            return run_backward(run)
