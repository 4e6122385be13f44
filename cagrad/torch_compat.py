"""torch's compiled-autograd entry points, served by cagrad.

``torch._dynamo.compiled_autograd`` is entered through three functions:
``_enable(compiler_fn, dynamic=True, ignore_active_disable_ctx=True)`` (what
``torch._dynamo.config.compiled_autograd = True`` enters around every call of
a ``torch.compile``\\ d function, and what torch's own tests use), ``_disable()``
(which AOTAutograd, Inductor and functorch enter around their own backward
passes) and ``reset()`` (called by ``torch._dynamo.reset()``). This module
implements the three with the same signatures and contracts on top of
:func:`cagrad.enable`, and :func:`install` puts them in place of torch's, so
that code and tests written for torch's compiled autograd run on cagrad
unchanged::

    import cagrad.torch_compat as tc

    with tc._enable(lambda gm: torch.compile(gm, backend="eager", fullgraph=True)):
        loss.backward()            # traced, compiled and run by cagrad

    tc.install()                   # torch's entry points now route to cagrad
    torch._dynamo.config.compiled_autograd = True
    train_step = torch.compile(train_step)
    train_step(model, data)        # its backward runs through cagrad
    tc.uninstall()                 # torch's own compiled autograd again

What the contract covers (see torch/_dynamo/compiled_autograd.py):

* the module flags Dynamo and AOTAutograd read:
  ``compiled_autograd_enabled`` (True inside an enabled context),
  ``in_compiled_autograd_region`` (True while compiled backward code runs),
  ``active_disable_ctx``, ``compiled_autograd_enabled_force_eager`` and
  ``depth``, kept exactly as torch keeps them, restored on exceptions;
* nesting: the innermost context wins, contexts must exit in reverse order
  (``AssertionError: Nested Compiled Autograd Contexts must return before
  their parent context``), ``dynamic`` must be a bool, the ``force_eager``
  Dynamo stance runs backward eagerly, and ``_disable()`` makes backward
  eager until it exits (``ignore_active_disable_ctx=False`` contexts opened
  inside it do nothing);
* ``torch._dynamo.utils.counters["compiled_autograd"]["captures"]`` grows by
  one per capture;
* ``compiler_fn`` gets a ``GraphModule`` with torch's placeholder signature
  ``(inputs, sizes, scalars, hooks, packed_inputs)`` that Dynamo traces as
  one graph (``fullgraph=True`` works), and is called while
  ``compiled_autograd_enabled`` is True; its result is first called (so
  ``torch.compile`` first traces) inside ``in_compiled_autograd_region``, in
  a ``CompileContext`` whose id is the capture's number (Dynamo's frame ids
  read ``!<capture>/<frame>/<compile>`` as under torch).

Differences from torch's compiled autograd:

* a backward with hooks, or with nodes cagrad runs opaquely (custom
  ``autograd.Function``\\ s among them), is cut into segments, and
  ``compiler_fn`` is called once per segment (torch inlines hooks and
  Python backwards into one graph), so a ``compiles`` count kept by the
  compiler grows by the number of segments; hooks run eagerly between
  segments instead of being traced by the compiler;
* ``captures`` is bumped once a capture compiled (cagrad's capture event),
  not at its start; a capture whose ``compiler_fn`` raises is a cagrad
  fallback to eager and is not counted;
* torch 2.13 bumps no ``counters["compiled_autograd"]["compiles"]`` itself
  (the compilers in torch's tests and
  ``torch._dynamo.utils.maybe_enable_compiled_autograd`` do); neither does
  this module;
* whatever cagrad cannot compile runs in eager autograd (counted in
  ``cagrad.counters``), where torch raises or graph-breaks;
* a tensor hook registered inside a ``torch.compile``\\ d forward while a
  context is open becomes a ``BackwardState`` input of AOTAutograd's
  backward; cagrad inlines that backward and runs the hook as an opaque
  call on the real ``BackwardState`` (checked like a tensor hook, and a hook
  returning None leaves the gradient as it is, as in eager, where torch's
  compiled autograd continues with None). Module backward hooks lifted the
  same way are not supported: such a backward still raises
  ``AssertionError: BackwardState requires CompiledAutograd``, as does one
  that cagrad falls back to eager for;
* a graph segment whose compiled function raises on its first call (where
  a lazy backend such as ``torch.compile`` compiles) runs uncompiled, with a warning and ``cagrad.counters
  ["segment_compile_failures"]``, where torch raises;
* the compiled graph does not steal its inputs (torch's
  ``locals_to_steal``), so the lifted tensors live until it returns;
* the cache-miss and graph logs are cagrad's (``cagrad``/``cagrad.verbose``
  loggers), not torch's ``compiled_autograd(_verbose)`` artifacts;
* a ``reset()`` from inside an open context turns every open context off
  until it exits (torch turns an outer one back on when an inner one exits,
  with ``compiled_autograd_enabled`` left False).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
import torch._dynamo.compiled_autograd as _ca
from torch.autograd.variable import Variable

from . import api, engine, events, internals

log = logging.getLogger("cagrad")

__all__ = [
    "_disable",
    "_enable",
    "disable",
    "enable",
    "install",
    "installed",
    "is_installed",
    "reset",
    "uninstall",
]

NESTING_MESSAGE = "Nested Compiled Autograd Contexts must return before their parent context"

# torch's entry points as they were when this module was imported; install()
# replaces those that exist, uninstall() puts these very objects back
_PATCHED_NAMES = ("_enable", "enable", "_disable", "reset")
_ORIGINALS: dict[str, Any] = {}
for _name in _PATCHED_NAMES:
    _fn = getattr(_ca, _name, None)
    if _fn is not None and not getattr(_fn, "__cagrad_compat__", False):
        _ORIGINALS[_name] = _fn
del _name, _fn

_lock = threading.RLock()
_installed = False


def _mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn.__cagrad_compat__ = True  # type: ignore[attr-defined]
    return fn


# ---------------------------------------------------------------------------
# compiler_fn: one cache for every compat context, capture ids

_pending_capture_id: int | None = None


def _capture_id() -> int | None:
    """The number of the capture now compiling (torch's ``COMPILE_COUNTER``).

    A capture may call ``compiler_fn`` once per segment; all of them get the
    number drawn at the first call, and :func:`_on_capture` ends it.
    """
    global _pending_capture_id
    if _pending_capture_id is None:
        counter = getattr(_ca, "COMPILE_COUNTER", None)
        if counter is None:
            return None
        _pending_capture_id = next(counter)
    return _pending_capture_id


class _SharedCompiler:
    """A ``compiler_fn`` as cagrad sees it under the compat entry points.

    torch's compiled autograd keeps one cache for the whole process, whatever
    compiler filled it: a graph captured under one ``_enable(compiler_fn)`` is
    a hit under any later ``_enable``, and only a miss calls the current
    ``compiler_fn``. ``torch._dynamo.config.compiled_autograd`` relies on that:
    every call of a ``torch.compile``\\ d function enters ``_enable`` with a
    fresh compiler object. cagrad keeps one cache per ``(compiler_fn,
    dynamic)`` key (by equality), so every instance of this class is equal to
    every other: all compat contexts share one cache per ``dynamic`` until
    :func:`reset`, and a miss compiles with this instance's ``compiler_fn``.
    """

    __slots__ = ("compiler_fn",)

    def __init__(self, compiler_fn: Callable[[torch.fx.GraphModule], Any]) -> None:
        self.compiler_fn = compiler_fn

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SharedCompiler)

    def __hash__(self) -> int:
        return hash(_SharedCompiler)

    def __repr__(self) -> str:
        return f"torch_compat({self.compiler_fn!r})"

    def __call__(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        cid = _capture_id()
        compiled = self.compiler_fn(gm)
        make_ctx = getattr(_ca, "make_compile_context", None)
        if cid is None or make_ctx is None:
            return compiled

        def run_in_compile_context(*args: Any) -> Any:
            # torch runs (and so lazily compiles) each graph in the capture's
            # CompileContext: Dynamo's compile ids read "!<capture>/..."
            with make_ctx(cid):
                return compiled(*args)

        run_in_compile_context.__wrapped__ = compiled  # type: ignore[attr-defined]
        return run_in_compile_context


# ---------------------------------------------------------------------------
# the engine switch and torch's native compiler


def _eager() -> Any:
    return engine.eager_engine()


def _set_engine(new: Any) -> Any:
    """Sets the autograd engine object Python's backward calls; returns the old one.

    cagrad routes backward through ``Variable._execution_engine`` (see
    :mod:`cagrad.engine`); torch's eager engine there means "no cagrad".
    """
    prior = Variable._execution_engine
    Variable._execution_engine = new
    return prior


def _restore_engine(prior: Any) -> None:
    # cagrad's engine only makes sense while some cagrad context is open
    _set_engine(prior if engine.active() else _eager())


def _set_native_compiler(compiler: Any, dynamic: bool) -> tuple[Any, bool]:
    """torch's C++ ``set_autograd_compiler``; returns the prior (compiler, dynamic)."""
    native = getattr(getattr(torch._C, "_dynamo", None), "compiled_autograd", None)
    setter = getattr(native, "set_autograd_compiler", None)
    if setter is None:
        return None, False
    try:
        prior = setter(compiler, dynamic)
    except TypeError:  # a one-argument signature
        prior = setter(compiler)
    if isinstance(prior, tuple):
        return prior[0], bool(prior[1])
    return prior, False


# ---------------------------------------------------------------------------
# frames: one per open _enable that did enable


@dataclasses.dataclass(eq=False)
class _Frame:
    state: Any  # cagrad.engine.EnableState
    prior_engine: Any
    prior_native: tuple[Any, bool]
    prior_depth: int
    orphaned: bool = False  # unwound by a misordered exit or by reset()


_frames: list[_Frame] = []
_run_saved: list[tuple[bool, bool, bool]] = []


def _on_capture(event: events.CaptureEvent) -> None:
    global _pending_capture_id
    _pending_capture_id = None
    from torch._dynamo.utils import counters

    counters["compiled_autograd"]["captures"] += 1


def _on_run(active: bool) -> None:
    """Brackets compiled code as torch's runtime wrapper does.

    torch runs the compiled graph (hooks included) with
    ``in_compiled_autograd_region`` set and inside ``_disable()``:
    ``compiled_autograd_enabled`` False, ``active_disable_ctx`` True. The
    prior values come back afterwards, also when the run raised.
    """
    if active:
        _run_saved.append(
            (_ca.in_compiled_autograd_region, _ca.compiled_autograd_enabled, _ca.active_disable_ctx)
        )
        _ca.in_compiled_autograd_region = True
        _ca.compiled_autograd_enabled = False
        _ca.active_disable_ctx = True
    elif _run_saved:
        (
            _ca.in_compiled_autograd_region,
            _ca.compiled_autograd_enabled,
            _ca.active_disable_ctx,
        ) = _run_saved.pop()


def _sync() -> None:
    """Puts listeners and torch's ``_disable`` in the state the frames need.

    While a compat context is open, cagrad's capture and run events feed
    torch's counters and flags, and torch's ``_disable`` (entered by
    AOTAutograd, Inductor and functorch around their own backward passes) is
    this module's, which also turns cagrad off. Outside, and without
    :func:`install`, torch is untouched.
    """
    with _lock:
        listening = bool(_frames)
        for registry, listener in ((events.on_capture, _on_capture), (events.on_run, _on_run)):
            present = listener in registry
            if listening and not present:
                registry.append(listener)
            elif not listening and present:
                registry.remove(listener)
        if _installed or _frames:
            _ensure_dynamo_skips()
        else:
            _remove_dynamo_skips()
        original = _ORIGINALS.get("_disable")
        if original is None:
            return
        if _installed or _frames:
            if _ca._disable is original:
                _ca._disable = _disable
        elif _ca._disable is _disable:
            _ca._disable = original


_skip_dir: str | None = None  # what _ensure_dynamo_skips added to Dynamo's SKIP_DIRS


def _ensure_dynamo_skips() -> None:
    """Keeps Dynamo from compiling cagrad's own frames.

    torch's compiled autograd runs in C++ and in torch's own Python files,
    which Dynamo never traces. cagrad is Python outside torch: a backward
    called from a ``torch.compile``\\ d function (after the graph break at
    ``.backward()``) runs with Dynamo's frame callback still set, and Dynamo
    would try to compile cagrad's walk. Adding the package directory to
    Dynamo's skip list (``torch._dynamo.trace_rules.add``) makes it run those
    frames as they are, while frames they call (hooks, compiled graphs) are
    treated as under eager autograd. The entry is there while a compat
    context is open or :func:`install` is in effect, and taken out after.
    """
    global _skip_dir
    if _skip_dir is not None:
        return
    try:
        from torch._dynamo import trace_rules
    except ImportError:  # pragma: no cover
        return
    skip_dirs = getattr(trace_rules, "SKIP_DIRS", None)
    add = getattr(trace_rules, "add", None)
    if skip_dirs is None or add is None:
        return
    size = len(skip_dirs)
    add(__name__.rpartition(".")[0])  # appends the package directory
    _skip_dir = skip_dirs[-1] if len(skip_dirs) > size else ""


def _remove_dynamo_skips() -> None:
    global _skip_dir
    if not _skip_dir:
        _skip_dir = None
        return
    from torch._dynamo import trace_rules

    skip_dirs = trace_rules.SKIP_DIRS
    for i in range(len(skip_dirs) - 1, -1, -1):  # the entry add() appended
        if skip_dirs[i] == _skip_dir:
            del skip_dirs[i]
            break
    recompile = getattr(trace_rules, "_recompile_re", None)
    if recompile is not None:
        recompile()
    _skip_dir = None


def _unwind(frames: list[_Frame]) -> None:
    """Pops the cagrad states of ``frames`` (innermost last in the list)."""
    for frame in reversed(frames):
        frame.orphaned = True
        engine.pop(frame.state)


# ---------------------------------------------------------------------------
# the entry points


@_mark
@contextlib.contextmanager
def _enable(
    compiler_fn: Callable[..., Any],
    dynamic: bool = True,
    ignore_active_disable_ctx: bool = True,
) -> Generator[None, None, None]:
    """torch's ``compiled_autograd._enable``, run by cagrad.

    Every backward started inside (``Tensor.backward``,
    ``torch.autograd.backward``, ``torch.autograd.grad``) goes through
    :func:`cagrad.enable` with ``compiler_fn`` (a callable ``GraphModule ->
    callable``, e.g. ``functools.partial(torch.compile, backend="eager",
    fullgraph=True)``; a ``torch.compile`` backend name also works) and
    ``dynamic`` (sizes symbolic from the first capture; False: static until
    they change).

    Args:
        compiler_fn: compiles one captured graph; called once per capture,
            or once per segment of a capture cut at hooks or opaque nodes.
        dynamic: must be a bool when truthy (``AssertionError`` otherwise).
        ignore_active_disable_ctx: with False, inside an active
            :func:`_disable` this context does nothing (the
            ``torch._dynamo.config.compiled_autograd`` path enters it so).

    Raises:
        AssertionError: on exit, when a context opened inside this one is
            still open (the inner one is shut down with it; its own exit
            later raises the same error).
    """
    if not ignore_active_disable_ctx and _ca.active_disable_ctx:
        yield
        return
    if dynamic and type(dynamic) is not bool:
        raise AssertionError(f"Expected dynamic to be bool, got {type(dynamic)}")
    from torch._dynamo import eval_frame

    stance = getattr(getattr(eval_frame, "_stance", None), "stance", "default")
    if stance == "force_eager":
        # torch's compiled autograd falls back to eager with Dynamo's stance
        _ca.compiled_autograd_enabled_force_eager = True
        try:
            yield
        finally:
            _ca.compiled_autograd_enabled_force_eager = False
        return
    if torch.cuda.is_available():
        from torch._inductor import cudagraph_trees  # noqa: F401  (as torch does)

    compiler = compiler_fn if isinstance(compiler_fn, str) else _SharedCompiler(compiler_fn)
    with _lock:
        prior_engine = Variable._execution_engine
        state = engine.push(compiler, bool(dynamic))
        # cagrad runs every backward here; torch's native compiler must not
        # take the ones cagrad hands to the eager engine
        prior_native = _set_native_compiler(None, False)
        frame = _Frame(state, prior_engine, prior_native, _ca.depth)
        _frames.append(frame)
        _ca.compiled_autograd_enabled = True
        _ca.depth += 1
        _sync()
    try:
        with torch.autograd.set_multithreading_enabled(False):
            yield
    finally:
        _exit(frame)


def _exit(frame: _Frame) -> None:
    with _lock:
        if frame.orphaned or frame not in _frames:
            _ca.depth -= 1
            if _ca.depth != frame.prior_depth:
                raise AssertionError(NESTING_MESSAGE)
            return
        idx = _frames.index(frame)
        above = _frames[idx + 1 :]
        del _frames[idx:]
        try:
            # a misordered exit shuts the contexts above down with it: torch
            # restores the prior compiler here, which turns them off too
            _unwind([frame, *above])
        finally:
            prior_active = frame.prior_engine is not _eager() or bool(frame.prior_native[0])
            if not prior_active:
                _ca.compiled_autograd_enabled = False
            _set_native_compiler(*frame.prior_native)
            _restore_engine(frame.prior_engine)
            _ca.depth -= 1
            _sync()
        if _ca.depth != frame.prior_depth:
            raise AssertionError(NESTING_MESSAGE)


@_mark
@contextlib.contextmanager
def _disable() -> Generator[None, None, None]:
    """torch's ``compiled_autograd._disable``: backward runs eagerly inside.

    Turns cagrad off (eager autograd runs every backward until exit, cagrad
    contexts opened inside with ``ignore_active_disable_ctx=True`` excepted)
    and does everything torch's ``_disable`` does: native compiler off,
    ``compiled_autograd_enabled`` False and ``active_disable_ctx`` True, and
    afterwards ``compiled_autograd_enabled`` True again if a compiler (cagrad
    or native) was active.
    """
    original = _ORIGINALS["_disable"]
    prior_engine = _set_engine(_eager())
    cagrad_was_active = prior_engine is not _eager()
    try:
        with original():
            yield
    finally:
        _restore_engine(prior_engine)
        if cagrad_was_active and engine.active():
            _ca.compiled_autograd_enabled = True


@_mark
def reset() -> None:
    """torch's ``compiled_autograd.reset`` plus :func:`cagrad.reset`.

    Returns to the state of a new process: compat contexts still open (left
    without exit, or reset from inside one) are shut down, backward is eager
    until the next ``_enable``, torch's native compiled-autograd state is
    cleared (compiler, verbose logger, cache, ``COMPILE_COUNTER``), and
    cagrad's caches and counters are emptied.

    Raises:
        AssertionError: inside ``in_compiled_autograd_region`` (torch's check).
    """
    global _pending_capture_id
    original = _ORIGINALS.get("reset")
    if original is not None:
        original()  # raises inside in_compiled_autograd_region, as torch does
    with _lock:
        frames = list(_frames)
        _frames.clear()
        try:
            _unwind(frames)
        except RuntimeError as e:  # a raw cagrad.enable opened inside is still open
            log.warning("cagrad.torch_compat.reset: %s", e)
        if frames:
            _restore_engine(frames[0].prior_engine)
        _ca.compiled_autograd_enabled = False
        _pending_capture_id = None
        _sync()
    api.reset()


# public spellings (torch's names carry the underscore)
enable = _enable
disable = _disable


# ---------------------------------------------------------------------------
# install / uninstall


def install() -> None:
    """Puts this module's ``_enable``, ``_disable`` and ``reset`` in torch.

    Replaces ``torch._dynamo.compiled_autograd._enable`` (and ``enable``
    where a torch version has it), ``_disable`` and ``reset``. Every caller
    looks them up there at call time, so afterwards
    ``torch._dynamo.config.compiled_autograd = True`` (``torch.compile``
    enters ``_enable`` around each call of the compiled function),
    ``torch._dynamo.utils.maybe_enable_compiled_autograd``, the ``_disable``
    of AOTAutograd/Inductor/functorch and ``torch._dynamo.reset()`` all reach
    cagrad. Calling it again does nothing. Where this torch's
    ``torch._dynamo.compiled_autograd`` is not the one cagrad knows (the
    internal ``compiled_autograd_entry`` of :mod:`cagrad.internals`), it
    installs nothing (logged once) and torch's own compiled autograd stays.
    """
    global _installed
    with _lock:
        if _installed or not internals.ok("compiled_autograd_entry"):
            return
        for name, original in _ORIGINALS.items():
            if getattr(_ca, name, None) is original:
                setattr(_ca, name, _COMPAT[name])
        _installed = True
        _sync()


def uninstall() -> None:
    """Puts torch's own entry points back, the very objects ``install`` found.

    Compat contexts still open keep running on cagrad until they exit.
    Calling it again, or without ``install``, does nothing.
    """
    global _installed
    with _lock:
        if not _installed:
            return
        for name, original in _ORIGINALS.items():
            if getattr(_ca, name, None) is _COMPAT[name]:
                setattr(_ca, name, original)
        _installed = False
        _sync()


def is_installed() -> bool:
    return _installed


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install()`` for the duration of a block (if it was not already)."""
    was = _installed
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


_COMPAT: dict[str, Any] = {"_enable": _enable, "enable": _enable, "_disable": _disable, "reset": reset}
