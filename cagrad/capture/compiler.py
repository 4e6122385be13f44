"""AutogradCompilerInstance: traces one backward into one FX graph.

The graph's signature is that of torch's compiled autograd graphs:
``forward(inputs, sizes, scalars, hooks, packed_inputs)``. ``inputs`` holds
the lifted tensors (root gradients, then saved tensors in run order);
``sizes`` the values of the symbols that dynamic sizes were traced as (see
:mod:`cagrad.keys.sizes`); ``hooks`` the backward's runtime objects (hook dicts,
opaque nodes, leaves, tensors retaining grad), which opaque calls take as
arguments; ``scalars`` and ``packed_inputs`` are empty in this version. The
graph returns a list: the leaf gradients (one per leaf that gets a defined
gradient, in accumulation order) when accumulation happens after the graph,
then one entry per defined ``autograd.grad`` result.

How it traces: the lifted tensors become fake tensors (FakeTensorMode)
bound to ``inputs[i]`` proxies (with dynamic sizes: fakes whose sizes,
strides and offsets are the SymInts of their size slots, the symbols bound
to ``sizes[j]``); with the fake mode and a ``ProxyTorchDispatchMode`` active
and grad mode off, :class:`BackwardWalk` runs the engine's steps. A traced
node is called on fake gradients while :class:`SwapSavedVariables` makes its
saved tensors unpack to their fakes, so the aten ops of its C++ backward
formula are recorded (with dynamic sizes, nodes that keep sizes as ints run
their Python formula, :mod:`cagrad.autograd.formulas`, instead). Everything else the
engine does becomes a ``call_function`` to :mod:`cagrad.capture.runtime_ops`, whose
outputs are fresh fakes with the metadata the engine guarantees (see
:mod:`cagrad.autograd.walk` for where that is an assumption). Tracing under fake
tensors never reads a value, so the graph depends only on what
:mod:`cagrad.keys.compiled_node_args` put in the key and the size check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from .. import internals

# torch's private tracing machinery; where an import fails, the internal
# "fake_tensor_capture" is off and every backward falls back before a trace
_PROXY = "torch.fx.experimental.proxy_tensor"
ConstantSource = internals.import_attr("fake_tensor_capture", "torch._dynamo.source", "ConstantSource")
FakeTensorMode = internals.import_attr("fake_tensor_capture", "torch._subclasses.fake_tensor", "FakeTensorMode")
ProxyTorchDispatchMode = internals.import_attr("fake_tensor_capture", _PROXY, "ProxyTorchDispatchMode")
PythonKeyTracer = internals.import_attr("fake_tensor_capture", _PROXY, "PythonKeyTracer")
disable_proxy_modes_tracing = internals.import_attr("fake_tensor_capture", _PROXY, "disable_proxy_modes_tracing")
fetch_object_proxy = internals.import_attr("fake_tensor_capture", _PROXY, "fetch_object_proxy")
track_tensor_tree = internals.import_attr("fake_tensor_capture", _PROXY, "track_tensor_tree")

from ..autograd import custom_function, formulas, run_context, saved_variables
from ..autograd.accumulate import dense_strides
from ..autograd.graph_task import GraphTask, NodeCall
from ..autograd.saved_variables import SwapSavedVariables
from ..autograd.validate import validate_outputs
from ..autograd.walk import MUST_BE_NONE, PASS, THIS_CALL, BackwardWalk, Kind, Layout, NodePlan, Obj, ResumePoint
from ..counters import counters
from ..errors import HookTraceFailed, NodeTraceFailed, Unsupported
from ..hooks import backward_tracing
from ..keys import subclasses
from ..keys.compiled_node_args import Collector
from ..keys.sizes import SizeCheck, static_check, symbolic_check
from . import runtime_ops, shape_env
from .shells import LiftedShell

log = logging.getLogger("cagrad")

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

# hook calls whose dict may be traced (Collector.traced_hooks): op -> what
# its hooks are called in logs and node tags
_TRACEABLE_HOOKS = {
    "tensor_pre_hooks": "tensor hook",
    "node_pre_hooks": "node pre-hook",
    "node_post_hooks": "node post-hook",
}

# in a deopt pattern (see cagrad.run.runtime): this result was defined but not
# strided where the graph uses it as strided (see cagrad.capture.segments); truthy,
# so the walk still treats it as defined, and the capture that follows falls
# back (non_strided_tensor) instead of assuming a strided gradient again
NON_STRIDED = "non_strided"

# what an opaque call is assumed to return: (shape, dtype, device, stride)
Spec = tuple[tuple[Any, ...], torch.dtype, torch.device, tuple[Any, ...]]


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
        aliases_input: per graph output, whether it shares storage with a
            graph input (then it must be copied before it becomes ``.grad``).
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
            (:func:`cagrad.keys.subclasses.rebuild`), and ``aliases_input``
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
    aliases_input: list[bool]
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


def _forced_plans(
    collector: Collector, task: GraphTask, force_opaque: frozenset[int]
) -> list[NodePlan]:
    plans = list(collector.plans)
    index = len(collector.objects)
    for pos in sorted(force_opaque):
        plan = plans[pos]
        if plan.kind in (Kind.AOT, Kind.CUSTOM, Kind.CUSTOM_TRACED):
            plans[pos] = NodePlan(Kind.CUSTOM, plan.hooks, node=index, record=plan.record)
        else:
            plans[pos] = NodePlan(Kind.OPAQUE, plan.hooks, node=index)
        index += 1
    return plans


class _AotBackward(torch.fx.Interpreter):
    """Runs an AOTAutograd backward graph op by op, so the trace records it.

    ``aten.view`` becomes ``aten.reshape``: the lazily compiled backward graph
    has not had the view-to-reshape pass the forward's compile applied, and
    saved tensors may not be viewable the way it assumed (torch's compiled
    autograd rewrites the same way when it inlines these graphs).

    Args:
        hooks: ``{graph node name: hook name}`` of the graph's tensor hook
            calls on its ``BackwardState`` (see
            :func:`cagrad.autograd.custom_function.backward_state_hooks`); each runs as
            ``call_hook(hook name, gradient)`` instead (the state placeholder
            is then never read).
    """

    def __init__(
        self,
        module: torch.fx.GraphModule,
        hooks: dict[str, str] | None = None,
        call_hook: Any = None,
    ) -> None:
        super().__init__(module)
        self.hooks = hooks or {}
        self.call_hook = call_hook

    def run_node(self, n: torch.fx.Node) -> Any:
        name = self.hooks.get(n.name) if n.op == "call_function" else None
        if name is None:
            return super().run_node(n)
        return self.call_hook(name, self.env[n.args[0]])

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.aten.view.default:
            target = torch.ops.aten.reshape.default
        return super().call_function(target, args, kwargs)


# what an inlined AOT backward graph gets for its BackwardState input: the
# state's only uses run as ``call_hook`` and never read it
_STATE_PLACEHOLDER = object()


def run_aot_backward(
    info: tuple[Any, Any, Any],
    saved: list,
    symints: list,
    grads: list,
    call_hook: Any = None,
) -> Any:
    """Runs an AOTAutograd backward graph as torch's compiled autograd
    inlines it (``proxy_call_aot_backward``): prologue, graph, epilogue.

    Args:
        info: the node's :func:`~cagrad.autograd.custom_function.aot_inline_info`.
        saved, symints, grads: the ctx's saved tensors and symints and the
            materialized incoming gradients.
        call_hook: for a graph that takes a ``BackwardState``:
            ``call_hook(hook name, gradient) -> gradient`` runs each of its
            tensor hooks.
    """
    bw_module, prologue, epilogue = info
    all_args = prologue(saved, list(symints), [], list(grads))
    state = custom_function.backward_state_hooks(bw_module)
    hooks = None
    if state is not None:
        # torch's convention: [*symints, *saved, *grads, backward_state]
        _, hooks = state
        num_placeholders = sum(1 for n in bw_module.graph.nodes if n.op == "placeholder")
        if hooks is None or call_hook is None or len(all_args) != num_placeholders - 1:
            raise RuntimeError("cannot pass the BackwardState of this AOT backward graph")
        all_args = [*all_args, _STATE_PLACEHOLDER]
    return epilogue(_AotBackward(bw_module, hooks, call_hook).run(*all_args))


class _Passed:
    """An item of an opaque call's result that the trace does not look at
    (:data:`~cagrad.autograd.walk.PASS`): later opaque calls get it as it is."""

    __slots__ = ("proxy",)

    def __init__(self, proxy: torch.fx.Proxy) -> None:
        self.proxy = proxy


def contiguous_strides(shape: Sequence[Any]) -> tuple[Any, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch computes them)."""
    strides = []
    acc: Any = 1
    for s in reversed(shape):
        strides.append(acc)
        acc = acc * torch.sym_max(s, 1)
    return tuple(reversed(strides))


