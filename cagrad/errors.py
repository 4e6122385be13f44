"""Exceptions that steer a backward pass between cagrad and eager autograd."""

from __future__ import annotations


class Unsupported(Exception):
    """cagrad cannot compile this backward; eager autograd must run it.

    Raised anywhere while a backward is collected or traced. The engine
    catches it, counts ``reason`` in ``cagrad.counters["fallback_reasons"]``,
    logs ``detail`` and runs the whole backward with eager autograd, so the
    gradients are eager's own.

    Args:
        reason: a short, stable slug (``"create_graph"``,
            ``"custom_function"``, ``"hidden_state:CatBackward0"``, ...); it
            is the counter key, so keep it free of addresses and sizes.
        detail: a sentence for the log that names the node, attribute or
            tensor involved.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class NodeTraceFailed(Unsupported):
    """One node could not be traced; it can run as it is instead.

    Attributes:
        pos: the node's position in the run order; the backward is traced
            again with that node as an opaque call (see
            :mod:`cagrad.compiled_backward`).
    """

    def __init__(self, reason: str, detail: str, pos: int) -> None:
        super().__init__(reason, detail)
        self.pos = pos


class EagerError(Exception):
    """Eager autograd would raise here; let eager run and raise it itself.

    Carries the error that cagrad's collection phase met (a modified saved
    tensor, a graph freed by an earlier backward, ...). The engine hands the
    backward to eager autograd, which raises the same exception with eager's
    own message at the point eager would, so error parity holds by
    construction.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause
