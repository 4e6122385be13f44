"""The benchmark workloads: each builds a model and returns a forward step.

A workload is ``build(device) -> Workload``; ``step()`` zeroes the
parameters' grads (set to None) and returns a scalar loss whose backward is
timed. Sizes follow issue 10's table: on CUDA the larger ones.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@dataclasses.dataclass
class Workload:
    """A model and its forward step.

    Attributes:
        model: the module (``torch.compile`` wraps it for that subject).
        step: ``step(model) -> loss`` (0-dim tensor).
        params: the tensors whose ``.grad`` the backward fills.
    """

    model: nn.Module
    step: Callable[[nn.Module], torch.Tensor]
    params: list[torch.Tensor]


def _module_workload(model: nn.Module, x: torch.Tensor) -> Workload:
    params = list(model.parameters())

    def step(m: nn.Module) -> torch.Tensor:
        for p in params:
            p.grad = None
        return m(x).float().square().mean()

    return Workload(model, step, params)


def mlp(device: str) -> Workload:
    width, batch = (1024, 256) if device == "cuda" else (256, 64)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return _module_workload(nn.Sequential(*layers).to(device), torch.randn(batch, width, device=device))


def _encoder(device: str, layers: int) -> Workload:
    d, batch, seq = (512, 16, 256) if device == "cuda" else (128, 8, 32)
    layer = nn.TransformerEncoderLayer(d, 8 if device == "cuda" else 4, 4 * d, dropout=0.0, batch_first=True)
    model = layer if layers == 1 else nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return _module_workload(model.to(device), torch.randn(batch, seq, d, device=device))


def _stack(layers: int) -> Callable[[str], Workload]:
    def build(device: str) -> Workload:
        return _encoder(device, layers)

    build.__name__ = f"transformer{layers}" if layers > 1 else "transformer"
    return build


def cnn(device: str) -> Workload:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )
    return _module_workload(model.to(device), torch.randn(16, 3, 32, 32, device=device))


def _recompute_addmm(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op == torch.ops.aten.addmm.default:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


class _Checkpointed(nn.Module):
    """Blocks, each under non-reentrant selective activation checkpointing
    that recomputes ``aten.addmm`` (``torch.utils.checkpoint``): the
    backward's AddmmBackward0 nodes read their saved tensors through
    checkpoint's hooks, so a compiled autograd runs them as they are."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(
                block, x, use_reentrant=False,
                context_fn=lambda: create_selective_checkpoint_contexts(_recompute_addmm),
            )  # fmt: skip
        return x


def checkpointed_mlp(device: str) -> Workload:
    """The MLP's four Linear + ReLU blocks, each checkpointed (:class:`_Checkpointed`)."""
    width, batch = (1024, 256) if device == "cuda" else (256, 64)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)]
    return _module_workload(_Checkpointed(blocks).to(device), torch.randn(batch, width, device=device))


def ddp_mlp(device: str) -> Workload:
    """A deeper MLP (8 Linear + ReLU blocks) under ``DistributedDataParallel``
    in a process group of one (gloo on CPU, NCCL on CUDA; started here on a
    free port of 127.0.0.1 unless one is running): the reducer's hooks on
    every weight's AccumulateGrad cut a compiled backward into segments, and
    each bucket's all-reduce runs from inside the backward."""
    model, x = _deep_mlp(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[torch.device(device).index or 0] if device == "cuda" else None)
    return _module_workload(ddp, x)


def fsdp2_mlp(device: str) -> Workload:
    """The 8-block MLP of :func:`ddp_mlp` under FSDP2 (``fully_shard`` on
    each Linear and on the root, a mesh of one rank): its hooks unshard each
    layer's parameters before the layer's backward, reshard them after, and
    reduce-scatter the gradients from inside the backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, x = _deep_mlp(device)
    mesh = init_device_mesh(torch.device(device).type, (1,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _module_workload(model, x)


def _deep_mlp(device: str) -> tuple[nn.Sequential, torch.Tensor]:
    """8 Linear + ReLU blocks and an input batch, in a process group of one
    (started here unless one is running)."""
    _one_process_group("nccl" if device == "cuda" else "gloo")
    width, batch = (1024, 256) if device == "cuda" else (256, 64)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).to(device), torch.randn(batch, width, device=device)


def _one_process_group(backend: str) -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


class _Chain(nn.Module):
    def __init__(self, width: int, n: int, device: str) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.randn(width, device=device))
        self.n = n

    def forward(self, _: torch.Tensor) -> torch.Tensor:
        z = self.x
        for i in range(self.n):
            z = z.sin() if i % 2 else z * 1.01
        return z


def _chain(n: int) -> Callable[[str], Workload]:
    def build(device: str) -> Workload:
        width = 4096 if device == "cuda" else 64
        return _module_workload(_Chain(width, n, device), torch.empty(0, device=device))

    build.__name__ = f"chain{n}"
    return build


WORKLOADS: dict[str, Callable[[str], Workload]] = {
    "mlp": mlp,
    "transformer": _stack(1),
    "transformer6": _stack(6),
    "chain200": _chain(200),
    "cnn": cnn,
}
# the first-backward growth series (issue 11): 1-8 layers, chains of 50-400
SERIES: dict[str, Callable[[str], Workload]] = {
    **{f"transformer{k}": _stack(k) for k in (2, 4, 8)},
    **{f"chain{n}": _chain(n) for n in (50, 100, 400)},
}
STEADY = list(WORKLOADS)  # the steady-state table's default rows
WORKLOADS.update(SERIES)
# more rows on request (--workloads): stacks whose backwards a compiled
# autograd runs segmented (nodes run as they are, DDP's reducer hooks)
WORKLOADS["checkpointed_mlp"] = checkpointed_mlp
WORKLOADS["ddp_mlp"] = ddp_mlp
WORKLOADS["fsdp2_mlp"] = fsdp2_mlp
FAMILIES = {"transformer": ["transformer", "transformer2", "transformer4", "transformer8"],
            "chain": ["chain50", "chain100", "chain200", "chain400"]}
