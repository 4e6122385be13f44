"""Code that warns while cagrad traces it is not traced.

A backward formula, a hook accepted by :mod:`cagrad.hooks.hook_tracing` or
a custom Function's backward accepted by :mod:`cagrad.hooks.backward_tracing`
is traced once, on fake tensors, when a graph is captured; after that the
graph's ops run and that Python code never runs again. A
``warnings.warn`` inside it (``torch.nn.functional.softmax`` without ``dim``
warns that the implicit dim is deprecated, ``torch.nn.functional.tanh``
that it is deprecated) would then be emitted once, at capture, where eager
emits it on every backward: shown every time under the ``"always"`` action,
raised every time under ``python -W error``, recorded every time by
``warnings.catch_warnings(record=True)`` and ``pytest.warns``.

So while cagrad traces such code, :func:`warnings_refused` makes
``warnings.warn`` raise :class:`WarnedInTrace` in the tracing thread: that
piece's trace fails, it runs as it is (a formula) or as an opaque call (a
hook, a custom backward) on every backward, and emits its warnings there as
eager does. Nothing is shown at capture.

Python's warning filters are not touched: a changed filter list clears every
module's ``__warningregistry__``, so a warning eager shows once per place
would be shown again. ``warnings.warn`` itself is swapped for the block
only; another thread that calls it meanwhile gets the original's behaviour
(with its ``stacklevel`` moved past the wrapper's frame). Not seen: a
``warn`` bound before the block (``from warnings import warn``),
``warnings.warn_explicit``, and C++ ``TORCH_WARN`` (a kernel's warning;
under fake tensors the meta kernels that run do not warn, and the graph
calls the same ATen op at run time unless a compiler replaces it).

Example::

    with warnings_refused():
        torch.nn.functional.softmax(fake_grad)   # raises WarnedInTrace
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
_refusing: dict[int, int] = {}  # thread id -> depth of open blocks
_original: Any = None  # warnings.warn while a block is open anywhere
_AT_IMPORT = warnings.warn


class WarnedInTrace(Exception):
    """Code being traced called ``warnings.warn``; the message names the
    warning's category and text. cagrad runs that code as it is instead."""


def _warn(message: Any, category: Any = None, stacklevel: int = 1, *args: Any, **kwargs: Any) -> None:
    if _refusing.get(threading.get_ident()):
        kind = category or (type(message) if isinstance(message, Warning) else UserWarning)
        raise WarnedInTrace(f"{getattr(kind, '__name__', kind)}: {message}")
    # a call that looked ``warn`` up just before the last block closed
    original = _original or _AT_IMPORT
    return original(message, category, stacklevel + 1, *args, **kwargs)


@contextlib.contextmanager
def warnings_refused() -> Iterator[None]:
    """Inside the block, ``warnings.warn`` called from this thread raises
    :class:`WarnedInTrace` (the warning is not emitted); other threads warn
    as before. Blocks nest and may be open in several threads.

    Raises:
        WarnedInTrace: from the ``warnings.warn`` call inside the block.
    """
    global _original
    me = threading.get_ident()
    with _lock:
        if not _refusing:
            _original = warnings.warn
            warnings.warn = _warn
        _refusing[me] = _refusing.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _refusing[me] -= 1
            if not _refusing[me]:
                del _refusing[me]
            if not _refusing:
                if warnings.warn is _warn:  # leave a later replacement alone
                    warnings.warn = _original
                _original = None
