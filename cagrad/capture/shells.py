"""Lifted tensors as metadata alone, for a trace after the run freed them.

A segmented backward frees each lifted tensor after its last reader, as
eager frees a node's saved tensors once it ran. When the first run of a
fresh capture fails a check (an opaque call returned a gradient in another
layout, or None, where the trace assumed otherwise), cagrad traces the
backward again at its end, assuming what the run saw, so that the next
backward hits (:func:`cagrad.compiled_backward.run`). That trace needs only
what a fake tensor is made of: a :class:`LiftedShell` per lifted tensor,
taken before the run, keeps it without keeping the memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LiftedShell:
    """The metadata of a strided tensor that a trace makes its fake from.

    Attributes:
        shape: sizes (ints), ``strides``: strides (ints, elements),
        offset: storage offset (elements), dtype, device, requires_grad:
        as the tensor's.
    """

    __slots__ = ("shape", "strides", "offset", "dtype", "device", "requires_grad")
    layout = torch.strided

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(t.shape)
        self.strides = tuple(t.stride())
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.device = t.device
        self.requires_grad = t.requires_grad

    def dim(self) -> int:
        return len(self.shape)

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def storage_offset(self) -> int:
        return self.offset

    def is_conj(self) -> bool:
        return False

    def is_neg(self) -> bool:
        return False


def shells(tensors: Sequence[torch.Tensor]) -> list[LiftedShell] | None:
    """One :class:`LiftedShell` per tensor, or None where a tensor is not a
    plain strided one without conjugate or negative bit (its fake needs the
    tensor itself: ``FakeTensorMode.from_tensor``)."""
    out = []
    for t in tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return None
        if t.layout is not torch.strided or t.is_conj() or t.is_neg():
            return None
        out.append(LiftedShell(t))
    return out
