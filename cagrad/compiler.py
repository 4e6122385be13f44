"""AutogradCompilerInstance: traces one backward into one FX graph.

The graph's signature is that of torch's compiled autograd graphs:
``forward(inputs, sizes, scalars, hooks, packed_inputs)``. ``inputs`` holds
the lifted tensors (root gradients, then saved tensors in run order);
``hooks`` holds the backward's runtime objects (hook dicts, opaque nodes,
leaves, tensors retaining grad), which opaque calls take as arguments; the
other lists are empty in this version. The graph returns a list: the leaf
gradients (one per leaf that gets a defined gradient, in accumulation order)
when accumulation happens after the graph, then one entry per defined
``autograd.grad`` result.

How it traces: the lifted tensors become fake tensors (FakeTensorMode)
bound to ``inputs[i]`` proxies; with the fake mode and a
``ProxyTorchDispatchMode`` active and grad mode off, :class:`BackwardWalk`
runs the engine's steps. A traced node is called on fake gradients while
:class:`SwapSavedVariables` makes its saved tensors unpack to their fakes, so
the aten ops of its C++ backward formula are recorded. Everything else the
engine does becomes a ``call_function`` to :mod:`cagrad.runtime_ops`, whose
outputs are fresh fakes with the metadata the engine guarantees (see
:mod:`cagrad.walk` for where that is an assumption). Tracing under fake
tensors never reads a value, so the graph depends only on what
:mod:`cagrad.compiled_node_args` put in the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    PythonKeyTracer,
    disable_proxy_modes_tracing,
    fetch_object_proxy,
    track_tensor_tree,
)
from torch.multiprocessing.reductions import StorageWeakRef

from . import runtime_ops, saved_variables
from .accumulate import dense_strides
from .compiled_node_args import TensorArgs
from .errors import Unsupported
from .graph_task import GraphTask, NodeCall
from .saved_variables import SwapSavedVariables
from .validate import validate_outputs
from .walk import MUST_BE_NONE, BackwardWalk, NodePlan, Obj, ResumePoint

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
        "accumulate",
        "call_node",
        "call_custom_function",
    )
)

# value shapes an opaque call is assumed to return: (shape, dtype, device, stride)
Spec = tuple[tuple[int, ...], torch.dtype, torch.device, tuple[int, ...]]


@dataclasses.dataclass
class Traced:
    """The result of one capture.

    Attributes:
        graph_module: the backward as one GraphModule (see module docstring).
        input_indices: for each graph input ``inputs[j]``, the index of the
            lifted tensor in :class:`TensorArgs` it is (unused ones pruned).
        leaf_outputs: ``(position in GraphTask.order, graph output index)``
            of every leaf gradient accumulated after the graph.
        capture_outputs: per ``autograd.grad`` input, its graph output index
            or None (no gradient reaches it).
        aliases_input: per graph output, whether it shares storage with a
            graph input (then it must be copied before it becomes ``.grad``).
        accumulate_at_end: leaves are accumulated after the graph (no opaque
            call could observe ``.grad`` during it).
    """

    graph_module: torch.fx.GraphModule
    input_indices: list[int]
    leaf_outputs: list[tuple[int, int]]
    capture_outputs: list[int | None]
    aliases_input: list[bool]
    accumulate_at_end: bool

    @property
    def has_opaque_calls(self) -> bool:
        return any(
            n.op == "call_function" and n.target in OPAQUE_TARGETS
            for n in self.graph_module.graph.nodes
        )


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch computes them)."""
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _spec_of(value: Any) -> Spec | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        # what an opaque call returning "this gradient, maybe replaced" is
        # assumed to return: this layout if it is dense (a copy into it is
        # always possible), else the contiguous one
        shape, stride = tuple(value.shape), tuple(value.stride())
        if not dense_strides(shape, stride):
            stride = contiguous_strides(shape)
        return (shape, value.dtype, value.device, stride)
    # an _InputMetadata entry: the engine's promise for a gradient on an edge
    shape = tuple(value.shape)
    return (shape, value.dtype, value.device, contiguous_strides(shape))


