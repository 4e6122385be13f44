"""BackwardWalk: the engine's per-node steps, once, for tracing and for running.

For each node in run order the eager engine (``evaluate_function`` and
``call_function`` in torch/csrc/autograd/engine.cpp) does, in this order:

1. take the node's input buffer;
2. with ``inputs=``: a node that is only captured runs its tensor pre-hooks
   on the buffer, records the captured gradients and stops; a needed node
   records its captures from the buffer as it is (before its hooks);
3. tensor pre-hooks (each hooked tensor, in the order its first hook was
   registered), then ``retain_grad`` hooks;
4. node pre-hooks;
5. the node itself (``AccumulateGrad``: into ``.grad`` if a gradient
   arrived, then the leaf's post-accumulate-grad hooks, always), then
   ``validate_outputs`` (which checks valid edges only);
6. post-hooks added from C++ that cagrad knows (DDP's reducer), then node
   post-hooks, on the node's outputs as it returned them: with
   ``inputs=`` a C++ node computes no gradient for an edge whose target does
   not run (unless another edge of the same argument's range is used), while
   an output for an invalid edge that it did compute (``CatBackward0``'s
   slice for an input that does not require grad) stays;
7. each output is added into the input buffer of the edge's target, for
   valid edges whose target runs.

The walk does these steps through an :class:`Executor`: the tracer
(:mod:`cagrad.capture.compiler`) records them into an FX graph, with hooks, opaque
nodes and accumulation as calls to :mod:`cagrad.capture.runtime_ops`; the
interpreter (:mod:`cagrad.run.interpreter`) runs them on real tensors. Steps 4,
5 (for opaque nodes) and 6 can turn a gradient into None, which the trace
cannot know in advance; it assumes "unchanged" and records a
:class:`ResumePoint` there, from which the interpreter finishes a backward
whose assumption failed at run time.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .graph_task import GraphTask, NodeCall


class Kind(enum.Enum):
    """How a node runs in the captured graph."""

    ROOT = "root"  # the virtual GraphRoot
    TRACED = "traced"  # its backward formula is traced into the graph
    OPAQUE = "opaque"  # a C++ node called as it is, at run time
    CUSTOM = "custom"  # a custom autograd.Function, called as PyNode would
    AOT = "aot"  # a torch.compile'd forward's backward, its graph inlined
    CUSTOM_TRACED = "custom_traced"  # a custom autograd.Function, its backward traced
    ACCUMULATE = "accumulate"  # AccumulateGrad


class Phase(enum.IntEnum):
    """Where in a node's steps a resume starts (after which step)."""

    # after the tensor pre-hooks and retain_grad hooks (the last of them, a
    # resume point only for hooks registered meanwhile: cagrad.hooks.added_hooks):
    # node pre-hooks next
    TENSOR_HOOKS = 0
    PRE_HOOKS = 1  # after node pre-hooks: the node runs next
    APPLY = 2  # after the node: post-hooks next
    POST_HOOKS = 3  # after post-hooks: outputs are handed along next


@dataclasses.dataclass
class NodeHooks:
    """One node's hooks, as indices into the backward's runtime objects.

    Attributes:
        tensor_pre: ``(input_nr, object index of the hook dict)``, in order.
        retain_grad: ``(input_nr, object index of a weakref to the tensor)``.
        pre: object index of the node pre-hook dict, or None.
        post: object index of the node post-hook dict, or None.
        post_accumulate: object index of the leaf's post-accumulate dict.
        cpp_post: object index of the tuple of hooks added from C++ to a
            leaf's AccumulateGrad (:mod:`cagrad.hooks.cpp_hooks`), or None.
    """

    tensor_pre: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    retain_grad: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    pre: int | None = None
    post: int | None = None
    post_accumulate: int | None = None
    cpp_post: int | None = None


@dataclasses.dataclass
class NodePlan:
    """How one NodeCall runs: its kind, hooks and runtime objects.

    Attributes:
        kind: see :class:`Kind`.
        hooks: its hooks, or None.
        node: object index of the node itself (opaque, custom, accumulate:
            the leaf variable).
        record: the forward record of a custom Function.
    """

    kind: Kind
    hooks: NodeHooks | None = None
    node: int | None = None
    record: Any = None


# in a snapshot's inputs (Phase.TENSOR_HOOKS): the slot the call being
# recorded fills, named after that call
THIS_CALL = object()
# in an opaque call's assumed result: this gradient is None (learnt from an
# earlier run, see BackwardWalk's ``profile``); anything else is a failed check
MUST_BE_NONE = "none"
# in an opaque call's assumed result: whatever is there (a gradient, None or
# anything else) is handed, unchecked, to a later opaque call (a node
# post-hook); it is never sent along an edge
PASS = "pass"


class Layout:
    """An opaque call's assumed gradient (``expected``: a fake tensor or
    ``(shape, dtype, device)``) with the dimension order its strides were
    seen in at run time (``order``: outermost dimension first), learnt from
    an earlier run (see BackwardWalk's ``profile``): the trace assumes the
    dense strides of that order, not the contiguous ones."""

    __slots__ = ("expected", "order")

    def __init__(self, expected: Any, order: tuple[int, ...]) -> None:
        self.expected = expected
        self.order = order


class Obj:
    """A reference to runtime object ``index`` (``hooks[index]`` in the graph)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclasses.dataclass
class ResumePoint:
    """The walk's state right after a speculative call, by value names.

    Attributes:
        pos: position in ``GraphTask.order`` of the node being processed.
        phase: which step just ran.
        buffers: pending input buffers, ``{NodeCall.id: [value name | None]}``.
        captured: ``autograd.grad`` results so far (value name or None).
        inputs: the node's (hooked) incoming gradients (value names).
        outs: the node's outputs before the speculative call (value names),
            for a resume after post-hooks.
    """

    pos: int
    phase: Phase
    buffers: dict[int, list[str | None]]
    captured: list[str | None]
    inputs: list[str | None]
    outs: list[str | None] | None = None


class Executor(Protocol):
    """What the walk needs from a tracer or an interpreter."""

    def metadata(self, fn: Any, input_nr: int) -> tuple[Sequence[Any], Any, Any]:
        """``(shape, dtype, device)`` node ``fn`` expects at ``input_nr``."""
        ...

    def validate(self, name: str, edges: Sequence[Any], grads: list, origin: str) -> list: ...

    def add(self, a: Any, b: Any, origin: str) -> Any: ...

    def apply_traced(self, pos: int, call: NodeCall, inputs: list) -> list: ...

    def apply_aot(self, pos: int, call: NodeCall, plan: NodePlan, inputs: list) -> list:
        """An AOTAutograd backward, PyNode semantics and validation included."""
        ...

    def apply_custom(self, pos: int, call: NodeCall, plan: NodePlan, inputs: list) -> list:
        """A custom Function's backward (:mod:`cagrad.hooks.backward_tracing`),
        PyNode semantics and validation included."""
        ...

    def opaque(self, op: str, args: tuple, result: Any, origin: str, resume: Any, pos: int) -> Any:
        """Runs or records ``runtime_ops.<op>(*args)``.

        ``result`` describes what the trace assumes it returns (None, a value
        like the given one, or a list of such); ``resume`` is a callable
        returning the :class:`ResumePoint` for speculative calls, else None;
        ``pos`` is the position in ``GraphTask.order`` of the node whose
        call or hook it is.
        """
        ...


class BackwardWalk:
    """Walks one backward through an executor.

    Args:
        task: structure and order.
        plans: one :class:`NodePlan` per entry of ``task.order``.
        executor: tracer or interpreter.
        accumulate_at_end: leaf gradients are collected and accumulated
            after the graph (no hook or opaque call can observe ``.grad``
            during it), instead of by opaque calls in order.
        retain_at_end: ``retain_grad`` gradients are collected
            (``retained``) and set as ``.grad`` after the graph, as eager's
            hook would have set them (no hook or opaque call can observe
            ``.grad`` during it), instead of by opaque calls in order.
        profile: for speculative calls whose assumption failed before,
            ``{(pos, phase): per result, False (None), True (defined), or
            the dimension order of a dense gradient in another layout than
            assumed}``; the trace then assumes that pattern instead of
            "every gradient defined, in the layout of its metadata"
            (:class:`Layout`).
    """

    def __init__(
        self,
        task: GraphTask,
        plans: Sequence[NodePlan],
        executor: Executor,
        accumulate_at_end: bool,
        profile: dict[tuple[int, Phase], tuple[bool, ...]] | None = None,
        retain_at_end: bool = False,
    ) -> None:
        self.task = task
        self.plans = plans
        self.ex = executor
        self.accumulate_at_end = accumulate_at_end
        self.profile = profile or {}
        self.has_exec_info = bool(task.output_edges)
        self.buffers: dict[int, list] = {}
        self.captured: list = [None] * task.num_captures
        self.leaf_grads: list[tuple[int, Any]] = []
        self.retain_at_end = retain_at_end
        # (object index of the weakref to the tensor, gradient), in run order
        self.retained: list[tuple[int, Any]] = []
        self.position = {id(call): pos for pos, call in enumerate(task.order)}
        self._root_grads: list = []
        # called with ((pos, phase), results) after each speculative call
        # (the interpreter's real results: see cagrad.run.runtime)
        self.observe: Callable[[tuple, Any], None] | None = None

    # -- entry points ---------------------------------------------------------
    def start(self, root_grads: list) -> None:
        """Validates the root gradients and places them (step 0)."""
        task = self.task
        grads = self.ex.validate("GraphRoot", task.root_edges, root_grads, "GraphRoot")
        self._root_grads = grads
        if not task.has_graph_root:
            fn, input_nr = task.root_edges[0]
            call = task.call_of[fn]
            buf = self.buffers[call.id] = [None] * len(call.input_metadata)
            buf[input_nr] = grads[0]

    def run(self, first: int = 0, phase: Phase | None = None, state: Any = None) -> None:
        """Runs every node from position ``first`` (resuming at ``phase``)."""
        order = self.task.order
        for pos in range(first, len(order)):
            if pos == first and phase is not None:
                self._step(pos, phase, state)
            else:
                self._step(pos, None, None)

    # -- one node -------------------------------------------------------------
    def _step(self, pos: int, phase: Phase | None, state: Any) -> None:
        call = self.task.order[pos]
        plan = self.plans[pos]
        if plan.kind is Kind.ROOT:
            self._distribute(call, self.task.root_edges, self._root_grads)
            return
        hooks = plan.hooks
        name = f"{call.name} (NodeCall {pos})"
        if phase is None:
            inputs = self.buffers.pop(call.id, None)
            if inputs is None:
                inputs = [None] * len(call.input_metadata)
            if self.has_exec_info:
                if not call.needed:
                    inputs = self._tensor_hooks(hooks, inputs, name, pos)
                    self._capture(call, inputs)
                    return
                self._capture(call, inputs)
            inputs = self._tensor_hooks(hooks, inputs, name, pos, resumable=True)
            phase, state = Phase.TENSOR_HOOKS, inputs
        if phase is Phase.TENSOR_HOOKS:
            inputs = state
            if hooks is not None and hooks.pre is not None:
                inputs = self.ex.opaque(
                    "node_pre_hooks",
                    (Obj(hooks.pre), inputs),
                    self._assume(pos, Phase.PRE_HOOKS, list(inputs)),
                    name,
                    lambda: self._snapshot(pos, Phase.PRE_HOOKS, inputs_=None),
                    pos,
                )
                self._observe(pos, Phase.PRE_HOOKS, inputs)
            phase, state = Phase.PRE_HOOKS, inputs
        if phase is Phase.PRE_HOOKS:
            inputs = state
            outs = self._apply(pos, call, plan, inputs, name)
            phase, state = Phase.APPLY, (outs, inputs)
        if phase is Phase.APPLY:
            outs, inputs = state
            if hooks is not None and hooks.cpp_post is not None:
                # added from C++ before any Python post-hook (DDP's reducer,
                # at construction); they return what they are given
                self.ex.opaque("cpp_post_hooks", (Obj(hooks.cpp_post),), None, name, None, pos)
            if hooks is not None and hooks.post is not None:
                # only a post-hook sees gradients on edges that are not used
                outs = self._as_eager_computes(call, plan, outs)
                outs = self.ex.opaque(
                    "node_post_hooks",
                    (Obj(hooks.post), outs, inputs),
                    self._assume(pos, Phase.POST_HOOKS, self._handed_on(call, outs)),
                    name,
                    lambda: self._snapshot(pos, Phase.POST_HOOKS, inputs_=None),
                    pos,
                )
                self._observe(pos, Phase.POST_HOOKS, outs)
            phase, state = Phase.POST_HOOKS, outs
        self._distribute(call, call.edges, state)

    def _apply(self, pos: int, call: NodeCall, plan: NodePlan, inputs: list, name: str) -> list:
        kind = plan.kind
        if kind is Kind.ACCUMULATE:
            grad = inputs[0]
            if self.accumulate_at_end:
                self.leaf_grads.append((pos, grad))
            else:
                post = plan.hooks.post_accumulate if plan.hooks is not None else None
                if grad is None and post is None:
                    return []
                # AccumulateGrad::apply calls the post-accumulate-grad hooks
                # even when no gradient arrived
                self.ex.opaque(
                    "accumulate",
                    (Obj(plan.node), grad, None if post is None else Obj(post)),
                    None,
                    name,
                    None,
                    pos,
                )
            return []
        if kind is Kind.TRACED:
            outs = self.ex.apply_traced(pos, call, inputs)
            return self.ex.validate(call.name, call.edges, outs, name)
        if kind is Kind.AOT:
            return self.ex.apply_aot(pos, call, plan, inputs)
        if kind is Kind.CUSTOM_TRACED:
            return self.ex.apply_custom(pos, call, plan, inputs)
        # opaque and custom nodes: run for real; the trace assumes a defined
        # gradient on every edge whose target runs, and hands what the node
        # returned for other edges to its post-hooks as it is
        passed = None if plan.hooks is None or plan.hooks.post is None else PASS
        expected = self._assume(
            pos,
            Phase.APPLY,
            [
                self._expected_grad(fn, input_nr) if self.task.executes(fn) else passed
                for fn, input_nr in call.edges
            ],
        )
        op = "call_node" if kind is Kind.OPAQUE else "call_custom_function"
        args = (Obj(plan.node), inputs)
        outs = self.ex.opaque(
            op, args, expected, name, lambda: self._snapshot(pos, Phase.APPLY, inputs_=inputs), pos
        )
        self._observe(pos, Phase.APPLY, outs)
        return outs

    def _observe(self, pos: int, phase: Phase, outs: Any) -> None:
        if self.observe is not None:
            self.observe((pos, phase), outs)

    def _assume(self, pos: int, phase: Phase, expected: list) -> list:
        pattern = self.profile.get((pos, phase))
        if pattern is None or len(pattern) != len(expected):
            return expected
        out = []
        for e, seen in zip(expected, pattern):
            if e is None or e is PASS:
                out.append(e)
            elif not seen:
                out.append(MUST_BE_NONE)
            elif isinstance(seen, tuple):
                # a dense gradient in another dimension order than assumed
                out.append(Layout(e, seen))
            else:
                out.append(e)
        return out

    def _expected_grad(self, fn: Any, input_nr: int) -> Any:
        if not self.task.executes(fn):
            return None
        return self.ex.metadata(fn, input_nr)

    def _as_eager_computes(self, call: NodeCall, plan: NodePlan, outs: list) -> list:
        """The node's outputs as eager's node returns them in this backward.

        A C++ node called from Python computes the gradients of all its valid
        edges; under ``inputs=`` eager's computes only those that
        ``task_should_compute_output`` asks for (see
        :meth:`GraphTask.computed_outputs`). Custom Functions (PyNode) return
        what their backward returned either way.
        """
        if not self.has_exec_info or plan.kind not in (Kind.TRACED, Kind.OPAQUE):
            return outs
        computed = self.task.computed_outputs(call)
        if computed is None:
            return outs
        return [o if c else None for o, c in zip(outs, computed)]

    def _handed_on(self, call: NodeCall, outs: list) -> list:
        """What a post-hook's result is assumed to be: the gradients it got
        on edges that are used; whatever it returns for other edges is not
        checked (they are not sent anywhere)."""
        executes = self.task.executes
        return [o if executes(fn) else None for (fn, _), o in zip(call.edges, outs)]

    def _tensor_hooks(self, hooks: NodeHooks | None, inputs: list, name: str, pos: int, resumable: bool = False) -> list:
        """Runs the tensor pre-hooks and retain_grad hooks of node ``pos``.
        ``resumable``: the last of these calls gets a resume point at
        ``Phase.TENSOR_HOOKS`` (a run whose user code registered hooks
        finishes from there, :mod:`cagrad.hooks.added_hooks`); the slot of
        its own result is :data:`THIS_CALL` in the snapshot's inputs."""
        if hooks is None:
            return inputs
        inputs = list(inputs)
        calls = len(hooks.tensor_pre) + (0 if self.retain_at_end else len(hooks.retain_grad))
        done = 0

        def resume(input_nr: int | None) -> Any:
            if not resumable or done != calls:
                return None
            return lambda: self._snapshot(
                pos, Phase.TENSOR_HOOKS, [THIS_CALL if i == input_nr else g for i, g in enumerate(inputs)]
            )

        for input_nr, obj in hooks.tensor_pre:
            grad = inputs[input_nr]
            done += 1
            inputs[input_nr] = self.ex.opaque(
                "tensor_pre_hooks", (Obj(obj), grad), grad, name, resume(input_nr), pos
            )
        for input_nr, obj in hooks.retain_grad:
            if self.retain_at_end:
                if inputs[input_nr] is not None:  # eager's hook ignores an undefined one
                    self.retained.append((obj, inputs[input_nr]))
            else:
                done += 1
                self.ex.opaque("retain_grad", (Obj(obj), inputs[input_nr]), None, name, resume(None), pos)
        return inputs

    def _capture(self, call: NodeCall, inputs: list) -> None:
        for input_nr, out_idx in call.captures:
            self.captured[out_idx] = inputs[input_nr]

    def _distribute(self, call: NodeCall, edges: Sequence[Any], outs: Sequence[Any]) -> None:
        call_of = self.task.call_of
        executes = self.task.executes
        for (fn, input_nr), g in zip(edges, outs):
            if not executes(fn):
                continue
            nxt = call_of[fn]
            buf = self.buffers.get(nxt.id)
            if buf is None:
                buf = self.buffers[nxt.id] = [None] * len(nxt.input_metadata)
            if g is None:
                continue
            old = buf[input_nr]
            if old is None:
                buf[input_nr] = g
            else:
                # InputBuffer::add: gradients are summed in arrival order
                buf[input_nr] = self.ex.add(
                    old, g, f"InputBuffer of {nxt.name} (NodeCall {self.position[id(nxt)]})"
                )

    def _snapshot(self, pos: int, phase: Phase, inputs_: list | None) -> tuple:
        """The raw state for a ResumePoint (the executor names the values)."""
        return (
            pos,
            phase,
            {k: list(v) for k, v in self.buffers.items()},
            list(self.captured),
            None if inputs_ is None else list(inputs_),
        )
