"""The runtime wrapper: runs a compiled backward and applies its results.

Two shapes of compiled backward:

* whole graph (no hook, no opaque node): one compiled callable; the leaf
  gradients it returns are accumulated into ``.grad`` after it, the engine's
  AccumulateGrad semantics included (see :mod:`cagrad.autograd.accumulate`);
* segmented (:mod:`cagrad.capture.segments`): compiled segments and opaque calls in
  eager's order, ``.grad`` updated in order by the graph itself, and the
  interpreter finishing the backward if a run-time check fails.

Either way the saved tensors are released afterwards unless ``retain_graph``,
and ``autograd.grad``'s results are returned.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..autograd import run_context, saved_variables
from ..autograd.accumulate import accumulate_all, accumulate_grad, dense_strides, stealable_outputs
from ..autograd.walk import Kind
from ..capture import runtime_ops, segments
from ..capture.shells import shells
from ..capture.layouts import dimension_order
from ..capture.traced import NON_STRIDED, runtime_objects
from ..compile.cuda_graphs import BorrowedOutputs
from ..counters import counters
from ..hooks import added_hooks, hooks_census
from ..keys import subclasses
from . import interpreter

log = logging.getLogger("cagrad")

UNUSED_MESSAGE = (
    "One of the differentiated Tensors appears to not have been used in the "
    "graph. Set allow_unused=True if this is the desired behavior."
)


def graph_inputs(entry: Any, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The graph's ``inputs`` list from the lifted tensors (unused ones pruned)."""
    return [tensors[i] for i in entry.traced.input_indices]


def call_whole(
    entry: Any, tensors: list[torch.Tensor], sizes: list[int], hand_over: bool = False
) -> list[torch.Tensor]:
    """Calls a whole-graph compiled backward on the lifted ``tensors`` and ``sizes``.

    Args:
        hand_over: the caller has released the saved tensors and needs
            ``tensors`` no more: it is emptied, so that a boxed graph
            (:mod:`cagrad.compile.boxed`) holds the only references and frees each
            input after its last use, as eager frees a node's saved tensors
            once the node has run.
    """
    inputs = graph_inputs(entry, tensors)
    if hand_over:
        tensors.clear()
    with run_context.grad_mode():
        outs = entry.fn(inputs, sizes, [], [], [])
    del inputs
    entry.calls += 1
    return outs if isinstance(outs, BorrowedOutputs) else list(outs)


def finish_whole(
    entry: Any, order: Sequence[Any], outs: Sequence[torch.Tensor], objects: Sequence[Any] = ()
) -> list:
    """Sets the ``retain_grad`` gradients and accumulates the leaf
    gradients; returns the ``autograd.grad`` results.

    Args:
        order: the backward's nodes in run order (the leaves' AccumulateGrad
            nodes are read from it by position).
        outs: the graph's outputs; :class:`~cagrad.compile.cuda_graphs.BorrowedOutputs`
            (a CUDA graph's, overwritten by its next replay) are never
            stolen into ``.grad`` and results are cloned.
        objects: the backward's runtime objects (the weakrefs of tensors
            that retain their gradient are read from it by index).
    """
    traced = entry.traced
    for obj, i in traced.retain_outputs:
        # eager's retains_grad hook: a contiguous copy, or an out-of-place sum
        runtime_ops.retain_grad(objects[obj], outs[i])
    if isinstance(outs, BorrowedOutputs):
        # a CUDA graph's outputs: the next replay overwrites them
        never = [False] * len(outs)
        accumulate_all(((order[pos].variable, outs[i], i) for pos, i in traced.leaf_outputs), never)
        return [None if i is None else outs[i].clone() for i in traced.capture_outputs]
    stealable = stealable_outputs(outs, traced.returns_input)
    if traced.output_specs is None:
        accumulate_all(((order[pos].variable, outs[i], i) for pos, i in traced.leaf_outputs), stealable)
        return [None if i is None else outs[i] for i in traced.capture_outputs]
    outs, stealable = subclasses.rebuild(traced.output_specs, outs, stealable)
    if any(order[pos].variable.is_nested for pos, _ in traced.leaf_outputs):
        # a jagged leaf gets eager's own AccumulateGrad (its layout check
        # reads the strides a jagged tensor may not have: torch 2.13
        # accumulates, then raises), every leaf in run order
        with torch.no_grad():
            for pos, i in traced.leaf_outputs:
                if order[pos].variable.is_nested:
                    order[pos](outs[i])
                else:
                    accumulate_grad(order[pos].variable, outs[i], stealable[i], False)
    else:
        accumulate_all(((order[pos].variable, outs[i], i) for pos, i in traced.leaf_outputs), stealable)
    return [None if i is None else outs[i] for i in traced.capture_outputs]


