"""A segmented backward as a hit guard collected it.

The segmented runtime (:func:`cagrad.run.runtime.run_segmented`, the
release of saved tensors) reads a collected backward through a few
attributes: the lifted tensors and the saved-tensor slot of each, the
runtime objects, the nodes run as they are, whether the run needs torch's
GraphTask around it, and the nodes in run order. A guard that accepted a
segmented graph (:mod:`cagrad.keys.leaf_hooks`) has all of these without
the full collection; :class:`GuardedBackward` holds them under the same
names as :class:`cagrad.keys.collection.CollectedBackward`.

The :class:`~cagrad.autograd.graph_task.GraphTask` is built only when
asked for: by the interpreter that finishes a deopted run, or by
``torch._C._will_engine_execute_node`` from a hook (see
:mod:`cagrad.autograd.run_context`). The guard has checked the structure it
is built from against the captured one, so it orders the nodes as the
guard did.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ..autograd.graph_task import GraphTask
from ..keys.compiled_node_args import TensorArgs


class _Collected:
    """The parts of a :class:`~cagrad.keys.compiled_node_args.Collector`
    the segmented runtime reads."""

    __slots__ = ("args", "objects", "releases", "needs_host")

    def __init__(self, args: TensorArgs, objects: list[Any], needs_host: bool) -> None:
        self.args = args
        self.objects = objects
        self.releases: list[Any] = []  # a guarded graph runs no node as it is
        self.needs_host = needs_host


class GuardedBackward:
    """One backward a guard accepted, for the segmented runtime.

    Args:
        call: the backward's :class:`~cagrad.keys.collection.BackwardCall`.
        hit: what the guard collected (:class:`~cagrad.keys.hit_path.Hit`).
        release_slots: the guard's ``(run position, attribute, index)`` of
            each lifted saved tensor, in lifting order.
        objects: the runtime objects (:meth:`~cagrad.keys.leaf_hooks.LeafHooks.collect`).
        needs_host: some leaf has C++ hooks, which may queue callbacks
            from C++ (:mod:`cagrad.run.host`).

    Raises:
        RuntimeError: the lifted tensors are not the root gradients
            followed by one tensor per saved-tensor slot (a bug of the guard
            generator).
    """

    def __init__(
        self,
        call: Any,
        hit: Any,
        release_slots: Sequence[tuple[int, str, int]],
        objects: list[Any],
        needs_host: bool,
    ) -> None:
        order = hit.order
        roots = len(call.grad_tensors)
        if len(hit.tensors) != roots + len(release_slots):
            raise RuntimeError(
                f"cagrad internal error: a guard lifted {len(hit.tensors)} tensors for "
                f"{roots} root gradients and {len(release_slots)} saved tensors"
            )
        args = TensorArgs()
        args.tensors = hit.tensors
        args.slots = [None] * roots + [(order[pos], attr, index) for pos, attr, index in release_slots]
        self.collector = _Collected(args, objects, needs_host)
        self._order = order
        self._call = call

    def run_order(self) -> Sequence[Any]:
        """The nodes in run order (None for the virtual GraphRoot)."""
        return self._order

    @functools.cached_property
    def task(self) -> GraphTask:
        """The backward's GraphTask, built on first use."""
        call = self._call
        return GraphTask(call.tensors, call.inputs, call.accumulate_grad)

    def will_execute(self, node: Any) -> bool:
        """``GraphTask.will_execute``, for ``torch._C._will_engine_execute_node``."""
        return self.task.will_execute(node)


__all__ = ["GuardedBackward"]
