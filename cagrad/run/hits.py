"""A backward that a hit guard accepted (:mod:`cagrad.keys.hit_path`):
which guard (:func:`try_guards`), its run as one graph (:func:`run_guarded`)
or as segments (:func:`guarded_segmented`), the guard built after a
full-path hit (:func:`add_guard`), and ``CAGRAD_VERIFY_GUARDS=1``'s
comparison with the full path (:func:`verify_hit`).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .. import events
from ..autograd import saved_variables
from ..compile import cuda_graphs
from ..compile.variants import prepare_symbolic
from ..counters import counters
from ..hooks.hooks_census import Census
from ..keys import hit_path
from ..keys.cache import CacheNode, CompiledEntry
from ..keys.collection import BackwardCall, CollectedBackward, collect_backward
from . import runtime
from .guarded import GuardedBackward

log = logging.getLogger("cagrad")


class GuardedHit(NamedTuple):
    """A backward a guard accepted.

    Attributes:
        guard: the guard.
        hit: what it collected.
        found: ``(entry, symbol values)``, the variant its sizes match.
        objects: the runtime objects, for a segmented entry only
            (:mod:`cagrad.keys.leaf_hooks`), else None.
    """

    guard: hit_path.HitGuard
    hit: hit_path.Hit
    found: tuple
    objects: list | None

    @property
    def entry(self) -> CompiledEntry:
        return self.found[0]


def try_guards(call: BackwardCall, cache: CacheNode, census: Census) -> GuardedHit | None:
    """The first guard that accepts this backward.

    None sends the backward down the full path: no guard accepts it, its
    key sequence has a fallback verdict now, or no variant accepts its sizes
    (a capture follows). The caller has checked that guards may be tried
    (:func:`~cagrad.keys.hit_path.census_allows`).
    """
    guards = cache.guards
    cpp_hooks = census.cpp_hooks
    for i, guard in enumerate(guards):
        leaves = guard.leaves
        if leaves.hooked and not cpp_hooks:
            continue  # its hooked leaves have no hooks now
        hit = guard(call.tensors, call.grad_tensors, census.counts)
        if hit is None:
            continue
        objects = None
        if leaves.hooked:  # their hooks are part of what the guard accepts
            # (a graph without hooked leaves: the guard's _hookless found no
            # C++ hook on any of its leaves; its objects only matter if its
            # entry is segmented, below)
            objects = leaves.collect(hit.order, census)
            if objects is None:
                continue
        node = guard.node
        found = node.match(hit.values) if node.verdict is None else None
        if found is None:
            return None
        if found[0].segmented is None:
            objects = None
        elif objects is None:
            objects = leaves.collect(hit.order, census)  # no hooked leaves: the leaf variables
            if objects is None:
                return None
        if i:
            guards.insert(0, guards.pop(i))
        return GuardedHit(guard, hit, found, objects)
    return None


def replay_early(guard: hit_path.HitGuard, call: BackwardCall) -> cuda_graphs.CudaGraphed | None:
    """Replays the CUDA graph the guard's last hit ran, before the guard
    runs (:meth:`~cagrad.compile.cuda_graphs.CudaGraphed.speculate`); the
    graphed backward it replayed, which the caller must settle, or None.

    The root gradients are the graph inputs known before the guard: the
    lifted tensors start with them (:mod:`cagrad.keys.hit_path`), and
    ``input_indices`` maps each graph input to its lifted tensor."""
    entry = guard.last_entry
    fn = entry.fn if entry is not None else None
    if not isinstance(fn, cuda_graphs.CudaGraphed):
        return None
    grads = call.grad_tensors
    roots = len(grads)
    known = {j: grads[i] for j, i in enumerate(entry.traced.input_indices) if i < roots}
    return fn if fn.speculate(known) else None


def run_guarded(
    call: BackwardCall, cache: CacheNode, guard: hit_path.HitGuard, hit: hit_path.Hit, found: tuple
) -> None:
    """Runs a backward a guard accepted: call, accumulate, release."""
    entry, sym_values = found
    guard.last_entry = entry
    if hit_path.verify_enabled():
        verify_hit(call, cache, guard, hit)
    graph_sizes = [fn(*sym_values) for fn in entry.traced.size_inputs]
    prepare_symbolic(entry, graph_sizes, hit.values)
    counters.bump("cache_hits")
    counters.bump("guard_hits")
    if not call.keep_graph:
        # the graph holds the lifted tensors from here on (cagrad.compile.boxed)
        order = hit.order
        if not saved_variables.release_nodes([order[pos] for pos in guard.release_positions]):
            runtime.release_slots([(order[pos], attr, index) for pos, attr, index in guard.release_slots])
    with events.running():
        outs = runtime.call_whole(entry, hit.tensors, graph_sizes, hand_over=not call.keep_graph)
    runtime.finish_whole(entry, hit.order, outs)


def guarded_segmented(call: BackwardCall, cache: CacheNode, fast: GuardedHit) -> GuardedBackward:
    """A segmented backward a guard accepted, as the segmented runtime reads
    a collected one."""
    guard = fast.guard
    guard.last_entry = fast.entry
    if hit_path.verify_enabled():
        verify_hit(call, cache, guard, fast.hit, fast.objects)
    counters.bump("guard_hits")
    return GuardedBackward(call, fast.hit, guard.release_slots, fast.objects, bool(guard.leaves.hooked))


def add_guard(collected: CollectedBackward, call: BackwardCall, cache: CacheNode, node: CacheNode) -> None:
    """Generates ``node``'s guard (once; False marks a graph it cannot guard)."""
    try:
        guard = hit_path.build(collected, call, node)
    except Exception:  # a generator bug must not cost the backward
        log.warning("cagrad could not generate a hit guard; this graph takes the full path", exc_info=True)
        guard = None
    if guard is None:
        node.guard = False
        return
    node.guard = guard
    cache.guards.insert(0, guard)
    if len(cache.guards) > hit_path.MAX_GUARDS:
        dropped = cache.guards.pop()
        dropped.node.guard = None  # rebuilt at its next full-path hit


