"""A deliberately wrong subject, for testing the fuzzer itself.

``BrokenMulSubject`` is eager autograd that adds 1 to every gradient it
returns when the backward graph contains a ``MulBackward0`` node (``mul`` or
``mul_scalar`` in the IR). Any program using those ops diverges; every other
program agrees with eager. Load it with ``--plugin PATH/broken_subject.py:BrokenMulSubject``.

``DrawsOnExp`` and ``CagradDrawsOnCapture`` leave the global random stream
one draw ahead of eager's: a ``state`` mismatch.

``SilencesWarnings`` ignores the warnings of a backward through ``sin``: a
``warnings`` mismatch on a program whose hooks warn (``tensor.warn``).

``KeepsSavedTensors`` runs every backward with ``retain_graph=True``: a
``lifetime`` mismatch (unless ``CAGRAD_FUZZ_LIFETIMES=0``) wherever the graph
saved a tensor the program does not hold.

``ForgetfulCagrad`` is cagrad that forgets its compiled graphs before every
backward (its counters kept): it recaptures at every size of a size
sequence, breaking the capture rule (:mod:`harness.capture_rule`).
"""

from __future__ import annotations

import warnings

import torch

import harness
from harness.program import ProgramRun, run_backward
from harness.subjects import graph_nodes


def graph_has(outputs: list[torch.Tensor], node_name: str) -> bool:
    """Whether a node of type ``node_name`` is reachable from ``outputs``.

    The walk (:func:`harness.subjects.graph_nodes`) keeps every node's Python
    object alive while it runs: a C++ node's object is created on access and
    freed with its last reference, so a walk keyed by ``id`` alone could meet
    a new node at a freed one's address and skip it (it missed the
    ``MulBackward0`` of a double-backward program on torch 2.11)."""
    return any(type(node).__name__ == node_name for node in graph_nodes(outputs))


