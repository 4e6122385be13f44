"""Which of a program's tensors a backward leaves alive, compared with eager's.

A compiled autograd can hold memory that eager frees, and no gradient shows
it:

* eager releases every saved tensor of the graph when a backward without
  ``retain_graph`` ends (``Node::release_variables``); a runtime that keeps
  its own references to them (a holder, a list of lifted tensors, a
  compiled graph's closure) keeps the activations of the whole forward
  alive until the graph dies, which is the memory a training step frees
  before the optimizer runs;
* a cache that holds a tensor of the program (a leaf, an activation, an
  output) keeps it after the program lets go of everything it built: a leak
  that grows with each new graph;
* a reference cycle through a tensor frees it only when Python's cyclic
  collector runs, not when the last user drops it;
* the reverse: a tensor eager keeps (``retain_graph=True``) freed early.

:class:`ForwardStorages` notes a weak reference to the storage of every
tensor the program's build creates (a ``TorchDispatchMode`` around
``build``: every aten op's outputs, each storage once, labelled by the op
that made it). Storages, not tensor objects: a view, a saved copy of an
output (``SavedVariable`` keeps ``tensor_data()``, a new tensor over the
same storage) and the tensor itself hold one block of memory. Because every
subject builds the program the same way (eager's forward, one seed), the
labels are the same for every subject.

:func:`harness.execution.execute` reads three sets (:class:`Lifetimes`),
with Python's cyclic collector paused over the build and the backward, so
that no collection runs at a point that depends on how much the subject
allocated:

* ``after_backward``: alive right after the backward, while the program
  still holds its leaves, outputs and hook trace;
* ``after_release``: alive once the program dropped everything it built
  (refcounts alone);
* ``leaked``: alive after ``gc.collect()`` on top of that (a collection runs
  only where ``after_release`` is not empty: it costs about 170 ms in a
  process that has imported Dynamo).

:func:`compare_lifetimes` names the first set that differs from eager's. A
storage freed *earlier* than eager's counts only right after the backward
(the program can still reach it there: a ``retain_graph`` ignored, or a
gradient eager adopts as a view of the forward's memory copied instead);
once the program let go, freeing what eager leaks is no fault.

On by default: every run records lifetimes unless
``CAGRAD_FUZZ_LIFETIMES=0`` is in the environment (a campaign's workers
inherit it, ``fuzz replay`` reads it). A peer's run records none (they are
never compared, and torch's compiled autograd keeps its last graph's
inputs alive, which would cost a ``gc.collect()`` per run): with that, a
campaign's throughput is within a few percent of one without lifetimes.
Its first campaigns, opt-in then, found five differences of cagrad's, all
fixed (two leaks, two reference cycles, and gradients eager adopts as
views of ``grad_tensors`` copied: docs/fuzzing.md, *Lifetimes*). The
models suite records lifetimes always (:mod:`harness.models.train`), the
stacks suite as a campaign does (:mod:`harness.stacks.execute`).

Example::

    storages = ForwardStorages()
    with storages:
        loss = (x * 2).sin().sum()  # x: a leaf made outside
    storages.alive()  # ('op 0 aten.mul.Tensor', 'op 2 aten.sum.default'): sin saved x * 2
    loss.backward()
    storages.alive()  # ('op 2 aten.sum.default',): released with the graph's saved tensors
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

from harness.outcome import Mismatch

#: labels listed in a mismatch's detail
SHOWN = 3
#: the environment variable that turns the comparison on
ENV = "CAGRAD_FUZZ_LIFETIMES"


def enabled() -> bool:
    """Whether runs record lifetimes: yes unless ``CAGRAD_FUZZ_LIFETIMES=0``
    (see the module docstring's *On by default*)."""
    return os.environ.get(ENV, "").strip() != "0"


def _storages(t: torch.Tensor) -> Iterator[Any]:
    """The untyped storages behind ``t`` (a wrapper subclass's inner
    tensors' storages); none for a tensor without one (sparse, meta)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    if t.layout is not torch.strided or t.device.type == "meta":
        return
    try:
        yield t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return  # a tensor torch gives no storage (functorch's wrappers)


class ForwardStorages(TorchDispatchMode):
    """A dispatch mode that notes a weak reference to the storage of every
    tensor an aten op returns inside it, each storage once.

    Labels read ``op <k> <overload>``: the k-th op call inside the mode
    (from 0) that returned that storage first. The mode adds no reference:
    what it notes dies when the program drops it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._refs: list[tuple[str, weakref.ref]] = []
        self._known: weakref.WeakSet = weakref.WeakSet()  # storages compare by identity
        self._calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        label = f"op {self._calls} {func}"
        self._calls += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for storage in _storages(t):
                    self._note(label, storage)
        return out

    def _note(self, label: str, storage: Any) -> None:
        if storage in self._known:
            return
        self._known.add(storage)
        self._refs.append((label, weakref.ref(storage)))

    def alive(self) -> tuple[str, ...]:
        """The labels of the noted storages still alive, in creation order."""
        return tuple(label for label, ref in self._refs if ref() is not None)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The mode taken off the dispatch-mode stack inside the block, where
        it is the innermost mode (a backward runs with no mode of the
        harness's active, and what it allocates is not noted); nothing
        changes where it is not active or another mode is inside it."""
        if _python_dispatch._get_current_dispatch_mode() is not self:
            yield
            return
        with _python_dispatch._pop_mode_temporarily():
            yield


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off inside the block (refcounts still free
    what they free), its previous state restored after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class Lifetimes:
    """The forward's storages alive at three points of one run (labels of
    :class:`ForwardStorages`); see the module docstring."""

    after_backward: tuple[str, ...] = ()
    after_release: tuple[str, ...] = ()
    leaked: tuple[str, ...] = ()


def after_release(storages: ForwardStorages) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(after_release, leaked)`` of :class:`Lifetimes`: call once the
    program's objects are dropped; collects cycles only if something is
    still alive."""
    held = storages.alive()
    if not held:
        return held, held
    gc.collect()
    return held, storages.alive()


_POINTS = (
    ("leaked", "after the program let go of it and Python's cyclic collector ran"),
    ("after_release", "after the program let go of it, before any collection (a reference cycle)"),
    ("after_backward", "right after the backward"),
)


def _listed(labels: Sequence[str]) -> str:
    shown = ", ".join(labels[:SHOWN])
    return shown + (f", ... ({len(labels)} in all)" if len(labels) > SHOWN else "")


def compare_lifetimes(expected: Lifetimes | None, actual: Lifetimes | None, at: str = "") -> list[Mismatch]:
    """One mismatch at ``"{at}lifetime"`` for the first point (leaked,
    after release, after the backward) where the subject's alive set is not
    eager's, or none.

    The detail reads ``forward storages alive <point> where eager freed
    them: op 3 aten.mul.Tensor, ...`` (or, right after the backward only,
    ``freed <point> where eager kept them alive``). None on either side
    (lifetimes not recorded, or the run raised): no mismatch.
    """
    if expected is None or actual is None:
        return []
    for field, point in _POINTS:
        want, got = getattr(expected, field), getattr(actual, field)
        want_set, got_set = set(want), set(got)
        extra = [x for x in got if x not in want_set]
        if extra:
            return [Mismatch(f"{at}lifetime", f"forward storages alive {point} where eager freed them: {_listed(extra)}")]
        early = [x for x in want if x not in got_set] if field == "after_backward" else []
        if early:
            return [Mismatch(f"{at}lifetime", f"forward storages freed {point} where eager kept them alive: {_listed(early)}")]
    return []


__all__ = ["ENV", "ForwardStorages", "Lifetimes", "after_release", "collector_paused", "compare_lifetimes", "enabled"]
