"""Hooks registered from C++: the ones cagrad knows, and how it runs them.

A hook added from C++ (``Node::add_post_hook`` and friends) is in none of the
Python dicts :mod:`cagrad.hooks.hooks_census` reads, and no Python API lists it.
cagrad therefore watches the Python objects that register such hooks being
constructed, and runs their hooks itself, as opaque calls at the place eager
runs them.

Known today: DDP's ``torch.distributed.Reducer``. Its constructor adds to the
``AccumulateGrad`` of each parameter it reduces a post-hook that calls
``Reducer::autograd_hook(index)`` (``index``: the parameter's position in the
constructor's ``params``); the hook marks the gradient ready and launches its
bucket's allreduce, and the last one queues ``finalize_backward`` on the
current GraphTask from C++. In python-reducer mode
(``torch._dynamo.config.optimize_ddp = "python_reducer"`` when DDP is
constructed) DDP reduces in Python post-accumulate-grad hooks and never
prepares the C++ reducer for a backward, but the constructor adds these hooks
all the same (torch 2.13.0 and 2.14.1), and eager runs them (they update the
reducer's bookkeeping and return before marking anything ready). cagrad runs
them there too, as eager does (torch's compiled autograd leaves them out of
its graph); a torch that added none there would show fewer C++ hooks than
recorded, and the backward would fall back (``invisible_hooks``). cagrad puts a
subclass in ``torch.distributed.Reducer`` (what DDP constructs) that records
each parameter's ``(reducer, index)``, calls ``reducer._autograd_hook(index)``
after the parameter's ``AccumulateGrad`` and its post-accumulate-grad hooks,
and runs the graph inside a host GraphTask of torch's (:mod:`cagrad.run.host`) so
that the C++ callback has one to go to.

Limits (see docs/fallbacks.md): a Reducer constructed before
``import cagrad`` is found by scanning live ``DistributedDataParallel``
modules at import; hooks added from C++ by anything else are not run by
cagrad: they are detected (:mod:`cagrad.autograd._hook_counts`) and their backward
falls back to eager (``invisible_hooks``).
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from typing import Any

import torch

_lock = threading.Lock()
# id(param) -> (weakref to the param, [ReducerHook, ...])
_hooks: dict[int, tuple[weakref.ref, list[ReducerHook]]] = {}


#: DDP's Python post-accumulate-grad hook in python-reducer mode
#: (``DistributedDataParallel._register_accum_grad_hook``), by module and name
_DDP_PYTHON_HOOK = (
    "torch.nn.parallel.distributed",
    "DistributedDataParallel._register_accum_grad_hook.<locals>.compiled_accum_grad_hook",
)


def is_ddp_python_hook(hook: Any) -> bool:
    """Whether ``hook`` is the post-accumulate-grad hook DDP registers on a
    parameter in python-reducer mode: a ``functools.partial`` of
    ``compiled_accum_grad_hook`` with the parameter's index. It divides its
    own parameter's ``.grad`` by the world size, all-reduces it (or runs the
    module's comm hooks on it) and copies the result into that ``.grad``: it
    reads and writes no other tensor of the backward."""
    if type(hook) is not functools.partial:
        return False
    fn = hook.func
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == _DDP_PYTHON_HOOK


class ReducerHook:
    """The post-hook a DDP ``Reducer`` added to one parameter's AccumulateGrad.

    Calling it runs ``Reducer::autograd_hook(index)`` (through the binding
    ``Reducer._autograd_hook``), which needs a current GraphTask of torch's
    for the callback it may queue.
    """

    __slots__ = ("_reducer", "index", "__weakref__")

    def __init__(self, reducer: Any, index: int) -> None:
        try:
            self._reducer = weakref.ref(reducer)
        except TypeError:  # torch's own class (found by the scan at import)
            self._reducer = lambda: reducer
        self.index = index

    @property
    def alive(self) -> bool:
        r = self._reducer()
        return r is not None and not getattr(r, "_cagrad_hooks_removed", False)

    def __call__(self) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer._autograd_hook(self.index)


def _record(reducer: Any, params: Any) -> None:
    with _lock:
        for index, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                continue
            key = id(p)
            entry = _hooks.get(key)
            if entry is None or entry[0]() is not p:
                entry = _hooks[key] = (weakref.ref(p, lambda _, key=key: _forget(key)), [])
            entry[1].append(ReducerHook(reducer, index))


def _forget(key: int) -> None:
    with _lock:
        _hooks.pop(key, None)


def any_live() -> bool:
    """Whether some parameter has a known C++ hook (checked once per backward)."""
    return bool(_hooks)


def post_hooks_of(variable: torch.Tensor) -> tuple[ReducerHook, ...]:
    """The C++ post-hooks of ``variable``'s AccumulateGrad cagrad knows, in
    registration order (empty if none)."""
    entry = _hooks.get(id(variable))
    if entry is None or entry[0]() is not variable:
        return ()
    return tuple(h for h in entry[1] if h.alive)


def _reducer_class(base: type) -> type:
    class Reducer(base):  # type: ignore[misc, valid-type]
        __doc__ = base.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            params = kwargs["params"] if "params" in kwargs else args[0]
            # python-reducer mode included: its C++ hooks are added all the same
            _record(self, list(params))

        def _remove_autograd_hooks(self) -> None:
            super()._remove_autograd_hooks()
            self._cagrad_hooks_removed = True

    Reducer.__module__ = base.__module__
    Reducer.__qualname__ = base.__qualname__
    return Reducer


def install() -> None:
    """Puts the recording Reducer in ``torch.distributed`` and records the
    reducers of live DDP modules (constructed before cagrad was imported)."""
    try:
        import torch.distributed as dist
    except ImportError:  # a torch built without distributed
        return
    if not dist.is_available() or getattr(dist.Reducer, "_cagrad_recording", False):
        return
    cls = _reducer_class(dist.Reducer)
    cls._cagrad_recording = True
    dist.Reducer = cls
    _scan_live_ddp()


def _scan_live_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel

    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel):
            reducer = getattr(obj, "reducer", None)
            if reducer is None:
                continue
            try:
                params = obj._build_params_for_reducer()[0]
            except Exception:  # noqa: BLE001  (a DDP internals change: not seen)
                continue
            _record(reducer, params)
