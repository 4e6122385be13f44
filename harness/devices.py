"""Which devices the oracle runs on, and per-device RNG/synchronization helpers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

def available_devices() -> list[torch.device]:
    """``cpu`` always, then ``cuda`` (the current CUDA device) when
    ``torch.cuda.is_available()``."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return devices


def resolve_devices(devices: Sequence[str | torch.device] | str | torch.device | None) -> list[torch.device]:
    """Normalizes a device selection.

    Args:
        devices: ``None`` for :func:`available_devices`, or one or more device
            names/objects (``"cpu"``, ``"cuda"``, ``"cuda:1"``).

    Raises:
        ValueError: a CUDA device is asked for but CUDA is not available, or
            the list is empty.
    """
    if devices is None:
        return available_devices()
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    out: list[torch.device] = []
    for d in devices:
        dev = torch.device(d)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {dev} requested but torch.cuda.is_available() is False")
        if dev not in out:
            out.append(dev)
    if not out:
        raise ValueError("no device selected")
    return out


def synchronize(device: torch.device) -> None:
    """Waits for queued kernels so that asynchronous errors surface here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def seeded(device: torch.device, seed: int = 0) -> Iterator[None]:
    """Runs the body with ``torch.manual_seed(seed)`` and restores the caller's
    RNG state afterwards (CPU, and ``device`` when it is a CUDA device), so a
    program that draws random numbers without seeding still builds
    bit-identical leaves for every subject and the caller's RNG is untouched."""
    cuda_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices, device_type="cuda"):
        torch.manual_seed(seed)
        yield
