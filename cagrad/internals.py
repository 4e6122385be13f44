"""The torch internals cagrad relies on, each checked where it is first used.

cagrad reads and wraps parts of torch that are not public API and change
between releases (the generated ``Functions.h``, ``Function.apply``, the
engine object, C struct layouts). Each one is an :class:`Internal` in
:data:`REGISTRY`: its name, the torch object it is, the cagrad module that
uses it, a check, and the feature that turns off when the check fails.
A failed check never raises: it logs the reason once (WARNING, ``cagrad``
logger), adds the feature to ``cagrad.counters["disabled_features"]``, and
the backwards that need the feature run in eager autograd, counted in
``cagrad.counters["fallback_reasons"]`` under ``internal:<name>``. So an
unknown torch can make cagrad do less, but never crash at import nor give a
gradient that differs from eager's.

Features (what turns off):

=====================  ========================================================
``engine``             every backward: eager runs it (reason ``internal:<name>``)
``custom_function``    custom ``autograd.Function`` nodes: backwards with one
                       fall back
``generated_nodes``    nodes generated from derivatives.yaml (``MulBackward0``
                       ...): backwards with one fall back
``native``             the C++ extension: Python paths instead, and no check
                       for hooks added from C++ (see :mod:`cagrad.native`)
``ddp_hooks``          DDP's reducer hooks are not known: backwards that reach
                       them fall back (``invisible_hooks``)
``torch_compat``       :func:`cagrad.torch_compat.install` (serving
                       ``torch._dynamo.compiled_autograd``) does nothing
``lazy_cuda``          a CPU backward's compile may initialize CUDA on a
                       machine with a GPU (see :mod:`cagrad.lazy_cuda`)
``nested_tensors``     jagged nested tensors: backwards with one fall back
                       (``internal:<name>``)
=====================  ========================================================

The table of every internal is in docs/torch-internals.md;
``python -m cagrad.doctor`` runs every check on the installed torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from .counters import counters
from .errors import Unsupported

log = logging.getLogger("cagrad")

FEATURES = (
    "engine", "custom_function", "generated_nodes", "native", "ddp_hooks", "torch_compat", "lazy_cuda",
    "nested_tensors",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Internal:
    """One torch internal cagrad relies on.

    Attributes:
        name: a stable slug; the fallback reason is ``internal:<name>``.
        torch_object: what in torch it is (dotted names, C++ files).
        used_by: the cagrad module(s) that use it.
        feature: what turns off when ``check`` fails (one of :data:`FEATURES`).
        check: returns None when the internal is as cagrad expects, else a
            sentence saying what differs; None for internals checked by their
            user, which reports through :func:`report` (the native extension).
    """

    name: str
    torch_object: str
    used_by: str
    feature: str
    check: Callable[[], str | None] | None


REGISTRY: dict[str, Internal] = {}
_lock = threading.RLock()
_results: dict[str, str | None] = {}  # name -> None (works) or why it failed
_off: dict[str, tuple[str, str]] = {}  # feature -> (name, why) of its first failed internal
_checked = False  # every check that needs no cagrad code has run
# True while the checks ran and none failed: what a backward reads first (a
# module attribute read, no call)
clean = False


def register(internal: Internal) -> Internal:
    """Adds ``internal`` to :data:`REGISTRY` (by its name).

    Raises:
        ValueError: an unknown feature.
    """
    if internal.feature not in FEATURES:
        raise ValueError(f"Internal {internal.name!r}: unknown feature {internal.feature!r}")
    REGISTRY[internal.name] = internal
    return internal


def why(name: str) -> str | None:
    """Runs the check of ``name`` once (later calls reuse its result) and
    returns None when it works, else why it is turned off. A check that
    raises counts as failed with the exception as its reason.

    Raises:
        KeyError: ``name`` is not in :data:`REGISTRY`.
    """
    try:
        return _results[name]
    except KeyError:
        pass
    internal = REGISTRY[name]
    if internal.check is None:
        return None  # not reported yet: its user has not run it
    try:
        result = internal.check()
    except Exception as e:  # noqa: BLE001 - a check that cannot run has failed
        result = f"its check raised {type(e).__name__}: {e}"
    report(name, result)
    return _results[name]


def ok(name: str) -> bool:
    """Whether the internal ``name`` works (runs its check on first call)."""
    return why(name) is None


def report(name: str, result: str | None) -> None:
    """Records the outcome of the check of ``name``: None (works) or why it
    failed. A failure is logged once and counted in
    ``counters["disabled_features"]`` (one per failed internal)."""
    global clean
    with _lock:
        if name in _results:
            return
        _results[name] = result
        if result is not None:
            _off.setdefault(REGISTRY[name].feature, (name, result))
            clean = False
    if result is not None:
        internal = REGISTRY[name]
        counters.record_disabled(internal.feature)
        log.warning(
            "cagrad turns off %s: torch's %s (used by %s) is not as cagrad expects: %s",
            internal.feature,
            internal.torch_object,
            internal.used_by,
            result,
        )


def run_checks() -> None:
    """Runs every check not run yet (those with a ``check``; the others are
    reported by their users when they first run)."""
    global _checked, clean
    for name, internal in list(REGISTRY.items()):
        if internal.check is not None:
            why(name)
    with _lock:
        _checked = True
        clean = not _off


def disabled(feature: str) -> tuple[str, str] | None:
    """``(name, why)`` of the first failed internal that turns ``feature``
    off (one known to have failed so far); None if it works."""
    if not _checked:
        run_checks()
    return _off.get(feature)


def require(feature: str) -> None:
    """Raises ``Unsupported("internal:<name>")`` if ``feature`` is off (a
    dict lookup once the checks ran: this runs on every backward).

    Raises:
        Unsupported: an internal of ``feature`` failed its check.
    """
    off = _off.get(feature) if _checked else disabled(feature)
    if off is not None:
        raise Unsupported(f"internal:{off[0]}", f"{REGISTRY[off[0]].torch_object}: {off[1]}")


def require_engine() -> None:
    """:func:`require` of ``"engine"``, the check every backward makes first.

    Raises:
        Unsupported: an internal every backward needs failed its check.
    """
    require("engine")


def guarded(name: str, fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` (an install step using the internal ``name``) if the
    check of ``name`` passes; an exception from it fails the internal.
    Returns what ``fn`` returns, or None."""
    if not ok(name):
        return None
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the internal differs from what cagrad expects
        with _lock:
            _results.pop(name, None)
        report(name, f"installing failed: {type(e).__name__}: {e}")
        return None