def run_segmented(
    entry: Any,
    collected: Any,
    sizes: list[int],
    sym_values: list[int],
    release_early: bool = False,
    retraceable: bool = False,
) -> list:
    """Runs a segmented backward; returns the ``autograd.grad`` results.

    ``release_early`` (a backward without ``retain_graph``): each node's
    saved tensors are freed as soon as the run is past the node, instead of
    after the run (:class:`_PastNodes`), and the run holds the only
    references to the lifted tensors (``collected``'s list is emptied).
    ``retraceable`` (the first run of a capture): the backward can still be
    traced after the run (:func:`cagrad.compiled_backward.run` does where a
    check failed): the lifted tensors' metadata is kept in
    ``collected.shells`` (:mod:`cagrad.capture.shells`) and the saved
    tensors freed early are dropped from the holders that a trace swaps
    for fakes, not with the holders (the memory is freed at the same point).
    """
    traced = entry.traced
    order = collected.run_order()
    objects = runtime_objects(collected.collector.objects, order, traced.force_opaque)
    resumed: list[list] = []

    registrations = hooks_census.Registrations()
    added: list[tuple[list, list]] = []

    def hooks_added(step: Any) -> bool:
        # user code in the step may have given a node that runs later a hook
        # dict the key did not see (cagrad.hooks.added_hooks)
        if not registrations.moved():
            return False
        point = step.resume
        # the node of the call itself has steps left, unless its post-hooks ran
        first = point.pos + 1 if point.phase.name == "POST_HOOKS" else point.pos
        found = added_hooks.plans_with_added(traced.plans, order, objects, first)
        if found is not None:
            added.append(found)
        return found is not None

    def on_speculation_failed(failure: Any, env: dict) -> list:
        step, result = failure.step, failure.result
        counters.bump("deopts")
        if failure.hooks_added:
            # nothing to learn for the next capture: the hooks are
            # registered inside each backward, after its key was read
            plans, objs = added[-1]
            log.info(
                "cagrad: %s registered hooks on nodes that had none; the interpreter finishes this backward",
                step.node.meta.get("autograd_node", step.node.name),
            )
            resumed.append(
                interpreter.resume(collected.task, plans, objs, step.resume, env, result, False)
            )
            return []
        entry.deopts += 1
        point = step.resume
        pattern = _pattern(step, result)
        log.info(
            "cagrad: %s returned %s; the interpreter finishes this backward",
            step.node.meta.get("autograd_node", step.node.name),
            "a gradient in another layout than the graph assumed"
            if failure.layout
            else "a non-strided gradient where the graph assumed a strided one"
            if NON_STRIDED in pattern
            else "None where the graph assumed a gradient",
        )
        # what the later speculative calls return, seen as the interpreter
        # runs them: the next capture assumes all of it at once
        seen: dict = {}
        resumed.append(
            interpreter.resume(
                collected.task, traced.plans, objects, step.resume, env, result, False,
                lambda site, outs: _observe(seen, site, outs),
            )
        )
        entry.last_deopt = ((point.pos, point.phase), pattern, failure.layout, seen)
        return []

    inputs = graph_inputs(entry, collected.collector.args.tensors)
    if retraceable:
        collected.shells = shells(collected.collector.args.tensors)
    past = None
    if release_early:
        collected.collector.args.tensors.clear()
        past = _PastNodes(collected, order, keep_holders=retraceable)
    with run_context.grad_mode():
        outs = segments.run(
            entry.segmented,
            inputs,
            sizes,
            sym_values,
            objects,
            on_speculation_failed,
            entry.learn_layouts,
            hand_over=release_early,
            before_step=None if past is None else past.before,
            hooks_added=hooks_added,
        )
    entry.calls += 1
    if resumed:
        return resumed[0]
    return [None if i is None else outs[i] for i in traced.capture_outputs]


def _pattern(step: Any, result: Any) -> tuple:
    """What an opaque call really returned, for the next capture's profile
    (see :class:`~cagrad.autograd.walk.BackwardWalk`): per result, whether
    it was defined, :data:`NON_STRIDED` for a non-strided gradient the graph
    cannot use, or the dimension order of a dense gradient that is not
    contiguous."""
    if isinstance(result, list):
        free = step.layout_free
        return tuple(_defined(v, i in free) for i, v in enumerate(result))
    return (_defined(result, step.layout_free),)


def _observe(seen: dict, site: tuple, outs: Any) -> None:
    """Records the pattern of a speculative call the interpreter ran, unless
    a result is not strided (whether the graph may take it as it is is the
    check's to say, :data:`NON_STRIDED`)."""
    values = outs if isinstance(outs, (list, tuple)) else [outs]
    if any(isinstance(v, torch.Tensor) and v.layout is not torch.strided for v in values):
        return
    seen[site] = tuple(_defined(v, True) for v in values)