class BrokenMulSubject(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("broken[mul]")

    def run(self, run: ProgramRun):
        hit = graph_has(run.outputs, "MulBackward0")
        result = run_backward(run)
        if hit:
            with torch.no_grad():
                for leaf in run.leaves:
                    if leaf.grad is not None:
                        leaf.grad.add_(1)
            if result is not None:
                result = tuple(None if g is None else g + 1 for g in result)
        return result


class InterruptOnSecondMul(BrokenMulSubject):
    """Like :class:`BrokenMulSubject`, but the second diverging run raises
    KeyboardInterrupt: a campaign stopped in the middle of a shrink."""

    hits = 0

    def run(self, run: ProgramRun):
        if graph_has(run.outputs, "MulBackward0"):
            type(self).hits += 1
            if type(self).hits == 2:
                raise KeyboardInterrupt
        return super().run(run)


class ForgetfulCagrad(harness.CagradSubject):
    """cagrad[eager,dynamic] that empties its caches before every backward
    (sizes symbolic from the first capture: the strictest capture rule, so
    one resize step already breaks it)."""

    def __init__(self) -> None:
        super().__init__("eager", dynamic=True)
        self.name = "forgetful_cagrad[eager]"

    def run(self, run: ProgramRun):
        from cagrad import engine

        engine.clear_caches()
        return super().run(run)


class FallsBackOnExp(harness.EagerSubject):
    """Eager autograd that reports a fallback (reason ``planted``) in its
    counters whenever the backward graph holds an ``ExpBackward0`` node, as
    cagrad reports the backwards it hands to eager."""

    def __init__(self) -> None:
        super().__init__("falls_back[exp]")
        self.fallbacks = 0

    def run(self, run: ProgramRun):
        if graph_has(run.outputs, "ExpBackward0"):
            self.fallbacks += 1
        return run_backward(run)

    def counters(self):
        return {"fallbacks": self.fallbacks, "fallback_reasons": {"planted": self.fallbacks} if self.fallbacks else {}}


class SegmentFailsOnExp(harness.EagerSubject):
    """Eager autograd that reports a graph segment its backend failed to
    compile (``segment_compile_failures``) whenever the backward graph holds
    an ``ExpBackward0`` node: right gradients, as cagrad's when it runs such
    a segment uncompiled."""

    def __init__(self) -> None:
        super().__init__("segment_fails[exp]")
        self.failures = 0

    def run(self, run: ProgramRun):
        if graph_has(run.outputs, "ExpBackward0"):
            self.failures += 1
        return run_backward(run)

    def counters(self):
        return {"segment_compile_failures": self.failures}


class TransposedGrads(harness.EagerSubject):
    """Eager autograd whose 2-D ``.grad`` values come back with transposed
    strides: the same values in another layout, a difference only
    ``CAGRAD_FUZZ_STRIDES=1`` reports."""

    def __init__(self) -> None:
        super().__init__("transposed[grads]")

    def run(self, run: ProgramRun):
        result = run_backward(run)
        for leaf in run.leaves:
            if leaf.grad is not None and leaf.grad.dim() == 2:
                leaf.grad = leaf.grad.t().contiguous().t()
        return result


class DrawsOnExp(harness.EagerSubject):
    """Eager autograd that draws one number from the global CPU generator
    (``torch.rand(())``) after every backward whose graph holds an
    ``ExpBackward0`` node: right gradients, and the random stream one draw
    ahead of eager's, as cagrad's native self-tests left it before issue 36.
    The oracle reports a ``mismatch`` of kind ``state`` (``state cpu_rng``)."""

    def __init__(self) -> None:
        super().__init__("draws[exp]")

    def run(self, run: ProgramRun):
        result = run_backward(run)
        if graph_has(run.outputs, "ExpBackward0"):
            torch.rand(())
        return result


class SilencesWarnings(harness.EagerSubject):
    """Eager autograd that ignores every warning of a backward whose graph
    holds a ``SinBackward0``: right gradients, and a hook's ``warn`` (or a
    kernel's) lost, as a compiled autograd that ran the hook once while it
    traced would lose it on every later backward. The oracle reports a
    ``mismatch`` of kind ``warnings``."""

    def __init__(self) -> None:
        super().__init__("silences[sin]")

    def run(self, run: ProgramRun):
        if not graph_has(run.outputs, "SinBackward0"):
            return run_backward(run)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_backward(run)


class KeepsSavedTensors(harness.EagerSubject):
    """Eager autograd that keeps the graph's saved tensors after the
    backward (``retain_graph=True`` where the program asked for none): right
    gradients, and the forward's activations held until the graph dies, as a
    runtime that kept its own references to them would hold them. The
    oracle reports a ``mismatch`` of kind ``lifetime`` (unless
    ``CAGRAD_FUZZ_LIFETIMES=0``)."""

    def __init__(self) -> None:
        super().__init__("keeps-saved")

    def run(self, run: ProgramRun):
        if run.driver is None and not run.retain_graph:
            run.retain_graph = True
        return run_backward(run)


class CagradDrawsOnCapture(harness.CagradSubject):
    """``cagrad[eager]`` that draws one number from the global CPU generator
    after each capture (``cagrad.compile.variants.capture`` patched while
    the subject is active): cagrad's own work touching the stream, past its
    guard (:func:`cagrad.preserve.preserved`). Its first backward of a
    program leaves the stream one draw ahead of eager's; a cache hit does
    not."""

    def __init__(self) -> None:
        super().__init__("eager")
        self.name = "cagrad-draws-on-capture[eager]"

    def active(self):
        import contextlib
        from unittest import mock

        from cagrad.compile import variants

        original = variants.capture

        def drawing(*args, **kwargs):
            entry = original(*args, **kwargs)
            torch.rand(())
            return entry

        @contextlib.contextmanager
        def ctx():
            with mock.patch.object(variants, "capture", drawing), super(CagradDrawsOnCapture, self).active():
                yield

        return ctx()
