"""Events other layers observe: a capture happened, compiled code is running.

Listeners are plain callables kept in module lists; they must not raise (an
exception from a listener propagates to the backward that emitted it).

* ``on_capture(info)``: after a backward was traced and handed to
  ``compiler_fn``; ``info`` is a :class:`CaptureEvent`.
* ``on_run(active)``: ``True`` right before cagrad runs a compiled backward
  (segments, opaque calls and the interpreter included) and ``False`` right
  after, also when it raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch


@dataclasses.dataclass
class CaptureEvent:
    """One capture.

    Attributes:
        graph_module: the captured backward graph.
        cache_keys: the node keys it was captured for.
        num_segments: compiled segments (1 for a graph without opaque calls).
        reason: why the cache missed (see :mod:`cagrad.explain`), or None.
        trace_s: seconds spent tracing the backward into the graph (the
            collection of keys before it not included).
        compile_s: seconds spent in ``compiler_fn`` (for a named backend the
            whole backend compile; through ``torch.compile`` only its
            wrapping, since Dynamo compiles on the first call).
    """

    graph_module: torch.fx.GraphModule
    cache_keys: list[Any]
    num_segments: int
    reason: Any = None
    trace_s: float = 0.0
    compile_s: float = 0.0


on_capture: list[Callable[[CaptureEvent], None]] = []
on_run: list[Callable[[bool], None]] = []


def emit_capture(event: CaptureEvent) -> None:
    for listener in list(on_capture):
        listener(event)


_NO_LISTENER = contextlib.nullcontext()


def running() -> contextlib.AbstractContextManager[None]:
    """Brackets the execution of compiled code with ``on_run`` calls; a
    reusable no-op where nothing listens (the common case, on every cache
    hit: no generator to create)."""
    if not on_run:
        return _NO_LISTENER
    return _running(list(on_run))


@contextlib.contextmanager
def _running(listeners: list[Callable[[bool], None]]) -> Iterator[None]:
    for listener in listeners:
        listener(True)
    try:
        yield
    finally:
        for listener in listeners:
            listener(False)
