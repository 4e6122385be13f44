"""The per-rank body of tests/cagrad/test_distributed.py (spawned, gloo on
127.0.0.1). Each case trains the same small MLP from the same seed on
rank-specific data, once in eager and once under ``cagrad.enable``, and
reports the largest difference of any ``.grad`` and cagrad's counters."""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _ddp_steps(variant: str, use_cagrad: bool, backend: str, rank: int) -> list:
    import cagrad

    m = _mlp()
    if variant == "find_unused":
        m.add_module("unused", torch.nn.Linear(4, 4))  # never called
    with _optimize_ddp("python_reducer" if variant == "python_reducer" else None):
        ddp = torch.nn.parallel.DistributedDataParallel(
            m, static_graph=variant == "static_graph", find_unused_parameters=variant == "find_unused"
        )
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(3):
        x = torch.randn(5, 8, generator=g)
        accumulate = variant == "no_sync" and step < 2
        with contextlib.ExitStack() as stack:
            if use_cagrad:
                stack.enter_context(_group_bytes(_GROUP_BYTES.get(variant)))
                stack.enter_context(cagrad.enable(backend))
            if accumulate:
                stack.enter_context(ddp.no_sync())
            ddp(x).pow(2).sum().backward()
        out.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
        if not accumulate:
            for p in m.parameters():
                p.grad = None
    return out


# the accumulations' groups (cagrad.capture.leaf_hook_groups): the
# default (one group: the MLP's gradients are 3.5 KiB), two groups
# (b2, W2, b1 add up to 336 bytes), one segment per accumulation
_GROUP_BYTES = {"grouped": "300", "per_leaf": "0"}


@contextlib.contextmanager
def _optimize_ddp(mode: str | None):
    """``torch._dynamo.config.optimize_ddp`` set to ``mode`` while DDP is
    constructed (it reads the mode there; "python_reducer": the gradients
    are reduced by post-accumulate-grad hooks in Python, and the C++
    reducer's hooks, still added, return early)."""
    if mode is None:
        yield
        return
    import torch._dynamo

    before = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = mode
    try:
        yield
    finally:
        torch._dynamo.config.optimize_ddp = before


@contextlib.contextmanager
def _group_bytes(value: str | None):
    before = os.environ.get("CAGRAD_LEAF_HOOK_GROUP_BYTES")
    if value is not None:
        os.environ["CAGRAD_LEAF_HOOK_GROUP_BYTES"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CAGRAD_LEAF_HOOK_GROUP_BYTES", None)
        else:
            os.environ["CAGRAD_LEAF_HOOK_GROUP_BYTES"] = before


def _fsdp_steps(variant: str, use_cagrad: bool, backend: str, rank: int) -> list:
    import cagrad
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = _mlp()
    reshard = variant != "no_reshard"
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(3):
        x = torch.randn(5, 8, generator=g)
        if variant == "accumulate":
            m.set_requires_gradient_sync(step == 2)
        with cagrad.enable(backend) if use_cagrad else contextlib.nullcontext():
            m(x).pow(2).sum().backward()
        out.append([p.grad.full_tensor().clone() for p in m.parameters() if p.grad is not None])
        if variant != "accumulate":
            for p in m.parameters():
                p.grad = None
    return out


def _max_diff(a: list, b: list) -> float:
    worst = 0.0
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            if (x is None) != (y is None):
                return float("inf")
            if x is not None:
                worst = max(worst, float((x - y).abs().max()))
    return worst


def run(rank: int, world: int, ports: Any, cases: list[tuple[str, str, str]], results: Any) -> None:
    """Runs ``cases`` (``(stack, variant, backend)``) on this rank; puts
    ``(rank, {case: (max_diff, counters)})`` or ``(rank, error text)``.
    ``ports``: the queue rank 0 hands its store's port through
    (:func:`harness.stacks.distributed.rendezvous`)."""
    try:
        import cagrad
        from harness.stacks.distributed import rendezvous

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        wait = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", store=rendezvous(rank, world, ports, wait), rank=rank, world_size=world, timeout=wait)
        report = {}
        for stack, variant, backend in cases:
            steps = _ddp_steps if stack == "ddp" else _fsdp_steps
            expected = steps(variant, False, backend, rank)
            cagrad.reset()
            actual = steps(variant, True, backend, rank)
            counters = {k: v for k, v in cagrad.counters.items() if not isinstance(v, dict)}
            counters["fallback_reasons"] = dict(cagrad.counters["fallback_reasons"])
            report[f"{stack}:{variant}:{backend}"] = (_max_diff(expected, actual), counters)
        results.put((rank, report))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        import traceback

        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
