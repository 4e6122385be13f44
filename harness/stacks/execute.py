"""One run of one stack under one subject in this process (one rank)."""

from __future__ import annotations

import time

import torch

from harness.devices import seeded, synchronize
from harness.outcome import ErrorInfo
from harness.stacks.outcome import RankRun, StackRun
from harness.stacks.stack import Stack, StackContext
from harness.subjects import Subject, counter_deltas


def execute(
    stack: Stack, subject: Subject, device: torch.device, seed: int = 0, rank: int = 0, world_size: int = 1
) -> StackRun:
    """Resets the subject, runs ``stack.fn`` with a fresh
    :class:`StackContext` under ``torch.manual_seed(seed)`` (the caller's RNG
    state restored afterwards) and returns what it recorded, its exception
    reduced to text, and the subject's counter deltas. Never raises an
    ``Exception`` of the stack or engine; resets the subject again after
    the run so that nothing leaks into the next one.

    Returns:
        A :class:`StackRun` with one :class:`RankRun` (this rank's).
    """
    ctx = StackContext(device, subject, rank=rank, world_size=world_size)
    rank_run = RankRun()
    out = StackRun(ranks=[rank_run])
    start = time.perf_counter()
    before: dict = {}
    try:
        subject.reset()
        before = subject.counters()
        with seeded(device, seed):
            stack.fn(ctx)
            synchronize(device)
    except Exception as exc:  # noqa: BLE001 - reported, judged against eager's
        rank_run.error = ErrorInfo.from_exception(exc)
    finally:
        try:
            out.counts, out.fallback_reasons = counter_deltas(before, subject.counters())
        except Exception:  # noqa: BLE001 - a broken engine already shows as the error
            pass
        out.seconds = time.perf_counter() - start
        out.engine_entries = ctx.engine_entries
        rank_run.results = ctx.results
        try:
            subject.reset()
        except Exception:  # noqa: BLE001
            pass
    return out
