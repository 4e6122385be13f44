"""A CPU program's compile on a machine with a GPU leaves CUDA uninitialized.

Eager autograd never initializes CUDA for a CPU program, so neither may
cagrad's compile of its backward: initializing it creates a CUDA context
(about half a GiB of device memory and a second of start-up) and makes the
CUDA generator readable, a state difference from eager. Torch's compile
stack asks the GPU in four places, each of which initializes CUDA:

* AOTAutograd and inductor enter Dynamo's ``preserve_rng_state``, which
  reads the CUDA generator whenever ``torch.cuda.is_available()``;
* inductor's cache keys name the GPU
  (``torch._inductor.codecache.CacheBase.get_system``);
* the runnable repro inductor writes of every graph names each GPU
  (``torch._dynamo.debug_utils._cuda_system_info_comment``);
* ``torch.utils._triton.has_triton`` asks the GPU its compute capability,
  at the first kernel of any device and again in Dynamo's compile metrics.

While CUDA is not initialized, :func:`cuda_left_uninitialized` answers each
as a host without CUDA would, and no answer it gives stays cached after it:
a later CUDA compile in the process asks the GPU as without cagrad. Once
CUDA is initialized every stand-in defers to torch's own. Each part is an
internal of :mod:`cagrad.internals` (feature ``lazy_cuda``); where one is
not as expected, that part does nothing and the compile may initialize
CUDA, as ``torch.compile``'s does. Measured on the H200, torch 2.11:
without these, ``torch.cuda.is_initialized()`` is true after a CPU backward
under ``aot_eager`` or ``inductor``; with them it stays false under both
(docs/global-state.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["cuda_left_uninitialized"]

log = logging.getLogger("cagrad")

#: the module defining Dynamo's ``preserve_rng_state``, then those that bind
#: it by name (``from torch._dynamo.utils import preserve_rng_state``)
RNG_PRESERVER_MODULES = (
    "torch._dynamo.utils",
    "torch._functorch.aot_autograd",
    "torch._inductor.select_algorithm",
    "torch._inductor.codegen.triton",
    "torch._inductor.cudagraph_trees",
)


def _lazy_cuda_preserver(original: Any) -> Any:
    """A stand-in for Dynamo's ``preserve_rng_state`` (``original``) that
    leaves CUDA uninitialized: while CUDA is not initialized it saves and
    restores the CPU generator only; after, it is ``original``."""

    @contextlib.contextmanager
    def preserve_rng_state() -> Iterator[None]:
        if torch.cuda.is_initialized():
            with original():
                yield
            return
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch._C._DisableFuncTorch():
            cpu = torch.random.get_rng_state().clone()
        try:
            yield
        finally:
            with _disable_current_modes():
                torch.random.set_rng_state(cpu)

    preserve_rng_state.cagrad_original = original  # type: ignore[attr-defined]
    return preserve_rng_state


#: inductor's module whose ``CacheBase.get_system`` reads the GPU's name
INDUCTOR_CODECACHE = "torch._inductor.codecache"


def _system_without_cuda(codecache: types.ModuleType, original: Any) -> Any:
    """A stand-in for inductor's ``CacheBase.get_system`` (``original``, the
    cached function) that leaves CUDA uninitialized.

    torch's answer names the GPU (``torch.cuda.get_device_properties``,
    which initializes CUDA) and is cached for the process; on a host
    without CUDA it is ``{"hash": <key of {}>}``. While CUDA is not
    initialized no CUDA kernel can be compiled, and a CPU kernel does not
    depend on the GPU, so the stand-in gives the no-CUDA answer and caches
    nothing: a later CUDA compile in the process reads the GPU's name as it
    would without cagrad. Once CUDA is initialized it is ``original``. The
    key of ``{}`` is inductor's ``SYSTEM_CACHE_KEY_STRATEGY`` where it has
    one (torch 2.13 and 2.14.1 do), else the sha256 of its JSON text; it
    only names the on-disk cache of CPU kernels.
    """

    def get_system() -> Any:
        if torch.cuda.is_initialized():
            return original()
        strategy = getattr(codecache, "SYSTEM_CACHE_KEY_STRATEGY", None)
        if strategy is not None and callable(getattr(strategy, "key_from_json", None)):
            return {"hash": strategy.key_from_json({})}
        return {"hash": hashlib.sha256(json.dumps({}, sort_keys=True).encode("utf-8")).hexdigest()}

    get_system.cagrad_original = original  # type: ignore[attr-defined]
    return get_system


@contextlib.contextmanager
def _system_info_left_unread() -> Iterator[None]:
    """Runs the body with inductor's ``CacheBase.get_system`` swapped for
    :func:`_system_without_cuda`'s (importing inductor's codecache, which
    every inductor compile imports anyway). Where the body populated
    ``CacheBase.get_local_cache_path``'s cache (a path named by the system
    hash), that cache is cleared afterwards, so no answer of the stand-in
    outlives the body. A no-op where the internal ``inductor_system_info``
    failed its check."""
    from . import internals

    if not internals.ok("inductor_system_info"):
        yield
        return
    codecache = importlib.import_module(INDUCTOR_CODECACHE)
    base = codecache.CacheBase
    descriptor = base.__dict__["get_system"]
    original = getattr(descriptor, "__func__", descriptor)
    original = getattr(original, "cagrad_original", original)
    path_cache = getattr(base.__dict__.get("get_local_cache_path"), "__func__", None)
    with _fills_forgotten(path_cache):
        base.get_system = staticmethod(_system_without_cuda(codecache, original))
        try:
            yield
        finally:
            base.get_system = descriptor


#: the module defining Dynamo's repro comment naming the GPUs, then those
#: that bind it by name; the first two are imported by every inductor compile
REPRO_COMMENT_MODULES = ("torch._dynamo.debug_utils", "torch._dynamo.repro.after_aot", "torch._dynamo.repro.aoti")
_NO_GPU_COMMENT = "# CUDA not initialized (a CPU compile under cagrad): no GPU info collected\n"


@contextlib.contextmanager
def _repro_comment_without_gpu() -> Iterator[None]:
    """Runs the body with Dynamo's ``_cuda_system_info_comment`` swapped,
    in the modules of :data:`REPRO_COMMENT_MODULES`, for one that names no
    GPU while CUDA is not initialized. Inductor writes a runnable repro of
    every graph it compiles (the ``fx_graph_runnable`` artifact of
    ``TORCH_TRACE``); its comment names each GPU through
    ``torch.cuda.get_device_name``, which initializes CUDA. The text is a
    log artifact only: the compiled code does not depend on it."""
    from . import internals

    if not internals.ok("dynamo_repro_comment"):
        yield
        return
    for name in REPRO_COMMENT_MODULES[:2]:
        importlib.import_module(name)
    original = sys.modules[REPRO_COMMENT_MODULES[0]]._cuda_system_info_comment
    original = getattr(original, "cagrad_original", original)

    def comment() -> str:
        return original() if torch.cuda.is_initialized() else _NO_GPU_COMMENT

    comment.cagrad_original = original  # type: ignore[attr-defined]
    with _bound_names_swapped(REPRO_COMMENT_MODULES, "_cuda_system_info_comment", original, comment):
        yield


@contextlib.contextmanager
def _triton_left_unprobed() -> Iterator[None]:
    """Runs the body with inductor's ``triton_disable_device_detection``
    set, so that ``torch.utils._triton.has_triton`` answers False without
    asking the GPU its compute capability (which initializes CUDA; inductor
    asks on the first kernel of any device, CPU included). The body is a
    CPU compile (CUDA is not initialized), whose kernels are C++ unless the
    user chose ``cpu_backend = "triton"``; then nothing is changed. Where
    the body populated ``has_triton``'s cache, that cache is cleared
    afterwards, so a later CUDA compile asks the GPU as without cagrad."""
    try:
        config = importlib.import_module("torch._inductor.config")
    except ImportError:  # a torch without inductor: nothing to answer
        yield
        return
    triton_utils = sys.modules.get("torch.utils._triton")
    has_triton = getattr(triton_utils, "has_triton", None)
    if (
        not hasattr(config, "triton_disable_device_detection")
        or getattr(config, "cpu_backend", "cpp") == "triton"
        or not callable(getattr(has_triton, "cache_clear", None))
    ):
        yield
        return
    with _fills_forgotten(has_triton):
        was = config.triton_disable_device_detection
        config.triton_disable_device_detection = True
        try:
            yield
        finally:
            _flush_runtime_metrics()
            config.triton_disable_device_detection = was


def _flush_runtime_metrics() -> None:
    """Logs now the compile metrics Dynamo would log at the compiled
    graph's first call. A compile that no Dynamo frame surrounds (cagrad's)
    records its timings in Dynamo's runtime metrics context
    (``torch._dynamo.utils.get_runtime_metrics_context``), whose ``finish``
    runs at the next call of any compiled graph and asks ``has_triton``;
    finished here, that question is answered inside the compile's window.
    A no-op where torch has no such context."""
    utils = sys.modules.get("torch._dynamo.utils")
    context = getattr(utils, "get_runtime_metrics_context", None)
    try:
        finish = getattr(context() if callable(context) else None, "finish", None)
        if callable(finish):
            finish()
    except Exception as e:  # noqa: BLE001 - torch's metrics logging, never the user's program
        log.debug("cagrad: Dynamo's runtime metrics were not logged (%s: %s)", type(e).__name__, e)


@contextlib.contextmanager
def _bound_names_swapped(modules: tuple[str, ...], attr: str, original: Any, stand_in: Any) -> Iterator[None]:
    """Runs the body with ``attr`` set to ``stand_in`` in each module of
    ``modules`` already imported that binds it to ``original`` (``from m
    import f`` binds a module's own name), and puts each back after."""
    swapped = []
    for name in modules:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, attr, None) is original:
            setattr(mod, attr, stand_in)
            swapped.append(mod)
    try:
        yield
    finally:
        for mod in swapped:
            setattr(mod, attr, original)


