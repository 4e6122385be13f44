"""The process-wide state a backward could leave changed, read as plain data.

A compiled autograd must leave the program as eager autograd leaves it: not
only its gradients, but the random streams a later ``dropout`` or
``torch.randperm`` draws from, grad mode, the default dtype and the flags
other code reads. :func:`capture` reads all of it into a
:class:`GlobalState`; :meth:`GlobalState.diff` names what differs between two
reads.

Example::

    >>> before = capture()
    >>> _ = torch.rand(1)                       # advances the CPU generator
    >>> [d.field for d in before.diff(capture())]
    ['cpu_rng']

Every field is read by one small function of its own (:data:`FIELDS`). A
reader that fails (the API it uses is missing on this torch) records the
value ``<unavailable: ...>`` instead of raising, so a new torch never makes
the comparison itself crash; the same reader fails alike on both sides, so it
never reports a difference that is not there.

CUDA generators are read only where CUDA is already initialized: reading them
would otherwise initialize CUDA, which is itself a change of state. Likewise
a config is read only where its module is already imported (importing
``torch._dynamo`` takes seconds, and a fuzz worker times each program): a
config field is ``None`` until then, and a ``None`` on either side of a
comparison is no difference (a module imported in between starts from its
defaults).
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import random
import sys
from typing import Any, Callable

import torch

__all__ = ["FIELDS", "GlobalState", "StateDifference", "capture", "left_differently"]


def _digest(t: torch.Tensor) -> str:
    # a generator state is a uint8 tensor (5056 bytes for the CPU mt19937):
    # its sha256 is enough to tell two states apart and prints short
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]


def _cpu_rng() -> str:
    return _digest(torch.get_rng_state())


def _cuda_rng() -> Any:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return tuple(_digest(s) for s in torch.cuda.get_rng_state_all())


def _python_random() -> str:
    return hashlib.sha256(repr(random.getstate()).encode()).hexdigest()[:16]


def _numpy_random() -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return (hashlib.sha256(keys.tobytes()).hexdigest()[:16], int(pos), int(has_gauss), float(gauss))


def _autocast() -> tuple:
    out = []
    for dev in ("cpu", "cuda"):
        try:
            out.append((dev, torch.is_autocast_enabled(dev), str(torch.get_autocast_dtype(dev))))
        except (RuntimeError, TypeError, AttributeError):
            out.append((dev, "<unavailable>"))
    out.append(("cache", torch.is_autocast_cache_enabled()))
    return tuple(out)


def _text(value: Any) -> str:
    """``repr(value)`` with sets and dicts in sorted order: a copied set of
    strings may iterate in another order than the set it was copied from."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_text(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{_text(k)}: {_text(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_text(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


#: types whose text is their repr (what :func:`_text` gives them, faster)
_PLAIN = (str, int, float, bool, type(None))


def _config(module_name: str) -> Callable[[], Any]:
    """A reader of a torch config module's keys and values, as text.

    ``get_config_copy()`` deep-copies every mutable value (sets, lists,
    dicts: milliseconds a read). Where the module has torch's cached export
    (``_get_dict(readonly_values=True)``, torch >= 2.13: refreshed key by key
    on ``setattr`` and ``patch``), its plain values are taken from it, and
    every other value is read live (``getattr``: the object itself, so a set
    changed in place shows; the cache holds a copy made when it was filled).
    A read whose plain values are the very objects of the last read, and
    whose other values have the same text, returns the last read's text
    (no repr and sort of the 800-odd keys). Elsewhere ``get_config_copy()``.
    """
    #: the last read through torch's cached export: its keys, its plain
    #: values (the objects), the texts of the others (read live), the text
    last: list[Any] = [None, None, None, None]

    def read() -> Any:
        mod = sys.modules.get(module_name)
        if mod is None:
            return None  # not imported: not read (see the module docstring)
        try:
            cached = mod._get_dict(readonly_values=True)
        except (AttributeError, TypeError):
            cfg = mod.get_config_copy()
            # values are compared by their text: some are callables or
            # objects without a useful __eq__; sorted so the text is stable
            return tuple(sorted((k, repr(v) if type(v) in _PLAIN else _text(v)) for k, v in cfg.items()))
        keys = tuple(cached)
        plain = [v for v in cached.values() if type(v) in _PLAIN]
        live = {k: _text(getattr(mod, k)) for k, v in cached.items() if type(v) not in _PLAIN}
        if (
            keys == last[0]
            and len(plain) == len(last[1])
            and all(map(operator.is_, plain, last[1]))  # is, not ==: 1 == True, their texts differ
            and live == last[2]
        ):
            return last[3]
        text = tuple(sorted((k, repr(v) if type(v) in _PLAIN else live[k]) for k, v in cached.items()))
        last[:] = [keys, plain, live, text]
        return text

    return read


