"""One run of one stack under one subject in this process (one rank).

The run of a single-process stack also records lifetimes
(:mod:`harness.lifetimes`) unless the subject is a peer or
``CAGRAD_FUZZ_LIFETIMES=0``: the stack runs inside a
:class:`~harness.lifetimes.ForwardStorages` mode, paused around each
backward and each recording (:meth:`StackContext.engine`), with Python's
cyclic collector paused, so that the storages noted are the ones the
stack's own code makes on the main thread (forwards, losses, optimizer
steps), labelled alike under every subject. A distributed rank records
none (see the comment in :func:`execute`). Which of them are alive is read after each backward and
once the stack has returned (everything it built dropped).
"""

from __future__ import annotations

import contextlib
import time

import torch

from harness import lifetimes
from harness.devices import seeded, synchronize
from harness.lifetimes import ForwardStorages, Lifetimes, after_release, collector_paused
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
    # one process only: a distributed rank's storages alive right after a
    # backward differ from run to run (ddp_no_sync: a forward's
    # aten.empty alive after rank 1's fourth backward under cagrad, in some
    # runs only), see docs/stacks.md
    noted = lifetimes.enabled() and not subject.peer and world_size == 1
    storages = ForwardStorages() if noted else None
    ctx = StackContext(device, subject, rank=rank, world_size=world_size, storages=storages)
    rank_run = RankRun()
    out = StackRun(ranks=[rank_run])
    start = time.perf_counter()
    before: dict = {}
    try:
        subject.reset()
        before = subject.counters()
        with seeded(device, seed), contextlib.ExitStack() as noting:
            if storages is not None:
                noting.enter_context(collector_paused())
                noting.enter_context(storages)
            stack.fn(ctx)
            synchronize(device)
        if storages is not None:
            held, leaked = after_release(storages)
            ctx.lifetimes.append(("end", Lifetimes(after_release=held, leaked=leaked)))
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
        rank_run.lifetimes = ctx.lifetimes
        try:
            subject.reset()
        except Exception:  # noqa: BLE001
            pass
    return out