def is_off(feature: str) -> bool:
    """Whether ``feature`` is turned off (see :func:`disabled`)."""
    return disabled(feature) is not None


def import_attr(name: str, module: str, attr: str | None = None) -> Any:
    """``module`` (or its ``attr``) imported, or a :class:`Missing` stand-in
    that fails the internal ``name`` when the import fails (a module-level
    import of a private torch module must not break ``import cagrad``)."""
    try:
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    except Exception as e:  # noqa: BLE001 - ImportError, AttributeError, or an import-time error
        what = module if attr is None else f"{module}.{attr}"
        report(name, f"cannot import {what}: {type(e).__name__}: {e}")
        return Missing(name, what)


class Missing:
    """Stands in for a torch object that could not be imported; using it
    raises ``Unsupported("internal:<name>")`` (so a backward falls back)."""

    def __init__(self, name: str, what: str) -> None:
        self._name = name
        self._what = what

    def _fail(self) -> Unsupported:
        return Unsupported(f"internal:{self._name}", f"{self._what} is not available in this torch")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._fail()

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise self._fail()


def results() -> dict[str, str | None]:
    """Every internal's outcome, running the checks not run yet (the
    native extension is reported only once it was loaded)."""
    return {name: why(name) for name in REGISTRY}


def recheck() -> None:
    """Forgets every outcome and the ``disabled_features`` counts and runs
    the checks again (for tests that break an internal, and undo it);
    internals reported by their users are reported again when next used."""
    global _checked, clean
    with _lock:
        _results.clear()
        _off.clear()
        counters.clear_disabled()
        _checked = clean = False
    run_checks()


# ---------------------------------------------------------------------------
# The entries. Checks read torch only (no cagrad module, no RNG draw, no
# graph kept alive); the ones that need cagrad's code are reported by it.


def _missing_attrs(obj: Any, where: str, names: tuple[str, ...]) -> str | None:
    absent = [n for n in names if not callable(getattr(obj, n, None))]
    return f"{where} lacks {', '.join(absent)}" if absent else None


