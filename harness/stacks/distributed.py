"""Runs a distributed stack: ``world_size`` spawned ranks on 127.0.0.1,
each running eager's reference and then every subject, in one process group
per spawn.

Process group: NCCL with one GPU per rank when the device is CUDA and the
machine has a GPU for every rank, else gloo on the CPU, joined through
rank 0's ``TCPStore`` on a port the kernel picks (:func:`rendezvous`).
Ranks report each run through a queue as it finishes (values serialized with ``torch.save``, tensors moved
to the CPU). A rank stops after a run that raised; the parent then waits a
short grace for the other ranks, kills what is left, and spawns anew for the
runs not done yet. Bounded time: every run must report within ``timeout``
seconds of the previous report (the first of each spawn gets
:data:`STARTUP_S` more), else the ranks are killed and the ranks that did
not report get a ``TimeoutError``; a spawn that raised everywhere takes a
grace of :data:`GRACE_S`. So a stack ends within about
``(subjects + 1) * (timeout + STARTUP_S + GRACE_S)`` seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import os
import queue as queue_module
import time
from collections.abc import Sequence
from typing import Any

import torch

from harness.outcome import ErrorInfo
from harness.stacks.outcome import RankRun, StackRun
from harness.stacks.stack import Stack
from harness.subjects import EagerSubject, Subject

#: Default seconds each run of a distributed stack may take (start-up
#: included for the first).
DEFAULT_TIMEOUT_S = 120.0
#: Seconds the first run of each spawn gets on top of ``timeout``, for
#: starting the ranks (importing torch) and joining the process group.
STARTUP_S = 60.0
#: Seconds the parent still waits for the other ranks once one rank raised.
GRACE_S = 15.0


def rendezvous(rank: int, world: int, ports: Any, timeout: datetime.timedelta) -> Any:
    """The process group's ``TCPStore`` on 127.0.0.1, made without a race on
    its port: rank 0's store binds port 0 (the kernel picks a free one) and
    hands the port to the other ranks through ``ports`` (a multiprocessing
    queue), once per rank. A port picked by the parent and bound later by
    rank 0 could be taken in between by another test's ranks, which the
    suite's parallel workers (pytest-xdist) make possible.

    Raises:
        queue.Empty: rank 0 did not hand out its port within ``timeout``.
    """
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        for _ in range(world - 1):
            ports.put(store.port)
    else:
        port = ports.get(timeout=timeout.total_seconds())
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)  # for code that reads it; the group uses the store
    return store


def process_group_backend(device: torch.device, world_size: int) -> tuple[str, str]:
    """``("nccl", "cuda")`` when ``device`` is CUDA and every rank has a
    GPU, else ``("gloo", "cpu")``."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl", "cuda"
    return "gloo", "cpu"