@contextlib.contextmanager
def _fills_forgotten(fn: Any) -> Iterator[None]:
    """Runs the body; where ``fn`` (a ``functools.cache``d function, or
    anything without ``cache_info``: then nothing is done) had an empty
    cache before and the body filled it, clears that cache afterwards, so
    no answer given inside the body outlives it."""
    info = getattr(fn, "cache_info", None)
    empty = callable(info) and info().currsize == 0
    try:
        yield
    finally:
        if empty and info().currsize:
            fn.cache_clear()


@contextlib.contextmanager
def cuda_left_uninitialized() -> Iterator[None]:
    """Runs the body with Dynamo's ``preserve_rng_state`` swapped for
    :func:`_lazy_cuda_preserver`'s in every module of
    :data:`RNG_PRESERVER_MODULES` already imported (see the module
    docstring); a no-op where CUDA is unavailable or already initialized,
    or where the internal ``dynamo_preserve_rng_state`` failed its check
    (the compile may then initialize CUDA, as torch.compile's does)."""
    if not torch.cuda.is_available() or torch.cuda.is_initialized():
        yield
        return
    from . import internals

    if not internals.ok("dynamo_preserve_rng_state"):
        yield
        return
    original = sys.modules["torch._dynamo.utils"].preserve_rng_state
    original = getattr(original, "cagrad_original", original)
    stand_in = _lazy_cuda_preserver(original)
    with (
        _bound_names_swapped(RNG_PRESERVER_MODULES, "preserve_rng_state", original, stand_in),
        _system_info_left_unread(),
        _repro_comment_without_gpu(),
        _triton_left_unprobed(),
    ):
        yield
