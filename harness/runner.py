"""The differential oracle: eager autograd against every subject, on every device."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from harness.compare import compare_tensor_lists, compare_trace
from harness.devices import resolve_devices
from harness.execution import Execution, execute
from harness.outcome import DifferentialReport, Mismatch, Outcome, Status
from harness.program import Program
from harness.subjects import EagerSubject, Subject, resolve_subjects
from harness.tolerance import TolerancePolicy, python_float_tolerance, tolerance_for


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
       modes: ``autograd.grad`` must leave ``.grad`` alone), ``trace[i]``.
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
        return policy(dtype, subject.backend, device.type)

    mismatches: list[Mismatch] = []
    if reference.grad_results is not None or got.grad_results is not None:
        mismatches += compare_tensor_lists(
            reference.grad_results or [], got.grad_results or [], lambda i: f"grad result {i}", tol, "grad result count"
        )
    mismatches += compare_tensor_lists(
        reference.leaf_grads, got.leaf_grads, lambda i: f"leaf {i} .grad", tol, "leaf count"
    )
    mismatches += compare_trace(reference.trace, got.trace, tol, python_float_tolerance(subject.backend, device.type))
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
    for device in device_list:
        reference = execute(EagerSubject(), program, device, seed)
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
    report.notes = _capture_notes(report.outcomes)
    return report