def _check_execution_engine() -> str | None:
    from torch.autograd import graph
    from torch.autograd.variable import Variable

    engine = getattr(Variable, "_execution_engine", None)
    if engine is None:
        return "Variable._execution_engine is missing"
    problem = _missing_attrs(engine, "Variable._execution_engine", ("run_backward", "queue_callback"))
    if problem:
        return problem
    run = getattr(graph, "_engine_run_backward", None)
    code = getattr(run, "__code__", None)
    if code is None or "_execution_engine" not in code.co_names:
        return "torch.autograd.graph._engine_run_backward does not call Variable._execution_engine"
    return None


def _check_graph_task_queries() -> str | None:
    import torch

    problem = _missing_attrs(torch._C, "torch._C", ("_current_graph_task_id", "_will_engine_execute_node"))
    problem = problem or _missing_attrs(
        torch._C._autograd, "torch._C._autograd", ("_get_current_graph_task_keep_graph",)
    )
    if problem:
        return problem
    if torch._C._current_graph_task_id() != -1:
        return "torch._C._current_graph_task_id() is not -1 outside a backward"
    return None


def _check_tensor_hooks() -> str | None:
    import torch
    from torch.autograd import function

    problem = _missing_attrs(torch.Tensor, "torch.Tensor", ("register_hook", "retain_grad"))
    problem = problem or _missing_attrs(function._HookMixin, "torch.autograd.function._HookMixin", ("_register_hook",))
    if problem:
        return problem
    with torch.inference_mode(False), torch.enable_grad():  # cagrad may be imported under no_grad
        x = torch.zeros(1, requires_grad=True)
        y = x * 1.0
    absent = [a for a in ("_backward_hooks", "retains_grad", "_post_accumulate_grad_hooks") if not hasattr(y, a)]
    if absent:
        return f"a tensor lacks {', '.join(absent)}"
    handle = y.grad_fn.register_prehook(lambda g: None)
    try:
        if not callable(getattr(handle, "hooks_dict_ref", None)):
            return "a node hook's RemovableHandle lacks hooks_dict_ref"
    finally:
        handle.remove()
    return None


def _check_saved_tensor_hooks() -> str | None:
    import torch

    return _missing_attrs(
        torch._C._autograd,
        "torch._C._autograd",
        ("_push_saved_tensors_default_hooks", "_pop_saved_tensors_default_hooks", "_get_sequence_nr"),
    )


def _check_node_types() -> str | None:
    import torch
    from torch.autograd import function

    functions = getattr(torch._C, "_functions", None)
    if not isinstance(getattr(functions, "AccumulateGrad", None), type):
        return "torch._C._functions.AccumulateGrad is not a type"
    if not isinstance(getattr(function, "BackwardCFunction", None), type):
        return "torch.autograd.function.BackwardCFunction is not a type"
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros(1, requires_grad=True)
        node = (x * torch.ones(1)).grad_fn
    if getattr(functions, type(node).__name__, None) is not type(node):
        return f"{type(node).__name__} is not in torch._C._functions"
    absent = [
        a
        for a in ("_raw_saved_self", "_saved_other", "_input_metadata", "_sequence_nr", "next_functions", "metadata")
        if not hasattr(node, a)
    ]
    return f"MulBackward0 lacks {', '.join(absent)}" if absent else None


def _check_function_apply() -> str | None:
    from torch.autograd.function import Function

    apply = Function.__dict__.get("apply")
    # torch <= 2.13: a Python classmethod; 2.14: _FunctionBase's C classmethod_descriptor
    if isinstance(apply, classmethod) or type(apply).__name__ == "classmethod_descriptor":
        return None
    return f"Function.apply is a {type(apply).__name__}, not a classmethod"


def _check_materialize_grads() -> str | None:
    import torch

    descriptor = torch._C._FunctionBase.__dict__.get("materialize_grads")
    if not hasattr(descriptor, "__set__"):
        return "torch._C._FunctionBase.materialize_grads is not a settable attribute"
    return None


def _check_input_grad_buffers() -> str | None:
    from torch.autograd.function import BackwardCFunction

    # cagrad.autograd.custom_function.input_grad_buffers_owner, read here
    # without importing that module (it imports this one)
    owner = next((k for k in BackwardCFunction.__mro__ if "input_grad_buffers" in k.__dict__), None)
    if owner is None:
        return None  # torch <= 2.14: no engine buffer reaches a custom backward
    descriptor = owner.__dict__["input_grad_buffers"]
    if not isinstance(descriptor, property):  # 2.15: a Python property of FunctionCtx
        return (
            f"{owner.__name__}.input_grad_buffers is a {type(descriptor).__name__}, "
            "not a property cagrad can answer for the backwards it runs"
        )
    return None