def dimension_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dimensions from the outermost (largest stride) to the
    innermost. A dimension of one element right inside another of the same
    stride (dense strides in this order give it that stride, as ``t`` has);
    other ties in index order."""
    stride, shape = t.stride(), t.shape
    return tuple(sorted(range(t.dim()), key=lambda d: (-stride[d], shape[d] == 1, d)))


def strides_in_order(shape: Sequence[Any], order: Sequence[int]) -> tuple[Any, ...]:
    """The strides of a dense tensor of ``shape`` whose dimensions, from the
    outermost, are ``order`` (a permutation, :func:`dimension_order`; the
    identity gives :func:`contiguous_strides`)."""
    strides: list[Any] = [None] * len(shape)
    acc: Any = 1
    for d in reversed(order):
        strides[d] = acc
        acc = acc * torch.sym_max(shape[d], 1)
    return tuple(strides)


def _spec_of(value: Any) -> Spec | None:
    if value is None:
        return None
    if isinstance(value, Layout):
        # learnt from a run (BackwardWalk's profile): the real layout
        spec = _spec_of(value.expected)
        if spec is None or sorted(value.order) != list(range(len(spec[0]))):
            return spec
        return (spec[0], spec[1], spec[2], strides_in_order(spec[0], value.order))
    if isinstance(value, torch.Tensor):
        # what an opaque call returning "this gradient, maybe replaced" is
        # assumed to return: this layout if it is dense (a copy into it is
        # always possible), else the contiguous one
        shape, stride = tuple(value.shape), tuple(value.stride())
        if not (value.is_contiguous() or dense_strides(shape, stride)):
            stride = contiguous_strides(shape)
        return (shape, value.dtype, value.device, stride)
    # (shape, dtype, device): the engine's promise for a gradient on an edge
    shape, dtype, device = value
    shape = tuple(shape)
    return (shape, dtype, device, contiguous_strides(shape))


class AutogradCompilerInstance:
    """Builds the graph for one backward (a new instance per capture).

    Args:
        task: the backward's structure and run order.
        collector: what was collected for it (plans, lifted tensors, size
            slots and where they sit).
        accumulate_at_end: see :class:`Traced`.
        profile: None patterns seen at speculative calls (see
            :class:`~cagrad.autograd.walk.BackwardWalk`).
        dynamic_slots: the size slots to trace as symbols.
        force_opaque: positions of nodes to run as they are (they failed to
            trace before).
        distinct_slots: slots that changed while slots of the same value
            did not, in an earlier backward of these keys, each mapped to
            its values in the earlier captures of these keys (a set: no
            history).

    Duck sizing: dynamic slots with the same value at capture share one
    symbol, as ``torch.compile``'s ShapeEnv does by default, except that
    ``distinct_slots`` share symbols only among themselves, and only those
    that had equal values in every earlier capture too: sizes that were
    told apart once (two experts of a mixture that received 3 and 5 tokens)
    never share a symbol again because their values happen to be equal at
    this capture (both 4), which made data-dependent sizes recapture at
    most steps. Giving each slot a symbol of its own instead made the trace
    learn every equality the graph needs as a guard (one sympy evaluation
    each) and cost 4-5x the static trace; the price of duck sizing is one
    more capture when two sizes that were equal in every capture so far
    stop being equal (a batch of 4 beside a layer of width 4), after which
    they stay apart.

    Sizes of 0 and 1: ``distinct_slots`` get symbols that may be 0 or 1
    (range ``[0, inf]``, or ``[1, inf]`` with 0 specialized on a torch whose
    sources were not read for it, :func:`cagrad.capture.shape_env.create_symbol`),
    traced in a :class:`~cagrad.capture.shape_env.TraceShapeEnv`; other
    slots keep torch's specialization of 0 and 1 (range ``[2, inf]``).
    """

    def __init__(
        self,
        task: GraphTask,
        collector: Collector,
        accumulate_at_end: bool,
        profile: dict | None = None,
        dynamic_slots: frozenset[int] = frozenset(),
        force_opaque: frozenset[int] = frozenset(),
        distinct_slots: Mapping[int, tuple[int, ...]] | frozenset[int] = frozenset(),
    ) -> None:
        self.task = task
        self.collector = collector
        self.force_opaque = force_opaque
        self.plans = _forced_plans(collector, task, force_opaque)
        self.args = collector.args
        self.num_roots = len(task.root_edges)
        self.accumulate_at_end = accumulate_at_end and not force_opaque
        self.profile = profile
        self.tracer = PythonKeyTracer()
        self.tracer.root = torch.nn.Module()
        self.tracer.graph = torch.fx.Graph(tracer_cls=PythonKeyTracer)
        self.tracer.tensor_attrs = {}
        values = collector.sizes.values
        self.slot_values: list[Any] = list(values)
        self.graph_symbols: list[Any] = []  # sympy symbols, in sizes[j] order
        self.graph_symints: list[torch.SymInt] = []
        self.symbolic = bool(dynamic_slots)
        if self.symbolic:
            self.shape_env = shape_env.trace_shape_env()
            self.fake_mode = FakeTensorMode(
                allow_fallback_kernels=True, allow_non_fake_inputs=False, shape_env=self.shape_env
            )
            by_symbol: dict[Any, torch.SymInt] = {}
            duck: dict[tuple[Any, ...], Any] = {}
            history = distinct_slots if isinstance(distinct_slots, Mapping) else {}
            zero_one = shape_env.zero_one_symbols()
            one_symbols = False
            for k in sorted(dynamic_slots):
                v = values[k]
                distinct = k in distinct_slots
                group = (v, distinct, history.get(k, ()))
                sym = duck.get(group)
                if sym is None:
                    source = ConstantSource(f"size{k}")
                    sym = shape_env.create_symbol(self.shape_env, v, source, zero_one and distinct)
                    duck[group] = sym
                    one_symbols = one_symbols or (zero_one and distinct and not sym.is_number)
                if sym.is_number:
                    continue  # a specialized 0 or 1: the slot stays static
                symint = by_symbol.get(sym)
                if symint is None:
                    symint = self.shape_env.create_symintnode(sym, hint=v, source=source)
                    by_symbol[sym] = symint
                    self.graph_symbols.append(sym)
                    self.graph_symints.append(symint)
                self.slot_values[k] = symint
            # where no symbol may be 1, every query guards as before; and
            # where a node has more than one input: their number (a split's
            # outputs) may follow a size, which no key field records, and
            # the contiguity guards answered without one pinned it
            self.shape_env.answer_queries = one_symbols and not any(
                c.node is not None and c.needed and len(c.input_metadata) > 1 for c in task.order
            )
        else:
            self.shape_env = None
            self.fake_mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=False)
        self.proxy_mode = ProxyTorchDispatchMode(self.tracer, "symbolic")
        self.hooks_proxy: torch.fx.Proxy | None = None

    # -- helpers ------------------------------------------------------------
    def _proxy(self, t: torch.Tensor) -> torch.fx.Proxy:
        if subclasses.is_wrapper_subclass(t):
            # a subclass value has no proxy of its own (its inner tensors do):
            # it cannot be an opaque call's argument
            raise Unsupported("tensor_subclass", f"a {type(t).__name__} passed to a call the graph does not trace")
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

    def _lifted_fake(self, i: int, t: torch.Tensor, handed_out: set[int]) -> torch.Tensor:
        """A fake of its own for lifted tensor ``i``.

        Each position gets a distinct fake even where the same tensor is
        lifted twice (one tensor saved by two nodes): the cache key does not
        record which lifted tensors are the same, so the graph must not read
        one of them in place of the other (it would, with a shared fake: the
        proxy of the last position wins, and a later hit where the two are
        different tensors used the wrong one).
        """
        if isinstance(t, LiftedShell) and not self.symbolic:
            # a trace after the run freed the tensor (cagrad.capture.shells)
            shape, stride, offset = list(t.shape), list(t.stride()), t.storage_offset()
        elif not self.symbolic and _holds_nested_int(t):
            # from_tensor would describe its nested int, which a fake mode
            # without a ShapeEnv cannot make: a fake of its own (the jagged
            # tensor rebuilt from it gets the captured nested int)
            shape, stride, offset = list(t.shape), list(t.stride()), t.storage_offset()
        elif not self.symbolic:
            fake = self.fake_mode.from_tensor(t)
            if id(fake) not in handed_out:
                handed_out.add(id(fake))
                return fake
            if t.layout is not torch.strided or t.is_conj() or t.is_neg():
                raise Unsupported(
                    "aliased_inputs",
                    f"lifted tensor {i} ({t.layout}, conj {t.is_conj()}, neg {t.is_neg()}) "
                    "is lifted twice and cannot get a fake of its own",
                )
            shape, stride, offset = list(t.shape), list(t.stride()), t.storage_offset()
        else:
            start = self.args.geometry[i]
            ndim = t.dim()
            v = self.slot_values
            shape = v[start : start + ndim]
            stride = v[start + ndim : start + 2 * ndim]
            offset = v[start + 2 * ndim]
        with self.fake_mode:
            if isinstance(offset, int) and offset == 0:
                fake = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
            else:
                extent = offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1
                base = torch.empty((extent,), dtype=t.dtype, device=t.device)
                fake = base.as_strided(shape, stride, offset)
            if t.requires_grad:
                fake.requires_grad_(True)
        return fake

    # -- Executor -------------------------------------------------------------
    def metadata(self, fn: Any, input_nr: int) -> tuple:
        target = self.task.call_of[fn]
        md = target.input_metadata[input_nr]
        shape = md.shape
        if self.symbolic:
            start = self.collector.metadata_slots.get((target.id, input_nr))
            if start is not None:
                shape = self.slot_values[start : start + len(shape)]
        return shape, md.dtype, md.device

    def validate(self, name: str, edges: Sequence[Any], grads: list, origin: str) -> list:
        marker = self._last_node()
        out = validate_outputs(name, edges, grads, self.metadata)
        self._tag_since(marker, origin)
        return out

    def add(self, a: Any, b: Any, origin: str) -> Any:
        marker = self._last_node()
        out = a + b
        self._tag_since(marker, origin)
        return out

    def _sym_attr(self, call: NodeCall, attr: str) -> Any:
        slots = self.collector.attr_slots[(call.id, attr)]
        if slots is None:
            return None
        if isinstance(slots, tuple):
            return [self.slot_values[k] for k in slots]
        return self.slot_values[slots]

    def apply_traced(self, pos: int, call: NodeCall, inputs: list) -> list:
        name = call.name
        marker = self._last_node()
        try:
            if name in formulas.FORMULAS and (self.symbolic or name in formulas.ALWAYS):
                out = formulas.apply(
                    name,
                    call.node,
                    inputs,
                    lambda attr: self._sym_attr(call, attr),
                    lambda i: self.metadata(*call.edges[i]),
                )
            else:
                out = call.node(*inputs)
        except Unsupported:
            raise
        except formulas.NonStridedGradient as e:
            raise NodeTraceFailed(f"non_strided_gradient:{name}", str(e), pos) from e
        except Exception as e:
            raise NodeTraceFailed(f"trace_failed:{name}", f"{type(e).__name__}: {e}", pos) from e
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for g in outs:
            if g is not None and g.layout is not torch.strided and not subclasses.is_wrapper_subclass(g):
                # (EmbeddingBackward0 with sparse=True): the node runs as it
                # is, and its gradient is checked where it returns (see
                # cagrad.capture.segments: it may reach .grad, not a traced op)
                raise NodeTraceFailed(
                    f"non_strided_gradient:{name}", f"{name} returns a {g.layout} gradient", pos
                )
        self._tag_since(marker, f"{name} (NodeCall {pos})")
        return outs

    def apply_aot(self, pos: int, call: NodeCall, plan: NodePlan, inputs: list) -> list:
        node = call.node
        info = custom_function.aot_inline_info(node)
        symints = self._sym_attr(call, "symints") or []
        origin = f"{call.name} (NodeCall {pos})"

        def call_hook(name: str, grad: torch.Tensor) -> torch.Tensor:
            # a tensor hook of the forward's BackwardState (runtime object
            # plan.node): an opaque call assumed to keep the gradient's
            # shape, dtype and device, which runtime_ops checks
            return self.opaque(
                "backward_state_hook",
                (Obj(plan.node), name, grad),
                grad,
                f"{origin} hook {name}",
                None,
                pos,
            )

        def backward(args: list) -> Any:
            saved = list(node.saved_tensors)
            return run_aot_backward(info, saved, list(symints), args, call_hook)

        return self._apply_pynode(pos, call, plan, inputs, backward, origin)

    def apply_custom(self, pos: int, call: NodeCall, plan: NodePlan, inputs: list) -> list:
        """Traces a custom Function's backward (accepted by
        :mod:`cagrad.hooks.backward_tracing`) inside PyNode's steps: its
        ``ctx.saved_tensors`` unpack to their fakes (the swap), and what it
        reads of the ctx is in the key. Any failure (a value read, an op
        without a fake kernel, an error eager would raise) makes the node
        run as it is in the next try (:class:`NodeTraceFailed`)."""
        node = call.node
        origin = f"{call.name} (NodeCall {pos})"
        fn = backward_tracing.user_backward(node, run_context.create_graph())

        def backward(args: list) -> Any:
            if fn is None:  # (the key said traceable: not reached)
                raise RuntimeError("the backward is no longer traceable")
            # a ctx torch.Size reads as its size slots (symbolic where they
            # are dynamic): put in the ctx for the trace, then put back
            own = node.__dict__
            real = {}
            for attr, _ in backward_tracing.ctx_sizes(node, run_context.create_graph()):
                real[attr] = own[attr]
                own[attr] = torch.Size(self._sym_attr(call, "ctx." + attr))
            try:
                return fn(node, *args)
            finally:
                own.update(real)

        outs = self._apply_pynode(pos, call, plan, inputs, backward, origin)
        counters.bump("custom_functions_traced")
        return outs

    def _apply_pynode(
        self, pos: int, call: NodeCall, plan: NodePlan, inputs: list, backward: Any, origin: str
    ) -> list:
        """PyNode's steps (:func:`custom_function.apply`) around ``backward``,
        traced; the ops it adds are tagged with ``origin``. A failure other
        than Unsupported raises NodeTraceFailed (the node then runs as it is)."""
        node = call.node
        marker = self._last_node()
        try:
            outs = custom_function.apply(
                node, plan.record, call.edges, inputs, backward, self.metadata,
                self._output_shape(call, plan),
            )
        except Unsupported:
            raise
        except Exception as e:
            raise NodeTraceFailed(f"trace_failed:{call.name}", f"{type(e).__name__}: {e}", pos) from e
        self._tag_since(marker, origin)
        return outs

    def _output_shape(self, call: NodeCall, plan: NodePlan) -> Any:
        """Forward output ``i``'s shape for its materialized zero gradient:
        its size slots where the key has them (see
        :meth:`Collector.write_outputs`), else the target's metadata."""

        def output_shape(i: int) -> Sequence[Any]:
            start = self.collector.output_slots.get((call.id, i))
            if start is None:
                return self.metadata(call.node, i)[0]
            return self.slot_values[start : start + len(plan.record.outputs[i].shape)]

        return output_shape

    def _arg(self, a: Any) -> Any:
        if isinstance(a, Obj):
            return self.hooks_proxy[a.index]
        if isinstance(a, _Passed):
            return a.proxy
        if isinstance(a, torch.Tensor):
            return self._proxy(a)
        if isinstance(a, (list, tuple)):
            return [self._arg(x) for x in a]
        return a

    def opaque(self, op: str, args: tuple, result: Any, origin: str, resume: Any, pos: int) -> Any:
        if op in _TRACEABLE_HOOKS and args[0].index in self.collector.traced_hooks:
            traced = self._trace_hooks(op, args[0].index, args[1:], origin)
            if traced is not None:
                return traced[0]
        target = getattr(runtime_ops, op)
        proxy = self.tracer.create_proxy("call_function", target, tuple(self._arg(a) for a in args), {})
        node = proxy.node
        node.meta["autograd_node"] = origin
        # whose call or hook it is (a segmented run releases the saved
        # tensors of every earlier node before it: cagrad.run.runtime)
        node.meta["cagrad_pos"] = pos
        if op == "accumulate" and args[2] is not None and args[2].index in self.collector.ddp_python_hooks:
            node.meta["cagrad_ddp_python_hooks"] = True
        if result is None:
            return None
        if isinstance(result, list):
            specs = [
                r if r is MUST_BE_NONE else None if r is PASS else _spec_of(r) for r in result
            ]
            outs: list = []
            for i, spec in enumerate(specs):
                if result[i] is PASS:
                    # not checked (spec None): the value goes on as it is
                    item = proxy[i]
                    item.node.meta["autograd_node"] = origin
                    outs.append(_Passed(item))
                    continue
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
            if NON_STRIDED in (self.profile or {}).get((pos, phase), ()):
                raise Unsupported(
                    "non_strided_tensor",
                    f"{origin} returned a non-strided (sparse) gradient that the graph "
                    "would use as a strided one",
                )
            node.meta["cagrad_resume"] = ResumePoint(
                pos,
                phase,
                {k: [self._name(v) for v in vs] for k, vs in buffers.items()},
                [self._name(v) for v in captured],
                [] if inputs is None else [node.name if v is THIS_CALL else self._name(v) for v in inputs],
            )
        return outs

    def _trace_hooks(self, op: str, index: int, args: tuple, origin: str) -> tuple[Any] | None:
        """Records one hook dict (``hooks[index]``, each hook accepted by
        :mod:`cagrad.hooks.hook_tracing`) as traced ops on its gradients
        (``args``: ``op``'s arguments after the dict); returns ``(result,)``
        (the new gradient, or list of them for node hooks), or None (nothing
        recorded) where a hook does not trace (it reads a value, or returns
        what eager would reject): the caller then records the opaque call,
        which runs the hooks, and raises eager's error, at run time. A None
        gradient is handed to the hooks as eager does; one that returns a
        tensor for it fails here.
        """
        hooks = self.collector.objects[index]
        kind = _TRACEABLE_HOOKS[op]
        graph = self.tracer.graph
        marker = self._last_node()
        try:
            result = getattr(runtime_ops, "traced_" + op)(hooks, *args)
        except Exception as e:  # noqa: BLE001 - any failure: the hooks run opaque
            node = self._last_node()
            while node is not marker:
                prev = node.prev
                graph.erase_node(node)
                node = prev
            counters.bump("hooks_opaque")
            log.info("%s: %s run opaque (%s: %s)", origin, kind, type(e).__name__, e)
            if self.accumulate_at_end:
                # the leaves would be accumulated after an opaque hook that
                # might read them: trace again with every hook opaque
                raise HookTraceFailed("hook_trace_failed", f"{origin}: {type(e).__name__}") from e
            return None
        self._tag_since(marker, f"{origin} {kind}")
        counters.bump("hooks_traced")
        return (result,)

    # -- capture --------------------------------------------------------------
    def capture(self) -> Traced:
        """Traces the backward.

        Raises:
            Unsupported: any failure to trace (an op without a fake kernel, a
                value read, a tensor that was not lifted, a size the check
                cannot express), with the node named; eager then runs the
                backward and raises eager's own error if there is one.
        """
        tracer = self.tracer
        placeholders = {
            name: tracer.create_proxy("placeholder", name, (), {}) for name in PLACEHOLDERS
        }
        inputs_proxy = placeholders["inputs"]
        self.hooks_proxy = placeholders["hooks"]
        if self.graph_symints:
            sizes_proxy = placeholders["sizes"]
            track_tensor_tree(
                self.graph_symints,
                [sizes_proxy[j] for j in range(len(self.graph_symints))],
                constant=None,
                tracer=tracer,
            )
        real = self.args.tensors
        subclass = self.collector.has_subclass
        if subclass:
            _check_subclass_capture(self.symbolic)
        with self.fake_mode:
            handed_out: set[int] = set()
            fakes = [self._lifted_fake(i, t, handed_out) for i, t in enumerate(real)]
        track_tensor_tree(
            fakes, [inputs_proxy[i] for i in range(len(fakes))], constant=None, tracer=tracer
        )
        with self.fake_mode:
            lifted = subclasses.unflatten(self.args.groups, self.args.slots, fakes)
        swapped = [(saved_variables.holder(slot), f) for slot, f in lifted if slot is not None]
        walk = BackwardWalk(
            self.task,
            self.plans,
            self,
            self.accumulate_at_end,
            self.profile,
            retain_at_end=self.accumulate_at_end and not run_context.create_graph(),
        )
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(self.fake_mode)
            stack.enter_context(self.proxy_mode)
            stack.enter_context(
                SwapSavedVariables([h for h, _ in swapped], [f for _, f in swapped])
            )
            walk.start([f for _, f in lifted[: self.num_roots]])
            walk.run()
        if self.shape_env is not None:
            self.shape_env.forget_probe()
        for read in inputs_proxy.node.users:
            # what the trace's fake values (meta["val"], detached) do not keep
            read.meta["cagrad_requires_grad"] = fakes[read.args[1]].requires_grad
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
        retain_outputs = []
        for obj, g in walk.retained:
            retain_outputs.append((obj, len(outputs)))
            outputs.append(g)
        output_specs = None
        if subclass:
            _check_no_opaque_calls(tracer.graph)
            if retain_outputs:
                raise Unsupported("tensor_subclass", "a tensor subclass in a backward with retain_grad")
            flat: list[torch.Tensor] = []
            output_specs = [subclasses.flatten(o, "a gradient the graph returns", flat) for o in outputs]
            outputs = flat
            if not any(output_specs):
                output_specs = None
        tracer.create_node(
            "output", "output", (tracer.create_arg([self._proxy(o) for o in outputs]),), {}
        )
        graph_module, used_inputs, used_sizes = self._finish()
        check, size_inputs, to_value = self._size_check(used_sizes)
        return Traced(
            graph_module,
            used_inputs,
            leaf_outputs,
            capture_outputs,
            _aliases_input(outputs, fakes),
            self.accumulate_at_end,
            check,
            size_inputs,
            to_value,
            self.plans,
            self.force_opaque,
            self.shape_env,
            output_specs,
            retain_outputs,
        )

    def _size_check(self, used_sizes: list[int]) -> tuple[SizeCheck, list[Any], Any]:
        values = self.collector.sizes.values
        if not self.symbolic:
            return static_check(values), [], lambda v: (lambda *_sym: v)
        env = self.shape_env
        if env.unbacked_var_to_val if hasattr(env, "unbacked_var_to_val") else False:
            raise Unsupported("dynamic_shapes", "the backward has data-dependent sizes")
        exprs = [v.node.expr if isinstance(v, torch.SymInt) else v for v in self.slot_values]
        try:
            check = symbolic_check(values, exprs, env)
            size_inputs = [check.function(self.graph_symbols[j]) for j in used_sizes]
        except ValueError as e:
            raise Unsupported("dynamic_shapes", str(e)) from e

        def to_value(x: Any) -> Any:
            if isinstance(x, torch.SymInt):
                return check.function(x.node.expr)
            return lambda *_sym, x=x: x

        return check, size_inputs, to_value

    def _finish(self) -> tuple[torch.fx.GraphModule, list[int], list[int]]:
        graph = self.tracer.graph
        for node in graph.nodes:
            if node.op == "get_attr":
                raise Unsupported(
                    "constant_tensor",
                    f"the trace captured a tensor that is not a graph input ({node.target})",
                )
        if run_context.create_graph():
            self._keep_saved_differentiable(graph)
        # a value a resume point names must exist when that point is reached,
        # even if the rest of the graph does not use it (a pending gradient
        # of a node that is only captured, say): the interpreter reads it
        resumed: set[str] = set()
        for node in graph.nodes:
            point = node.meta.get("cagrad_resume")
            if point is not None:
                for names in (*point.buffers.values(), point.captured, point.inputs):
                    resumed.update(n for n in names if n is not None)
        graph.eliminate_dead_code(
            is_impure_node=lambda n: (
                n.is_impure() or n.target in OPAQUE_TARGETS or n.name in resumed
            )
        )
        used_inputs = _prune(graph, "inputs")
        used_sizes = _prune(graph, "sizes")
        graph.lint()
        return (
            torch.fx.GraphModule(self.tracer.root, graph, "CompiledAutograd"),
            used_inputs,
            used_sizes,
        )


    def _keep_saved_differentiable(self, graph: torch.fx.Graph) -> None:
        """For ``create_graph=True``: drops the ``detach`` that unpacking a
        saved tensor records.

        ``SavedVariable::unpack`` rebuilds the saved tensor around the
        unpacked data (``make_variable``), which a proxy tensor records as
        ``aten.detach``. On real tensors the rebuilt variable carries the
        saved tensor's own grad_fn edge (or grad accumulator), so a graph
        recorded under grad mode flows through it; the lifted input is that
        very variable, so the graph uses it as it is.
        """
        slots = self.args.slots
        ph = next(n for n in graph.nodes if n.op == "placeholder" and n.target == "inputs")
        for read in list(ph.users):
            if read.op != "call_function" or read.args[0] is not ph:
                continue
            if slots[read.args[1]] is None:
                continue  # a root gradient, not a saved tensor
            for user in list(read.users):
                if user.op == "call_function" and user.target is torch.ops.aten.detach.default:
                    user.replace_all_uses_with(read)
                    graph.erase_node(user)


