"""What cagrad reads from one backward before running it: the call as given
(:class:`BackwardCall`), the global modes it compiles under
(:func:`check_supported_mode`) and the collection (:func:`collect_backward`):
eager's run order, one CacheKey per node, the lifted tensors and the runtime
objects (:class:`CollectedBackward`). Nothing here runs a node or a hook.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import internals
from ..autograd import _hook_counts, run_context
from ..autograd.graph_task import GraphTask
from ..errors import EagerError, Unsupported
from ..hooks.hooks_census import Census
from .cache_key import CacheKey, KeyWriter
from .compiled_node_args import Collector, write_tensor


@dataclasses.dataclass
class CollectedBackward:
    """Everything cagrad reads from one backward before running it.

    Attributes:
        task: structure and run order.
        collector: lifted tensors (root gradients first), runtime objects,
            node plans.
        task_key: the ``GraphTask`` key (roots, inputs, mode).
        node_keys: one CacheKey per node in run order.
        shells: the lifted tensors' metadata, kept by a first run for a
            trace after it (:func:`cagrad.run.runtime.run_segmented`).
    """

    task: GraphTask
    collector: Collector
    task_key: CacheKey
    node_keys: list[CacheKey]
    shells: list | None = None

    @property
    def keys(self) -> list[CacheKey]:
        return [self.task_key, *self.node_keys]

    def run_order(self) -> list[Any]:
        """The nodes in run order (None for the virtual GraphRoot)."""
        return [c.node for c in self.task.order]


def check_supported_mode(create_graph: bool = False) -> None:
    """Raises Unsupported for global modes this version does not compile.

    ``create_graph=True`` is compiled: the graph runs with grad mode on, so
    its result is differentiable as eager's (see :mod:`cagrad.autograd.run_context`).
    """
    if not internals.clean:  # a torch internal failed its check (or the checks did not run yet)
        internals.require_engine()
        off = internals.disabled("ddp_hooks")
        if off is not None and _hook_counts.counts_fn() is None:
            # DDP's reducer hooks are not recorded, and the extension that
            # would see them on the leaves (invisible_hooks) is off too
            raise Unsupported(f"internal:{off[0]}", f"{off[1]}; and cagrad's C++ extension is off")
    if torch.is_anomaly_enabled():
        raise Unsupported("anomaly_mode", "anomaly detection checks every node in eager")
    if torch.is_inference_mode_enabled():
        raise Unsupported("inference_mode", "backward inside inference mode")
    if _any_autocast():
        raise Unsupported("autocast", "backward inside an autocast region")
    if _dispatch_modes():
        # a user's TorchDispatchMode (a FLOP counter, a debug mode) sees
        # eager's kernels in eager, and would see the compiled graph's ops
        raise Unsupported("dispatch_mode", "backward inside a TorchDispatchMode")


def _autocast_on_cpu_or_cuda() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


# how many user TorchDispatchModes are active (torch's infra modes, such as
# FakeTensorMode, are kept apart and not counted); a torch without it: none
_dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


# whether autocast is on for any device type: one C call, about 70 ns (the
# CPU and CUDA checks with torch.cuda.is_available() took 0.7 us a backward
# on this project's CPU machine). An autocast region of another device
# falls back too: eager is right wherever cagrad is not sure.
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", _autocast_on_cpu_or_cuda)


def collect_backward(
    tensors: Sequence[torch.Tensor],
    grad_tensors: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    accumulate_grad: bool,
    create_graph: bool = False,
    census: Census | None = None,
) -> CollectedBackward:
    """Walks the graph in eager's order and collects keys, tensors, objects.

    With ``create_graph`` the key says so (its graph is compiled for grad
    mode on) and root gradients are lifted as they are, differentiable.
    ``census`` is one taken for this backward already (only without
    ``inputs``: with them the GraphTask may add a ``retain_grad`` hook).

    Raises:
        Unsupported: something in the graph cannot be compiled.
        EagerError: eager would raise (see :class:`EagerError`).
    """
    task = GraphTask(tensors, inputs, accumulate_grad)
    collector = Collector(task, census if census is not None else Census())
    w = KeyWriter()
    if create_graph:
        w.tag(b"c")  # absent otherwise: keys of plain backwards are unchanged
    w.tag(b"A" if accumulate_grad else b"G")
    w.size(len(grad_tensors))
    for i, g in enumerate(grad_tensors):
        if g is None:
            raise EagerError(RuntimeError(f"element {i} of gradients tuple is None"))
        what = f"gradient {i} of the roots"
        start = write_tensor(w, g, what, collector.sizes)
        collector.args.add(g.detach() if g.requires_grad and not create_graph else g, None, start)
    for i, (fn, root_nr) in enumerate(task.root_edges):
        root = task.call_of[fn]
        # which node and which of its inputs (the root's output_nr) the root
        # gradient flows into: a root at another output of the same node
        # (aminmax's max after its min) walks the same nodes with the same
        # metadata and differs only here
        w.size(root.id)
        w.size(root_nr)
        collector.write_metadata(w, root, root_nr, f"root edge {i}")
    w.size(len(task.output_edges))
    for fn, input_nr in task.output_edges:
        call = task.call_of.get(fn) if fn is not None else None
        if call is None:
            w.tag(b"N")
        else:
            w.size(call.id)
            w.size(input_nr)
    node_keys = [collector.collect(call) for call in task.order]
    collector.finish()
    return CollectedBackward(task, collector, CacheKey("GraphTask", w.getvalue()), node_keys)


@dataclasses.dataclass
class BackwardCall:
    """The arguments of ``ImperativeEngine.run_backward``, as given."""

    tensors: Sequence[Any]
    grad_tensors: Sequence[Any]
    keep_graph: bool
    create_graph: bool
    inputs: Sequence[Any]
    allow_unreachable: bool
    accumulate_grad: bool

    def run_eager(self, engine: Any) -> Any:
        """Runs the backward in torch's ``engine``, whose GraphTask is the
        current one inside it (callbacks, task id)."""
        with run_context.delegated():
            return engine.run_backward(
                self.tensors,
                self.grad_tensors,
                self.keep_graph,
                self.create_graph,
                self.inputs,
                allow_unreachable=self.allow_unreachable,
                accumulate_grad=self.accumulate_grad,
            )
