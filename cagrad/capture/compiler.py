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
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

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

from ..autograd import run_context, saved_variables
from ..autograd.graph_task import GraphTask
from ..autograd.saved_variables import SwapSavedVariables
from ..autograd.validate import validate_outputs
from ..autograd.walk import BackwardWalk, Kind, NodePlan
from ..errors import Unsupported
from ..keys import subclasses
from ..keys.compiled_node_args import Collector
from ..keys.sizes import SizeCheck, static_check, symbolic_check
from . import shape_env
from .graph_checks import (
    check_no_opaque_calls,
    check_subclass_capture,
    holds_nested_int,
    prune,
    returns_input,
)
from .layouts import Spec
from .node_apply import NodeApplication
from .opaque_calls import OpaqueCalls
from .shells import LiftedShell
from .traced import OPAQUE_TARGETS, PLACEHOLDERS, Traced

log = logging.getLogger("cagrad")


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


class AutogradCompilerInstance(NodeApplication, OpaqueCalls):
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
        elif not self.symbolic and holds_nested_int(t):
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
                # a view with a size 0 holds no element: the sum above may
                # then fall below its offset (a diagonal past the matrix,
                # at a storage offset), where no base is needed beyond it
                extent = torch.sym_max(extent, offset + 1)
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
            check_subclass_capture(self.symbolic)
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
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                stack.enter_context(self.fake_mode)
                stack.enter_context(self.proxy_mode)
                stack.enter_context(
                    SwapSavedVariables([h for h, _ in swapped], [f for _, f in swapped])
                )
                walk.start([f for _, f in lifted[: self.num_roots]])
                walk.run()
        finally:
            # a trace that raised too: the frames it kept keep the
            # backward's tensors in their locals
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
            check_no_opaque_calls(tracer.graph)
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
            returns_input(outputs, fakes),
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
        used_inputs = prune(graph, "inputs")
        used_sizes = prune(graph, "sizes")
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
