"""One backward pass through cagrad: collect, look up, capture, run.

::

    collect_backward   GraphTask + one CacheKey per node + lifted tensors
                       + runtime objects (hooks, opaque nodes, leaves)
    cache lookup       CacheNode trie, per compiler
    miss               AutogradCompilerInstance.capture -> compiler_fn
                       (per segment when the graph has opaque calls)
    run                runtime wrapper: compiled graph, .grad, release

Anything unsupported raises :class:`Unsupported` before a side effect, and
the whole backward runs in eager autograd instead (counted, logged).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from . import events, explain, internal_errors, internals, logs
from .autograd import _hook_counts, run_context, saved_variables, transforms
from .autograd.graph_task import GraphTask
from .capture import segments
from .capture.compiler import AutogradCompilerInstance, Traced
from .compile import cuda_graphs, direct_compile, disk_cache, marked_sizes, specialize
from .compile.backends import check_graph
from .counters import counters
from .errors import EagerError, HookTraceFailed, NodeTraceFailed, Unsupported
from .hooks.hooks_census import Census
from .keys import hit_path
from .keys.cache import MAX_VARIANTS, CacheNode, CompiledEntry, FallbackVerdict
from .keys.cache_key import CacheKey, KeyWriter
from .keys.compiled_node_args import Collector, write_tensor
from .keys.sizes import tighten
from .run import host, runtime
from .run.guarded import GuardedBackward

log = logging.getLogger("cagrad")


@dataclasses.dataclass
class CollectedBackward:
    """Everything cagrad reads from one backward before running it.

    Attributes:
        task: structure and run order.
        collector: lifted tensors (root gradients first), runtime objects,
            node plans.
        task_key: the ``GraphTask`` key (roots, inputs, mode).
        node_keys: one CacheKey per node in run order.
        shells: the lifted tensors' metadata, kept by a first run for a
            trace after it (:func:`cagrad.run.runtime.run_segmented`).
    """

    task: GraphTask
    collector: Collector
    task_key: CacheKey
    node_keys: list[CacheKey]
    shells: list | None = None

    @property
    def keys(self) -> list[CacheKey]:
        return [self.task_key, *self.node_keys]

    def run_order(self) -> list[Any]:
        """The nodes in run order (None for the virtual GraphRoot)."""
        return [c.node for c in self.task.order]


def check_supported_mode(create_graph: bool = False) -> None:
    """Raises Unsupported for global modes this version does not compile.

    ``create_graph=True`` is compiled: the graph runs with grad mode on, so
    its result is differentiable as eager's (see :mod:`cagrad.autograd.run_context`).
    """
    if not internals.clean:  # a torch internal failed its check (or the checks did not run yet)
        internals.require_engine()
        off = internals.disabled("ddp_hooks")
        if off is not None and _hook_counts.counts_fn() is None:
            # DDP's reducer hooks are not recorded, and the extension that
            # would see them on the leaves (invisible_hooks) is off too
            raise Unsupported(f"internal:{off[0]}", f"{off[1]}; and cagrad's C++ extension is off")
    if torch.is_anomaly_enabled():
        raise Unsupported("anomaly_mode", "anomaly detection checks every node in eager")
    if torch.is_inference_mode_enabled():
        raise Unsupported("inference_mode", "backward inside inference mode")
    if _any_autocast():
        raise Unsupported("autocast", "backward inside an autocast region")


def _autocast_on_cpu_or_cuda() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


# whether autocast is on for any device type: one C call, about 70 ns (the
# CPU and CUDA checks with torch.cuda.is_available() took 0.7 us a backward
# on this project's CPU machine). An autocast region of another device
# falls back too: eager is right wherever cagrad is not sure.
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", _autocast_on_cpu_or_cuda)


def collect_backward(
    tensors: Sequence[torch.Tensor],
    grad_tensors: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    accumulate_grad: bool,
    create_graph: bool = False,
    census: Census | None = None,
) -> CollectedBackward:
    """Walks the graph in eager's order and collects keys, tensors, objects.

    With ``create_graph`` the key says so (its graph is compiled for grad
    mode on) and root gradients are lifted as they are, differentiable.
    ``census`` is one taken for this backward already (only without
    ``inputs``: with them the GraphTask may add a ``retain_grad`` hook).

    Raises:
        Unsupported: something in the graph cannot be compiled.
        EagerError: eager would raise (see :class:`EagerError`).
    """
    task = GraphTask(tensors, inputs, accumulate_grad)
    collector = Collector(task, census if census is not None else Census())
    w = KeyWriter()
    if create_graph:
        w.tag(b"c")  # absent otherwise: keys of plain backwards are unchanged
    w.tag(b"A" if accumulate_grad else b"G")
    w.size(len(grad_tensors))
    for i, g in enumerate(grad_tensors):
        if g is None:
            raise EagerError(RuntimeError(f"element {i} of gradients tuple is None"))
        what = f"gradient {i} of the roots"
        start = write_tensor(w, g, what, collector.sizes)
        collector.args.add(g.detach() if g.requires_grad and not create_graph else g, None, start)
    for i, (fn, root_nr) in enumerate(task.root_edges):
        root = task.call_of[fn]
        # which node and which of its inputs (the root's output_nr) the root
        # gradient flows into: a root at another output of the same node
        # (aminmax's max after its min) walks the same nodes with the same
        # metadata and differs only here
        w.size(root.id)
        w.size(root_nr)
        collector.write_metadata(w, root, root_nr, f"root edge {i}")
    w.size(len(task.output_edges))
    for fn, input_nr in task.output_edges:
        call = task.call_of.get(fn) if fn is not None else None
        if call is None:
            w.tag(b"N")
        else:
            w.size(call.id)
            w.size(input_nr)
    node_keys = [collector.collect(call) for call in task.order]
    collector.finish()
    return CollectedBackward(task, collector, CacheKey("GraphTask", w.getvalue()), node_keys)


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


@dataclasses.dataclass
class BackwardCall:
    """The arguments of ``ImperativeEngine.run_backward``, as given."""

    tensors: Sequence[Any]
    grad_tensors: Sequence[Any]
    keep_graph: bool
    create_graph: bool
    inputs: Sequence[Any]
    allow_unreachable: bool
    accumulate_grad: bool

    def run_eager(self, engine: Any) -> Any:
        """Runs the backward in torch's ``engine``, whose GraphTask is the
        current one inside it (callbacks, task id)."""
        with run_context.delegated():
            return engine.run_backward(
                self.tensors,
                self.grad_tensors,
                self.keep_graph,
                self.create_graph,
                self.inputs,
                allow_unreachable=self.allow_unreachable,
                accumulate_grad=self.accumulate_grad,
            )


def run(
    call: BackwardCall,
    cache: CacheNode,
    compiler_fn: Any,
    compile_graph: Callable[..., Callable[..., Any]],
    eager_engine: Any,
    dynamic: bool | None,
    cuda_graphs: bool = False,
    disk: disk_cache.DiskCache | None = None,
) -> Any:
    """Runs one backward through cagrad, or through eager when it must.

    ``cuda_graphs``: wrap new whole-graph entries in
    :class:`~cagrad.compile.cuda_graphs.CudaGraphed` (``mode="reduce-overhead"``).
    ``disk``: where captures are looked up before tracing and stored after
    compiling (:mod:`cagrad.compile.disk_cache`); its
    :class:`~cagrad.errors.CacheFileError` propagates.
    """
    counters.bump("backwards")
    outs = None
    running = False  # once True, the backward cannot be handed to eager
    try:
        # first: under a functorch transform nothing may be collected or traced
        transforms.check_active()
        check_supported_mode(call.create_graph)
        census = None
        fast = None
        if cache.guards and hit_path.eligible_call(call) and transforms.plain(call.tensors):
            census = Census()  # the full path below reuses it on a guard miss
            if hit_path.census_allows(census):  # else hooks are live and no guard can see them
                early = _replay_early(cache.guards[0], call) if cuda_graphs else None
                try:
                    fast = _try_guards(call, cache, census)
                    if fast is not None and fast.entry.segmented is None:
                        running = True
                        return _run_guarded(call, cache, fast.guard, fast.hit, fast.found)
                finally:
                    if early is not None:
                        early.settle()
        if fast is not None:
            # a segmented graph the guard accepted: it runs below, after
            # this try, as a collected one does (its hooks run as it goes)
            collected = _guarded_segmented(call, cache, fast)
            node, found, sizes_values = fast.guard.node, fast.found, fast.hit.values
        else:
            transforms.check_call(call.tensors, call.grad_tensors, call.inputs)
            collected = collect_backward(
                call.tensors, call.grad_tensors, call.inputs, call.accumulate_grad, call.create_graph, census
            )
            node = cache.find(collected.keys)
            if node is not None and node.verdict is not None:
                raise Unsupported(node.verdict.reason, node.verdict.detail)
            sizes_values = collected.collector.sizes.values
            found = None if node is None else node.match(sizes_values)
        ctx = run_context.current()
        if ctx is not None:
            ctx.task = collected.task if fast is None else collected
        if found is None:
            sizes = collected.collector.sizes
            reason = explain.diagnose(cache, collected.keys, sizes) if _wants_reason() else None
            node = cache.lookup(collected.keys)
            entry = _capture(collected, cache, node, compiler_fn, compile_graph, dynamic, reason, disk)
            if cuda_graphs:
                _use_cuda_graphs(entry, call.create_graph, compiler_fn)
            sym_values = entry.check.match(sizes.values)
            if sym_values is None:
                raise Unsupported("dynamic_shapes", "a fresh capture does not accept its own sizes")
        else:
            entry, sym_values = found
        fresh = node.guard is None and entry.segmented is None
        graph_sizes = [fn(*sym_values) for fn in entry.traced.size_inputs]
        if entry.segmented is None:
            _prepare_symbolic(entry, graph_sizes, sizes_values)
        elif node.guard is None:
            # before the run, which empties the collected lists (a whole
            # graph's guard is made after its call, which may fall back)
            _add_guard(collected, call, cache, node)
        if found is not None:
            counters.bump("cache_hits")  # not one if it fell back above
        early_release = False
        if entry.segmented is None:
            first_run = entry.calls == 0
            # a first run may still fall back to eager, which needs the saved tensors
            early_release = not first_run and not fresh and not call.keep_graph
            if early_release:
                runtime.release_lifted(collected)
            running = True
            try:
                with events.running():
                    outs = runtime.call_whole(
                        entry, collected.collector.args.tensors, graph_sizes, hand_over=early_release
                    )
            except Exception as e:
                if not first_run:
                    raise
                # the first call is when torch.compile compiles: a backend failure
                node.verdict = FallbackVerdict("compile_failed", f"{type(e).__name__}: {e}")
                raise Unsupported(node.verdict.reason, node.verdict.detail) from e
            if fresh:
                _add_guard(collected, call, cache, node)
    except Unsupported as u:
        counters.record_fallback(u.reason, u.detail)
        return call.run_eager(eager_engine)
    except EagerError as e:
        counters.record_fallback("eager_error", f"eager raises here: {e.cause}")
        return call.run_eager(eager_engine)
    except Exception as e:
        # a cagrad bug before anything ran (cagrad.internal_errors)
        if running or not internal_errors.catches(e):
            raise
        internal_errors.record(e)
        return call.run_eager(eager_engine)
    if outs is not None:
        result = runtime.finish_whole(
            entry, [c.node for c in collected.task.order], outs, collected.collector.objects
        )
    else:
        deopts = entry.deopts
        # captured in this backward: where the run fails a check, the
        # backward is traced again at its end (see _retrace)
        retraceable = found is None and entry.calls == 0
        release_early = not call.keep_graph

        def run_it() -> list:
            return runtime.run_segmented(entry, collected, graph_sizes, sym_values, release_early, retraceable)

        with events.running():
            if collected.collector.needs_host:
                # hooks added from C++ may queue callbacks from C++
                result = host.run_hosted(run_it, eager_engine)
            else:
                result = run_it()
        if entry.deopts != deopts:
            _respeculate(node, entry)
            if retraceable:
                _retrace(collected, cache, node, compiler_fn, compile_graph, dynamic)
        if retraceable:
            collected.shells = None
    if not call.keep_graph:
        runtime.release(collected, lifted=not early_release)
    if call.accumulate_grad:
        return None
    runtime.check_unused(result, call.allow_unreachable)
    return tuple(result)


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


def _try_guards(call: BackwardCall, cache: CacheNode, census: Census) -> GuardedHit | None:
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
        if census.claim_slots and hit_path.has_foreign_saved_hooks(hit):
            return None
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


def _replay_early(guard: hit_path.HitGuard, call: BackwardCall) -> cuda_graphs.CudaGraphed | None:
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


def _run_guarded(
    call: BackwardCall, cache: CacheNode, guard: hit_path.HitGuard, hit: hit_path.Hit, found: tuple
) -> None:
    """Runs a backward a guard accepted: call, accumulate, release."""
    entry, sym_values = found
    guard.last_entry = entry
    if hit_path.verify_enabled():
        _verify_hit(call, cache, guard, hit)
    graph_sizes = [fn(*sym_values) for fn in entry.traced.size_inputs]
    _prepare_symbolic(entry, graph_sizes, hit.values)
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
    return None


def _guarded_segmented(call: BackwardCall, cache: CacheNode, fast: GuardedHit) -> GuardedBackward:
    """A segmented backward a guard accepted, as the segmented runtime reads
    a collected one."""
    guard = fast.guard
    guard.last_entry = fast.entry
    if hit_path.verify_enabled():
        _verify_hit(call, cache, guard, fast.hit, fast.objects)
    counters.bump("guard_hits")
    return GuardedBackward(call, fast.hit, guard.release_slots, fast.objects, bool(guard.leaves.hooked))


def _prepare_symbolic(entry: CompiledEntry, graph_sizes: list[int], values: Sequence[int]) -> None:
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


def _add_guard(collected: CollectedBackward, call: BackwardCall, cache: CacheNode, node: CacheNode) -> None:
    """Generates ``node``'s guard (once; False marks a graph it cannot guard)."""
    try:
        guard = hit_path.build(collected, call, node)
    except Exception:  # noqa: BLE001 - a generator bug must not cost the backward
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