class AutogradCompilerInstance:
    """Builds the graph for one backward (a new instance per capture).

    Args:
        task: the backward's structure and run order.
        plans: one :class:`NodePlan` per entry of ``task.order``.
        args: the lifted tensors, root gradients first.
        num_roots: how many of ``args`` are root gradients.
        accumulate_at_end: see :class:`Traced`.
    """

    def __init__(
        self,
        task: GraphTask,
        plans: Sequence[NodePlan],
        args: TensorArgs,
        num_roots: int,
        accumulate_at_end: bool,
        profile: dict | None = None,
    ) -> None:
        self.task = task
        self.profile = profile
        self.plans = plans
        self.args = args
        self.num_roots = num_roots
        self.accumulate_at_end = accumulate_at_end
        self.tracer = PythonKeyTracer()
        self.tracer.root = torch.nn.Module()
        self.tracer.graph = torch.fx.Graph(tracer_cls=PythonKeyTracer)
        self.tracer.tensor_attrs = {}
        self.fake_mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=False)
        self.proxy_mode = ProxyTorchDispatchMode(self.tracer, "symbolic")
        self.hooks_proxy: torch.fx.Proxy | None = None

    # -- helpers ------------------------------------------------------------
    def _proxy(self, t: torch.Tensor) -> torch.fx.Proxy:
        return fetch_object_proxy(self.tracer, t).proxy

    def _name(self, t: Any) -> str | None:
        return None if t is None else self._proxy(t).node.name

    def _last_node(self) -> torch.fx.Node:
        return next(iter(reversed(self.tracer.graph.nodes)))

    def _tag_since(self, marker: torch.fx.Node, origin: str) -> None:
        node = marker.next
        root = self.tracer.graph._root
        while node is not root:
            node.meta.setdefault("autograd_node", origin)
            node = node.next

    def _fake(self, spec: Spec) -> torch.Tensor:
        shape, dtype, device, stride = spec
        with disable_proxy_modes_tracing():
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    # -- Executor -------------------------------------------------------------
    def validate(self, name: str, edges: Sequence[Any], grads: list, origin: str) -> list:
        marker = self._last_node()
        out = validate_outputs(name, edges, grads)
        self._tag_since(marker, origin)
        return out

    def add(self, a: Any, b: Any, origin: str) -> Any:
        marker = self._last_node()
        out = a + b
        self._tag_since(marker, origin)
        return out

    def apply_traced(self, pos: int, call: NodeCall, inputs: list) -> list:
        name = call.name
        marker = self._last_node()
        try:
            out = call.node(*inputs)
        except Exception as e:
            raise Unsupported(f"trace_failed:{name}", f"{type(e).__name__}: {e}") from e
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for g in outs:
            if g is not None and g.layout is not torch.strided:
                raise Unsupported("non_strided_tensor", f"{name} returned a {g.layout} gradient")
        self._tag_since(marker, f"{name} (NodeCall {pos})")
        return outs

    def _arg(self, a: Any) -> Any:
        if isinstance(a, Obj):
            return self.hooks_proxy[a.index]
        if isinstance(a, torch.Tensor):
            return self._proxy(a)
        if isinstance(a, (list, tuple)):
            return [self._arg(x) for x in a]
        return a

    def opaque(self, op: str, args: tuple, result: Any, origin: str, resume: Any) -> Any:
        target = getattr(runtime_ops, op)
        proxy = self.tracer.create_proxy("call_function", target, tuple(self._arg(a) for a in args), {})
        node = proxy.node
        node.meta["autograd_node"] = origin
        if result is None:
            return None
        if isinstance(result, list):
            specs = [MUST_BE_NONE if r is MUST_BE_NONE else _spec_of(r) for r in result]
            outs: list = []
            for i, spec in enumerate(specs):
                if spec is None or spec is MUST_BE_NONE:
                    outs.append(None)
                    continue
                item = proxy[i]
                item.node.meta["autograd_node"] = origin
                fake = self._fake(spec)
                track_tensor_tree(fake, item, constant=None, tracer=self.tracer)
                outs.append(fake)
        else:
            specs = _spec_of(result)
            outs = self._fake(specs)
            track_tensor_tree(outs, proxy, constant=None, tracer=self.tracer)
        node.meta["cagrad_spec"] = specs
        if resume is not None:
            pos, phase, buffers, captured, inputs = resume()
            node.meta["cagrad_resume"] = ResumePoint(
                pos,
                phase,
                {k: [self._name(v) for v in vs] for k, vs in buffers.items()},
                [self._name(v) for v in captured],
                [] if inputs is None else [self._name(v) for v in inputs],
            )
        return outs

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
        self.hooks_proxy = placeholders["hooks"]
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
        walk = BackwardWalk(self.task, self.plans, self, self.accumulate_at_end, self.profile)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(self.fake_mode)
            stack.enter_context(self.proxy_mode)
            stack.enter_context(
                SwapSavedVariables([h for h, _ in swapped], [f for _, f in swapped])
            )
            walk.start(fakes[: self.num_roots])
            walk.run()
        outputs = [g for _, g in walk.leaf_grads if g is not None]
        leaf_outputs = []
        for pos, g in walk.leaf_grads:
            if g is not None:
                leaf_outputs.append((pos, len(leaf_outputs)))
        capture_outputs: list[int | None] = []
        for g in walk.captured:
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
            self.accumulate_at_end,
        )

    def _finish(self) -> tuple[torch.fx.GraphModule, list[int]]:
        graph = self.tracer.graph
        for node in graph.nodes:
            if node.op == "get_attr":
                raise Unsupported(
                    "constant_tensor",
                    f"the trace captured a tensor that is not a graph input ({node.target})",
                )
        graph.eliminate_dead_code(
            is_impure_node=lambda n: n.is_impure() or n.target in OPAQUE_TARGETS
        )
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