def _check_ddp_reducer() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return None  # no DDP, nothing to record
    from torch.nn.parallel import DistributedDataParallel

    reducer = getattr(dist, "Reducer", None)
    if not isinstance(reducer, type):
        return "torch.distributed.Reducer is not a class"
    if not callable(getattr(DistributedDataParallel, "_build_params_for_reducer", None)):
        return "DistributedDataParallel lacks _build_params_for_reducer"
    # the recording subclass finds the parameters by name in pybind11's signature line
    while "_cagrad_recording" in reducer.__dict__:  # cagrad's own subclass, installed already
        reducer = reducer.__mro__[1]
    signature = (getattr(reducer.__init__, "__doc__", None) or "").split("\n", 1)[0]
    if "(self" not in signature or "params:" not in signature:
        return "torch.distributed.Reducer.__init__ does not take params (its pybind11 signature)"
    return None


def _check_compiled_autograd() -> str | None:
    ca = importlib.import_module("torch._dynamo.compiled_autograd")
    config = importlib.import_module("torch._dynamo.config")
    absent = [
        a
        for a in (
            "_enable", "_disable", "reset", "in_compiled_autograd_region", "compiled_autograd_enabled",
            "active_disable_ctx", "compiled_autograd_enabled_force_eager", "depth",
        )
        if not hasattr(ca, a)
    ]  # fmt: skip
    if absent:
        return f"torch._dynamo.compiled_autograd lacks {', '.join(absent)}"
    if not hasattr(config, "compiled_autograd"):
        return "torch._dynamo.config lacks compiled_autograd"
    return None


def _check_preserve_rng_state() -> str | None:
    utils = importlib.import_module("torch._dynamo.utils")
    fn = getattr(utils, "preserve_rng_state", None)
    if not callable(fn):
        return "torch._dynamo.utils lacks preserve_rng_state"
    return None


def _check_inductor_system_info() -> str | None:
    codecache = importlib.import_module("torch._inductor.codecache")
    base = getattr(codecache, "CacheBase", None)
    descriptor = getattr(base, "__dict__", {}).get("get_system")
    if not isinstance(descriptor, staticmethod) or not callable(descriptor.__func__):
        return "torch._inductor.codecache.CacheBase lacks the staticmethod get_system"
    return None


def _check_repro_comment() -> str | None:
    debug_utils = importlib.import_module("torch._dynamo.debug_utils")
    if not callable(getattr(debug_utils, "_cuda_system_info_comment", None)):
        return "torch._dynamo.debug_utils lacks _cuda_system_info_comment"
    return None


def _check_nested_ints() -> str | None:
    nt = importlib.import_module("torch.nested._internal.nested_tensor")
    registry = getattr(nt, "_tensor_symint_registry", None)
    if registry is None or not hasattr(registry, "__contains__"):
        return "torch.nested._internal.nested_tensor lacks _tensor_symint_registry"
    ni = importlib.import_module("torch.nested._internal.nested_int")
    node = getattr(ni, "NestedIntNode", None)
    missing = _missing_attrs(node, "NestedIntNode", ("nested_int", "nested_int_coeff", "is_nested_int"))
    if node is None or missing:
        return missing or "torch.nested._internal.nested_int lacks NestedIntNode"
    return None


def nested_int_registry() -> Any:
    """torch's map of offsets (or lengths) tensors to their nested ints, or
    None where the ``nested_ints`` internal is not as cagrad expects."""
    if not ok("nested_ints"):
        return None
    return importlib.import_module("torch.nested._internal.nested_tensor")._tensor_symint_registry


