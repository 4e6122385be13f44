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


class HookTraceFailed(Unsupported):
    """A tensor hook chosen for tracing did not trace, in a graph that
    accumulates its leaves after it runs (no opaque calls were expected).

    The backward is traced again with every hook opaque and leaves
    accumulated in order inside the graph (see
    :func:`cagrad.compile.variants.trace_with_retries`).
    """


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


class CacheFileError(RuntimeError):
    """A file of cagrad's disk cache (``enable(cache_dir=...)``) cannot be used.

    Raised by the backward that looked the file up, before anything ran: the
    file does not start with cagrad's magic line, its header is not cagrad's
    or names another format, torch, Python or cagrad version, its body is
    truncated or does not match its checksum, the key stored in it is not the
    key it was looked up for, or the graph in it cannot be rebuilt. cagrad
    never uses such a file, and never deletes or rewrites it by itself: remove
    it (or the whole cache directory) and the next backward traces and
    stores its graph again.

    Attributes:
        path: the file.
        problem: what is wrong with it.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(
            f"cagrad: cache file {path} cannot be used: {problem}. Delete it "
            "(cagrad traces the backward again and writes a new one)."
        )
        self.path = path
        self.problem = problem