def distributed_available() -> str | None:
    """``None`` when gloo process groups can run here, else why not."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this build"
    return None


def run_distributed(
    stack: Stack,
    subjects: Sequence[Subject],
    device: torch.device,
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> tuple[StackRun, list[StackRun]]:
    """Runs ``stack`` on ``stack.world_size`` ranks: eager's reference, then
    each subject.

    Returns:
        ``(reference, runs)``: one :class:`StackRun` per subject, each with
        one :class:`RankRun` per rank; counters are rank 0's, except
        ``fallbacks`` and the fallback reasons: summed over the ranks. A rank that
        did not report in time, or died, has a ``TimeoutError`` /
        ``ProcessDied`` error.
    """
    import torch.multiprocessing as mp

    steps: list[Subject] = [EagerSubject(), *subjects]
    world = stack.world_size
    pg_backend, device_type = process_group_backend(device, world)
    done: dict[int, StackRun] = {}
    pending = list(range(len(steps)))
    spawn = mp.get_context("spawn")
    while pending:
        results, ports = spawn.Queue(), spawn.Queue()
        todo = [(i, steps[i]) for i in pending]
        args = (world, ports, pg_backend, device_type, stack.name, stack.fn.__module__, todo, seed, timeout, results)
        procs = [
            spawn.Process(target=rank_main, args=(rank, *args), daemon=True, name=f"{stack.name}-rank{rank}")
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        try:
            finished = _collect(procs, results, pending, world, timeout, done)
        finally:
            _end(procs)
            results.close()
            ports.close()
        pending = pending[finished:]
    return done[0], [done[i] for i in range(1, len(steps))]


def _collect(
    procs: list, results: Any, pending: list[int], world: int, timeout: float, done: dict[int, StackRun]
) -> int:
    """Gathers the reports of ``pending`` runs from one spawn into ``done``;
    returns how many of ``pending`` were settled (the runs after a failed one
    are not, and go to the next spawn)."""
    inbox: dict[int, dict[int, dict]] = {}  # run index -> rank -> report
    for k, idx in enumerate(pending):
        got = inbox.setdefault(idx, {})
        started = time.monotonic()
        deadline = started + timeout + (STARTUP_S if k == 0 else 0.0)
        while len(got) < world and time.monotonic() < deadline:
            try:
                kind, rank, step, payload = results.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
                data = decode(payload)
            except queue_module.Empty:
                if any(not p.is_alive() and r not in got for r, p in enumerate(procs)):
                    deadline = min(deadline, time.monotonic() + 2.0)  # drain what a dead rank sent
                continue
            except Exception:  # noqa: BLE001 - a rank killed mid-message: treated as silent
                continue
            if kind == "fatal":  # a rank could not start: every pending run fails on it
                error = dataclasses.replace(data, message=f"rank {rank} failed to start: {data.message}")
                for later in pending[k:]:
                    done[later] = StackRun(ranks=[RankRun(error=error) for _ in range(world)])
                return len(pending)
            inbox.setdefault(step, {})[rank] = data
            if step == idx and data["error"] is not None:
                deadline = min(deadline, time.monotonic() + GRACE_S)
        waited = time.monotonic() - started
        ranks = []
        for r, p in enumerate(procs):
            if r in got:
                ranks.append(RankRun(results=got[r]["results"], error=got[r]["error"]))
            elif p.is_alive():
                message = f"did not report within {waited:.0f} s; killed"
                ranks.append(RankRun(error=ErrorInfo("TimeoutError", message, "")))
            else:
                message = f"exited with code {p.exitcode} without reporting"
                ranks.append(RankRun(error=ErrorInfo("ProcessDied", message, "")))
        zero = got.get(0, {})
        counts = dict(zero.get("counts", {}))
        reasons: dict[str, int] = {}
        for report in got.values():  # a fallback on any rank counts
            for reason, n in report.get("fallback_reasons", {}).items():
                reasons[reason] = reasons.get(reason, 0) + n
        if "fallbacks" in counts:
            counts["fallbacks"] = sum(r.get("counts", {}).get("fallbacks", 0) for r in got.values())
        done[idx] = StackRun(
            ranks=ranks,
            counts=counts,
            fallback_reasons=reasons,
            engine_entries=zero.get("engine_entries", 0),
            seconds=zero.get("seconds", 0.0),
        )
        if any(r.error is not None for r in ranks):
            return k + 1
    return len(pending)


def _end(procs: list) -> None:
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def encode(value: Any) -> bytes:
    """``torch.save`` of ``value`` (tensors moved to the CPU first)."""
    buf = io.BytesIO()
    torch.save(_to_cpu(value), buf)
    return buf.getvalue()


def decode(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def rank_main(
    rank: int,
    world: int,
    ports: Any,
    pg_backend: str,
    device_type: str,
    stack_name: str,
    stack_module: str,
    steps: list[tuple[int, Subject]],
    seed: int,
    timeout: float,
    results: Any,
) -> None:
    """The body of one spawned rank: joins the process group, prepares every
    subject (``import cagrad`` before any model is built), then runs each
    step (eager's reference or a subject) and reports it; stops after a step
    that raised."""
    import torch.distributed as dist

    from harness.stacks import registry
    from harness.stacks.execute import execute

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(1)
            device = torch.device("cpu")
        try:
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = 1  # no compile worker pool per rank
        except Exception:  # noqa: BLE001
            pass
        wait = datetime.timedelta(seconds=max(timeout, 10.0))
        dist.init_process_group(pg_backend, store=rendezvous(rank, world, ports, wait), rank=rank, world_size=world, timeout=wait)
        for _, subject in steps:
            subject.prepare()
        stack = registry.get(stack_name, stack_module)
    except Exception as exc:  # noqa: BLE001
        results.put(("fatal", rank, None, encode(ErrorInfo.from_exception(exc))))
        return
    try:
        for idx, subject in steps:
            run = execute(stack, subject, device, seed, rank=rank, world_size=world)
            rank_run = run.ranks[0]
            payload = {
                "results": rank_run.results,
                "error": rank_run.error,
                "counts": run.counts,
                "fallback_reasons": run.fallback_reasons,
                "engine_entries": run.engine_entries,
                "seconds": run.seconds,
            }
            results.put(("run", rank, idx, encode(payload)))
            if rank_run.error is not None:
                break
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
