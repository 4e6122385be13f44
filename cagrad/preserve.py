"""The process state cagrad's own work leaves as it found it.

Eager autograd runs no compiler and no self-test, so nothing those do may
show after a backward: not a draw from a random generator (a seeded training
loop with dropout would take another stream), nor a flag or a config value.
:func:`preserved` saves that state around cagrad's internal work (backend
compiles, the native extension's self-tests) and puts back whatever changed.
It is never put around code of the user's (hooks, saved-tensor hooks,
custom Functions): what those change must show as it does in eager.

What is saved (the fields torch's own ``torch._dynamo.convert_frame.
preserve_global_state`` restores around a Dynamo compile, and more): the CPU
generator; the generator of every CUDA device, where CUDA is initialized;
Python's ``random``; grad mode; the default dtype; the deterministic
algorithms setting and its ``warn_only``; the intra-op thread count;
anomaly mode and its ``check_nan``; autocast (enabled and dtype, CPU and
CUDA) and its cache; ``torch.get_float32_matmul_precision()``; and the
Dynamo, inductor and functorch configs where they are imported. A value put
back is set only where it changed.

CUDA left as it was: on a machine with a GPU, a CPU program's compile would
create a CUDA context that eager never creates; :func:`preserved` runs its
body inside :func:`cagrad.lazy_cuda.cuda_left_uninitialized`, which answers
torch's questions to the GPU as a host without CUDA would while CUDA is not
initialized.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from .lazy_cuda import cuda_left_uninitialized

__all__ = ["preserved"]

#: config modules restored where already imported (never imported here)
_CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
_AUTOCAST_DEVICES = ("cpu", "cuda")


def _cuda_states() -> list[torch.Tensor] | None:
    # reading CUDA's generators would initialize CUDA, itself a change
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.get_rng_state_all()


def _autocast() -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES]


#: the value types torch's config export hands out as they are (it deep-copies the rest)
_SHARED_SET = frozenset({int, float, bool, type(None), str, tuple})
#: items ``copy.deepcopy`` returns as they are (a container of only these
#: needs no more than a shallow copy)
_ATOMIC = frozenset({int, float, bool, type(None), str, type, types.FunctionType, types.BuiltinFunctionType})


def _copy(value: Any) -> Any:
    """``copy.deepcopy(value)``, as a shallow copy where that is the same
    (a list, set or dict of atomic items: most mutable config values)."""
    kind = type(value)
    if kind in (list, set) and all(type(v) in _ATOMIC for v in value):
        return kind(value)
    if kind is dict and all(type(k) in _ATOMIC and type(v) in _ATOMIC for k, v in value.items()):
        return dict(value)
    return copy.deepcopy(value)


class _ConfigRead:
    """One read of a torch config module, for :meth:`_Saved.restore`.

    ``get_config_copy()`` deep-copies every set, list and dict of the
    module's 800-odd keys (about a millisecond for the three modules, twice
    per compile). Where torch keeps a cached export of the module
    (``_get_dict(readonly_values=True)``, torch >= 2.13: refreshed key by key
    on ``setattr``, ``patch`` and ``delattr``), this read takes the shared
    values from it (no copy; a change replaces the object, so ``is`` tells
    unchanged values apart at once), and deep-copies only the mutable
    values (about 30), read live: the export holds copies made when it was
    filled, which miss a change made in place. Elsewhere, and for a
    deprecated or deleted mutable key (reading it warns or raises),
    ``get_config_copy()``.
    """

    def __init__(self, mod: Any) -> None:
        self.mod = mod
        self.mutable: dict[str, Any] = {}
        export = _export(mod)
        self.cached = export is not None
        if export is not None:
            for key in [k for k, v in export.items() if type(v) not in _SHARED_SET]:
                live = _live(mod, key)
                if live is _UNREADABLE:
                    self.cached, self.mutable = False, {}
                    break
                self.mutable[key] = _copy(live)
        self.export = export if self.cached else mod.get_config_copy()

    def restore(self) -> None:
        """Sets back every key whose value differs from this read's."""
        mod = self.mod
        now = _export(mod) if self.cached else None
        if now is None:
            now = mod.get_config_copy()  # not getattr: reading a deprecated key warns
        if not _unchanged(now, self.export):  # one comparison in C, key by key only where one differs
            self._restore_set(now)
        for key, value in self.mutable.items():
            if key in now and not _same(_live(mod, key), value):
                setattr(mod, key, value)

    def _restore_set(self, now: dict[str, Any]) -> None:
        for key, value in self.export.items():
            if key in self.mutable or key not in now:
                continue
            if now[key] is not value and not _same(now[key], value):
                setattr(self.mod, key, value)