def _defined(value: Any, free: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value is not None
    if value.layout is not torch.strided:
        return True if free else NON_STRIDED
    order = dimension_order(value)
    if order == tuple(range(value.dim())) or not dense_strides(value.shape, value.stride()):
        return True
    return order


class _PastNodes:
    """Releases the saved tensors of a segmented run's nodes as the run goes
    past them.

    Eager releases a node's saved tensors right after it ran, its hooks
    included (``call_function`` then ``release_variables`` in
    ``torch/csrc/autograd/engine.cpp``). A segmented run knows where it is
    at each opaque call: the node at its position ``q``
    (:attr:`~cagrad.capture.segments.OpaqueStep.pos`) is being run, and
    every node before ``q`` has run. Before a segment, with ``q`` the
    position of the next opaque call (:attr:`~cagrad.capture.segments.
    Segment.next_pos`), every node before ``q`` has run or runs inside the
    segment, hooks included, reading its saved tensors from the run's
    values (which the segment's boxed call then frees after their last
    use). So before each step, the nodes before ``q`` that hold saved
    tensors (traced nodes with lifted tensors, nodes run as they are) are
    released; the rest are released after the run (:func:`release`). A
    node released here is never run again: the interpreter resumes a
    backward at a later position.
    """

    def __init__(self, collected: Any, order: Sequence[Any], keep_holders: bool = False) -> None:
        """``order``: the backward's nodes in run order (``collected.run_order()``);
        ``keep_holders``: lifted slots are freed through their holders
        (see :func:`run_segmented`'s ``retraceable``)."""
        self.collected = collected
        self.keep_holders = keep_holders
        self.count = len(order)
        position = {id(node): pos for pos, node in enumerate(order) if node is not None}
        by_pos: dict[int, tuple[list, list]] = {}
        for slot in collected.collector.args.slots:
            if slot is not None:
                by_pos.setdefault(position[id(slot[0])], ([], []))[0].append(slot)
        for call in collected.collector.releases:
            by_pos.setdefault(position[id(call.node)], ([], []))[1].append(call)
        self.pending = sorted(by_pos.items(), key=lambda item: item[0])
        self.done = 0  # how many of pending are released

    def before(self, step: Any) -> None:
        if isinstance(step, segments.Segment):
            q = step.next_pos
            if q is None:
                q = self.count  # no opaque call follows: every node
        else:
            q = step.pos
            if q is None:
                return
        k = self.done
        while k < len(self.pending) and self.pending[k][0] < q:
            k += 1
        if k == self.done:
            return
        batch = self.pending[self.done:k]
        self.done = k
        slots = [slot for _, (slots_, _) in batch for slot in slots_]
        calls = [call for _, (_, calls_) in batch for call in calls_]
        _release_nodes(self.collected, slots, calls, self.keep_holders)


def _release_nodes(collected: Any, slots: Sequence[Any], calls: Sequence[Any], keep_holders: bool = False) -> None:
    """Frees the saved tensors of the nodes of lifted ``slots`` and of the
    nodes run as they are (``calls``, NodeCalls of
    ``collected.collector.releases``); with ``keep_holders``, the slots'
    tensors through their holders, which a later trace still swaps for
    fakes (the engine's ``release_variables`` drops the holders too)."""
    if keep_holders:
        release_one = saved_variables.release
        for slot in slots:
            if slot is not None:
                release_one(slot)
        slots = []
    nodes = _nodes_of(slots)
    nodes.extend(call.node for call in calls)
    if saved_variables.release_nodes(nodes):
        return
    release_slots(slots)
    if not calls:
        return
    plans = collected.collector.plans
    position = {id(call): pos for pos, call in enumerate(collected.task.order)}
    for call in calls:
        kind = plans[position[id(call)]].kind
        if kind is Kind.CUSTOM:
            saved_variables.release_custom(call.node)
        else:
            schema = call.schema
            saved_variables.release_node(call.node, schema.tensors, schema.tensor_lists)


def release(collected: Any, lifted: bool = True) -> None:
    """Frees the saved tensors of every node that ran, as eager does.

    Args:
        lifted: also the slots whose tensors the graph read as inputs
            (False when :func:`release_lifted` freed them before the call).
    """
    slots = collected.collector.args.slots if lifted else []
    _release_nodes(collected, slots, collected.collector.releases)


def release_lifted(collected: Any) -> None:
    """Frees the saved-tensor slots whose tensors the graph reads as inputs
    (it holds them itself from then on)."""
    release_slots(collected.collector.args.slots)


def release_slots(slots: Sequence[Any]) -> None:
    """Frees saved-tensor slots ``(node, attribute, index)`` (None: skipped):
    with the C++ extension, every saved tensor of their nodes, as eager
    releases a node that ran (all of them ran: a captured-only node lifts
    no saved tensor)."""
    if saved_variables.release_nodes(_nodes_of(slots)):
        return
    release_one = saved_variables.release
    for slot in slots:
        if slot is not None:
            release_one(slot)


def _nodes_of(slots: Sequence[Any]) -> list:
    return [slot[0] for slot in slots if slot is not None]


def check_unused(result: Sequence[Any], allow_unreachable: bool) -> None:
    """Raises eager's error for an ``autograd.grad`` input with no gradient."""
    if not allow_unreachable and any(r is None for r in result):
        raise RuntimeError(UNUSED_MESSAGE)
