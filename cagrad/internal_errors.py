"""The safety net: an unexpected exception inside cagrad becomes a fallback.

cagrad reads torch's private state (Node attributes, SavedVariables, hook
dicts, FakeTensor and SymInt machinery) whose shape changes between torch
releases; its checks (:mod:`cagrad.internals`) catch the changes they know
of. Anything else that raises while cagrad collects, keys, traces or
compiles a backward is a cagrad bug, not the user's error. Nothing has run
yet at that point (no hook, no node, no ``.grad`` written), so the backward
is handed whole to eager autograd, as any :class:`~cagrad.errors.Unsupported`
case is: the user gets eager's gradients, and eager's own exception where
the program is really at fault. The exception is counted as the fallback
reason :data:`REASON` and logged at WARNING level with its traceback (once
per exception type and raising line; every occurrence at INFO).

Not caught, by design:

* exceptions raised once anything ran (a compiled graph, a hook, an opaque
  node): eager cannot run the backward again from the start;
* :class:`~cagrad.errors.CacheFileError` (a bad disk-cache file is the
  user's to remove, and says which);
* anything with ``CAGRAD_STRICT=1`` in the environment, read at each
  failure: the test suite and the harness (fuzz campaigns, the model and
  stacks suites) run strict, so that an internal error is reported as the
  fault it is (an exception eager does not raise) instead of hidden by the
  fallback.

Example::

    try:
        collected = collect_backward(...)
    except Exception as e:
        if not internal_errors.catches(e):
            raise
        internal_errors.record(e)
        return call.run_eager(eager_engine)
"""

from __future__ import annotations

import logging
import os
import threading
import traceback

from .counters import counters
from .errors import CacheFileError

#: the fallback reason an internal error is counted under
REASON = "internal_error"
#: environment variable: set to anything but "" or "0", internal errors raise
STRICT_ENV = "CAGRAD_STRICT"

log = logging.getLogger("cagrad")
_warned: set[tuple[str, str, int]] = set()
_lock = threading.Lock()


def strict() -> bool:
    """Whether internal errors raise (``CAGRAD_STRICT`` set and not "0")."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def catches(exc: BaseException) -> bool:
    """Whether ``exc``, raised before anything of the backward ran, is turned
    into a fallback: any ``Exception`` but a ``CacheFileError``, unless
    :func:`strict`."""
    return isinstance(exc, Exception) and not isinstance(exc, CacheFileError) and not strict()


def where(exc: BaseException) -> tuple[str, int]:
    """The innermost frame of ``exc``'s traceback: ``(file, line)``."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ("?", 0)
    last = frames[-1]
    return (last.filename, last.lineno or 0)


def detail(exc: BaseException) -> str:
    """One line naming the exception and where it was raised."""
    file, line = where(exc)
    return f"{type(exc).__qualname__}: {exc} (at {os.path.basename(file)}:{line})"


def record(exc: BaseException) -> None:
    """Counts ``exc`` as a :data:`REASON` fallback and logs it (the
    traceback at WARNING level the first time its type and line are seen)."""
    file, line = where(exc)
    seen = (type(exc).__qualname__, file, line)
    with _lock:
        first = seen not in _warned
        _warned.add(seen)
    if first:
        log.warning(
            "cagrad: internal error, this backward runs in eager autograd (please report it; "
            "%s=1 raises it instead)",
            STRICT_ENV,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
    counters.record_fallback(REASON, detail(exc))
