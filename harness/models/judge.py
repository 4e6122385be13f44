"""The compare layer: one subject's :class:`RowRun` against eager's, step by
step: recorded values under the per-dtype tolerance policy
(:func:`harness.stacks.judge.compare_results`, which applies
:mod:`harness.tolerance`), the global state field by field
(:meth:`harness.global_state.GlobalState.diff`), and the forwards' tensors
the run leaves alive (:func:`harness.lifetimes.compare_lifetimes`)."""

from __future__ import annotations

import re

import torch

from harness.lifetimes import compare_lifetimes
from harness.models.outcome import RowOutcome, RowStatus
from harness.models.row import ModelRow
from harness.models.train import RowRun
from harness.outcome import Mismatch
from harness.stacks.judge import compare_results
from harness.subjects import Subject
from harness.tolerance import TolerancePolicy, tolerance_for

_STEP = re.compile(r"^step(\d+)\.")


def _step(m: Mismatch) -> float:
    if m.where.startswith("end."):
        return float("inf")  # what the run left once it dropped everything
    match = _STEP.match(m.where)
    return int(match.group(1)) if match else -1


def state_mismatches(expected: RowRun, actual: RowRun) -> list[Mismatch]:
    """One :class:`Mismatch` per global-state field that differs after a
    step, named ``step<i>.state.<field>`` (steps both runs finished)."""
    out = []
    for step, (e, a) in enumerate(zip(expected.states, actual.states)):
        for d in e.diff(a):
            out.append(Mismatch(f"step{step}.state.{d.field}", f"eager left {d.expected!r}, the subject {d.actual!r}"))
    return out


def lifetime_mismatches(subject: Subject, expected: RowRun, actual: RowRun) -> list[Mismatch]:
    """:func:`harness.lifetimes.compare_lifetimes` after each backward and
    at the end, named ``step<i>.lifetime`` (``end.lifetime``); none for a
    peer (torch's compiled autograd keeps its last graph's inputs alive,
    :mod:`harness.lifetimes`)."""
    if subject.peer:
        return []
    out = []
    for (where, e), (_, a) in zip(expected.lifetimes, actual.lifetimes):
        out += compare_lifetimes(e, a, at=f"{where}.")
    return out


def judge(
    row: ModelRow,
    subject: Subject,
    device: torch.device,
    reference: RowRun,
    got: RowRun,
    policy: TolerancePolicy = tolerance_for,
) -> RowOutcome:
    """The outcome of ``got`` (the subject's run of ``row``) against
    ``reference`` (eager's), see :mod:`harness.models.outcome` for the
    statuses. Mismatches are listed in step order, values before the state
    within a step."""
    outcome = RowOutcome(
        row=row.name,
        library=row.library,
        subject=subject.name,
        device=str(device),
        status=RowStatus.MATCH,
        error=got.error,
        eager_error=reference.error,
        counts=dict(got.counts),
        fallback_reasons=dict(got.fallback_reasons),
        forced_opaque=dict(got.forced_opaque),
        opaque_nodes=dict(got.opaque_nodes),
        seconds=got.seconds,
        peer=subject.peer,
    )
    if reference.error is not None or got.error is not None:
        outcome.status = RowStatus.ERROR
        return outcome
    values = compare_results(
        reference.results, got.results, subject.backend, device.type, policy, compute_dtype=row.compute_dtype
    )
    mismatches = values + state_mismatches(reference, got) + lifetime_mismatches(subject, reference, got)
    outcome.mismatches = sorted(mismatches, key=_step)  # stable: values first within a step
    if outcome.mismatches:
        outcome.status = RowStatus.MISMATCH
    elif got.counts.get("fallbacks", 0) > 0:
        outcome.status = RowStatus.FELL_BACK
    return outcome
