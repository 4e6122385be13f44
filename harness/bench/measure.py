"""Times the cells of one workload, its subjects side by side: steady-state
backward, overhead, memory."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any

import torch

import cagrad
from cagrad import engine as cagrad_engine
from cagrad.autograd.graph_task import GraphTask
from cagrad.run import runtime

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
        counters: cagrad's counters over the warm-up and timed backwards
            (captures, hits, ...).
        ratio: median over the timed turns of this subject's backward time
            over eager's in the same turn, where eager ran beside it
            (:func:`measure_row`); None for eager itself.
        turn_ms: each timed backward's time (ms), turn by turn (None in a
            turn where it did not run); a turn's entries of the subjects of
            one row were timed one after another.
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
    ratio: float | None = None
    turn_ms: list[float | None] = dataclasses.field(default_factory=list)
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
    """Runs ``WARMUP`` then ``iters`` timed backwards (forward untimed) of one
    subject alone: :func:`measure_row` with one subject."""
    return measure_row(workload, {"subject": subject}, device, iters)["subject"]


_COUNTED = ("captures", "cache_hits", "guard_hits", "fallbacks")
_CUDA_GRAPH_COUNTERS = (
    "cudagraph_records", "cudagraph_replays", "cudagraph_early_replays", "cudagraph_wasted_replays",
    "cudagraph_evictions",
)


class _Row:
    """The subjects of one workload, each with its model (``Subject.wrap`` of
    the workload's module), cell and timed backwards, run one after another."""

    def __init__(self, workload: Workload, subjects: dict[str, Subject], device: str) -> None:
        self.workload, self.subjects, self.device = workload, subjects, device
        self.models = {name: s.wrap(workload.model) for name, s in subjects.items()}
        self.cells = {name: Cell() for name in subjects}
        self.totals: dict[str, list[float | None]] = {name: [] for name in subjects}
        self.records = {name: 0 for name in subjects}

    def live(self) -> list[str]:
        return [name for name, cell in self.cells.items() if cell.error is None]

    def backward(self, name: str, timed: bool) -> None:
        """One forward (untimed) and backward of ``name``; a cagrad subject's
        counters are added to its cell's from the deltas around the backward
        (another cagrad subject of the row counts into the same counters)."""
        subject, cell = self.subjects[name], self.cells[name]
        loss = self.workload.step(self.models[name])
        _sync(self.device)
        before = cagrad.counters.snapshot() if subject.is_cagrad else None
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            allocated = torch.cuda.memory_allocated()
        start = time.perf_counter()
        backward_in(subject, loss)
        _sync(self.device)
        if timed:
            self.totals[name].append(time.perf_counter() - start)
        records = 0
        if before is not None:
            after = cagrad.counters.snapshot()
            for key in (*_COUNTED, *_CUDA_GRAPH_COUNTERS):
                delta = after[key] - before[key]
                if delta or key in _COUNTED:
                    cell.counters[key] = cell.counters.get(key, 0) + delta
            for reason, n in after["fallback_reasons"].items():
                if n != before["fallback_reasons"].get(reason, 0):
                    reasons = cell.counters.setdefault("fallback_reasons", {})
                    reasons[reason] = reasons.get(reason, 0) + n - before["fallback_reasons"].get(reason, 0)
            for reason, n in after["cudagraph_skip_reasons"].items():
                if n != before["cudagraph_skip_reasons"].get(reason, 0):
                    cell.counters["cudagraph_skip_reasons"] = after["cudagraph_skip_reasons"]
            records = after["cudagraph_records"] - before["cudagraph_records"]
        if timed and self.device == "cuda":
            peak = (torch.cuda.max_memory_allocated() - allocated) / 2**20
            cell.peak_mib = max(cell.peak_mib or 0.0, peak)
            self.records[name] += records
            if subject.is_cagrad and not records:
                cell.peak_steady_mib = max(cell.peak_steady_mib or 0.0, peak)


def measure_row(workload: Workload, subjects: dict[str, Subject], device: str, iters: int) -> dict[str, Cell]:
    """Times the subjects of one workload side by side: each runs ``WARMUP``
    backwards, then ``iters`` turns run one timed backward of every subject,
    in an order rotated each turn (the machine's drift and each backward's
    effect on the caches fall on every subject alike). A subject whose
    backward raises is reported with its error and left out of later turns.

    Returns:
        a :class:`Cell` per subject. Where ``"eager"`` is among them, each
        other cell's ``ratio`` is the median over turns of its time divided
        by eager's time in the same turn.
    """
    torch._dynamo.reset()
    cagrad.reset()
    row = _Row(workload, subjects, device)
    try:
        nodes = _node_count(workload.step(workload.model))
    except Exception as e:  # noqa: BLE001 - a failing row is reported, the rest run
        for cell in row.cells.values():
            cell.error = _error(e)
        return row.cells
    for name in subjects:
        row.cells[name].nodes = nodes
        try:
            for _ in range(WARMUP):
                row.backward(name, timed=False)
        except Exception as e:  # noqa: BLE001
            row.cells[name].error = _error(e)
    gc.collect()
    for i in range(iters):
        names = row.live()
        if not names:
            break
        for name in names[i % len(names):] + names[: i % len(names)]:
            try:
                row.backward(name, timed=True)
            except Exception as e:  # noqa: BLE001
                row.cells[name].error = _error(e)
        for name in subjects:  # one entry per turn for every subject: paired by index
            if len(row.totals[name]) < i + 1:
                row.totals[name].append(None)
    eager = row.totals.get("eager")
    for name, cell in row.cells.items():
        cell.turn_ms = [None if t is None else t * 1e3 for t in row.totals[name]]
    for name in row.live():
        cell, subject, model = row.cells[name], subjects[name], row.models[name]
        totals = [t for t in row.totals[name] if t is not None]
        try:
            cell.ms = statistics.median(totals) * 1e3
            if eager is not None and name != "eager":
                ratios = [t / e for t, e in zip(row.totals[name], eager) if t is not None and e]
                cell.ratio = statistics.median(ratios) if ratios else None
            if subject.is_cagrad:
                cell.records_timed = row.records[name] if device == "cuda" else 0
                overheads = _overheads(workload, subject, model, device, max(OVERHEAD_ITERS, iters // 2))
                if overheads:
                    cell.overhead_us_per_node = statistics.median(overheads) * 1e6 / max(cell.nodes or 0, 1)
            if device == "cuda":
                cell.gpu_ms = statistics.median(_device_ms(workload, subject, model) for _ in range(PROFILED))
        except Exception as e:  # noqa: BLE001
            cell.error = _error(e)
    for cell in row.cells.values():
        if cell.error is not None:
            cell.ms = None
    return row.cells


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


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
