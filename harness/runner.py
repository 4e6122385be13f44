"""The differential oracle: eager autograd against every subject, on every device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from harness.capture_rule import SizeVariant, allowed_captures, check_captures, size_classes
from harness.compare import compare_state, compare_tensor_lists, compare_trace
from harness.devices import resolve_devices
from harness.execution import Execution, StepValues, execute
from harness.lifetimes import compare_lifetimes
from harness.outcome import DifferentialReport, Mismatch, Outcome, Status
from harness.program import Observation, Program
from harness.subjects import EagerSubject, Subject, resolve_subjects
from harness.tolerance import TolerancePolicy, python_float_tolerance, tolerance_for
from harness.warnings_seen import compare_warnings


class ProgramBuildError(RuntimeError):
    """The program's ``build`` raised under plain eager: the program is broken,
    so no subject can be judged. The original exception is ``__cause__``."""


def judge(
    subject: Subject,
    device: torch.device,
    reference: Execution,
    got: Execution,
    policy: TolerancePolicy = tolerance_for,
) -> Outcome:
    """Compares one subject's execution with eager's and classifies it.

    Rules (in order):

    1. eager raised: the subject must raise the same exception class
       (``equal``, even where cagrad counted a fallback to reach it: the
       counts and reasons are still recorded); another class is an
       ``error``; success is a ``mismatch`` at ``"exception"``.
    2. the subject raised: ``error``.
    3. any compared value differs: ``mismatch`` (every difference listed).
       Compared: ``grad result i`` (mode ``"grad"``), ``leaf i .grad`` (both
       modes: ``autograd.grad`` must leave ``.grad`` alone), ``trace[i]``
       (before the leaf ``.grad`` s when the trace holds
       :class:`~harness.program.Observation` s: the per-step records of
       a program that trains, whose earliest difference is listed first);
       each by the loosest tolerance among its own dtype and the floating
       dtypes of the program's leaves and outputs
       (:attr:`harness.execution.Execution.value_dtypes`); then the process
       state the backward left, field by field, against what eager's left
       (``state cpu_rng``, ``state grad_enabled``, ...:
       :func:`harness.compare.compare_state`); then the Python warnings
       the backward emitted (``warnings``: the same ``(category,
       message)`` s the same number of times, but for a peer those of
       torch's compiler stack: :func:`harness.warnings_seen.compare_warnings`);
       then which of the forward's storages the run left alive, right
       after the backward, once the program let go of them, and after a
       cyclic collection (``lifetime``: :func:`harness.lifetimes.compare_lifetimes`;
       not for a peer, whose compiled autograd keeps its last graph's
       inputs alive).
       A subject that runs the program several times
       (:attr:`Subject.steps`) has every step compared with eager's one run.
    4. the subject fell back at least once: ``fallback``.
    5. otherwise ``equal``.
    """
    outcome = Outcome(
        subject=subject.name,
        device=str(device),
        status=Status.EQUAL,
        error=got.error,
        eager_error=reference.error,
        counts=dict(got.counts),
        fallback_reasons=dict(got.fallback_reasons),
        seconds=got.seconds,
    )
    fell_back = got.counts.get("fallbacks", 0) > 0 or bool(got.fallback_reasons)
    if reference.error is not None:
        if got.error is None:
            outcome.status = Status.MISMATCH
            outcome.mismatches.append(
                Mismatch("exception", f"eager raised {reference.error.short()}; the subject succeeded")
            )
        elif got.exc_type is not reference.exc_type:
            outcome.status = Status.ERROR
        else:
            # error parity holds; counters and fallback reasons stay recorded
            # (cagrad may count the eager re-run that raised as a fallback).
            outcome.status = Status.EQUAL
        return outcome
    if got.error is not None:
        outcome.status = Status.ERROR
        return outcome

    def tol(dtype: torch.dtype):
        # a grad that passed through a lower-precision value (a float64 leaf
        # added to a float32 tensor) carries that value's rounding: judge it
        # by the loosest tolerance among the program's floating dtypes
        own = policy(dtype, subject.backend, device.type)
        if not (dtype.is_floating_point or dtype.is_complex):
            return own
        others = [policy(d, subject.backend, device.type) for d in reference.value_dtypes if d != dtype]
        return max([own, *others], key=lambda t: (t.rtol, t.atol))

    mismatches: list[Mismatch] = []
    steps = [
        *got.earlier,
        StepValues(
            got.leaf_grads, got.grad_results, got.trace, got.state_before, got.state_after, got.warnings, got.lifetimes
        ),
    ]
    for k, step in enumerate(steps, 1):
        # every step of a many-step subject (warm-up, recording, replays)
        # against eager's one run; a one-step subject's labels stay as they were
        at = f"step {k}/{len(steps)}: " if len(steps) > 1 else ""
        if reference.grad_results is not None or step.grad_results is not None:
            mismatches += compare_tensor_lists(
                reference.grad_results or [], step.grad_results or [],
                lambda i, at=at: f"{at}grad result {i}", tol, f"{at}grad result count",
            )
        grads = compare_tensor_lists(
            reference.leaf_grads, step.leaf_grads, lambda i, at=at: f"{at}leaf {i} .grad", tol, f"{at}leaf count"
        )
        found = compare_trace(reference.trace, step.trace, tol, python_float_tolerance(subject.backend, device.type))
        found = [dataclasses.replace(m, where=at + m.where) for m in found] if at else found
        # a program that records per-step observations (optimizer steps):
        # the earliest step's difference first, the last step's .grad after
        observed = any(isinstance(e, Observation) for e in reference.trace)
        mismatches += found + grads if observed else grads + found
    for k, step in enumerate(steps, 1):
        # after every value: a value that differs is the likelier root cause
        at = f"step {k}/{len(steps)}: " if len(steps) > 1 else ""
        mismatches += compare_state(reference.state_before, reference.state_after, step.state_before, step.state_after, at)
        mismatches += compare_warnings(reference.warnings, step.warnings, at, peer=subject.peer)
        if not subject.peer:
            # torch's compiled autograd keeps its last graph's inputs (the
            # leaves among them) alive: every program would differ
            mismatches += compare_lifetimes(reference.lifetimes, step.lifetimes, at)
    outcome.mismatches = mismatches
    if mismatches:
        outcome.status = Status.MISMATCH
    elif fell_back:
        outcome.status = Status.FALLBACK
    return outcome


def _capture_notes(outcomes: Iterable[Outcome]) -> list[str]:
    """Notes where compiled subjects that all agreed with eager captured a
    different number of graphs on the same device (informational)."""
    notes = []
    by_device: dict[str, dict[str, int]] = {}
    for o in outcomes:
        if o.status is Status.EQUAL and o.captures is not None:
            by_device.setdefault(o.device, {})[o.subject] = o.captures
    for device, caps in by_device.items():
        if len(set(caps.values())) > 1:
            listed = ", ".join(f"{s}={n}" for s, n in caps.items())
            notes.append(f"{device}: capture counts differ: {listed}")
    return notes


def run_differential(
    program: Program,
    subjects: Sequence[Subject | str] | Subject | str | None = None,
    devices: Sequence[str | torch.device] | str | torch.device | None = None,
    *,
    policy: TolerancePolicy = tolerance_for,
    seed: int = 0,
    after_subject: Callable[[Subject, torch.device, Outcome], None] | None = None,
) -> DifferentialReport:
    """Runs ``program`` under eager autograd and each subject, on each device.

    Every subject's ``prepare`` runs first (``import cagrad`` installs a
    process-wide hook interception, so it happens before the reference).
    For every device the program is built afresh for the eager reference and
    for every subject (each build under ``torch.manual_seed(seed)``, with the
    caller's RNG state restored), each subject's engine is reset before its
    run, and its results are judged by :func:`judge`.

    Args:
        program: anything with ``name`` and ``build(device) -> ProgramRun``.
        subjects: subject names (``"cagrad[aot_eager]"``, see
            :mod:`harness.subjects`) and/or :class:`Subject` objects;
            ``None`` for :func:`~harness.subjects.default_subjects`.
        devices: ``None`` for CPU plus CUDA when available, or explicit
            devices.
        policy: ``(dtype, backend, device_type) -> Tolerance``.
        seed: the seed set before each build.
        after_subject: called with ``(subject, device, outcome)`` right
            after each subject's outcome on a device is judged, before the
            next subject is reset: the subject's engine still holds the
            state that run (a size sequence: its last variant) left, so
            the caller may run more programs in it (the fuzzer's
            neighbours, :class:`fuzz.oracle.Oracle`). What it raises
            propagates.

    A *size sequence* (a program whose ``size_variants()`` returns a list
    of :class:`~harness.capture_rule.SizeVariant`) runs every variant in
    order under each subject, resetting the subject only before the first,
    judges each variant against eager's run of it, and merges them into one
    outcome per (subject, device) (:func:`merge_variants`), with cagrad's
    captures checked by :func:`harness.capture_rule.check_captures`.

    Returns:
        A :class:`DifferentialReport` with one outcome per (subject, device).

    Raises:
        ValueError: an unknown subject name, or CUDA asked for without CUDA.
        ProgramBuildError: ``program.build`` raised under plain eager.
    """
    subject_list = resolve_subjects(subjects)
    device_list = resolve_devices(devices)
    report = DifferentialReport(program=getattr(program, "name", repr(program)), devices=[str(d) for d in device_list])
    for subject in subject_list:
        subject.prepare()
    variants = size_variants(program)
    if variants is not None:
        report.variants = [v.label for v in variants]
        for device in device_list:
            _run_sequence(report, variants, subject_list, device, policy, seed, after_subject)
        report.notes = _capture_notes(report.outcomes) + _sequence_notes(report.outcomes)
        return report
    for device in device_list:
        reference = eager_reference(program, device, seed)
        if reference.phase == "build":
            assert reference.error is not None
            raise ProgramBuildError(
                f"program {report.program!r} failed to build on {device}: {reference.error.short()}\n"
                f"{reference.error.traceback}"
            )
        if reference.error is not None:
            report.eager_errors[str(device)] = reference.error
        for subject in subject_list:
            got = execute(subject, program, device, seed)
            report.outcomes.append(judge(subject, device, reference, got, policy))
            if after_subject is not None:
                after_subject(subject, device, report.outcomes[-1])
    report.notes = _capture_notes(report.outcomes)
    return report


def eager_reference(program: Program, device: torch.device, seed: int = 0) -> Execution:
    """Eager's run of ``program``, the one subjects are judged against. A
    run that warned is followed by a second one, whose warnings replace the
    first's: a warning torch emits once per process (``TORCH_WARN_ONCE``,
    Dynamo's ``warn_once``) is the first run's alone, and the subjects,
    which run after it, are judged against what eager emits from then on.
    Where lifetimes are recorded (:mod:`harness.lifetimes`), the second run
    is made in any case and its lifetimes replace the first's: a build that
    initialises something once per process (a DTensor's device mesh) makes
    more ops, and other storages, the first time."""
    reference = execute(EagerSubject(), program, device, seed)
    recorded = reference.lifetimes is not None
    if (reference.warnings or recorded) and reference.error is None:
        again = execute(EagerSubject(), program, device, seed)
        if again.error is None:
            if reference.warnings:
                reference.warnings = again.warnings
            if recorded:
                reference.lifetimes = again.lifetimes  # eager runs one step: no earlier ones
    return reference


def size_variants(program: Program) -> list[SizeVariant] | None:
    """The program's size variants when it is a size sequence with more
    than one variant, else None."""
    fn = getattr(program, "size_variants", None)
    if fn is None:
        return None
    variants = list(fn())
    return variants if len(variants) > 1 else None


def _run_sequence(
    report: DifferentialReport,
    variants: Sequence[SizeVariant],
    subjects: Sequence[Subject],
    device: torch.device,
    policy: TolerancePolicy,
    seed: int,
    after_subject: Callable[[Subject, torch.device, Outcome], None] | None = None,
) -> None:
    references = []
    for k, variant in enumerate(variants):
        reference = eager_reference(variant.program, device, seed)
        if reference.phase == "build":
            assert reference.error is not None
            raise ProgramBuildError(
                f"program {report.program!r} failed to build on {device} at size variant {k} "
                f"({variant.label}): {reference.error.short()}\n{reference.error.traceback}"
            )
        if reference.error is not None and str(device) not in report.eager_errors:
            report.eager_errors[str(device)] = reference.error
        references.append(reference)
    for subject in subjects:
        judged, static, graphs = [], set(), []
        for k, (variant, reference) in enumerate(zip(variants, references)):
            got = execute(subject, variant.program, device, seed, reset=k == 0, probe_sizes=True)
            judged.append(judge(subject, device, reference, got, policy))
            static.update(got.static_sizes)
            graphs.append((got.node_types, size_classes(got.size_values)))
        report.outcomes.append(merge_variants(subject, variants, judged, sorted(static), graphs))
        if after_subject is not None:
            after_subject(subject, device, report.outcomes[-1])


_WORST = (Status.ERROR, Status.MISMATCH, Status.FALLBACK, Status.EQUAL)


def merge_variants(
    subject: Subject,
    variants: Sequence[SizeVariant],
    judged: Sequence[Outcome],
    static_sizes: Sequence[str] = (),
    graphs: Sequence[Any] | None = None,
) -> Outcome:
    """One outcome for a size sequence: the worst variant's status (error,
    mismatch, fallback, equal), every variant's mismatches (their detail
    naming the variant), the first error, counts summed, and per variant its
    label, sizes, status and counts in :attr:`Outcome.variants`.

    A subject whose captures are checked (``subject.capture_rule()`` is not
    None) gets a ``mismatch`` at ``"captures"`` when no variant raised or
    diverged and the captures break the rule: its weaker form when
    ``static_sizes`` names what keeps sizes static in the graph (written to
    every variant entry as ``static_sizes``). ``graphs``: each variant's
    backward node types and size classes (a variant with a new graph may
    capture once; :func:`harness.capture_rule.allowed_captures`)."""
    first = judged[0]
    merged = Outcome(subject=first.subject, device=first.device, status=Status.EQUAL)
    for variant, o in zip(variants, judged):
        for m in o.mismatches:
            merged.mismatches.append(dataclasses.replace(m, detail=f"{m.detail} (size variant {variant.label})"))
        merged.error = merged.error or o.error
        merged.eager_error = merged.eager_error or o.eager_error
        for k, v in o.counts.items():
            merged.counts[k] = merged.counts.get(k, 0) + v
        for r, n in o.fallback_reasons.items():
            merged.fallback_reasons[r] = merged.fallback_reasons.get(r, 0) + n
        merged.seconds += o.seconds
        merged.variants.append(
            {"label": variant.label, "sizes": list(variant.sizes), "status": o.status.value, "counts": dict(o.counts)}
        )
    merged.status = min((o.status for o in judged), key=_WORST.index)
    rule = subject.capture_rule()
    if rule is not None:
        dynamic = rule.dynamic
        sizes = [v.rule_shapes() for v in variants]
        static = bool(static_sizes)
        for entry, most in zip(merged.variants, allowed_captures(sizes, dynamic, static, graphs)):
            entry["allowed_captures"] = most
            if static:
                entry["static_sizes"] = list(static_sizes)
        if merged.status in (Status.EQUAL, Status.FALLBACK):
            captures = [o.counts.get("captures", 0) for o in judged]
            # a variant that raised (as eager raised) reset the subject
            # (harness.execution.execute): every graph captured so far is
            # gone, and the next variant captures afresh
            dropped = [
                o.counts.get("deopts", 0) + (sum(captures[: i + 1]) if o.error is not None else 0)
                for i, o in enumerate(judged)
            ]
            problem = check_captures(captures, sizes, dynamic, static=static, dropped=dropped, graphs=graphs)
            if problem is not None:
                if static:
                    problem += f"; weaker rule because of: {', '.join(static_sizes)}"
                merged.status = Status.MISMATCH
                merged.mismatches.append(Mismatch("captures", problem))
    return merged


def _sequence_notes(outcomes: Iterable[Outcome]) -> list[str]:
    """Per device, every subject's captures per size variant side by side
    (informational: torch's compiled autograd may recompile differently)."""
    by_device: dict[str, list[str]] = {}
    for o in outcomes:
        if o.variants and any(c is not None for c in o.captures_per_variant):
            caps = ",".join("-" if c is None else str(c) for c in o.captures_per_variant)
            by_device.setdefault(o.device, []).append(f"{o.subject}={caps}")
    return [f"{device}: captures per size variant: {'; '.join(items)}" for device, items in by_device.items()]