def verify_hit(
    call: BackwardCall, cache: CacheNode, guard: hit_path.HitGuard, hit: hit_path.Hit, objects: list | None = None
) -> None:
    """``CAGRAD_VERIFY_GUARDS=1``: the full path must agree with the guard
    (and with its runtime ``objects``, for a segmented graph).

    Raises:
        RuntimeError: the guard accepted a backward that the full collection
            keys or lifts differently (a bug in :mod:`cagrad.keys.hit_path`).
    """
    collected = collect_backward(call.tensors, call.grad_tensors, call.inputs, call.accumulate_grad)
    problems = []
    if cache.find(collected.keys) is not guard.node:
        problems.append("the key sequence ends at another CacheNode")
    if collected.collector.sizes.values != hit.values:
        problems.append(f"size slots {collected.collector.sizes.values} != {hit.values}")
    order = tuple(c.node for c in collected.task.order)
    if len(order) != len(hit.order) or any(a is not b for a, b in zip(order, hit.order)):
        problems.append("another run order")
    tensors = collected.collector.args.tensors
    if len(tensors) != len(hit.tensors) or not all(map(_same_tensor, tensors, hit.tensors)):
        problems.append("other lifted tensors")
    if objects is not None and not _same_objects(collected.collector.objects, objects):
        problems.append("other runtime objects")
    if problems:
        raise RuntimeError(
            "cagrad internal error: a hit guard accepted a backward the full path sees "
            f"differently ({'; '.join(problems)}); guard source:\n{guard.source}"
        )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
        and a.requires_grad == b.requires_grad
    )


def _same_objects(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """The same runtime objects, a tuple of hooks by its elements."""

    def same(x: Any, y: Any) -> bool:
        if type(x) is tuple and type(y) is tuple:
            return len(x) == len(y) and all(map(operator.is_, x, y))
        return x is y

    return len(a) == len(b) and all(map(same, a, b))
