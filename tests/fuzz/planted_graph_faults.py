"""cagrad subjects with a planted fault in a graph feature, for testing the fuzzer.

``DetachedCreateGraph``: ``cagrad[eager]`` whose ``create_graph=True``
backwards build no graph (``torch.autograd.grad`` and ``backward`` called
with ``create_graph=True`` while the subject is active run with
``create_graph=False``, ``retain_graph=True``): first-order grads come back
detached, as from an engine that forgot to run its graph with grad mode on.
Only a double backward sees it. ``EagerDetachedCreateGraph`` is plain
eager autograd with the same fault.

``RootAtOutputZero``: ``cagrad[eager]`` whose graph task seeds every
non-leaf root at output 0 of its node (``gradient_edge`` patched while the
subject is active): a root at output 1 of ``var_mean`` or ``unbind`` gets
its gradient in the wrong slot. Only a root at an output >= 1 sees it.

``ScaledDTensorGrad``: ``cagrad[eager]`` that doubles the local values of
every DTensor leaf's ``.grad`` after the backward; ``ReplicatedDTensorGrad``:
``cagrad[eager]`` that redistributes every sharded DTensor leaf's ``.grad``
to ``Replicate()`` (values unchanged, placements not eager's). Only a
program with a DTensor leaf (``subclass_kind: "dtensor"``) sees either.

``ScaledJaggedGrad``: ``cagrad[eager]`` that doubles the values of every
jagged leaf's ``.grad`` after the backward; ``ReoffsetJaggedGrad``:
``cagrad[eager]`` whose jagged leaf grads come out with other offsets (the
first two components' lengths moved by one, the values unchanged). Only a
program with a jagged leaf (``subclass_kind: "jagged"``) sees either.

Load with ``--plugin PATH/planted_graph_faults.py:NAME``; the package never
imports this file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

import harness


@contextlib.contextmanager
def _without_create_graph() -> Iterator[None]:
    grad, backward = torch.autograd.grad, torch.autograd.backward

    def no_graph_grad(*args, **kwargs):
        if kwargs.get("create_graph"):
            kwargs.update(create_graph=False, retain_graph=True)
        return grad(*args, **kwargs)

    def no_graph_backward(*args, **kwargs):
        if kwargs.get("create_graph"):
            kwargs.update(create_graph=False, retain_graph=True)
        return backward(*args, **kwargs)

    with mock.patch.object(torch.autograd, "grad", no_graph_grad), mock.patch.object(
        torch.autograd, "backward", no_graph_backward
    ):
        yield


class DetachedCreateGraph(harness.CagradSubject):
    """``cagrad[eager]`` without ``create_graph`` (module doc)."""

    def __init__(self) -> None:
        super().__init__("eager")
        self.name = "cagrad-detached-create-graph[eager]"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with _without_create_graph(), super().active():
            yield


class EagerDetachedCreateGraph(harness.EagerSubject):
    """Eager autograd with the same fault, for tests that should not pay
    for importing cagrad in a fresh process."""

    def __init__(self) -> None:
        super().__init__("eager-detached-create-graph")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with _without_create_graph():
            yield


class RootAtOutputZero(harness.CagradSubject):
    """``cagrad[eager]`` that seeds roots at output 0 (module doc)."""

    def __init__(self) -> None:
        super().__init__("eager")
        self.name = "cagrad-root-at-output-0[eager]"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from cagrad.autograd import graph_task

        original = graph_task.gradient_edge

        def slot_zero(t, index, what):
            fn, nr = original(t, index, what)
            return (fn, 0) if fn is not None and what == "tensors" else (fn, nr)

        with mock.patch.object(graph_task, "gradient_edge", slot_zero), super().active():
            yield


class _BreaksLeafGrads(harness.CagradSubject):
    """``cagrad[eager]``, then :meth:`break_grad` (under ``no_grad``) on
    every leaf :meth:`leaves` picks: a fault in the ``.grad`` s a backward
    leaves. Subclasses name themselves ``cagrad-<label>[eager]``."""

    label = ""

    def __init__(self) -> None:
        super().__init__("eager")
        self.name = f"cagrad-{self.label}[eager]"

    def leaves(self, run) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def break_grad(self, leaf: torch.Tensor) -> None:
        raise NotImplementedError

    def run(self, run):
        result = super().run(run)
        with torch.no_grad():
            for leaf in self.leaves(run):
                self.break_grad(leaf)
        return result


class _DTensorLeafGrads(_BreaksLeafGrads):
    def leaves(self, run) -> Iterator[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        for leaf in run.leaves:
            if isinstance(leaf, DTensor) and isinstance(leaf.grad, DTensor):
                yield leaf


class ScaledDTensorGrad(_DTensorLeafGrads):
    """``cagrad[eager]`` whose DTensor leaf grads come out doubled (module doc)."""

    label = "scaled-dtensor-grad"

    def break_grad(self, leaf: torch.Tensor) -> None:
        leaf.grad.to_local().mul_(2)


class ReplicatedDTensorGrad(_DTensorLeafGrads):
    """``cagrad[eager]`` whose sharded DTensor leaf grads come out replicated (module doc)."""

    label = "replicated-dtensor-grad"

    def break_grad(self, leaf: torch.Tensor) -> None:
        from torch.distributed.tensor import Replicate

        if leaf.grad.placements != (Replicate(),):
            leaf.grad = leaf.grad.redistribute(placements=[Replicate()])


class _JaggedLeafGrads(_BreaksLeafGrads):
    def leaves(self, run) -> Iterator[torch.Tensor]:
        for leaf in run.leaves:
            if leaf.layout == torch.jagged and leaf.grad is not None and leaf.grad.layout == torch.jagged:
                yield leaf


class ScaledJaggedGrad(_JaggedLeafGrads):
    """``cagrad[eager]`` whose jagged leaf grads come out doubled (module doc)."""

    label = "scaled-jagged-grad"

    def break_grad(self, leaf: torch.Tensor) -> None:
        leaf.grad.values().mul_(2)


class ReoffsetJaggedGrad(_JaggedLeafGrads):
    """``cagrad[eager]`` whose jagged leaf grads come out with other offsets (module doc)."""

    label = "reoffset-jagged-grad"

    def break_grad(self, leaf: torch.Tensor) -> None:
        # torch refuses a .grad of another nested int: the grad's offsets
        # (the leaf's, shared) are rewritten in place
        offsets = leaf.grad.offsets()
        offsets[1] += 1 if offsets[2] - offsets[1] > 1 else -1
