"""A new variant of a CacheNode: trace, compile, and what a failed run
teaches the next capture.

::

    capture             trace (retrying with failing nodes run as they are)
                        -> compiler_fn (per segment with opaque calls)
    dynamic_slots       which size slots a new variant traces as symbols
    prepare_symbolic    a static-first graph's symbolic code, before its call
    respeculate         a run failed a check: recapture with what it saw
    retrace             ... at the end of that run, so the next backward hits

Called by :func:`cagrad.compiled_backward.run`; raises
:class:`~cagrad.errors.Unsupported` before any side effect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import events, internal_errors, logs
from ..autograd import run_context
from ..capture import segments
from ..capture.compiler import AutogradCompilerInstance
from ..capture.traced import Traced
from ..counters import counters
from ..errors import HookTraceFailed, NodeTraceFailed, Unsupported
from ..keys.cache import MAX_VARIANTS, CacheNode, CompiledEntry, FallbackVerdict
from ..keys.collection import CollectedBackward
from ..keys.sizes import tighten
from . import cuda_graphs, direct_compile, disk_cache, marked_sizes, specialize
from .backends import check_graph

log = logging.getLogger("cagrad")


def trace(
    collected: CollectedBackward,
    profile: dict | None = None,
    dynamic_slots: frozenset[int] = frozenset(),
    force_opaque: frozenset[int] = frozenset(),
    distinct_slots: Any = frozenset(),
) -> Traced:
    """Captures ``collected`` into a GraphModule (no compile, no run).

    Args:
        profile: None patterns seen at speculative calls before.
        dynamic_slots: size slots to trace as symbols.
        distinct_slots: of those, slots not duck-sized with slots outside
            them, each with its values at the earlier captures, which it
            must share with a slot to share its symbol (see
            :class:`~cagrad.capture.compiler.AutogradCompilerInstance`).
        force_opaque: run-order positions of nodes to call as they are
            instead of tracing them (they failed to trace before).

    Raises:
        NodeTraceFailed: a node's backward could not be traced; retrying
            with its position in ``force_opaque`` may succeed.
        Unsupported: anything else that cannot be captured.
    """
    collector = collected.collector
    with logs.meta_failures_held("trace"), logs.torch_warnings_held("trace"):
        return AutogradCompilerInstance(
            collected.task,
            collector,
            accumulate_at_end=not collector.any_opaque,
            profile=profile,
            dynamic_slots=dynamic_slots,
            force_opaque=force_opaque,
            distinct_slots=distinct_slots,
        ).capture()


MAX_FORCED_OPAQUE = 16


def trace_with_retries(
    collected: CollectedBackward, node: CacheNode, dynamic_slots: frozenset[int], count: bool = True
) -> Traced:
    """Traces; a node that fails to trace runs as it is in the next try.

    A tensor hook chosen for tracing that does not trace in a graph with no
    other opaque call makes every hook of the backward opaque in the next try
    (:class:`~cagrad.errors.HookTraceFailed`); later captures of the same
    keys find the same and do the same.

    The positions that failed are kept on ``node`` so later captures of the
    same keys start with them opaque. Each one is logged and counted
    (``counters["nodes_forced_opaque"]``, ``counters["opaque_reasons"]``)
    unless ``count`` is False.

    Raises:
        Unsupported: more than :data:`MAX_FORCED_OPAQUE` nodes failed, or
            something else cannot be captured.
    """
    while True:
        try:
            return trace(collected, node.profile, dynamic_slots, node.force_opaque, _distinct_history(node))
        except HookTraceFailed:
            collector = collected.collector
            if not collector.traced_hooks:
                raise
            collector.traced_hooks = frozenset()
            collector.any_opaque = True
        except NodeTraceFailed as e:
            if e.pos in node.force_opaque or len(node.force_opaque) >= MAX_FORCED_OPAQUE:
                raise Unsupported(e.reason, e.detail) from e
            name = collected.task.order[e.pos].name
            detail = f"{name} (NodeCall {e.pos}): {e.detail}"
            if count:
                counters.record_forced_opaque(e.reason, detail)
            else:
                log.info("cagrad runs a node as it is (%s): %s", e.reason, detail)
            node.force_opaque = node.force_opaque | {e.pos}


def _distinct_history(node: CacheNode) -> dict[int, tuple[int, ...]]:
    """Each of ``node``'s distinct slots with its values at the captures of
    its variants: what two of them must share to share a symbol."""
    expected = [v.check.expected for v in node.variants]
    return {k: tuple(values[k] for values in expected) for k in sorted(node.distinct_slots)}


def prepare_symbolic(entry: CompiledEntry, graph_sizes: list[int], values: Sequence[int]) -> None:
    """Compiles a static-first graph's symbolic code before its first call
    at sizes it was not compiled for (:func:`cagrad.compile.direct_compile.
    compile_graph`), while the backward can still fall back: the size
    guards the backend adds join the entry's SizeCheck, which must still
    accept these sizes.

    Raises:
        Unsupported: ``compile_failed`` (the backend failed, now or before:
            this backward runs in eager), ``dynamic_shapes`` (the new
            guards reject these sizes: eager now, a capture next time).
    """
    compiled = direct_compile.find(entry.fn)
    if compiled is None or not compiled.needs_symbolic(graph_sizes):
        return
    env = entry.traced.shape_env
    before = len(env.guards) if env is not None else 0
    with run_context.grad_mode():
        compiled.prepare_symbolic()
    if env is not None:
        try:
            added = tighten(entry.traced.check, env, before)
        except ValueError as e:
            compiled.fn, compiled.symbolic_failed = None, f"size guards: {e}"
            raise Unsupported("compile_failed", f"symbolic code: size guards: {e}") from e
        if added:
            logs.verbose_log.debug("the backend added %d size guards: %s", added, entry.traced.check.guard_exprs[-added:])
    if entry.traced.check.match(values) is None:
        raise Unsupported("dynamic_shapes", "the symbolic code's size guards do not accept these sizes")


MAX_RESPECULATIONS = 3
# recaptures for an opaque call's layout alone, after which its captures copy
# such results into the assumed strides (right values, eager's layout lost)
MAX_LAYOUT_RESPECULATIONS = 3


def respeculate(node: CacheNode, entry: CompiledEntry) -> None:
    """After a failed check: recapture with the None pattern (and the
    layouts) seen there and at the speculative calls the interpreter ran
    after it."""
    site, pattern, layout, seen = entry.last_deopt
    node.profile.update(seen)
    node.profile[site] = pattern
    node.variants.remove(entry)  # the next backward with these keys traces again
    if layout:
        node.layout_respeculations += 1
        if node.layout_respeculations == MAX_LAYOUT_RESPECULATIONS:
            log.info(
                "cagrad: an opaque call's gradient layout changed %d times; this graph's "
                "captures copy it into the layout they assume from now on",
                MAX_LAYOUT_RESPECULATIONS,
            )
        return
    node.respeculations += 1
    if node.respeculations > MAX_RESPECULATIONS:
        node.verdict = FallbackVerdict(
            "speculation_failed",
            "hooks or opaque nodes keep returning None gradients in new places",
        )


def _count_capture(root: CacheNode, state_change: Any, shape_change: bool) -> None:
    counters.bump("captures")
    if state_change:
        counters.bump("recompiles_global_state")
        logs.verbose_log.debug("global state changed since this graph was compiled: %s", state_change)
    elif shape_change:
        counters.bump("recompiles_shape")
    elif root.captures:
        counters.bump("recompiles_new_node")
    root.captures += 1


def retrace(
    collected: CollectedBackward,
    root: CacheNode,
    node: CacheNode,
    compiler_fn: Any,
    compile_graph: Callable[..., Callable[..., Any]],
    dynamic: bool | None,
) -> None:
    """Traces a backward again at the end of its first run, which failed a
    check: the new variant assumes what the run saw (``node.profile``, as
    :func:`respeculate` left it), so the next backward with these keys
    hits instead of capturing. The trace swaps the holders still in the
    saved-tensor slots for fakes (the run freed the tensors through them,
    :func:`cagrad.run.runtime.run_segmented`), made from the lifted
    tensors' metadata (``collected.shells``). Counted as
    ``counters["retraces"]``, not as a capture (no backward was added).

    Not where tensor hooks were traced into the graph: a hook may have
    changed its tensor's hook dict during the run (removed itself), and
    the trace reads the dict as it is now, while the keys recorded it as
    it was; the next backward recaptures then.

    Never raises: a failure is logged, and the next backward captures (or
    falls back) as it would have without this.
    """
    shells = collected.shells
    if node.verdict is not None or shells is None or collected.collector.traced_hooks:
        return
    args = collected.collector.args
    tensors = args.tensors
    args.tensors = shells
    try:
        capture(collected, root, node, compiler_fn, compile_graph, dynamic, retrace=True)
    except Exception as e:  # noqa: BLE001 - the backward itself is done and right
        node.verdict = None  # this backward's own capture did not fail; the next one decides
        log.info("cagrad: tracing a backward again after its run failed (%s: %s); the next one captures", type(e).__name__, e)
    finally:
        args.tensors = tensors


def slots_to_trace_dynamic(
    node: CacheNode, sizes: Any, dynamic: bool | None, other_sizes: bool = False, marked: Sequence[int] = ()
) -> frozenset[int]:
    """Which size slots to trace as symbols for a new variant.

    ``dynamic=True``: every slot that may be dynamic, from the first
    capture on. ``dynamic=None``: the first capture of a key sequence is
    static (tracing with symbols costs 2 to 12 times a static trace: torch's
    ``SymInt`` arithmetic and sympy on every op, see ``docs/DESIGN.md``,
    which a graph whose sizes never change should not pay); once a backward
    differs from the first variant in a size that may be dynamic, every slot
    that may be dynamic, so that one more capture serves any sizes (the
    static variant keeps serving its own); also at once where the disk cache
    holds this graph for other sizes (``other_sizes``: another process saw
    them change, as Dynamo's profile-guided automatic dynamic remembers
    across runs). ``dynamic=False``: the slots whose values differ from the
    first variant's (accumulated), torch's compiled autograd's STATIC ->
    DYNAMIC ``SizeInput``.

    ``marked``: slots of dimensions the user marked with
    ``torch._dynamo.mark_dynamic`` (:meth:`Collector.marked_dynamic_slots
    <cagrad.keys.compiled_node_args.Collector.marked_dynamic_slots>`). Where
    one of them may be dynamic, every slot that may be dynamic is a symbol
    from this capture on, whatever ``dynamic`` says, as Dynamo traces a
    marked dimension as a symbol from its first compile: the marked size
    and the sizes derived from it (a gradient's shape, a view's numel)
    stay symbolic together, and a backward at another value of it hits.
    """
    ok = sizes.dynamic_ok
    if any(ok[i] for i in marked):
        # kept on the node: a retrace after a failed run reads shells, not the marked tensors
        node.dynamic_slots = node.dynamic_slots | _may_be_dynamic(ok)
    if node.variants:
        # duck sizing merged these with slots of the same value that kept it
        changed = node.variants[0].check.changed(sizes.values)
        node.distinct_slots = node.distinct_slots | frozenset(i for i in changed if ok[i])
    if dynamic is None:
        # all of them once a size that may be dynamic has changed (not only
        # the global state, or sizes that stay static), here or in another process
        changed_before = bool(node.distinct_slots) if node.variants else other_sizes
        return _may_be_dynamic(ok) if changed_before else node.dynamic_slots
    if dynamic:
        return _may_be_dynamic(ok)
    if not node.variants:
        return node.dynamic_slots
    node.dynamic_slots = node.dynamic_slots | frozenset(i for i in changed if ok[i])
    return node.dynamic_slots


def _tagged_marked(compile_graph: Callable[..., Any]) -> Callable[..., Any]:
    """``compile_graph`` tagging each graph it compiles as one whose sizes
    include a dimension marked with ``mark_dynamic`` (:mod:`cagrad.compile.marked_sizes`)."""

    def compile_tagged(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        gm.meta[marked_sizes.MARKED] = True
        return compile_graph(gm, *args, **kwargs)

    return compile_tagged


def _may_be_dynamic(ok: Sequence[bool]) -> frozenset[int]:
    return frozenset(i for i, d in enumerate(ok) if d)


def use_cuda_graphs(entry: CompiledEntry, create_graph: bool, compiler_fn: Any) -> None:
    """Wraps a fresh entry's compiled backward for CUDA graph replay, or
    counts why it stays as it is (:mod:`cagrad.compile.cuda_graphs`). Graphs of a
    backend that specializes (:mod:`cagrad.compile.specialize`) warm up one call
    more, so that the graph records the specialized code."""
    why = cuda_graphs.unsafe_reason(entry.traced, create_graph)
    if why is not None:
        counters.record_cudagraph_skip(why)
        logs.verbose_log.debug("no CUDA graph for this backward: %s", why)
    elif entry.fn is not None and not isinstance(entry.fn, cuda_graphs.CudaGraphed):
        name = compiler_fn if isinstance(compiler_fn, str) else None
        warmup = specialize.HOT_CALLS if specialize.wanted(name) else 1
        entry.fn = cuda_graphs.CudaGraphed(entry.fn, warmup, cuda_graphs.unread_host_inputs(entry.traced.graph_module))


def capture(
    collected: CollectedBackward,
    root: CacheNode,
    node: CacheNode,
    compiler_fn: Any,
    compile_graph: Callable[..., Callable[..., Any]],
    dynamic: bool | None,
    reason: Any = None,
    disk: disk_cache.DiskCache | None = None,
    retrace: bool = False,
) -> CompiledEntry:
    """Traces and compiles a new variant of ``node``'s graph.

    ``retrace``: at the end of a backward whose first run failed a check
    (:func:`retrace`): counted as ``retraces``, not as a capture.
    """
    if len(node.variants) >= MAX_VARIANTS:
        node.verdict = FallbackVerdict(
            "too_many_size_variants",
            f"{MAX_VARIANTS} variants of one graph (sizes or global states) were compiled",
        )
        raise Unsupported(node.verdict.reason, node.verdict.detail)
    if not retrace:
        logs.miss(reason)
    sizes = collected.collector.sizes
    state_change = node.state_change(sizes.values)
    shape_change = bool(node.variants) and not state_change
    started = time.perf_counter()
    stored, other_sizes = disk.load(collected, compiler_fn, dynamic) if disk is not None else (None, False)
    marked = collected.collector.marked_dynamic_slots()
    dynamic_slots = slots_to_trace_dynamic(node, sizes, dynamic, other_sizes, marked)
    if dynamic_slots and collected.collector.has_subclass:
        # a subclass is traced with static sizes (cagrad.keys.subclasses):
        # other sizes make another static variant
        dynamic_slots = frozenset()
    try:
        traced = stored if stored is not None else trace_with_retries(collected, node, dynamic_slots)
        check_graph(compiler_fn, traced.graph_module)
    except Unsupported as u:
        node.verdict = FallbackVerdict(u.reason, u.detail)
        raise
    except Exception as e:
        if internal_errors.catches(e):  # not traced again for this key
            node.verdict = FallbackVerdict(internal_errors.REASON, internal_errors.detail(e))
        raise
    if retrace:
        counters.bump("retraces")
    else:
        _count_capture(root, state_change, shape_change)
    symbolic = not traced.check.is_static
    if symbolic and any(i in dynamic_slots for i in marked):
        compile_graph = _tagged_marked(compile_graph)
    if dynamic_slots and not dynamic:
        logs.verbose_log.debug(
            "sizes marked dynamic: %s",
            ", ".join(sizes.origin(i) for i in sorted(dynamic_slots)[:16]),
        )
    record = disk.record(collected, traced, compiler_fn, dynamic) if disk is not None and stored is None else None
    traced_at = time.perf_counter()
    env = traced.shape_env
    guards_before = len(env.guards) if env is not None else 0
    try:
        with run_context.grad_mode():
            state = direct_compile.global_state() if isinstance(compiler_fn, str) else None
            if traced.has_opaque_calls:
                sg = segments.split(traced.graph_module, traced.to_value)
                segments.compile_segments(sg, lambda gm: compile_graph(gm, symbolic))
                entry = CompiledEntry(None, traced, segmented=sg)
                entry.learn_layouts = node.layout_respeculations < MAX_LAYOUT_RESPECULATIONS
            else:
                entry = CompiledEntry(compile_graph(traced.graph_module, symbolic, static_first=True), traced)
        entry.state = state
        compiled = [entry.fn] if entry.segmented is None else [seg.fn for seg in entry.segmented.segments]
        counters.bump("graph_segments", len(compiled))
        direct_compile.link_all(compiled, traced)
        if env is not None:
            added = tighten(traced.check, env, guards_before)
            if added:
                logs.verbose_log.debug("the backend added %d size guards: %s", added, traced.check.guard_exprs[-added:])
    except Exception as e:
        node.verdict = FallbackVerdict("compile_failed", f"{type(e).__name__}: {e}")
        raise Unsupported("compile_failed", f"{type(e).__name__}: {e}") from e
    compiled_at = time.perf_counter()
    if record is not None:
        disk.store(record)
    node.variants.append(entry)
    logs.graph_captured(traced.graph_module)
    events.emit_capture(
        events.CaptureEvent(
            traced.graph_module,
            collected.node_keys,
            len(entry.segmented.segments) if entry.segmented is not None else 1,
            reason,
            traced_at - started,
            compiled_at - traced_at,
        )
    )
    return entry
