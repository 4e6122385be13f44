"""The compare layer: one subject's :class:`StackRun` against eager's, rank by
rank, value by value, under the per-dtype tolerance policy
(:mod:`harness.tolerance`, compared by :func:`harness.compare.compare_structure`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from harness.compare import compare_structure
from harness.lifetimes import compare_lifetimes
from harness.outcome import ErrorInfo, Mismatch
from harness.stacks.outcome import RankRun, StackOutcome, StackRun, StackStatus
from harness.subjects import Subject
from harness.tolerance import TolerancePolicy, python_float_tolerance, tolerance_for

_WORST = (StackStatus.ERROR, StackStatus.MISMATCH, StackStatus.MATCH)


def compare_results(
    expected: dict[str, Any],
    actual: dict[str, Any],
    backend: str | None,
    device_type: str,
    policy: TolerancePolicy = tolerance_for,
    prefix: str = "",
    compute_dtype: torch.dtype | None = None,
) -> list[Mismatch]:
    """Every difference between two recorded result dicts, in eager's order.

    A name eager recorded that the subject did not (or the reverse) is a
    mismatch at that name. Tensors are compared under
    ``policy(dtype, backend, device_type)`` (dense, sparse and DTensor-local
    alike; layout must match), Python floats under the float32 policy, other
    values with ``==``. ``prefix`` is prepended to every ``where``. With
    ``compute_dtype`` (:attr:`Stack.compute_dtype`) floating tensors are
    judged with that dtype's tolerance.
    """

    def tol(dtype: torch.dtype):
        if compute_dtype is not None and dtype.is_floating_point:
            dtype = compute_dtype
        return policy(dtype, backend, device_type)

    floats = python_float_tolerance(backend, device_type)
    out: list[Mismatch] = []
    for name, value in expected.items():
        if name not in actual:
            out.append(Mismatch(prefix + name, "recorded by eager, not by the subject"))
            continue
        out.extend(compare_structure(value, actual[name], prefix + name, tol, floats))
    for name in actual:
        if name not in expected:
            out.append(Mismatch(prefix + name, "recorded by the subject, not by eager"))
    return out


def judge_rank(
    expected: RankRun,
    actual: RankRun,
    backend: str | None,
    device_type: str,
    policy: TolerancePolicy,
    prefix: str,
    compute_dtype: torch.dtype | None = None,
) -> tuple[StackStatus, list[Mismatch]]:
    """One rank's status: eager raised -> the same exception type is a match,
    another type an error, success a mismatch at ``"exception"``; the subject
    raised alone -> error; else a mismatch when any value differs, or when
    the stack's storages alive after a backward or at the end differ from
    eager's (:func:`harness.lifetimes.compare_lifetimes`, at
    ``backward<k>.lifetime`` and ``end.lifetime``; only where both runs
    recorded them)."""
    if expected.error is not None:
        if actual.error is None:
            return StackStatus.MISMATCH, [
                Mismatch(prefix + "exception", f"eager raised {expected.error.short()}; the subject succeeded")
            ]
        same = actual.error.type == expected.error.type
        return (StackStatus.MATCH if same else StackStatus.ERROR), []
    if actual.error is not None:
        return StackStatus.ERROR, []
    mismatches = compare_results(expected.results, actual.results, backend, device_type, policy, prefix, compute_dtype)
    for (where, want), (_, got) in zip(expected.lifetimes, actual.lifetimes):
        mismatches += compare_lifetimes(want, got, at=f"{prefix}{where}.")
    return (StackStatus.MISMATCH if mismatches else StackStatus.MATCH), mismatches


def judge(
    stack: str,
    subject: Subject,
    device: torch.device,
    reference: StackRun,
    got: StackRun,
    policy: TolerancePolicy = tolerance_for,
    compute_dtype: torch.dtype | None = None,
    expect_compiled: bool = True,
) -> StackOutcome:
    """The outcome of ``got`` (the subject's run) against ``reference``.

    Ranks are judged one by one (:func:`judge_rank`; mismatch names are
    prefixed ``rank<r>/`` when there are several) and the worst status wins
    (error, then mismatch, then match). A compiled subject (one with a
    ``backend``) whose run never entered :meth:`StackContext.engine` is an
    error: the stack did not exercise it. A match whose run counted
    ``fallbacks`` is ``fell_back`` when ``expect_compiled``
    (:attr:`Stack.expect_compiled`). Counters are the subject's.
    ``compute_dtype``: see :func:`compare_results`.
    """
    outcome = StackOutcome(
        stack=stack,
        subject=subject.name,
        device=str(device),
        status=StackStatus.MATCH,
        counts=dict(got.counts),
        fallback_reasons=dict(got.fallback_reasons),
        seconds=got.seconds,
        eager_error=_with_rank(reference),
        error=_with_rank(got),
        peer=subject.peer,
    )
    if len(got.ranks) != len(reference.ranks):
        outcome.status = StackStatus.ERROR
        outcome.error = outcome.error or ErrorInfo(
            "RankCountError", f"eager ran {len(reference.ranks)} ranks, the subject {len(got.ranks)}", ""
        )
        return outcome
    statuses = []
    many = len(reference.ranks) > 1
    for r, (e, a) in enumerate(zip(reference.ranks, got.ranks)):
        prefix = f"rank{r}/" if many else ""
        status, mismatches = judge_rank(e, a, subject.backend, device.type, policy, prefix, compute_dtype)
        statuses.append(status)
        outcome.mismatches.extend(mismatches)
    outcome.status = min(statuses, key=_WORST.index) if statuses else StackStatus.MATCH
    if subject.backend is not None and got.engine_entries == 0 and got.error is None:
        outcome.status = StackStatus.ERROR
        outcome.error = ErrorInfo("EngineNotEntered", "the stack never entered the subject's engine (ctx.engine())", "")
    if outcome.status is StackStatus.MATCH and expect_compiled and got.counts.get("fallbacks", 0) > 0:
        outcome.status = StackStatus.FELL_BACK
    return outcome


def _with_rank(run: StackRun) -> ErrorInfo | None:
    """The first rank's error, its message prefixed ``rank <r>:`` when the
    run has several ranks."""
    for r, rank in enumerate(run.ranks):
        if rank.error is not None:
            if len(run.ranks) == 1:
                return rank.error
            return dataclasses.replace(rank.error, message=f"rank {r}: {rank.error.message}")
    return None
