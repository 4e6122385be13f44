"""Where cagrad plugs into torch: the autograd engine object.

Every Python entry point to a backward (``Tensor.backward``,
``torch.autograd.backward``, ``torch.autograd.grad``) ends in
``Variable._execution_engine.run_backward(...)`` (via
``torch.autograd.graph._engine_run_backward``), after torch's own argument
checks and gradient creation. While any ``cagrad.enable`` context is open
in any thread that attribute holds a :class:`CagradEngine`, which runs the
backwards of the threads inside a context through cagrad, and everything
else through torch's engine. Contexts belong to the thread that entered
them. Leaving the last one puts torch's engine back.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch.autograd.variable import Variable

from . import compiled_backward
from .autograd import run_context
from .keys.collection import BackwardCall
from .compile.backends import CompilerFn, resolve
from .compile.disk_cache import DiskCache, resolve_dir
from .keys.cache import CacheNode


@dataclasses.dataclass(eq=False)
class EnableState:
    """One active ``cagrad.enable`` context."""

    compiler_fn: CompilerFn
    dynamic: bool | None
    compile_graph: Callable[..., Any]
    cache: CacheNode
    cuda_graphs: bool = False  # mode="reduce-overhead" (cagrad.compile.cuda_graphs)
    disk: DiskCache | None = None  # cache_dir (cagrad.compile.disk_cache)


# guards the caches, the counters and the engine swap; a cagrad backward holds
# it while it runs, so backwards of several threads run one at a time
_lock = threading.RLock()
_caches: dict[tuple[Any, bool, bool], CacheNode] = {}
# per thread: ``stack`` (the thread's enable contexts), ``busy``
_tls = threading.local()
_open_contexts = 0  # in all threads; the engine is swapped in while > 0
# None where this torch has no such attribute ("execution_engine" in
# cagrad.internals: every backward is eager's then)
_eager_engine = getattr(Variable, "_execution_engine", None)


def _stack() -> list[EnableState]:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def cache_for(compiler_fn: CompilerFn, dynamic: bool | None, cuda_graphs: bool = False) -> CacheNode:
    """The trie root for one compiler (kept until ``cagrad.reset()``)."""
    with _lock:
        key = (compiler_fn, dynamic, cuda_graphs)
        root = _caches.get(key)
        if root is None:
            root = _caches[key] = CacheNode()
        return root


def clear_caches() -> None:
    with _lock:
        _caches.clear()


class CagradEngine:
    """Stands in for torch's ``ImperativeEngine`` while cagrad is enabled.

    ``run_backward`` takes the engine's arguments (tensors, grad_tensors,
    keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad) and
    returns what the engine returns (a tuple of gradients for
    ``autograd.grad``, else None). It runs the backward through cagrad only
    in a thread inside a ``cagrad.enable`` context; in every other thread
    (the object is process-wide, as torch's is) it is torch's engine.
    ``queue_callback`` queues on the cagrad backward running in this thread
    (see :mod:`cagrad.autograd.run_context`), else on torch's. Other attributes
    (``is_checkpoint_valid``, ...) are torch's engine's own.
    """

    def __init__(self, eager: Any) -> None:
        self._eager = eager

    def run_backward(
        self,
        tensors: Any,
        grad_tensors: Any,
        keep_graph: bool,
        create_graph: bool,
        inputs: Any = (),
        allow_unreachable: bool = False,
        accumulate_grad: bool = True,
    ) -> Any:
        call = BackwardCall(
            tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad
        )
        stack = getattr(_tls, "stack", None)
        state = stack[-1] if stack else None
        busy = getattr(_tls, "busy", False)
        if state is None or (busy and not run_context.in_custom_backward()) or _tracing():
            # no cagrad context in this thread; or a backward started while
            # cagrad compiles or runs one, or one that torch.compile's own
            # tracing runs (AOTAutograd's joint graph, under FakeTensors):
            # eager, uncounted (part of a compile or of a hook, not a user's
            # backward). One that a custom Function's backward starts while
            # cagrad runs it (a reentrant checkpoint's) is the user's: below
            return call.run_eager(self._eager)
        ctx = run_context.RunContext(create_graph=bool(create_graph), keep_graph=bool(keep_graph))
        with _lock:
            prior = run_context.enter(ctx)
            try:
                _tls.busy = True
                # the walk allocates many short-lived objects; a cyclic collection
                # in the middle of it would scan every live graph for nothing
                gc_was_enabled = gc.isenabled()
                gc.disable()
                try:
                    result = compiled_backward.run(
                        call,
                        state.cache,
                        state.compiler_fn,
                        state.compile_graph,
                        self._eager,
                        state.dynamic,
                        cuda_graphs=state.cuda_graphs,
                        disk=state.disk,
                    )
                finally:
                    _tls.busy = busy  # True again after a nested backward
                    if gc_was_enabled:
                        gc.enable()
                # eager runs the final callbacks after the whole backward, still
                # inside it (a callback may queue more, or ask for the task id)
                ctx.drain()
            finally:
                run_context.leave(prior)
        return result

    def queue_callback(self, callback: Callable[[], Any]) -> None:
        """``ImperativeEngine.queue_callback``: ``callback`` runs once after
        the current backward, in queue order.

        Raises:
            RuntimeError: torch's, outside a backward.
        """
        if not run_context.queue(callback):
            self._eager.queue_callback(callback)

    # Dynamo must not trace into cagrad: a backward inside a torch.compile'd
    # function graph-breaks here and runs as a plain Python call
    _dynamo_disable = getattr(torch._dynamo, "disable", None)
    if _dynamo_disable is not None:  # else torch.compile's tracing is still sent to eager by _tracing()
        run_backward = _dynamo_disable(run_backward, recursive=True)
    del _dynamo_disable

    def __getattr__(self, name: str) -> Any:
        return getattr(self._eager, name)


def _tracing() -> bool:
    """True while torch.compile traces (Dynamo, or AOTAutograd on FakeTensors)."""
    return torch.compiler.is_compiling() or (
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    )


_engine = CagradEngine(_eager_engine)


def push(compiler_fn: CompilerFn, dynamic: bool | None, cuda_graphs: bool = False, cache_dir: Any = None) -> EnableState:
    """Activates a compiler in this thread; installs the engine on the first
    context of any thread. ``cache_dir``: see :func:`cagrad.compile.disk_cache.resolve_dir`."""
    global _open_contexts
    directory = resolve_dir(cache_dir)
    state = EnableState(
        compiler_fn,
        dynamic,
        resolve(compiler_fn),
        cache_for(compiler_fn, dynamic, cuda_graphs),
        cuda_graphs,
        None if directory is None else DiskCache(directory),
    )
    with _lock:
        _stack().append(state)
        _open_contexts += 1
        if _eager_engine is not None:
            Variable._execution_engine = _engine
    return state


def pop(state: EnableState) -> None:
    """Deactivates ``state``; restores torch's engine after the last context
    of every thread.

    Raises:
        RuntimeError: if this thread's contexts are left out of order, or
            ``state`` was entered in another thread.
    """
    global _open_contexts
    stack = _stack()
    if not stack or stack[-1] is not state:
        raise RuntimeError(
            "cagrad.enable contexts must be exited in reverse order of entry, "
            "in the thread that entered them"
        )
    with _lock:
        stack.pop()
        _open_contexts -= 1
        if _open_contexts == 0 and _eager_engine is not None:
            Variable._execution_engine = _eager_engine


def active() -> bool:
    """Whether a cagrad context is open in this thread."""
    return bool(getattr(_tls, "stack", None))


def eager_engine() -> Any:
    return _eager_engine
