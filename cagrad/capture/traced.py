"""What one capture produces: :class:`Traced`, and the names its graph uses.

A capture (:class:`cagrad.capture.compiler.AutogradCompilerInstance`) turns
one backward into one FX graph with the signature of torch's compiled
autograd graphs, ``forward(inputs, sizes, scalars, hooks, packed_inputs)``
(:data:`PLACEHOLDERS`); the graph calls the runtime ops of
:data:`OPAQUE_TARGETS` where the engine's work cannot be traced. The cache
(:mod:`cagrad.keys.cache`), the runtime (:mod:`cagrad.run.runtime`) and the
disk cache (:mod:`cagrad.compile.traced_serde`) read a capture through
:class:`Traced`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from ..keys.sizes import SizeCheck
from . import runtime_ops

PLACEHOLDERS = ("inputs", "sizes", "scalars", "hooks", "packed_inputs")

# the runtime ops a graph may call; they have side effects, so they are never
# removed as dead code
OPAQUE_TARGETS = frozenset(
    getattr(runtime_ops, name)
    for name in (
        "tensor_pre_hooks",
        "retain_grad",
        "node_pre_hooks",
        "node_post_hooks",
        "cpp_post_hooks",
        "accumulate",
        "call_node",
        "call_custom_function",
        "backward_state_hook",
    )
)

# in a deopt pattern (see cagrad.run.runtime): this result was defined but not
# strided where the graph uses it as strided (see cagrad.capture.segments); truthy,
# so the walk still treats it as defined, and the capture that follows falls
# back (non_strided_tensor) instead of assuming a strided gradient again
NON_STRIDED = "non_strided"


@dataclasses.dataclass
class Traced:
    """The result of one capture.

    Attributes:
        graph_module: the backward as one GraphModule (see module docstring).
        input_indices: for each graph input ``inputs[j]``, the index of the
            lifted tensor it is (unused ones pruned).
        leaf_outputs: ``(position in GraphTask.order, graph output index)``
            of every leaf gradient accumulated after the graph.
        capture_outputs: per ``autograd.grad`` input, its graph output index
            or None (no gradient reaches it).
        returns_input: per graph output, whether it is a graph input itself
            (then it is copied before it becomes ``.grad``, as eager copies
            a gradient something else holds; a view of an input is not:
            :func:`cagrad.capture.graph_checks.returns_input`).
        accumulate_at_end: leaves are accumulated after the graph (no opaque
            call could observe ``.grad`` during it).
        check: which size slot values this graph accepts.
        size_inputs: per graph size input ``sizes[j]``, the function of the
            check's symbol values that gives it.
        to_value: turns a SymInt of the trace into a function of the check's
            symbol values (ints pass through as constants); used to evaluate
            opaque calls' assumed shapes at run time.
        plans: the node plans the graph was traced with (nodes forced to run
            as they are included).
        force_opaque: positions of nodes that failed to trace and run as
            they are; their nodes follow the collected runtime objects, in
            position order (see :func:`runtime_objects`).
        shape_env: the trace's ShapeEnv (None when every size is static); a
            backend compiling the graph directly adds its guards to it.
        output_specs: None where every output is plain; else, per output
            (``leaf_outputs`` and ``capture_outputs`` count these), the
            :class:`~cagrad.keys.subclasses.SubclassSpec` of a tensor
            subclass the graph returns as its inner tensors, or None: the
            runtime rebuilds the subclass before anything reads the outputs
            (:func:`cagrad.keys.subclasses.rebuild`), and ``returns_input``
            is per graph output (flat).
        retain_outputs: ``(runtime object index of the weakref to a tensor
            that retains its gradient, graph output index)`` of each
            ``retain_grad`` gradient set as ``.grad`` after the graph, in run
            order (empty where they are opaque calls in the graph).
    """

    graph_module: torch.fx.GraphModule
    input_indices: list[int]
    leaf_outputs: list[tuple[int, int]]
    capture_outputs: list[int | None]
    returns_input: list[bool]
    accumulate_at_end: bool
    check: SizeCheck
    size_inputs: list[Any]
    to_value: Any
    plans: list[Any]
    force_opaque: frozenset[int]
    shape_env: Any = None
    output_specs: list[Any] | None = None
    retain_outputs: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def has_opaque_calls(self) -> bool:
        return any(
            n.op == "call_function" and n.target in OPAQUE_TARGETS
            for n in self.graph_module.graph.nodes
        )


def runtime_objects(objects: list[Any], run_order: Sequence[Any], force_opaque: frozenset[int]) -> list[Any]:
    """The graph's ``hooks`` list: the collected ``objects``, then the
    forced-opaque nodes (``run_order``: the backward's nodes in run order)."""
    return objects + [run_order[pos] for pos in sorted(force_opaque)]
