"""The suite: every selected stack under eager and every subject, judged."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from harness.stacks.distributed import DEFAULT_TIMEOUT_S, distributed_available, run_distributed
from harness.stacks.execute import execute
from harness.stacks.judge import judge
from harness.stacks.outcome import StackOutcome, StacksReport, StackStatus
from harness.stacks.stack import Stack
from harness.subjects import Subject, make_subject
from harness.tolerance import TolerancePolicy, tolerance_for

#: The subjects a suite run uses unless told otherwise: cagrad per backend,
#: and torch's own compiled autograd as a peer.
DEFAULT_SUBJECTS = ("cagrad[eager]", "cagrad[aot_eager]", "cagrad[inductor]", "torch_ca[eager]")


def resolve(subjects: Sequence[Subject | str] | None) -> list[Subject]:
    """Subject objects for names (``harness.subjects`` grammar) or objects;
    :data:`DEFAULT_SUBJECTS` when ``None``.

    Raises:
        ValueError: an unknown subject name.
    """
    return [make_subject(s) if isinstance(s, str) else s for s in (subjects or DEFAULT_SUBJECTS)]


def skip_reason(stack: Stack, device: torch.device) -> str | None:
    """Why ``stack`` cannot run on ``device`` here (``None``: it can)."""
    if stack.requires_cuda and device.type != "cuda":
        return stack.skip_reason or "needs CUDA"
    if stack.distributed:
        return distributed_available()
    return None


def run_stack(
    stack: Stack,
    subjects: Sequence[Subject],
    device: torch.device,
    *,
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT_S,
    policy: TolerancePolicy = tolerance_for,
) -> list[StackOutcome]:
    """One stack under eager and each subject; one outcome per subject.

    Every subject's ``prepare`` runs before eager's reference (``import
    cagrad`` must precede the models it hooks). Distributed stacks run in
    spawned ranks (:func:`~harness.stacks.distributed.run_distributed`,
    ``timeout`` seconds per run).
    """
    reason = skip_reason(stack, device)
    if reason is not None:
        return [
            StackOutcome(stack.name, s.name, str(device), StackStatus.SKIPPED, skip_reason=reason, peer=s.peer)
            for s in subjects
        ]
    if stack.distributed:
        reference, runs = run_distributed(stack, subjects, device, seed, timeout)
    else:
        for s in subjects:
            s.prepare()
        reference = execute(stack, _eager(), device, seed)
        runs = [execute(stack, s, device, seed) for s in subjects]
    return [
        judge(stack.name, s, device, reference, got, policy, stack.compute_dtype, stack.expect_compiled)
        for s, got in zip(subjects, runs)
    ]


def run_stacks(
    stacks: Sequence[Stack],
    subjects: Sequence[Subject | str] | None = None,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT_S,
    policy: TolerancePolicy = tolerance_for,
    on_outcomes: Callable[[list[StackOutcome]], None] | None = None,
) -> StacksReport:
    """Runs each stack under eager and each subject on ``device``.

    Args:
        stacks: the stacks (see :func:`harness.stacks.registry.select`).
        subjects: names or objects; :data:`DEFAULT_SUBJECTS` when ``None``.
        device: ``"cpu"`` or ``"cuda"``.
        seed: the seed every run starts from.
        timeout: seconds each run of a distributed stack may take.
        policy: the tolerance policy (:func:`harness.tolerance.tolerance_for`).
        on_outcomes: called with each stack's outcomes as they are judged
            (progress output).

    Returns:
        A :class:`StacksReport`, stacks outer, subjects inner.

    Raises:
        ValueError: an unknown subject name, or CUDA asked for without CUDA.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch.cuda.is_available() is False")
    subject_list = resolve(subjects)
    report = StacksReport(device=str(dev), subjects=[s.name for s in subject_list])
    for stack in stacks:
        outcomes = run_stack(stack, subject_list, dev, seed=seed, timeout=timeout, policy=policy)
        report.outcomes.extend(outcomes)
        if on_outcomes is not None:
            on_outcomes(outcomes)
    return report


def _eager() -> Subject:
    return make_subject("eager")
