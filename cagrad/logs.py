"""cagrad's loggers, and switching them on like TORCH_LOGS.

Loggers (standard :mod:`logging`):

* ``cagrad``: fallbacks (INFO, with their reason) and every captured graph
  (DEBUG, once per capture, as readable FX code);
* ``cagrad.verbose``: why each capture happened (DEBUG): the new node type
  and its index, the first differing byte of a key, or the sizes that
  changed and became dynamic (see :mod:`cagrad.explain`);
* ``cagrad.guards``: the generated hit guard of each captured graph, or why
  a graph gets none (DEBUG; see :mod:`cagrad.keys.hit_path`).

Switch them on with the environment variable ``CAGRAD_LOGS`` (read at
import), a comma-separated list like ``TORCH_LOGS``: ``graph`` (captured
graphs), ``verbose`` (miss reasons), ``fallbacks``, ``guards`` (generated hit
guards); ``all`` for all four.
Or call :func:`set_logs`. Either attaches one stderr handler to ``cagrad``
if it has none.

:func:`meta_failures_held` keeps torch's FakeTensor logger from printing,
at ERROR, a meta kernel's failure that cagrad's trace catches and handles;
:func:`torch_warnings_held` keeps the Python warnings torch emits while
cagrad traces or compiles from being shown (or raised, under ``-W error``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator

log = logging.getLogger("cagrad")
verbose_log = logging.getLogger("cagrad.verbose")
guards_log = logging.getLogger("cagrad.guards")

_FORMAT = "[cagrad %(levelname)s] %(message)s"

#: the logger that torch's FakeTensor mode logs a failing meta kernel to
#: (``torch/_subclasses/fake_tensor.py``: ``log.exception("failed while
#: attempting to run meta for %s", func)``, then it raises)
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
_META_FAILED = "failed while attempting to run meta"
_KNOWN = ("graph", "verbose", "fallbacks", "guards")


def set_logs(graph: bool = False, verbose: bool = False, fallbacks: bool = False, guards: bool = False) -> None:
    """Sets what cagrad logs to stderr (replaces the previous setting).

    Args:
        graph: each captured graph (``cagrad`` at DEBUG).
        verbose: why each capture happened (``cagrad.verbose`` at DEBUG).
        fallbacks: each backward eager ran instead (``cagrad`` at INFO).
        guards: each generated hit guard (``cagrad.guards`` at DEBUG).
    """
    if graph:
        log.setLevel(logging.DEBUG)
    elif fallbacks:
        log.setLevel(logging.INFO)
    else:
        log.setLevel(logging.WARNING)
    verbose_log.setLevel(logging.DEBUG if verbose else logging.NOTSET)
    guards_log.setLevel(logging.DEBUG if guards else logging.INFO)  # long: only when asked
    if (graph or verbose or fallbacks or guards) and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        log.addHandler(handler)


def from_env(value: str | None = None) -> None:
    """Applies ``CAGRAD_LOGS`` (or ``value``).

    Raises:
        ValueError: an unknown name in the list (the message lists the known).
    """
    value = os.environ.get("CAGRAD_LOGS", "") if value is None else value
    names = {n.strip().lstrip("+") for n in value.split(",") if n.strip()}
    if not names:
        return
    if "all" in names:
        names = set(_KNOWN)
    unknown = names - set(_KNOWN)
    if unknown:
        raise ValueError(f"CAGRAD_LOGS: unknown {sorted(unknown)}; known: {', '.join(_KNOWN)}, all")
    set_logs(
        graph="graph" in names,
        verbose="verbose" in names,
        fallbacks="fallbacks" in names,
        guards="guards" in names,
    )


def miss(reason: object) -> None:
    """Logs why a backward is captured (formatted only when the logger is on)."""
    if verbose_log.isEnabledFor(logging.DEBUG):
        verbose_log.debug("capture: %s", reason)


def graph_captured(graph_module) -> None:
    """Logs a captured graph (formatted only when the logger is on)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "captured graph:\n%s",
            graph_module.print_readable(print_output=False, include_stride=True, include_device=True),
        )


class _MetaFailuresHeld(logging.Filter):
    """Holds back, from this thread only, the records of torch's FakeTensor
    logger that say a meta kernel raised."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == self.thread and str(record.msg).startswith(_META_FAILED):
            self.held.append(record)
            return False
        return True


@contextlib.contextmanager
def meta_failures_held(what: str) -> Iterator[None]:
    """Inside: a meta kernel that raises while cagrad traces (the exception
    reaches cagrad, which runs that node as it is or the backward in eager,
    and says so in its counters and fallback log) is not logged at ERROR by
    torch's FakeTensor logger, as it would be under ``torch.compile``: a
    program whose eager run logs nothing logs nothing under cagrad either.
    Each held record is logged to ``cagrad.verbose`` at DEBUG instead, with
    its traceback, prefixed by ``what``. Records of other threads and other
    messages pass."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    held = _MetaFailuresHeld()
    logger.addFilter(held)
    try:
        yield
    finally:
        logger.removeFilter(held)
        for record in held.held:
            verbose_log.debug("%s: torch's FakeTensor logged: %s", what, record.getMessage(), exc_info=record.exc_info)


def _errors_possible() -> bool:
    """Whether a warning filter in force turns some warning into an
    exception (``python -W error``, pytest's ``filterwarnings = error``)."""
    return any(f[0] == "error" for f in warnings.filters)


@contextlib.contextmanager
def torch_warnings_held(what: str) -> Iterator[None]:
    """Inside: a Python warning emitted in this thread while cagrad traces
    or compiles a backward is neither shown nor raised, and is logged to
    ``cagrad.verbose`` at DEBUG (prefixed by ``what``) instead.

    Eager runs no trace and no compiler, so it emits none of these: torch's
    FakeTensor reading a non-leaf tensor's ``.grad`` ("The .grad attribute of
    a Tensor that is not a leaf Tensor is being accessed", which torch itself
    hides from display but which an ``"error"`` filter turns into an
    exception before that), or a compiler's advice. A warning of the user's
    code being traced never gets here: :mod:`cagrad.capture.warnings_in_trace`
    makes it fail that trace, and the code then warns when it runs.

    How, and what it costs:

    * no ``"error"`` filter in force: ``warnings.showwarning`` is replaced
      for the block (as torch's ``torch._logging.hide_warnings`` does);
      filters and registries are untouched, so a held warning counts, in
      its (torch) module's registry, as shown;
    * an ``"error"`` filter in force: the filters are also set to record
      every warning for the block (:class:`warnings.catch_warnings`), which
      clears Python's once-per-place registries (a warning eager shows once
      may be shown once more), and another thread's warning during the block
      is logged here rather than raised there.
    """
    me = threading.get_ident()
    held: list[warnings.WarningMessage] = []
    if _errors_possible():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                held.extend(caught)
    else:
        prior = warnings.showwarning

        def _show(message, category, filename, lineno, file=None, line=None):
            if threading.get_ident() == me:
                held.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
            else:
                prior(message, category, filename, lineno, file, line)

        warnings.showwarning = _show
        try:
            yield
        finally:
            if warnings.showwarning is _show:  # leave a later replacement alone
                warnings.showwarning = prior
    for w in held:
        verbose_log.debug("%s: torch warned (%s:%s) %s: %s", what, w.filename, w.lineno, w.category.__name__, w.message)
