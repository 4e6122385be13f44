"""cagrad: a compiled autograd for PyTorch, written in Python.

Inside ``with cagrad.enable(compiler_fn):`` every backward pass is walked,
keyed node by node (:class:`CacheKey`), looked up in a shadow-graph cache,
and on a miss traced whole into one FX graph that ``compiler_fn`` compiles.
See docs/DESIGN.md for the architecture; the modules map onto it:

=====================  =====================================================
``graph_task``         GraphTask: dependencies, ``inputs=``, eager's order
``ready_queue``        the engine's priority queue, ties included
``node_schema``        what each node type saves, and what Python can't see
``compiled_node_args`` CompiledNodeArgs: one node's key and lifted tensors
``cache_key``          CacheKey and its byte encoding
``cache``              CacheNode trie, compiled entries, fallback verdicts
``saved_variables``    SavedTensorHolder and SwapSavedVariables
``hooks_census``       finding every hook a backward would run
``_hook_counts``       hooks the census missed, read from C++ hook lists
``cpp_hooks``          hooks added from C++ (DDP's reducer) and their calls
``host``               a GraphTask of torch's around a graph, for C++ callbacks
``walk``               the engine's per-node steps, for tracing and running
``compiler``           AutogradCompilerInstance: the trace
``interpreter``        the walk on real tensors (finishing deopted runs)
``runtime_ops``        opaque calls: hooks, opaque nodes, AccumulateGrad
``custom_function``    custom autograd.Function backward as PyNode runs it
``segments``           graphs cut at opaque calls, compiled per segment
``validate``           the engine's validate_outputs
``accumulate``         AccumulateGrad semantics for ``.grad``
``runtime``            the runtime wrapper around a compiled graph
``compiled_backward``  one backward: collect, look up, capture, run
``engine``             the stand-in for torch's autograd engine
``run_context``        the running backward as torch's engine describes it
``backends``           compiler_fn resolution
``counters``           counters and fallback reasons
``sizes``              size slots (SizeInput) and per-variant size checks
``formulas``           Python formulas for nodes that keep sizes as ints
``explain``            why a backward misses the cache
``logs``               the cagrad / cagrad.verbose loggers, CAGRAD_LOGS
``events``             capture and run listeners
``disk_cache``         captured graphs stored on disk (warm start, cache_dir)
``graph_serde``        captured graphs and size expressions as plain data
=====================  =====================================================
"""

from . import cpp_hooks as _cpp_hooks
from . import custom_function as _custom_function
from . import hooks_census as _hooks_census
from . import logs as _logs
from . import run_context as _run_context
from .api import Capture, capture, enable, reset
from .cache_key import CacheKey
from .counters import counters
from .errors import CacheFileError, Unsupported
from .explain import Diagnosis, explain
from .logs import set_logs

_hooks_census.install()
_custom_function.install()
_run_context.install()
_cpp_hooks.install()
try:
    _logs.from_env()
except ValueError as _e:
    _logs.log.warning("%s", _e)

__all__ = [
    "CacheFileError",
    "CacheKey",
    "Capture",
    "Diagnosis",
    "Unsupported",
    "capture",
    "counters",
    "enable",
    "explain",
    "reset",
    "set_logs",
]