def _check_subclass_capture(symbolic: bool) -> None:
    """What a backward with a tensor subclass does not compile (see
    :mod:`cagrad.keys.subclasses`)."""
    if run_context.create_graph():
        raise Unsupported(
            "tensor_subclass",
            "create_graph=True with a tensor subclass (a rebuilt subclass gradient has no graph)",
        )
    if symbolic:
        raise Unsupported("tensor_subclass", "dynamic sizes in a backward with a tensor subclass")


def _check_no_opaque_calls(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in OPAQUE_TARGETS:
            raise Unsupported(
                "tensor_subclass",
                f"a tensor subclass in a backward with opaque calls ({node.meta.get('autograd_node', node.name)})",
            )


def _prune(graph: torch.fx.Graph, placeholder: str) -> list[int]:
    """Renumbers ``<placeholder>[i]`` reads so the list holds only used items."""
    ph = next(n for n in graph.nodes if n.op == "placeholder" and n.target == placeholder)
    reads = sorted(
        (u for u in ph.users if u.op == "call_function" and u.args[0] is ph),
        key=lambda u: u.args[1],
    )
    used = []
    for new_index, user in enumerate(reads):
        used.append(user.args[1])
        user.args = (ph, new_index)
    return used


def _aliases_input(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[bool]:
    storages = {StorageWeakRef(t.untyped_storage()) for t in inputs}
    return [StorageWeakRef(o.untyped_storage()) in storages for o in outputs]


def _holds_nested_int(t: torch.Tensor) -> bool:
    """Whether ``t`` is a nested tensor's offsets (or lengths), holding its
    nested int, or a view of a nested tensor or of such a tensor (a
    ``values()`` saved for a node)."""
    registry = internals.nested_int_registry()
    if registry is None:
        return False
    base = t._base
    return t in registry or (base is not None and (base.is_nested or base in registry))
