"""The suite: every selected row under eager and every subject, judged.

Each row runs eager first, then each subject, from the same seed, in one
process: this one (``isolate=False``), or a fresh spawned process per row
(``isolate=True``, the command line's default), so that a row sees a process
in which cagrad has not run yet (as a user's training script does), a crash
or hang of one row cannot take the others with it, and the memory a model
held is given back. With ``per_subject=True`` each (row, subject) gets its
own process (eager's reference runs again in each): then every subject, not
only the first, starts where cagrad has never run, so what cagrad does once
per process (its first backward) shows under each. Only outcomes (plain
data) cross the process boundary.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence

import torch

from harness.models.judge import judge
from harness.models.libraries import prepare_offline, prepare_torchvision, unavailable, versions
from harness.models.outcome import ModelsReport, RowOutcome, RowStatus
from harness.models.registry import get
from harness.models.row import ModelRow
from harness.models.train import train
from harness.outcome import ErrorInfo
from harness.subjects import Subject, make_subject
from harness.tolerance import TolerancePolicy, tolerance_for

#: The subjects a run uses unless told otherwise: cagrad per backend.
DEFAULT_SUBJECTS = ("cagrad[eager]", "cagrad[aot_eager]", "cagrad[inductor]")

#: Seconds one row (eager and every subject) may take in its own process.
DEFAULT_TIMEOUT_S = 1200.0


def resolve(subjects: Sequence[Subject | str] | None) -> list[Subject]:
    """Subject objects for names (:mod:`harness.subjects` grammar) or
    objects; :data:`DEFAULT_SUBJECTS` when ``None``.

    Raises:
        ValueError: an unknown subject name.
    """
    return [make_subject(s) if isinstance(s, str) else s for s in (subjects or DEFAULT_SUBJECTS)]


def _outcomes(
    row: ModelRow, subjects: Sequence[Subject], device: torch.device, status: RowStatus, **kw
) -> list[RowOutcome]:
    return [RowOutcome(row.name, row.library, s.name, str(device), status, peer=s.peer, **kw) for s in subjects]


def run_row(
    row: ModelRow,
    subjects: Sequence[Subject],
    device: torch.device,
    *,
    seed: int = 0,
    policy: TolerancePolicy = tolerance_for,
) -> list[RowOutcome]:
    """``row`` under eager and each subject in this process; one outcome per
    subject (``skipped`` for all when a library it needs is unavailable).

    Every subject's ``prepare`` runs before the libraries are imported and
    before eager's reference (``import cagrad`` must precede the models it
    hooks). Eager's results are kept; each subject's are judged and dropped.
    """
    for s in subjects:
        s.prepare()
    for library in row.libraries:
        reason = unavailable(library)
        if reason is not None:
            return _outcomes(row, subjects, device, RowStatus.SKIPPED, skip_reason=reason)
    reference = train(row, make_subject("eager"), device, seed)
    out = []
    for s in subjects:
        out.append(judge(row, s, device, reference, train(row, s, device, seed), policy))
    return out


def _child(name: str, module: str, subject_names: list[str], device: str, seed: int, conn) -> None:
    prepare_offline()
    try:
        outcomes = run_row(get(name, module), resolve(subject_names), torch.device(device), seed=seed)
        conn.send([o.to_json() for o in outcomes])
    except BaseException as exc:  # noqa: BLE001 - sent back as the row's error
        conn.send({"error": ErrorInfo.from_exception(exc).to_json()})
    finally:
        conn.close()


def run_row_isolated(
    row: ModelRow,
    subjects: Sequence[Subject],
    device: torch.device,
    *,
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[RowOutcome]:
    """:func:`run_row` in a fresh spawned process (default tolerance policy;
    subjects are passed by name). A process that dies, raises outside the
    row, or runs past ``timeout`` seconds (then killed) gives ``error`` for
    every subject."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_child,
        args=(row.name, row.build.__module__, [s.name for s in subjects], str(device), seed, child),
        daemon=True,
    )
    proc.start()
    child.close()
    data, timed_out = None, False
    try:
        if parent.poll(timeout):
            data = parent.recv()
        else:
            timed_out = True
    except EOFError:  # the process died without sending
        pass
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()
    if isinstance(data, list):
        return [RowOutcome.from_json(d) for d in data]
    if isinstance(data, dict):
        error = ErrorInfo(**data["error"])
    elif timed_out:
        error = ErrorInfo("Timeout", f"the row's process ran past {timeout:.0f} s and was killed", "")
    else:
        error = ErrorInfo("ProcessDied", f"the row's process exited with code {proc.exitcode} before reporting", "")
    return _outcomes(row, subjects, device, RowStatus.ERROR, error=error)


def run_models(
    rows: Sequence[ModelRow],
    subjects: Sequence[Subject | str] | None = None,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    isolate: bool = True,
    per_subject: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
    policy: TolerancePolicy = tolerance_for,
    on_outcomes: Callable[[list[RowOutcome]], None] | None = None,
) -> ModelsReport:
    """Runs each row under eager and each subject on ``device``.

    Args:
        rows: the rows (:func:`harness.models.registry.select`).
        subjects: names or objects; :data:`DEFAULT_SUBJECTS` when ``None``.
        device: ``"cpu"`` or ``"cuda"``.
        seed: the seed every run starts from.
        isolate: each row in its own spawned process (``policy`` is then
            the default one); ``False``: all in this process.
        per_subject: with ``isolate``, a process per (row, subject) instead.
        timeout: seconds an isolated row may take.
        policy: the tolerance policy (:func:`harness.tolerance.tolerance_for`).
        on_outcomes: called with each row's outcomes as they are judged.

    Returns:
        A :class:`ModelsReport`, rows outer, subjects inner.

    Raises:
        ValueError: an unknown subject name, CUDA asked for without CUDA, or
            a custom ``policy`` with ``isolate=True``.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch.cuda.is_available() is False")
    if isolate and policy is not tolerance_for:
        raise ValueError("a custom tolerance policy needs isolate=False (spawned rows use the default)")
    subject_list = resolve(subjects)
    prepare_offline()
    note = prepare_torchvision()
    report = ModelsReport(device=str(dev), subjects=[s.name for s in subject_list], versions=versions())
    if note:
        report.notes.append(note)
    for row in rows:
        if isolate and per_subject:
            outcomes = [o for s in subject_list for o in run_row_isolated(row, [s], dev, seed=seed, timeout=timeout)]
        elif isolate:
            outcomes = run_row_isolated(row, subject_list, dev, seed=seed, timeout=timeout)
        else:
            outcomes = run_row(row, subject_list, dev, seed=seed, policy=policy)
        report.outcomes.extend(outcomes)
        if on_outcomes is not None:
            on_outcomes(outcomes)
    return report
