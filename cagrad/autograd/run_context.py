"""The backward cagrad runs in this thread, as torch's engine would describe it.

While torch's engine runs a backward, the thread has a current ``GraphTask``,
and three things read it from Python:

* ``Variable._execution_engine.queue_callback(cb)``: ``cb`` runs once after
  the whole backward, in queue order; a callback may queue more
  (``GraphTask::exec_post_processing`` in torch/csrc/autograd/engine.cpp).
  FSDP2, DDP's ``_DDPSink`` and comm hooks, and module trackers use it.
* ``torch._C._current_graph_task_id()``: an id per backward, ``-1`` outside
  one. Non-reentrant checkpointing keys its recomputation by it (one
  recompute per backward; selective checkpointing consumes each cached value
  once), ``register_multi_grad_hook`` counts per backward by it, and FSDP2
  asks it whether a backward is running.
* ``torch._C._will_engine_execute_node(node)``: whether the current backward
  runs ``node`` (``register_multi_grad_hook(mode="all")``).
* ``torch._C._autograd._get_current_graph_task_keep_graph()``: whether the
  backward keeps the graph (``retain_graph``); ``True`` outside one. An
  AOTAutograd backward compiled lazily while it runs reads it (saved tensors
  used once, donated buffers refused when the graph is kept).

A cagrad backward has no GraphTask of torch's, so this module answers them
for it: :class:`RunContext` is the backward cagrad runs in this thread, and
:func:`install` wraps the three ``torch._C`` functions to answer from it (and
from torch otherwise). ``queue_callback`` is answered by the engine object
(:class:`cagrad.engine.CagradEngine`), through :func:`queue`.

When cagrad hands a backward to torch's engine (a fallback, or a backward
started from a hook), or runs its graph inside a host GraphTask of torch's
(:mod:`cagrad.run.host`, for hooks registered from C++ that queue callbacks
from C++), torch's GraphTask is the current one for callbacks, as in eager.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_tls = threading.local()
# ids far above torch's own (a per-process counter from 0), so that a
# cagrad backward and an eager one never share one
_ids = itertools.count(1 << 48)
_ids_lock = threading.Lock()

# None where this torch lacks one ("graph_task_queries" in cagrad.internals:
# then install() is not called and every backward falls back)
_original_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_original_will_execute = getattr(torch._C, "_will_engine_execute_node", None)
_original_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


class RunContext:
    """One cagrad backward in progress in this thread.

    Attributes:
        id: what ``torch._C._current_graph_task_id()`` returns during it.
        task: the :class:`~cagrad.autograd.graph_task.GraphTask` once collected (None
            before), which answers ``_will_engine_execute_node``.
        callbacks: callbacks queued from its hooks, run by :meth:`drain`.
        delegated: > 0 while torch's engine runs a backward inside this one
            (a fallback, a reentrant backward): torch's GraphTask answers.
        hosted: True while the graph runs inside a host GraphTask of
            torch's: callbacks go to that GraphTask, as in eager.
        create_graph: the backward records a differentiable graph (its
            nodes run with grad mode on, as the engine runs them).
        keep_graph: the backward keeps the graph (``retain_graph``); True
            unless told, torch's answer outside a backward.
    """

    __slots__ = ("id", "task", "callbacks", "delegated", "hosted", "create_graph", "keep_graph")

    def __init__(self, create_graph: bool = False, keep_graph: bool = True) -> None:
        with _ids_lock:
            self.id = next(_ids)
        self.create_graph = create_graph
        self.keep_graph = keep_graph
        self.task: Any = None
        self.callbacks: list[Callable[[], Any]] = []
        self.delegated = 0
        self.hosted = False

    def drain(self) -> None:
        """Runs the queued callbacks in order, including those they queue.

        As in eager, an exception from a callback propagates and the
        callbacks after it do not run.
        """
        i = 0
        while i < len(self.callbacks):
            self.callbacks[i]()
            i += 1
        self.callbacks.clear()


class _GradMode:
    """``torch.set_grad_enabled(want)`` as a context manager that switches
    only where the mode differs (about 150 ns where torch's costs 550 ns:
    it runs twice on every cache hit)."""

    __slots__ = ("want", "prior")

    def __init__(self, want: bool) -> None:
        self.want = want
        self.prior = want

    def __enter__(self) -> None:
        self.prior = torch.is_grad_enabled()
        if self.prior != self.want:
            torch._C._set_grad_enabled(self.want)

    def __exit__(self, *exc: Any) -> None:
        if self.prior != self.want:
            torch._C._set_grad_enabled(self.prior)


def grad_mode() -> _GradMode:
    """The grad mode the engine runs nodes in: on for ``create_graph=True``
    (the backward's own computation is recorded, for double backward), off
    otherwise. A context manager (restores the mode it found on exit)."""
    ctx = getattr(_tls, "ctx", None)
    return _GradMode(ctx is not None and ctx.create_graph)


def create_graph() -> bool:
    """Whether this thread's cagrad backward runs with ``create_graph=True``."""
    ctx = getattr(_tls, "ctx", None)
    return ctx is not None and ctx.create_graph


def current() -> RunContext | None:
    """The cagrad backward that torch's queries are about in this thread, or
    None (no cagrad backward, or torch's engine runs one inside it)."""
    ctx = getattr(_tls, "ctx", None)
    if ctx is None or ctx.delegated:
        return None
    return ctx


@contextlib.contextmanager
def running(ctx: RunContext) -> Iterator[RunContext]:
    """Makes ``ctx`` this thread's current backward for the block."""
    prior = enter(ctx)
    try:
        yield ctx
    finally:
        leave(prior)


def enter(ctx: RunContext) -> RunContext | None:
    """Makes ``ctx`` this thread's current backward; returns the one it
    replaces, for :func:`leave` (what :func:`running` does, without a
    generator's cost: the engine calls it on every backward)."""
    prior = getattr(_tls, "ctx", None)
    _tls.ctx = ctx
    return prior


def leave(prior: RunContext | None) -> None:
    """Restores the current backward :func:`enter` replaced."""
    _tls.ctx = prior


@contextlib.contextmanager
def delegated() -> Iterator[None]:
    """Torch's engine runs a backward in this block: its GraphTask answers."""
    ctx = getattr(_tls, "ctx", None)
    if ctx is None:
        yield
        return
    ctx.delegated += 1
    try:
        yield
    finally:
        ctx.delegated -= 1


@contextlib.contextmanager
def custom_backward(node: Any = None) -> Iterator[None]:
    """A custom Function's own backward runs in this block (cagrad calls it
    as ``PyNode::apply`` does); ``node`` is its ctx (the
    ``BackwardCFunction``), which :func:`running_custom` names. A backward
    it starts (a reentrant ``torch.utils.checkpoint`` recomputes its region
    and calls ``torch.autograd.backward`` on it) is a backward of the
    user's, which ``cagrad.engine`` runs through cagrad like the outer one."""
    depth = getattr(_tls, "custom_depth", 0)
    nodes = getattr(_tls, "custom_nodes", None)
    if nodes is None:
        nodes = _tls.custom_nodes = []
    _tls.custom_depth = depth + 1
    nodes.append(node)
    try:
        yield
    finally:
        nodes.pop()
        _tls.custom_depth = depth


def running_custom(node: Any) -> bool:
    """Whether ``node``'s backward is the innermost one cagrad runs in this
    thread (:func:`custom_backward`), not one torch's engine runs."""
    nodes = getattr(_tls, "custom_nodes", None)
    return bool(nodes) and nodes[-1] is node


def in_custom_backward() -> bool:
    """Whether this thread is inside :func:`custom_backward`."""
    return getattr(_tls, "custom_depth", 0) > 0


def queue(callback: Callable[[], Any]) -> bool:
    """Queues ``callback`` on this thread's cagrad backward.

    Returns:
        False when no cagrad backward owns callbacks here (none runs, torch's
        engine runs one inside it, or it is hosted): the caller hands the
        callback to torch's engine, which raises its own error outside a
        backward.
    """
    ctx = current()
    if ctx is None or ctx.hosted:
        return False
    ctx.callbacks.append(callback)
    return True


def _current_graph_task_id() -> int:
    ctx = current()
    if ctx is None or ctx.hosted:
        return _original_graph_task_id()
    return ctx.id


def _will_engine_execute_node(node: Any) -> bool:
    ctx = current()
    if ctx is None or ctx.task is None:
        return _original_will_execute(node)
    if not hasattr(node, "next_functions"):
        raise TypeError(
            "_will_engine_execute_node expects an grad_fn, "
            f"but got {type(node).__name__}"
        )
    return ctx.task.will_execute(node)


def _get_current_graph_task_keep_graph() -> bool:
    ctx = current()
    if ctx is None:
        return _original_keep_graph()
    return ctx.keep_graph  # hosted too: the host GraphTask keeps nothing


_current_graph_task_id.__doc__ = _original_graph_task_id.__doc__
_get_current_graph_task_keep_graph.__doc__ = _original_keep_graph.__doc__
_will_engine_execute_node.__doc__ = _original_will_execute.__doc__
# out of Dynamo's sight, as torch's own functions are (see
# cagrad.autograd.saved_variables: checkpoint's unpack hook calls them)
_current_graph_task_id = torch.compiler.disable(_current_graph_task_id)
_will_engine_execute_node = torch.compiler.disable(_will_engine_execute_node)
_get_current_graph_task_keep_graph = torch.compiler.disable(_get_current_graph_task_keep_graph)


def install() -> None:
    """Wraps ``torch._C._current_graph_task_id``,
    ``torch._C._will_engine_execute_node`` and
    ``torch._C._autograd._get_current_graph_task_keep_graph`` (callers look
    them up at call time, as ``torch.autograd.graph``,
    ``torch.utils.checkpoint`` and AOTAutograd's runtime wrappers do)."""
    torch._C._current_graph_task_id = _current_graph_task_id
    torch._C._will_engine_execute_node = _will_engine_execute_node
    torch._C._autograd._get_current_graph_task_keep_graph = _get_current_graph_task_keep_graph