def _verify_hit(
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


MAX_RESPECULATIONS = 3
# recaptures for an opaque call's layout alone, after which its captures copy
# such results into the assumed strides (right values, eager's layout lost)
MAX_LAYOUT_RESPECULATIONS = 3


def _respeculate(node: CacheNode, entry: CompiledEntry) -> None:
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


def _retrace(
    collected: CollectedBackward,
    root: CacheNode,
    node: CacheNode,
    compiler_fn: Any,
    compile_graph: Callable[..., Callable[..., Any]],
    dynamic: bool | None,
) -> None:
    """Traces a backward again at the end of its first run, which failed a
    check: the new variant assumes what the run saw (``node.profile``, as
    :func:`_respeculate` left it), so the next backward with these keys
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
        _capture(collected, root, node, compiler_fn, compile_graph, dynamic, retrace=True)
    except Exception as e:  # noqa: BLE001 - the backward itself is done and right
        node.verdict = None  # this backward's own capture did not fail; the next one decides
        log.info("cagrad: tracing a backward again after its run failed (%s: %s); the next one captures", type(e).__name__, e)
    finally:
        args.tensors = tensors


def _dynamic_slots(
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


def _use_cuda_graphs(entry: CompiledEntry, create_graph: bool, compiler_fn: Any) -> None:
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


def _wants_reason() -> bool:
    return logs.verbose_log.isEnabledFor(logging.DEBUG) or bool(events.on_capture)


def _capture(
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
    (:func:`_retrace`): counted as ``retraces``, not as a capture.
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
    dynamic_slots = _dynamic_slots(node, sizes, dynamic, other_sizes, marked)
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
