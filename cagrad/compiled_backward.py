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

The steps live in :mod:`cagrad.keys.collection` (collect),
:mod:`cagrad.run.hits` (a guarded hit) and :mod:`cagrad.compile.variants`
(capture); this module runs one backward through them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from . import events, explain, internal_errors, logs
from .autograd import run_context, transforms
from .compile import disk_cache, variants
from .counters import counters
from .errors import EagerError, Unsupported
from .hooks.hooks_census import Census
from .keys import hit_path
from .keys.cache import CacheNode, FallbackVerdict
from .keys.collection import BackwardCall, check_supported_mode, collect_backward
from .run import hits, host, runtime


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
                early = hits.replay_early(cache.guards[0], call) if cuda_graphs else None
                try:
                    fast = hits.try_guards(call, cache, census)
                    if fast is not None and fast.entry.segmented is None:
                        running = True
                        return hits.run_guarded(call, cache, fast.guard, fast.hit, fast.found)
                finally:
                    if early is not None:
                        early.settle()
        if fast is not None:
            # a segmented graph the guard accepted: it runs below, after
            # this try, as a collected one does (its hooks run as it goes)
            collected = hits.guarded_segmented(call, cache, fast)
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
            entry = variants.capture(collected, cache, node, compiler_fn, compile_graph, dynamic, reason, disk)
            if cuda_graphs:
                variants.use_cuda_graphs(entry, call.create_graph, compiler_fn)
            sym_values = entry.check.match(sizes.values)
            if sym_values is None:
                raise Unsupported("dynamic_shapes", "a fresh capture does not accept its own sizes")
        else:
            entry, sym_values = found
        fresh = node.guard is None and entry.segmented is None
        graph_sizes = [fn(*sym_values) for fn in entry.traced.size_inputs]
        if entry.segmented is None:
            variants.prepare_symbolic(entry, graph_sizes, sizes_values)
        elif node.guard is None:
            # before the run, which empties the collected lists (a whole
            # graph's guard is made after its call, which may fall back)
            hits.add_guard(collected, call, cache, node)
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
                hits.add_guard(collected, call, cache, node)
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
        # backward is traced again at its end (see variants.retrace)
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
            variants.respeculate(node, entry)
            if retraceable:
                variants.retrace(collected, cache, node, compiler_fn, compile_graph, dynamic)
        if retraceable:
            collected.shells = None
    if not call.keep_graph:
        runtime.release(collected, lifted=not early_release)
    if call.accumulate_grad:
        return None
    runtime.check_unused(result, call.allow_unreachable)
    return tuple(result)


def _wants_reason() -> bool:
    return logs.verbose_log.isEnabledFor(logging.DEBUG) or bool(events.on_capture)
