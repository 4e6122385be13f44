"""Times one (workload, subject) cell: steady-state backward, overhead, memory."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any

import torch

import cagrad
from cagrad import engine as cagrad_engine
from cagrad.run import runtime
from cagrad.autograd.graph_task import GraphTask

from .subjects import Subject, backward_in
from .workloads import Workload

WARMUP = 3  # the first backward captures and compiles; the rest are hits
PROFILED = 5  # CUDA: backwards run under the profiler after the timed ones
OVERHEAD_ITERS = 10  # cagrad: fewest backwards that time its overhead, after the timed ones


@dataclasses.dataclass
class Cell:
    """One measurement.

    Attributes:
        ms: median steady-state backward time (milliseconds).
        nodes: autograd nodes in the backward.
        overhead_us_per_node: cagrad only: median of (time inside cagrad's
            engine, from torch's call of ``run_backward`` to its return,
            minus the compiled graph's call) per node, in microseconds: the
            guard or full collection, the lookup, accumulation and release.
            Timed in backwards of their own after the timed ones (at least
            ``OVERHEAD_ITERS``, half as many): on CUDA the graph's call is
            timed between two synchronizations, which ``ms`` must not
            include; GPU work queued before the call (a CUDA graph replayed
            before the guard) counts as the call's.
            torch's Python front end before it (``torch.autograd.backward``,
            the root gradient's ``ones_like``), which eager runs the same
            way, is not counted: 9 to 70 us of a 20-node CPU backward, more
            after a backward that evicted the CPU caches.
        peak_mib: CUDA only: peak memory allocated during one backward above
            what was allocated before it (MiB), the largest over the timed
            backwards.
        peak_steady_mib: CUDA, cagrad only: the same over the timed
            backwards that recorded no CUDA graph (a recording allocates the
            graph's whole pool; a replay allocates nothing), None where every
            one recorded.
        records_timed: cagrad only: CUDA graphs recorded during the timed
            backwards.
        gpu_ms: CUDA only: median over ``PROFILED`` more backwards of the
            summed device time of the kernels, copies and memsets the
            backward launched (ms; CUPTI through ``torch.profiler``, kernels
            inside a replayed CUDA graph included): the GPU's own work, the
            floor that removing all host overhead (a CUDA graph) could reach.
        counters: cagrad's counters after the timed backwards (captures,
            hits, ...).
        error: what went wrong, if the cell could not be measured.
    """

    ms: float | None = None
    nodes: int | None = None
    overhead_us_per_node: float | None = None
    peak_mib: float | None = None
    peak_steady_mib: float | None = None
    records_timed: int | None = None
    gpu_ms: float | None = None
    counters: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _node_count(loss: torch.Tensor) -> int:
    return len(GraphTask([loss], [], True).order)


def _device_ms(workload: Workload, subject: Subject, model: Any) -> float:
    """Device time (ms) of what one backward launched: the profiler runs
    around the backward alone (the forward's work finished before it starts,
    the backward's before it stops)."""
    from torch.profiler import ProfilerActivity, profile

    loss = workload.step(model)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        backward_in(subject, loss)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def _timed(fn: Any, spans: list[float], device: str) -> Any:
    """``fn`` that appends each call's duration (s) to ``spans``; on CUDA the
    device is synchronized before and after, both inside the span, so the
    span holds its work and any queued before it."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        _sync(device)
        try:
            return fn(*args, **kwargs)
        finally:
            _sync(device)
            spans.append(time.perf_counter() - start)

    return timed


def measure(workload: Workload, subject: Subject, device: str, iters: int) -> Cell:
    """Runs ``WARMUP`` then ``iters`` timed backwards (forward untimed)."""
    torch._dynamo.reset()
    cagrad.reset()
    model = subject.wrap(workload.model)
    cell = Cell()
    try:
        cell.nodes = _node_count(workload.step(model))
        for _ in range(WARMUP):
            backward_in(subject, workload.step(model))
        gc.collect()
        totals = []
        records_at_start = cagrad.counters["cudagraph_records"]
        for _ in range(iters):
            records_before = cagrad.counters["cudagraph_records"]
            loss = workload.step(model)
            _sync(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            backward_in(subject, loss)
            _sync(device)
            totals.append(time.perf_counter() - start)
            if device == "cuda":
                peak = (torch.cuda.max_memory_allocated() - before) / 2**20
                cell.peak_mib = max(cell.peak_mib or 0.0, peak)
                if subject.is_cagrad and cagrad.counters["cudagraph_records"] == records_before:
                    cell.peak_steady_mib = max(cell.peak_steady_mib or 0.0, peak)
        if subject.is_cagrad:
            cell.records_timed = cagrad.counters["cudagraph_records"] - records_at_start
            snap = cagrad.counters.snapshot()
            cell.counters = {k: snap[k] for k in ("captures", "cache_hits", "guard_hits", "fallbacks")}
            if snap["fallbacks"]:
                cell.counters["fallback_reasons"] = snap["fallback_reasons"]
            for k in (
                "cudagraph_records", "cudagraph_replays", "cudagraph_early_replays", "cudagraph_wasted_replays",
                "cudagraph_evictions", "cudagraph_skip_reasons",
            ):
                if snap.get(k):  # reduce-overhead: whether the backward replayed a CUDA graph
                    cell.counters[k] = snap[k]
            overheads = _overheads(workload, subject, model, device, max(OVERHEAD_ITERS, iters // 2))
            if overheads:
                cell.overhead_us_per_node = statistics.median(overheads) * 1e6 / max(cell.nodes, 1)
        cell.ms = statistics.median(totals) * 1e3
        if device == "cuda":
            cell.gpu_ms = statistics.median(_device_ms(workload, subject, model) for _ in range(PROFILED))
    except Exception as e:  # noqa: BLE001 - a failing cell is reported, the rest run
        cell.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return cell


def _overheads(workload: Workload, subject: Subject, model: Any, device: str, n: int) -> list[float]:
    """cagrad's overhead (s) in each of ``n`` backwards of their own: the
    time inside its engine minus the compiled graph's call (backwards that
    made no single whole-graph call are left out). The wrappers that time
    them synchronize the GPU around the graph's call, which the timed
    backwards must not do."""
    calls: list[float] = []
    engine_spans: list[float] = []
    real_call = runtime.call_whole
    # the graph's call waits for the GPU on both sides; the engine's span
    # does not (the forward's queued work is not cagrad's)
    runtime.call_whole = _timed(real_call, calls, device)
    # the instance's attribute, ahead of the class's method
    cagrad_engine._engine.run_backward = _timed(cagrad_engine._engine.run_backward, engine_spans, "cpu")
    try:
        for _ in range(n):
            loss = workload.step(model)
            _sync(device)
            calls_before, spans_before = len(calls), len(engine_spans)
            backward_in(subject, loss)
            _sync(device)
            if len(calls) == calls_before + 1 and len(engine_spans) == spans_before + 1:
                calls[-1] = engine_spans[-1] - calls[-1]  # cagrad's overhead in this backward
            else:
                del calls[calls_before:]
    finally:
        runtime.call_whole = real_call
        cagrad_engine._engine.__dict__.pop("run_backward", None)
    return calls
