"""One isolated run of one program under one subject on one device.

:func:`execute` resets the subject, builds the program freshly under a fixed
seed (the caller's RNG state is restored afterwards), runs its backward inside
the subject's context, and snapshots everything the oracle compares: copies
of the leaf ``.grad`` s, of the ``autograd.grad`` results and of the hook
trace, the warnings the backward emitted, plus the subject's counter
deltas. A subject with :attr:`~harness.subjects.Subject.steps` above 1
(CUDA graphs: a warm-up, a recording, replays) runs the program that many
times in a row, each build fresh under the same seed, its state kept
between them; every step's values are kept for the oracle. Exceptions are
captured, never propagated, except that a failing ``build`` is flagged as
such so that the runner can tell a broken program from a broken engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch

from harness import global_state, lifetimes, warnings_seen
from harness.devices import seeded, synchronize
from harness.lifetimes import Lifetimes
from harness.outcome import ErrorInfo
from harness.program import Program, ThreadTrace
from harness.subjects import Subject, counter_deltas, graph_nodes
from harness.warnings_seen import WarningRecord


@dataclasses.dataclass
class StepValues:
    """The compared values of one step before the last (see
    :attr:`Execution.earlier`); fields as :class:`Execution`'s."""

    leaf_grads: list[torch.Tensor | None]
    grad_results: list[torch.Tensor | None] | None
    trace: list[Any]
    state_before: global_state.GlobalState | None = None
    state_after: global_state.GlobalState | None = None
    warnings: list[WarningRecord] = dataclasses.field(default_factory=list)
    lifetimes: Lifetimes | None = None


@dataclasses.dataclass
class Execution:
    """What one run produced.

    Attributes:
        mode: the program's mode (``"backward"`` or ``"grad"``), ``None`` when
            the build failed.
        leaf_grads: a detached copy of each leaf's ``.grad`` after the last
            backward (``None`` where unset), in both modes.
        grad_results: mode ``"grad"``: copies of the returned tuple; ``None``
            in mode ``"backward"``.
        trace: a copy of ``ProgramRun.trace`` (tensors cloned, containers
            copied).
        state_before, state_after: the process state
            (:mod:`harness.global_state`) read after the build, before the
            backward (and before a subject's size probe), and right after
            the backward, both under the run's seed; None where the build
            or the backward raised.
        warnings: every Python warning the backward emitted, in order
            (:mod:`harness.warnings_seen`; C++ ``TORCH_WARN`` s included).
        lifetimes: which storages of the forward were alive right after
            the backward, after the program let go of its objects, and
            after a cyclic collection (:mod:`harness.lifetimes`, unless
            ``CAGRAD_FUZZ_LIFETIMES=0``); None for a peer, where not
            recorded, or where the build or the backward raised.
        earlier: subjects with ``steps`` > 1: the values of each step
            before the last, in order (the fields above are the last
            step's); empty otherwise.
        error: the exception, reduced to text; ``exc_type`` is its class.
        phase: where the exception happened: ``"reset"``, ``"build"`` or
            ``"backward"`` (``None`` without one).
        counts, fallback_reasons: counter deltas over the backward (see
            :func:`harness.subjects.counter_deltas`).
        seconds: wall time of build and backward.
        static_sizes: what the subject keeps static by design in this
            graph, and ``size_values`` its size slots' values (see
            :class:`harness.subjects.SizeProbe`).
        value_dtypes: the floating dtypes of the program's leaves and
            outputs (a grad that flowed through a lower-precision value
            carries its rounding: :func:`harness.runner.judge` compares it
            with the loosest of these tolerances).
        node_types: the backward graph's node type names, sorted (size
            sequences: a size can change the graph itself, as ``x[0:2]``
            is an ``AliasBackward0`` at size 2 and a ``SliceBackward0`` at
            size 5; see :func:`harness.capture_rule.allowed_captures`).
    """

    mode: str | None = None
    leaf_grads: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    grad_results: list[torch.Tensor | None] | None = None
    trace: list[Any] = dataclasses.field(default_factory=list)
    state_before: global_state.GlobalState | None = None
    state_after: global_state.GlobalState | None = None
    warnings: list[WarningRecord] = dataclasses.field(default_factory=list)
    lifetimes: Lifetimes | None = None
    earlier: list[StepValues] = dataclasses.field(default_factory=list)
    error: ErrorInfo | None = None
    exc_type: type[BaseException] | None = None
    phase: str | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    static_sizes: list[str] = dataclasses.field(default_factory=list)
    size_values: tuple[int | None, ...] = ()
    node_types: tuple[str, ...] = ()
    value_dtypes: tuple[torch.dtype, ...] = ()


def _trace_snapshot(trace: list) -> list:
    """``snapshot`` of a trace; a :class:`~harness.program.ThreadTrace` keeps
    its threads."""
    copy = snapshot(list(trace))
    if isinstance(trace, ThreadTrace):
        out = ThreadTrace()
        out[:] = copy
        out.threads, out.owner = list(trace.threads), trace.owner
        return out
    return copy