for _entry in (
    Internal(
        "execution_engine",
        "Variable._execution_engine (run_backward, queue_callback), called by torch.autograd.graph._engine_run_backward",
        "cagrad.engine",
        "engine",
        _check_execution_engine,
    ),
    Internal(
        "graph_task_queries",
        "torch._C._current_graph_task_id, _will_engine_execute_node, "
        "torch._C._autograd._get_current_graph_task_keep_graph",
        "cagrad.autograd.run_context",
        "engine",
        _check_graph_task_queries,
    ),
    Internal(
        "tensor_hooks",
        "Tensor.register_hook, Tensor.retain_grad, _HookMixin._register_hook, Tensor._backward_hooks, "
        "RemovableHandle.hooks_dict_ref",
        "cagrad.hooks.hooks_census",
        "engine",
        _check_tensor_hooks,
    ),
    Internal(
        "saved_tensor_hooks",
        "torch._C._autograd._push/_pop_saved_tensors_default_hooks, _get_sequence_nr",
        "cagrad.autograd.saved_variables",
        "engine",
        _check_saved_tensor_hooks,
    ),
    Internal(
        "node_types",
        "torch._C._functions (AccumulateGrad, generated node types), BackwardCFunction, "
        "node attributes _raw_saved_*, _input_metadata, _sequence_nr, metadata",
        "cagrad.autograd.node_schema, cagrad.keys.compiled_node_args",
        "engine",
        _check_node_types,
    ),
    Internal(
        "fake_tensor_capture",
        "torch._subclasses.fake_tensor.FakeTensorMode, torch.fx.experimental.symbolic_shapes.ShapeEnv, "
        "torch._dynamo.source.ConstantSource",
        "cagrad.capture.compiler",
        "engine",
        None,  # reported by import_attr where cagrad.capture.compiler imports them
    ),
    Internal(
        "function_apply",
        "torch.autograd.Function.apply (classmethod or C classmethod_descriptor)",
        "cagrad.autograd.custom_function",
        "custom_function",
        _check_function_apply,
    ),
    Internal(
        "materialize_grads",
        "torch._C._FunctionBase.materialize_grads (a settable descriptor)",
        "cagrad.autograd.custom_function",
        "custom_function",
        _check_materialize_grads,
    ),
    Internal(
        "input_grad_buffers",
        "FunctionCtx.input_grad_buffers (torch 2.15: the engine's InputBuffers, handed to a custom backward)",
        "cagrad.autograd.custom_function",
        "custom_function",
        _check_input_grad_buffers,
    ),
    Internal(
        "functions_header",
        "torch/include/torch/csrc/autograd/generated/Functions.h (the node structs' fields)",
        "cagrad.autograd.node_schema",
        "generated_nodes",
        None,  # reported by cagrad.autograd.node_schema when it parses the header
    ),
    Internal(
        "native_extension",
        "torch's C++ headers and libraries, THPFunction/THPVariable layouts, Node hook lists",
        "cagrad.native",
        "native",
        None,  # reported by cagrad.native.load (build and self-tests)
    ),
    Internal(
        "ddp_reducer",
        "torch.distributed.Reducer (subclassed), DistributedDataParallel._build_params_for_reducer",
        "cagrad.hooks.cpp_hooks",
        "ddp_hooks",
        _check_ddp_reducer,
    ),
    Internal(
        "compiled_autograd_entry",
        "torch._dynamo.compiled_autograd (_enable, _disable, reset, its region flags), "
        "torch._dynamo.config.compiled_autograd",
        "cagrad.torch_compat",
        "torch_compat",
        _check_compiled_autograd,
    ),
    Internal(
        "nested_ints",
        "torch.nested._internal.nested_tensor._tensor_symint_registry (offsets -> nested int), "
        "torch.nested._internal.nested_int.NestedIntNode (nested_int, nested_int_coeff, is_nested_int)",
        "cagrad.keys.sizes, cagrad.keys.subclasses, cagrad.capture.compiler",
        "nested_tensors",
        _check_nested_ints,
    ),
    Internal(
        "dynamo_preserve_rng_state",
        "torch._dynamo.utils.preserve_rng_state, bound by name in AOTAutograd and inductor modules",
        "cagrad.lazy_cuda",
        "lazy_cuda",
        _check_preserve_rng_state,
    ),
    Internal(
        "inductor_system_info",
        "torch._inductor.codecache.CacheBase.get_system (a cached staticmethod naming the GPU for "
        "inductor's cache keys), CacheBase.get_local_cache_path",
        "cagrad.lazy_cuda",
        "lazy_cuda",
        _check_inductor_system_info,
    ),
    Internal(
        "dynamo_repro_comment",
        "torch._dynamo.debug_utils._cuda_system_info_comment (names each GPU in the runnable repro inductor "
        "writes of every graph), bound by name in torch._dynamo.repro.after_aot and .aoti",
        "cagrad.lazy_cuda",
        "lazy_cuda",
        _check_repro_comment,
    ),
):
    register(_entry)
del _entry
