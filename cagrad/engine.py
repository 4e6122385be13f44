"""Where cagrad plugs into torch: the autograd engine object.

Every Python entry point to a backward (``Tensor.backward``,
``torch.autograd.backward``, ``torch.autograd.grad``) ends in
``Variable._execution_engine.run_backward(...)`` (via
``torch.autograd.graph._engine_run_backward``), after torch's own argument
checks and gradient creation. While any ``cagrad.enable`` context is active
that attribute holds a :class:`CagradEngine`, which runs the backward through
cagrad and forwards everything else to torch's engine. Leaving the last
context puts torch's engine back.
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
from .backends import CompilerFn, resolve
from .cache import CacheNode


@dataclasses.dataclass(eq=False)
class EnableState:
    """One active ``cagrad.enable`` context."""

    compiler_fn: CompilerFn
    dynamic: bool
    compile_graph: Callable[..., Any]
    cache: CacheNode


_lock = threading.RLock()
_stack: list[EnableState] = []
_caches: dict[tuple[Any, bool], CacheNode] = {}
_tls = threading.local()
_eager_engine = Variable._execution_engine


def cache_for(compiler_fn: CompilerFn, dynamic: bool) -> CacheNode:
    """The trie root for one compiler (kept until ``cagrad.reset()``)."""
    with _lock:
        key = (compiler_fn, dynamic)
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
    ``autograd.grad``, else None). Other attributes (``queue_callback``,
    ``is_checkpoint_valid``) are torch's engine's own.
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
        call = compiled_backward.BackwardCall(
            tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad
        )
        state = _stack[-1] if _stack else None
        if state is None or getattr(_tls, "busy", False) or _tracing():
            # a backward started while cagrad compiles or runs one, or one
            # that torch.compile's own tracing runs (AOTAutograd's joint
            # graph, under FakeTensors), goes to eager uncounted: it is part
            # of a compile, not a user's backward
            return call.run_eager(self._eager)
        with _lock:
            _tls.busy = True
            # the walk allocates many short-lived objects; a cyclic collection
            # in the middle of it would scan every live graph for nothing
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                return compiled_backward.run(
                    call, state.cache, state.compiler_fn, state.compile_graph, self._eager, state.dynamic
                )
            finally:
                _tls.busy = False
                if gc_was_enabled:
                    gc.enable()

    # Dynamo must not trace into cagrad: a backward inside a torch.compile'd
    # function graph-breaks here and runs as a plain Python call
    run_backward = torch._dynamo.disable(run_backward, recursive=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._eager, name)


def _tracing() -> bool:
    """True while torch.compile traces (Dynamo, or AOTAutograd on FakeTensors)."""
    return torch.compiler.is_compiling() or (
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    )


_engine = CagradEngine(_eager_engine)


def push(compiler_fn: CompilerFn, dynamic: bool) -> EnableState:
    """Activates a compiler; installs the engine on the first one."""
    state = EnableState(compiler_fn, dynamic, resolve(compiler_fn), cache_for(compiler_fn, dynamic))
    with _lock:
        _stack.append(state)
        Variable._execution_engine = _engine
    return state


def pop(state: EnableState) -> None:
    """Deactivates ``state``; restores torch's engine after the last one.

    Raises:
        RuntimeError: if contexts are left out of order.
    """
    with _lock:
        if not _stack or _stack[-1] is not state:
            raise RuntimeError("cagrad.enable contexts must be exited in reverse order of entry")
        _stack.pop()
        if not _stack:
            Variable._execution_engine = _eager_engine


def active() -> bool:
    return bool(_stack)


def eager_engine() -> Any:
    return _eager_engine