_UNREADABLE = object()


def _export(mod: Any) -> dict[str, Any] | None:
    """``mod``'s cached export (a new dict; its values must not be changed),
    or None where torch has none."""
    try:
        return mod._get_dict(readonly_values=True)
    except (AttributeError, TypeError):
        return None


def _live(mod: Any, key: str) -> Any:
    """The object ``mod.<key>`` is now (the one a change in place changes),
    or ``_UNREADABLE`` for a key whose read would warn (deprecated) or
    raise (deleted)."""
    entry = getattr(mod, "_config", {}).get(key)
    if entry is None or getattr(entry, "deprecated", False):
        return _UNREADABLE
    try:
        return getattr(mod, key)
    except AttributeError:
        return _UNREADABLE


def _configs() -> list[_ConfigRead]:
    return [_ConfigRead(mod) for mod in map(sys.modules.get, _CONFIGS) if mod is not None and hasattr(mod, "get_config_copy")]


def _unchanged(now: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether two reads of a config hold equal values of the same types
    for every key (``8`` and ``8.0`` are equal but not the same value; a
    container's items are compared by ``==`` alone)."""
    try:
        return bool(now == saved) and list(map(type, now.values())) == list(map(type, saved.values()))
    except Exception:  # noqa: BLE001 - a value without a usable __eq__: compared key by key
        return False


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a usable __eq__
        return False


class _Saved:
    """One read of the state :func:`preserved` restores."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = _cuda_states()
        self.python = random.getstate()
        self.grad = torch.is_grad_enabled()
        self.dtype = torch.get_default_dtype()
        self.deterministic = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        self.threads = torch.get_num_threads()
        self.anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self.autocast = _autocast()
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.matmul = torch.get_float32_matmul_precision()
        self.configs = _configs()

    def restore(self) -> None:
        """Puts back every field that differs from this read."""
        if not torch.equal(torch.get_rng_state(), self.cpu):
            torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            now = torch.cuda.get_rng_state_all()
            if len(now) != len(self.cuda) or any(not torch.equal(a, b) for a, b in zip(now, self.cuda)):
                torch.cuda.set_rng_state_all(self.cuda)
        if random.getstate() != self.python:
            random.setstate(self.python)
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        deterministic = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        if deterministic != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != self.anomaly:
            torch.set_anomaly_enabled(*self.anomaly)
        for (device, enabled, dtype), now in zip(self.autocast, _autocast()):
            if now[1] != enabled:
                torch.set_autocast_enabled(device, enabled)
            if now[2] != dtype:
                torch.set_autocast_dtype(device, dtype)
        if torch.is_autocast_cache_enabled() != self.autocast_cache:
            torch.set_autocast_cache_enabled(self.autocast_cache)
        if torch.get_float32_matmul_precision() != self.matmul:
            torch.set_float32_matmul_precision(self.matmul)
        for read in self.configs:
            read.restore()


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Runs the body, then puts back every part of the process state (see
    the module docstring) that the body changed, whether it returned or
    raised. For cagrad's own work only, never around code of the user's.

    Costs a few tenths of a millisecond (the config reads, see
    :class:`_ConfigRead`; about two milliseconds where torch has no cached
    config export): it wraps compiles and self-tests, never a cache hit.
    """
    saved = _Saved()
    try:
        with cuda_left_uninitialized():
            yield
    finally:
        saved.restore()