def _mode_stacks() -> tuple:
    return (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())


#: name -> reader. Order is the order differences are reported in.
FIELDS: dict[str, Callable[[], Any]] = {
    "cpu_rng": _cpu_rng,
    "cuda_rng": _cuda_rng,
    "python_random": _python_random,
    "numpy_random": _numpy_random,
    "grad_enabled": torch.is_grad_enabled,
    "inference_mode": torch.is_inference_mode_enabled,
    "forward_grad_enabled": lambda: torch._C._is_fwd_grad_enabled(),
    "default_dtype": lambda: str(torch.get_default_dtype()),
    "default_device": lambda: str(torch.get_default_device()),
    "deterministic_algorithms": lambda: (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ),
    "num_threads": torch.get_num_threads,
    "num_interop_threads": torch.get_num_interop_threads,
    "autocast": _autocast,
    "anomaly_mode": lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
    "float32_matmul_precision": torch.get_float32_matmul_precision,
    "cudnn_flags": lambda: (
        torch.backends.cudnn.enabled,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    ),
    "multithreading_enabled": lambda: torch.autograd.is_multithreading_enabled(),
    "view_replay_enabled": lambda: torch.autograd.is_view_replay_enabled(),
    "saved_tensors_hooks": lambda: repr(torch._C._autograd._top_saved_tensors_default_hooks(False)),
    "mode_stacks": _mode_stacks,
    "dynamo_config": _config("torch._dynamo.config"),
    "inductor_config": _config("torch._inductor.config"),
    "functorch_config": _config("torch._functorch.config"),
}


def _read(reader: Callable[[], Any]) -> Any:
    try:
        return reader()
    except Exception as exc:  # noqa: BLE001 - a missing API is recorded, not raised
        return f"<unavailable: {type(exc).__name__}>"


@dataclasses.dataclass(frozen=True)
class StateDifference:
    """One field of the global state that differs between two reads.

    Attributes:
        field: the name in :data:`FIELDS` (``"cpu_rng"``, ``"grad_enabled"``, ...).
        expected: its value in the first read (eager's, in the oracle).
        actual: its value in the second read (the subject's). Generator
            states are shown as a 16-hex-digit sha256 of their bytes; configs
            as the keys whose values differ.
    """

    field: str
    expected: Any
    actual: Any

    def __str__(self) -> str:
        return f"{self.field}: expected {self.expected!r}, got {self.actual!r}"


@dataclasses.dataclass(frozen=True)
class GlobalState:
    """One read of every field of :data:`FIELDS`.

    Attributes:
        values: field name -> the value its reader returned (hashable
            plain data: strings, numbers, tuples), or ``"<unavailable: E>"``.
    """

    values: dict[str, Any]

    def diff(self, other: GlobalState) -> list[StateDifference]:
        """The fields whose values differ, in :data:`FIELDS` order.

        Config fields report only the keys that changed, as
        ``(key, value)`` pairs on each side, and nothing where either read
        found the module not imported (``None``).
        """
        out = []
        for name in self.values:
            a, b = self.values[name], other.values.get(name)
            if a == b:
                continue
            if name.endswith("_config") and (a is None or b is None):
                continue  # imported between the reads: nothing set it before
            if name.endswith("_config") and isinstance(a, tuple) and isinstance(b, tuple):
                da, db = dict(a), dict(b)
                keys = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
                a = tuple((k, da.get(k)) for k in keys)
                b = tuple((k, db.get(k)) for k in keys)
            out.append(StateDifference(name, a, b))
        return out


def capture() -> GlobalState:
    """Read the global state now. Never raises; nothing it reads is changed.

    Returns:
        a :class:`GlobalState`; two reads with nothing run between them
        compare equal (``a.diff(b) == []``).
    """
    return GlobalState({name: _read(reader) for name, reader in FIELDS.items()})


def left_differently(
    reference_before: GlobalState, reference_after: GlobalState, before: GlobalState, after: GlobalState
) -> list[StateDifference]:
    """The fields a run left otherwise than a reference run of the same
    program (the oracle: eager's backward, then a subject's).

    A field the reference changed must end at the reference's value (the
    random streams, which both runs start from the same seed); a field the
    reference left alone must end where this run found it, so that a
    change an earlier run leaked is not blamed on this one.

    Args:
        reference_before, reference_after: reads around the reference run.
        before, after: reads around this run.

    Returns:
        one :class:`StateDifference` per such field, in :data:`FIELDS`
        order; ``expected`` is the value it should have ended at.
    """
    expected = {}
    for name, value in after.values.items():
        ref_a, ref_b = reference_after.values.get(name), reference_before.values.get(name)
        expected[name] = ref_a if ref_a != ref_b else before.values.get(name)
    return GlobalState(expected).diff(after)
