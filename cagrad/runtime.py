"""The runtime wrapper: runs a compiled backward and applies its results."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import saved_variables
from .accumulate import accumulate_grad
from .cache import CompiledEntry
from .compiled_node_args import TensorArgs
from .graph_task import GraphTask

UNUSED_MESSAGE = (
    "One of the differentiated Tensors appears to not have been used in the "
    "graph. Set allow_unused=True if this is the desired behavior."
)


def call_compiled(entry: CompiledEntry, args: TensorArgs) -> list[torch.Tensor]:
    """Calls the compiled graph on this backward's lifted tensors.

    Returns:
        the graph's outputs (see :class:`cagrad.compiler.Traced`).
    """
    tensors = args.tensors
    inputs = [tensors[i] for i in entry.traced.input_indices]
    with torch.no_grad():
        outs = entry.fn(inputs, [], [], [], [])
    entry.calls += 1
    return list(outs)


def apply_results(
    entry: CompiledEntry,
    task: GraphTask,
    args: TensorArgs,
    outs: Sequence[torch.Tensor],
    keep_graph: bool,
    allow_unreachable: bool,
) -> tuple[torch.Tensor | None, ...] | None:
    """Releases the graph, fills ``.grad``, returns ``autograd.grad``'s tuple.

    Raises:
        RuntimeError: eager's "appears to not have been used in the graph"
            error, after the backward ran, as eager raises it.
    """
    traced = entry.traced
    if not keep_graph:
        for slot in args.slots:
            if slot is not None:
                saved_variables.release(slot)
    stealable = [not a for a in traced.aliases_input]
    seen: set[int] = set()
    for i, out in enumerate(outs):
        # a backend may hand back one buffer for two outputs (e.g. after CSE);
        # only one of them may become a .grad without a copy
        ptr = out.untyped_storage().data_ptr()
        if ptr:
            if ptr in seen:
                stealable[i] = False
            seen.add(ptr)
    order = task.order
    for pos, out_idx in traced.leaf_outputs:
        accumulate_grad(order[pos].node.variable, outs[out_idx], stealable[out_idx])
    if task.accumulate_grad:
        return None
    result = tuple(None if i is None else outs[i] for i in traced.capture_outputs)
    if not allow_unreachable and any(r is None for r in result):
        raise RuntimeError(UNUSED_MESSAGE)
    return result
