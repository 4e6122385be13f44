"""cagrad: a compiled autograd for PyTorch, written in Python.

Inside ``with cagrad.enable(compiler_fn):`` every backward pass is walked,
keyed node by node (:class:`CacheKey`), looked up in a shadow-graph cache,
and on a miss traced whole into one FX graph that ``compiler_fn`` compiles.
See docs/DESIGN.md for the architecture; the modules map onto it.
The package follows the pipeline; each stage is a sub-package that imports
only the stages before it (and the leaf modules ``errors``, ``counters``,
``preserve`` and ``internals``, which import only the first two, and
``logs``, ``events`` and ``internal_errors``, which import no more):

==============================  ===============================================
``autograd/`` (eager's rules)
``autograd.graph_task``         GraphTask: dependencies, ``inputs=``, eager's order
``autograd.ready_queue``        the engine's priority queue, ties included
``autograd.node_schema``        what each node type saves, and what Python can't see
``autograd.walk``               the engine's per-node steps, for tracing and running
``autograd.validate``           the engine's validate_outputs
``autograd.accumulate``         AccumulateGrad semantics for ``.grad``
``autograd.saved_variables``    SavedTensorHolder and SwapSavedVariables
``autograd.custom_function``    custom autograd.Function backward as PyNode runs it
``autograd.run_context``        the running backward as torch's engine describes it
``autograd.formulas``           Python formulas for nodes that keep sizes as ints
``autograd._hook_counts``       hooks the census cannot see, from C++ hook lists
``autograd.transforms``         backwards under a functorch transform (eager runs them)
``hooks/``
``hooks.hooks_census``          finding every hook a backward would run
``hooks.cpp_hooks``             hooks added from C++ (DDP's reducer) and their calls
``hooks.hook_tracing``          tensor and node hooks pure enough to trace, their fingerprint
``keys/`` (collect, look up)
``keys.collection``             what a backward is read as before it runs: keys, tensors, objects
``keys.compiled_node_args``     CompiledNodeArgs: one node's key and lifted tensors
``keys.cache_key``              CacheKey and its byte encoding
``keys.sizes``                  size slots (SizeInput) and per-variant size checks
``keys.cache``                  CacheNode trie, compiled entries, fallback verdicts
``keys.hit_path``               generated hit guards (the cache-hit path)
``keys.leaf_hooks``              guards of graphs whose only hooks are C++ post hooks on leaves
``keys.subclasses``             tensor subclasses: keyed, lifted flattened, rebuilt
``capture/`` (trace)
``capture.compiler``            AutogradCompilerInstance: the trace
``capture.traced``              Traced: what a capture produces; the graph's placeholders and opaque targets
``capture.node_apply``          a node's backward applied under the trace (formula, AOT, custom Function)
``capture.opaque_calls``        opaque calls in the trace (runtime ops) and traced hook dicts
``capture.aot_backward``        an AOTAutograd backward graph run op by op under the trace
``capture.layouts``             dense strides in a dimension order; an opaque call's assumed layout
``capture.graph_checks``        checks and passes on a captured graph (subclasses, pruning, aliasing)
``capture.runtime_ops``         opaque calls: hooks, opaque nodes, AccumulateGrad
``capture.segments``            graphs cut at opaque calls, compiled per segment
``capture.shape_env``           the trace's ShapeEnv: sizes of 1 as symbols
``capture.backend_queries``     a backend's size queries answered without a guard (MoE counts)
``capture.leaf_hook_groups``    accumulations with C++ hooks only, grouped (DDP buckets)
``capture.shells``              lifted tensors as metadata, for a retrace after a run freed them
``compile/`` (backend)
``compile.variants``            a new variant of a CacheNode: trace, compile, respeculate, retrace
``compile.backends``            compiler_fn resolution
``compile.direct_compile``      backends called without Dynamo
``compile.specialize``          static-first graphs, specialized per size
``compile.boxed``               boxed calls that free each input after its last use
``compile.cuda_graphs``         CUDA-graph replay (``mode="reduce-overhead"``)
``compile.cuda_graph_host``     a CUDA graph's host inputs, read by value, and unread ones
``compile.cuda_graph_layout``   a CUDA graph's buffers, spans and in-place addresses
``compile.disk_cache``          captured graphs stored on disk (warm start)
``compile.traced_serde``        a capture (Traced) as plain data, and back
``compile.graph_serde``         captured graphs and size expressions as plain data
``compile.marked_sizes``        ``mark_dynamic`` sizes handed to a Dynamo ``compiler_fn`` as symbols
``native/`` (C++ extension)
``native.build``                compiling cagrad_ext.cpp against torch's headers
``native.self_tests``           each C++ function against the Python it replaces
``native.guard_program``        the instructions of the extension's hit-guard walk and collect
``run/`` (run)
``run.runtime``                 the runtime wrapper around a compiled graph
``run.interpreter``             the walk on real tensors (finishing deopted runs)
``run.host``                    a GraphTask of torch's around a graph, for C++ callbacks
``run.guarded``                 a segmented backward run from a hit guard's collection
``run.hits``                    a backward a hit guard accepted: chosen, run, verified
top level
``compiled_backward``           one backward: collect, look up, capture, run
``engine``                      the stand-in for torch's autograd engine
``api``                         ``enable``, ``capture``, ``explain``, ``reset``
``explain``                     why a backward misses the cache
``torch_compat``                torch's compiled-autograd entry points, served by cagrad
``internals``                   the torch internals cagrad relies on, checked; what turns off
``internal_errors``             the safety net: an unexpected error before running is a fallback (leaf)
``doctor``                      ``python -m cagrad.doctor``: those checks on the installed torch
``counters``, ``errors``        counters, fallback reasons, error types (leaves)
``preserve``                    process state cagrad's own work puts back (leaf)
``logs``, ``events``            the loggers and CAGRAD_LOGS; capture and run listeners (leaves)
==============================  ===============================================
"""

from . import internals as _internals
from . import logs as _logs
from .autograd import custom_function as _custom_function
from .autograd import run_context as _run_context
from .counters import counters
from .errors import CacheFileError, Unsupported
from .explain import Diagnosis
from .hooks import cpp_hooks as _cpp_hooks
from .hooks import hooks_census as _hooks_census
from .keys.cache_key import CacheKey
from .logs import set_logs

# after every submodule import: the package attribute `explain` is the function
from .api import Capture, capture, enable, explain, reset  # noqa: E402

# each install needs torch internals that change between releases: where a
# check fails, the install is skipped and what needs it turns off
_internals.run_checks()
_internals.guarded("tensor_hooks", _hooks_census.install)
_internals.guarded("function_apply", _custom_function.install)
_internals.guarded("input_grad_buffers", _custom_function.install_input_grad_buffers)
_internals.guarded("graph_task_queries", _run_context.install)
_internals.guarded("ddp_reducer", _cpp_hooks.install)
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
