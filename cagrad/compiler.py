"""AutogradCompilerInstance: traces one backward into one FX graph.

The graph's signature is that of torch's compiled autograd graphs:
``forward(inputs, sizes, scalars, hooks, packed_inputs)``, where ``inputs``
is the list of lifted tensors (root gradients, then saved tensors in run
order) and the other lists are empty in this version. It returns a list of
gradients: first one per leaf that receives a defined gradient (in the order
its ``AccumulateGrad`` runs), then, for ``autograd.grad``, one per captured
input gradient that is defined.

How it traces: the lifted tensors become fake tensors (FakeTensorMode)
bound to ``inputs[i]`` proxies; with the fake mode and a
``ProxyTorchDispatchMode`` active and grad mode off, each node is called in
run order on fake gradients while :class:`SwapSavedVariables` makes its saved
tensors unpack to their fakes. The aten ops its C++ backward formula runs are
recorded. Between nodes the engine's own steps are replayed in Python and so
recorded too: ``validate_outputs`` on every edge and the input-buffer sums.
Tracing under fake tensors never reads a value, so the graph depends only on
what :mod:`cagrad.compiled_node_args` put in the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    PythonKeyTracer,
    fetch_object_proxy,
    track_tensor_tree,
)
from torch.multiprocessing.reductions import StorageWeakRef

from .compiled_node_args import TensorArgs
from .errors import Unsupported
from .graph_task import GraphTask, NodeCall
from .node_schema import NodeKind
from . import saved_variables
from .saved_variables import SwapSavedVariables
from .validate import validate_outputs

PLACEHOLDERS = ("inputs", "sizes", "scalars", "hooks", "packed_inputs")


@dataclasses.dataclass
class Traced:
    """The result of one capture.

    Attributes:
        graph_module: the backward as one GraphModule (see module docstring).
        input_indices: for each graph input ``inputs[j]``, the index of the
            lifted tensor in :class:`TensorArgs` it is (unused ones pruned).
        leaf_outputs: ``(position in GraphTask.order, graph output index)``
            of every leaf gradient, in accumulation order.
        capture_outputs: per ``autograd.grad`` input, its graph output index
            or None (no gradient reaches it).
        aliases_input: per graph output, whether it shares storage with a
            graph input (then it must be copied before it becomes ``.grad``).
    """

    graph_module: torch.fx.GraphModule
    input_indices: list[int]
    leaf_outputs: list[tuple[int, int]]
    capture_outputs: list[int | None]
    aliases_input: list[bool]


class AutogradCompilerInstance:
    """Builds the graph for one backward (a new instance per capture).

    Args:
        task: the backward's structure and run order.
        args: the lifted tensors, root gradients first.
        num_roots: how many of ``args`` are root gradients.
    """

    def __init__(self, task: GraphTask, args: TensorArgs, num_roots: int) -> None:
        self.task = task
        self.args = args
        self.num_roots = num_roots
        self.tracer = PythonKeyTracer()
        self.tracer.root = torch.nn.Module()
        self.tracer.graph = torch.fx.Graph(tracer_cls=PythonKeyTracer)
        self.tracer.tensor_attrs = {}
        self.fake_mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=False)
        self.proxy_mode = ProxyTorchDispatchMode(self.tracer, "symbolic")

    # -- helpers ------------------------------------------------------------
    def _proxy(self, t: torch.Tensor) -> torch.fx.Proxy:
        return fetch_object_proxy(self.tracer, t).proxy

    def _last_node(self) -> torch.fx.Node:
        return next(iter(reversed(self.tracer.graph.nodes)))

    def _tag_since(self, marker: torch.fx.Node, origin: str) -> None:
        node = marker.next
        root = self.tracer.graph._root
        while node is not root:
            node.meta.setdefault("autograd_node", origin)
            node = node.next

    # -- capture --------------------------------------------------------------
    def capture(self) -> Traced:
        """Traces the backward.

        Raises:
            Unsupported: any failure to trace (an op without a fake kernel, a
                value read, a tensor that was not lifted), with the node named;
                eager then runs the backward and raises eager's own error if
                there is one.
        """
        tracer = self.tracer
        placeholders = {
            name: tracer.create_proxy("placeholder", name, (), {}) for name in PLACEHOLDERS
        }
        inputs_proxy = placeholders["inputs"]
        real = self.args.tensors
        with self.fake_mode:
            fakes = [self.fake_mode.from_tensor(t) for t in real]
        track_tensor_tree(
            fakes, [inputs_proxy[i] for i in range(len(fakes))], constant=None, tracer=tracer
        )
        swapped = [
            (saved_variables.holder(slot), f)
            for slot, f in zip(self.args.slots, fakes)
            if slot is not None
        ]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(self.fake_mode)
            stack.enter_context(self.proxy_mode)
            stack.enter_context(
                SwapSavedVariables([h for h, _ in swapped], [f for _, f in swapped])
            )
            leaf_grads, captured = self._walk(fakes[: self.num_roots])
        outputs = [g for _, g in leaf_grads if g is not None]
        leaf_outputs = []
        for pos, g in leaf_grads:
            if g is not None:
                leaf_outputs.append((pos, len(leaf_outputs)))
        capture_outputs: list[int | None] = []
        for g in captured:
            if g is None:
                capture_outputs.append(None)
            else:
                capture_outputs.append(len(outputs))
                outputs.append(g)
        tracer.create_node(
            "output", "output", (tracer.create_arg([self._proxy(o) for o in outputs]),), {}
        )
        graph_module, used_inputs = self._finish()
        return Traced(
            graph_module,
            used_inputs,
            leaf_outputs,
            capture_outputs,
            _aliases_input(outputs, fakes),
        )

    def _walk(self, root_grads: list[torch.Tensor]) -> tuple[list, list]:
        task = self.task
        call_of = task.call_of
        has_exec_info = bool(task.output_edges)
        marker = self._last_node()
        grads = validate_outputs("GraphRoot", task.root_edges, root_grads)
        self._tag_since(marker, "GraphRoot")
        position = {id(call): pos for pos, call in enumerate(task.order)}
        buffers: dict[Any, list] = {}
        if not task.has_graph_root:
            fn, input_nr = task.root_edges[0]
            buffers[fn] = [None] * len(call_of[fn].input_metadata)
            buffers[fn][input_nr] = grads[0]
        leaf_grads: list[tuple[int, torch.Tensor | None]] = []
        captured: list[torch.Tensor | None] = [None] * task.num_captures
        for pos, call in enumerate(task.order):
            node = call.node
            if node is None:
                outs: list = grads
                edges = task.root_edges
            else:
                inputs = buffers.pop(node, None)
                if inputs is None:
                    inputs = [None] * len(call.input_metadata)
                for input_nr, out_idx in call.captures:
                    captured[out_idx] = inputs[input_nr]
                if not call.needed:
                    continue
                if call.schema.kind is NodeKind.ACCUMULATE_GRAD:
                    leaf_grads.append((pos, inputs[0]))
                    continue
                outs, edges = self._apply(pos, call, inputs)
            for (fn, input_nr), g in zip(edges, outs):
                if fn is None:
                    continue
                nxt = call_of[fn]
                if has_exec_info and not (nxt.needed or nxt.captures):
                    continue
                buf = buffers.get(fn)
                if buf is None:
                    buf = buffers[fn] = [None] * len(nxt.input_metadata)
                if g is None:
                    continue
                old = buf[input_nr]
                if old is None:
                    buf[input_nr] = g
                else:
                    # InputBuffer::add: the engine sums gradients in arrival order
                    marker = self._last_node()
                    buf[input_nr] = old + g
                    self._tag_since(marker, f"InputBuffer of {nxt.name} (NodeCall {position[id(nxt)]})")
        return leaf_grads, captured

    def _apply(self, pos: int, call: NodeCall, inputs: list) -> tuple[list, Any]:
        node = call.node
        name = call.name
        marker = self._last_node()
        try:
            out = node(*inputs)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            edges = call.edges
            outs = validate_outputs(name, edges, outs)
        except Unsupported:
            raise
        except Exception as e:
            raise Unsupported(f"trace_failed:{name}", f"{type(e).__name__}: {e}") from e
        for g in outs:
            if g is not None and g.layout is not torch.strided:
                raise Unsupported("non_strided_tensor", f"{name} returned a {g.layout} gradient")
        self._tag_since(marker, f"{name} (NodeCall {pos})")
        return outs, edges

    def _finish(self) -> tuple[torch.fx.GraphModule, list[int]]:
        graph = self.tracer.graph
        for node in graph.nodes:
            if node.op == "get_attr":
                raise Unsupported(
                    "constant_tensor",
                    f"the trace captured a tensor that is not a graph input ({node.target})",
                )
        graph.eliminate_dead_code()
        used_inputs = _prune_inputs(graph)
        graph.lint()
        return torch.fx.GraphModule(self.tracer.root, graph, "CompiledAutograd"), used_inputs


def _prune_inputs(graph: torch.fx.Graph) -> list[int]:
    """Renumbers ``inputs[i]`` reads so the list holds only used tensors."""
    inputs = next(n for n in graph.nodes if n.op == "placeholder" and n.target == "inputs")
    reads = sorted(
        (u for u in inputs.users if u.op == "call_function" and u.args[0] is inputs),
        key=lambda u: u.args[1],
    )
    used = []
    for new_index, user in enumerate(reads):
        used.append(user.args[1])
        user.args = (inputs, new_index)
    return used


def _aliases_input(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[bool]:
    storages = {StorageWeakRef(t.untyped_storage()) for t in inputs}
    return [StorageWeakRef(o.untyped_storage()) in storages for o in outputs]