def snapshot(value: Any) -> Any:
    """A copy of ``value`` whose tensors are detached clones (containers
    copied recursively), so later in-place changes cannot alter it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        items = [snapshot(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    return value


def execute(
    subject: Subject,
    program: Program,
    device: torch.device,
    seed: int = 0,
    *,
    reset: bool = True,
    probe_sizes: bool = False,
) -> Execution:
    """Runs ``program`` on ``device`` under ``subject``; never raises an
    exception of the program or engine (``KeyboardInterrupt`` and other
    non-``Exception`` errors pass through).

    ``reset=False`` keeps the subject's state (its compiled-graph cache)
    from the previous run: the later variants of a size sequence run so.
    ``probe_sizes`` fills :attr:`Execution.static_sizes`, ``size_values``
    and ``node_types`` (size sequences)."""
    out = Execution(phase="reset")
    start = time.perf_counter()
    try:
        if reset:
            subject.reset()
        steps = max(1, int(getattr(subject, "steps", 1)))
        for step in range(steps):
            values = _step(out, subject, program, device, seed, probe_sizes and step == 0)
            if step < steps - 1:
                out.earlier.append(values)
            else:
                out.leaf_grads, out.grad_results, out.trace = values.leaf_grads, values.grad_results, values.trace
                out.state_before, out.state_after = values.state_before, values.state_after
                out.warnings, out.lifetimes = values.warnings, values.lifetimes
        out.phase = None
    except Exception as exc:
        out.error = ErrorInfo.from_exception(exc)
        out.exc_type = type(exc)
        try:
            subject.reset()  # leave no half-finished state to the next subject
        except Exception:
            pass
    out.seconds = time.perf_counter() - start
    return out


def _step(
    out: Execution, subject: Subject, program: Program, device: torch.device, seed: int, probe_sizes: bool
) -> StepValues:
    """Builds ``program`` afresh and runs its backward once under
    ``subject``; counter deltas add up in ``out``, and ``out.phase`` says
    where it is (``"build"``, then ``"backward"``). Raises what the build or
    the backward raises."""
    if not lifetimes.enabled() or subject.peer:
        # (a peer's are never compared: torch's compiled autograd keeps its
        # last graph's inputs alive, and collecting them costs a gc.collect)
        return _build_and_run(out, subject, program, device, seed, probe_sizes, None)
    storages = lifetimes.ForwardStorages()
    with lifetimes.collector_paused():
        values = _build_and_run(out, subject, program, device, seed, probe_sizes, storages)
        # the program lets go of everything it built (values holds copies)
        released, leaked = lifetimes.after_release(storages)
    assert values.lifetimes is not None  # _build_and_run recorded after_backward
    values.lifetimes = dataclasses.replace(values.lifetimes, after_release=released, leaked=leaked)
    return values


def _build_and_run(
    out: Execution,
    subject: Subject,
    program: Program,
    device: torch.device,
    seed: int,
    probe_sizes: bool,
    storages: lifetimes.ForwardStorages | None,
) -> StepValues:
    """:func:`_step`'s build, backward and copies; the program's objects
    are dropped when it returns (its lifetimes hold ``after_backward``
    where ``storages`` records them)."""
    with seeded(device, seed):
        out.phase = "build"
        with storages if storages is not None else contextlib.nullcontext():
            run = program.build(device)
        out.mode = run.mode
        out.value_dtypes = _floating_dtypes([*run.leaves, *run.outputs])
        synchronize(device)
        out.phase = "backward"
        state_before = global_state.capture()
        if probe_sizes:
            probe = subject.size_probe(run)
            out.static_sizes, out.size_values = probe.static, probe.size_values
            out.node_types = tuple(sorted(type(n).__name__ for n in graph_nodes(run.outputs)))
        before = subject.counters()
        try:
            with warnings_seen.recording() as emitted:
                result = subject.run(run)
                synchronize(device)
        finally:
            counts, reasons = counter_deltas(before, subject.counters())
            for k, v in counts.items():
                out.counts[k] = out.counts.get(k, 0) + v
            for k, v in reasons.items():
                out.fallback_reasons[k] = out.fallback_reasons.get(k, 0) + v
        # read under the run's seed, before anything else draws: the
        # stream a backward leaves is the one the next forward draws from
        state_after = global_state.capture()
    with _snapshot_memory(device):
        return StepValues(
            [snapshot(leaf.grad) for leaf in run.leaves],
            [snapshot(g) for g in (result or ())] if run.mode == "grad" else None,
            _trace_snapshot(run.trace),
            state_before,
            state_after,
            emitted,
            None if storages is None else Lifetimes(after_backward=storages.alive()),
        )


_SNAPSHOT_POOLS: dict[int, Any] = {}


def _snapshot_memory(device: torch.device) -> Any:
    """Where a step's copies are allocated: on CUDA, a memory pool of their
    own (``torch.cuda.MemPool``), so that the copies kept from one step do
    not take the blocks the next step's build would get. A many-step subject
    then meets its inputs at the addresses of the step before, as a training
    loop does, and its CUDA graphs read them in place and replay early (with
    the copies in the main pool, the fuzzer's CUDA-graph subject saw few
    early replays)."""
    if device.type != "cuda" or not hasattr(torch.cuda, "use_mem_pool"):
        return contextlib.nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _SNAPSHOT_POOLS.get(index)
    if pool is None:
        pool = _SNAPSHOT_POOLS[index] = torch.cuda.MemPool()
    return torch.cuda.use_mem_pool(pool, torch.device("cuda", index))


def _floating_dtypes(tensors: list[Any]) -> tuple[torch.dtype, ...]:
    found = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())}
    return tuple(sorted(found, key=str))
