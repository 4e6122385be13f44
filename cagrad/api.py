"""The public API: enable, reset, capture, explain."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from . import engine
from . import explain as explain_mod
from .autograd import run_context, transforms
from .capture import leaf_hook_groups
from .compile.variants import trace_with_retries
from .keys.collection import CollectedBackward, check_supported_mode, collect_backward
from .compile.backends import CompilerFn
from .compile.cuda_graphs import check_mode
from .counters import counters
from .keys.cache import CacheNode
from .keys.cache_key import CacheKey


def enable(
    compiler_fn: CompilerFn = "inductor",
    dynamic: bool | None = None,
    mode: str | None = None,
    cache_dir: str | os.PathLike | bool | None = None,
) -> _Enabled:
    """Runs every backward started inside the context through cagrad.

    ``Tensor.backward``, ``torch.autograd.backward`` and
    ``torch.autograd.grad`` walk the autograd graph, look its cache keys up,
    and on a miss trace the whole backward into one FX graph that
    ``compiler_fn`` compiles; on a hit they re-collect the inputs and call the
    compiled graph. Gradients and ``.grad`` updates are eager's. A backward
    cagrad cannot compile runs in eager autograd, counted in
    ``cagrad.counters["fallbacks"]`` with its reason.

    Args:
        compiler_fn: a ``torch.compile`` backend name (``"eager"``,
            ``"aot_eager"``, ``"inductor"``, ...) or a callable
            ``torch.fx.GraphModule -> callable``. The callable gets graphs
            with the signature ``(inputs, sizes, scalars, hooks,
            packed_inputs)`` (lists) returning a list of gradients.
        dynamic: None (the default): the first capture of a graph is
            static; the first backward that differs from it only in sizes
            traces the graph once more with every size that may be dynamic
            as a symbol, after which any sizes are a cache hit (the static
            graph keeps serving the sizes it was traced for). Tracing with
            symbols costs 2 to 12 times a static trace (torch's ``SymInt``
            arithmetic on every op), which a loop whose sizes never change
            does not pay this way. True: sizes are symbols from the first
            capture: a backward that differs from a cached one only in sizes
            is a cache hit, and the backend compiles the graph for any size.
            With None or True, sizes equal at capture share a symbol (duck
            sizing, as ``torch.compile``'s): when they stop being equal (a
            batch of 4 beside a layer width of 4, then a batch of 5) the
            graph is traced once more with them apart, and hits from then
            on. False: sizes start static; the first time a backward differs
            from a cached one only in sizes, only the sizes that changed
            become symbols and the graph is traced once more, after which any
            value of them is a cache hit (torch's compiled autograd's
            STATIC -> DYNAMIC ``SizeInput``). Either way, sizes a C++ node
            keeps with no Python formula stay static (see
            :mod:`cagrad.autograd.formulas`).
        mode: ``"reduce-overhead"`` replays each whole-graph compiled
            backward on CUDA as a CUDA graph (parameters read in place,
            other inputs copied into the graph's buffers; one graph per
            tuple of sizes, at most :data:`cagrad.compile.cuda_graphs.MAX_GRAPHS`);
            backwards where that is not safe (opaque calls, CPU inputs,
            ``create_graph``) run without one, counted in
            ``cagrad.counters["cudagraph_skips"]`` with the reason. None or
            ``"default"``: no CUDA graphs. See :mod:`cagrad.compile.cuda_graphs`.
        cache_dir: a directory where captured graphs are kept across
            processes (warm start): a capture first looks its graph up
            there and, if found and its size check accepts the sizes,
            rebuilds it instead of tracing (``counters["disk_hits"]``; it
            still counts as a capture); a graph that was traced is written
            there once its compile succeeded (``disk_stores``). The backend's
            own disk caches (inductor's) then find their compiled code
            too. None (the default): the environment variable
            ``CAGRAD_CACHE_DIR`` if set, else no disk cache; False: none.
            Only graphs that depend on nothing but their keys are stored:
            not those of a callable ``compiler_fn`` or of backends other
            than ``"eager"``, ``"aot_eager"`` and ``"inductor"``, nor graphs
            with hooks, opaque calls, custom ``autograd.Function``\\ s or
            compiled-forward (AOT) backwards (``disk_skips``). See
            :mod:`cagrad.compile.disk_cache` for the key and the file format.

    Contexts nest; the innermost one's compiler is used, and each compiler
    keeps its own cache until :func:`reset`. A context belongs to the thread
    that entered it: backwards that other threads run meanwhile stay eager
    (unless they are inside contexts of their own), and it must be left in
    that thread.

    Raises:
        TypeError / ValueError: for a ``compiler_fn`` that is neither a
            registered backend name nor a callable (on entering); an
            unknown ``mode``, a ``dynamic`` other than None, True and
            False, or a ``CAGRAD_LEAF_HOOK_GROUP_BYTES`` that is not a
            number of bytes (ValueError, at once).
        RuntimeError: on leaving contexts out of order, or from another
            thread (the context stays open and can still be left properly).
        cagrad.CacheFileError: from a backward whose file in the cache
            directory is not a cagrad cache file, was written by another
            format, torch, Python or cagrad version, is truncated or corrupt,
            holds another key, or cannot be rebuilt; nothing of that
            backward has run. Delete the file named in the error. A file
            that cannot be written is logged (warning) and skipped.
    """
    if dynamic not in (None, True, False):
        raise ValueError(f"cagrad.enable: dynamic must be None, True or False, not {dynamic!r}")
    leaf_hook_groups.group_bytes()  # a malformed setting fails here, not at a capture
    return _Enabled(compiler_fn, dynamic, check_mode(mode), cache_dir)


class _Enabled:
    """The context manager :func:`enable` returns (single use)."""

    def __init__(
        self, compiler_fn: CompilerFn, dynamic: bool | None, cuda_graphs: bool = False, cache_dir: Any = None
    ) -> None:
        self._args = (compiler_fn, dynamic, cuda_graphs, cache_dir)
        self._state: engine.EnableState | None = None

    def __enter__(self) -> None:
        if self._state is not None:
            raise RuntimeError("a cagrad.enable context cannot be entered twice; call enable() again")
        self._state = engine.push(*self._args)

    def __exit__(self, *exc: object) -> None:
        if self._state is None:
            raise RuntimeError("this cagrad.enable context was not entered")
        engine.pop(self._state)  # raises, leaving it open, when out of order
        self._args = None  # type: ignore[assignment]


def reset() -> None:
    """Empties every compiled-graph cache and sets all counters to zero."""
    engine.clear_caches()
    counters.clear()


@dataclasses.dataclass
class Capture:
    """What :func:`capture` returns.

    Attributes:
        graph_module: the backward's FX graph, exactly as a ``compiler_fn``
            would receive it.
        cache_keys: one :class:`CacheKey` per autograd node, in the order the
            engine runs them (a ``GraphRoot`` first when there are several
            roots).
        task_key: the key of the backward as a whole (mode, root gradients'
            metadata, inputs), which precedes ``cache_keys`` in the cache.
        size_values: every size slot of the backward, in slot order: its
            value (int) where it may become a symbol, None where it stays
            static (sizes a C++ node keeps with no Python formula, values
            too large to be symbols). With ``dynamic=True``, slots of equal
            value share a symbol (duck sizing, see :func:`enable`).
    """

    graph_module: torch.fx.GraphModule
    cache_keys: list[CacheKey]
    task_key: CacheKey
    size_values: tuple[int | None, ...] = ()


def capture(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    grad_outputs: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    dynamic: bool = False,
    create_graph: bool = False,
) -> Capture:
    """Traces the backward of ``outputs`` without running it.

    With ``inputs=None`` the backward is that of ``torch.autograd.backward(
    outputs, grad_outputs)`` (gradients for every leaf); with ``inputs`` it is
    that of ``torch.autograd.grad(outputs, inputs, grad_outputs)``. Nothing
    is compiled or run, no ``.grad`` changes, the graph is not released, and
    the cache and counters are untouched.

    Args:
        outputs: the roots; each must require grad.
        grad_outputs: gradients of the roots (implicit ones for scalars).
        inputs: tensors to differentiate with respect to, or None.
        dynamic: trace every size that may be dynamic as a symbol (the graph
            ``enable(dynamic=True)`` would compile); False: static sizes.
        create_graph: the backward of ``backward(..., create_graph=True)``
            (or ``grad``'s): its task key says so and saved tensors enter the
            graph differentiable, as the graph a double backward needs.

    Raises:
        cagrad.Unsupported: if the backward cannot be compiled (the reason
            says why).
        RuntimeError: for arguments eager autograd rejects.
    """
    outs, grads, ins = backward_arguments(outputs, grad_outputs, inputs)
    check_supported_mode(create_graph)
    # collected and traced as inside the engine's create_graph backward
    ctx = run_context.running(run_context.RunContext(create_graph=True)) if create_graph else contextlib.nullcontext()
    with ctx:
        collected = collect_or_raise(outs, grads, ins, accumulate_grad=inputs is None, create_graph=create_graph)
        sizes = collected.collector.sizes
        slots = frozenset(i for i, ok in enumerate(sizes.dynamic_ok) if ok) if dynamic else frozenset()
        traced = trace_with_retries(collected, CacheNode(), slots, count=False)
    values = tuple(v if ok else None for v, ok in zip(sizes.values, sizes.dynamic_ok))
    return Capture(traced.graph_module, collected.node_keys, collected.task_key, values)


def backward_arguments(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    grad_outputs: torch.Tensor | Sequence[torch.Tensor | None] | None,
    inputs: torch.Tensor | Sequence[torch.Tensor] | None,
) -> tuple[tuple, tuple, tuple]:
    """``(outputs, grad_outputs, inputs)`` as tuples, the implicit root
    gradients created as ``torch.autograd.backward`` creates them.

    Raises:
        RuntimeError: for a non-scalar root without a gradient (eager's).
    """
    outs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    if grad_outputs is None:
        grads: tuple = (None,) * len(outs)
    elif isinstance(grad_outputs, torch.Tensor):
        grads = (grad_outputs,)
    else:
        grads = tuple(grad_outputs)
    grads = torch.autograd._make_grads(outs, grads, is_grads_batched=False)
    ins = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    return outs, grads, ins


def collect_or_raise(
    outs: tuple, grads: tuple, ins: tuple, accumulate_grad: bool, create_graph: bool = False
) -> CollectedBackward:
    """:func:`~cagrad.keys.collection.collect_backward`, raising eager's own
    error where eager would raise (a freed graph, a modified saved tensor),
    and Unsupported under a functorch transform, before anything is collected
    (:mod:`cagrad.autograd.transforms`)."""
    from .errors import EagerError

    transforms.check_call(outs, grads, ins)
    try:
        return collect_backward(outs, grads, ins, accumulate_grad=accumulate_grad, create_graph=create_graph)
    except EagerError as e:
        raise e.cause from None


def explain(
    outputs: Any,
    grad_outputs: Any = None,
    inputs: Any = None,
    compiler_fn: Any = "inductor",
    dynamic: bool | None = None,
) -> explain_mod.Diagnosis:
    """Whether ``backward``/``grad`` of ``outputs`` would hit cagrad's cache.

    Collects the backward as :func:`cagrad.enable` would (nothing is run,
    traced or compiled, no ``.grad`` changes) and looks it up in the cache of
    ``(compiler_fn, dynamic)``.

    Args:
        outputs, grad_outputs, inputs: as for :func:`cagrad.capture`.
        compiler_fn, dynamic: which cache to look in (as given to
            :func:`cagrad.enable`).

    Returns:
        a :class:`Diagnosis`; ``str()`` of it is one line for a log.

    Raises:
        cagrad.Unsupported: the backward would run in eager anyway.
        RuntimeError: for arguments eager autograd rejects.
    """
    outs, grads, ins = backward_arguments(outputs, grad_outputs, inputs)
    collected = collect_or_raise(outs, grads, ins, accumulate_grad=inputs is None)
    return explain_mod.diagnose(engine.cache_for(compiler_fn, dynamic), collected.keys, collected.collector.sizes)
