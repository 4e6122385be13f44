"""Running a captured graph that contains opaque calls.

A graph with hooks or opaque nodes is cut at each opaque call: the runs of
tensor ops between them become *segments*, each its own GraphModule (same
``(inputs, sizes, scalars, hooks, packed_inputs)`` signature) that
``compiler_fn`` compiles; the opaque calls run in Python with the current
backward's objects, in the graph's order, which is eager's.

After an opaque call the result is checked against what the trace assumed
(:mod:`cagrad.autograd.walk`). A None where the trace assumed a gradient
cannot be run by the compiled segments, so the interpreter finishes the
backward from that call's :class:`~cagrad.autograd.walk.ResumePoint` with the values
computed so far. So does a dense gradient in another dimension order than
assumed (``CopySlices`` returns its base's strides, a custom Function what
its backward computed): the interpreter hands it on as eager does, and the
next capture assumes that layout (see :func:`_conform`); a layout with gaps
or overlaps, a call without a resume point (a tensor hook), or a graph that
keeps changing layouts gets a copy in the assumed strides instead (values
unchanged). The values are eager's either way.

A gradient that is not strided (sparse COO: a custom Function's backward or
a node run as it is, such as ``EmbeddingBackward0`` with ``sparse=True``,
may return one; the engine's ``validate_outputs`` lets it through) where the
trace assumed a strided one is handed on as it is when only opaque calls use
it (accumulation into ``.grad``, hooks, nodes run as they are, which all run
eager's code on it) or it is an ``autograd.grad`` result (see
:func:`layout_free`); a traced op would compute something else with it, so
otherwise the interpreter finishes the backward, and the recapture that
follows falls back (:data:`NON_STRIDED`).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from ..autograd.accumulate import dense_strides, stealable_outputs
from ..autograd.walk import MUST_BE_NONE, Phase
from ..counters import counters
from . import leaf_hook_groups, runtime_ops
from .traced import OPAQUE_TARGETS, PLACEHOLDERS

log = logging.getLogger("cagrad")

# opaque calls whose result is the gradient they were given (or a
# replacement of the same layout) and that have no resume point: a value
# they get is only layout-free if their result is
_PASS_THROUGH = frozenset(
    getattr(runtime_ops, name) for name in ("tensor_pre_hooks", "backward_state_hook")
)


@dataclasses.dataclass
class Segment:
    """A run of tensor ops, compiled on its own.

    ``restride``: ``(input index, static strides or None, stride
    functions of the symbol values)`` of each input that an earlier segment
    computes. The backend compiled this segment for the strides the trace
    gave that value, and the earlier segment's compiled code may return it
    with others (inductor returned a transposed ``where`` contiguous on
    CUDA, and this segment's size-and-stride assert then failed); such an
    input is copied into the traced strides before the call (:func:`run`),
    as an opaque call's result is (:func:`_conform`).
    """

    graph_module: torch.fx.GraphModule
    in_names: list[str]
    out_names: list[str]
    fn: Callable[..., Any] | None = None
    calls: int = 0
    restride: list[tuple[int, tuple[int, ...] | None, tuple[Callable[..., int], ...]]] = dataclasses.field(
        default_factory=list
    )
    # the run's values no later step reads, dropped after this one (eager
    # frees a gradient once the node that reads it has run)
    release: list[str] = dataclasses.field(default_factory=list)
    # those of them it reads: once compiled, they are dropped before the
    # call, so that the boxed call (cagrad.compile.boxed) holds the last
    # reference and frees each after its last use inside the segment
    drop_before: list[str] = dataclasses.field(default_factory=list)
    # the position of the next opaque step (None: none follows): every node
    # before it has run, or runs inside this segment with its hooks, so its
    # saved tensors are read from the run's values, not from the node
    # (cagrad.run.runtime releases them before the call)
    next_pos: int | None = None


@dataclasses.dataclass
class OpaqueStep:
    """One call to :mod:`cagrad.capture.runtime_ops` and the items read from its result."""

    node: torch.fx.Node
    args: Any  # the node's args, with value names (_Ref) where the graph has nodes
    items: list[tuple[int, str]]
    spec: Any
    resume: Any
    # which results may be non-strided (see layout_free): a bool for a single
    # result, the set of indices for a list
    layout_free: Any = False
    # the values it reads that a segment computed, restrided in place in the
    # run's values before the call (see Segment.restride): (name, static
    # strides or None, stride functions)
    restride: list[tuple[str, tuple[int, ...] | None, tuple[Callable[..., int], ...]]] = dataclasses.field(
        default_factory=list
    )
    # as Segment.release
    release: list[str] = dataclasses.field(default_factory=list)
    # the position in the backward's run order of the node whose call or
    # hook this is (every node before it has run: cagrad.run.runtime
    # releases their saved tensors here)
    pos: int | None = None
    # the values of release it reads, less its own resume point's: dropped
    # before the call, which then holds the run's last reference to them
    drop_before: list[str] = dataclasses.field(default_factory=list)
    # an accumulation handed the run's last reference to its gradient
    # (runtime_ops.accumulate_handed: .grad may adopt it, as in eager)
    hands_grad: bool = False


class SpeculationFailed(Exception):
    """An opaque call's result failed the trace's assumption: a None, a
    non-strided gradient, or (``layout``) a dense gradient in another
    dimension order, which eager would hand on as it is; or
    (``hooks_added``) the call registered hooks on nodes that had none and
    have not run (:mod:`cagrad.hooks.added_hooks`): its result conformed,
    but the rest of the graph lacks those hooks."""

    def __init__(self, step: OpaqueStep, result: Any, layout: bool = False, hooks_added: bool = False) -> None:
        super().__init__(step.node.name)
        self.step = step
        self.result = result
        self.layout = layout
        self.hooks_added = hooks_added


# what _conform returns for a dense result in another dimension order than
# assumed, where the run learns layouts (a failed check)
_OTHER_LAYOUT = object()


@dataclasses.dataclass
class SegmentedGraph:
    """A captured graph cut into segments and opaque steps, in order."""

    steps: list[Segment | OpaqueStep]
    input_reads: dict[str, int]
    object_reads: dict[str, int]
    output: list[str | None]
    # some accumulation adopts the gradient handed to it (run then notes
    # which compiled segments' outputs overlap)
    hands_grads: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.hands_grads = any(isinstance(s, OpaqueStep) and s.hands_grad for s in self.steps)

    @property
    def segments(self) -> list[Segment]:
        return [s for s in self.steps if isinstance(s, Segment)]


def _names(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        return [_names(a) for a in arg]
    return arg


class _Ref(str):
    """An opaque call's argument that is a graph value (by name), as opposed
    to a constant (a ``str`` constant, e.g. a hook name, stays itself)."""

    __slots__ = ()


def _refs(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return _Ref(arg.name)
    if isinstance(arg, (list, tuple)):
        return [_refs(a) for a in arg]
    return arg


def _used(arg: Any, out: set[str]) -> None:
    if isinstance(arg, torch.fx.Node):
        out.add(arg.name)
    elif isinstance(arg, (list, tuple)):
        for a in arg:
            _used(a, out)


def layout_free(value: torch.fx.Node) -> bool:
    """Whether a non-strided tensor may stand for ``value`` in the graph.

    True when every use of ``value`` is an opaque call (it runs eager's code
    on the real tensor: ``.grad`` accumulation, hooks, nodes run as they are)
    or the graph's output (an ``autograd.grad`` result, which eager returns
    as it is). A call that hands the gradient on without a resume point of
    its own (a tensor hook) counts only if its result is layout-free too;
    the others' results are checked when they return.
    """
    for user in value.users:
        if user.op == "output":
            continue
        if user.op != "call_function" or user.target not in OPAQUE_TARGETS:
            return False
        if user.target in _PASS_THROUGH and not layout_free(user):
            return False
    return True


def split(gm: torch.fx.GraphModule, to_value: Callable[[Any], Callable[..., int]]) -> SegmentedGraph:
    """Cuts ``gm`` at its opaque calls (see module docstring).

    ``to_value`` turns the trace's SymInts in the opaque calls' assumed
    shapes into functions of the symbol values, evaluated at run time.
    """
    graph = gm.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    inputs_ph, hooks_ph, sizes_ph = placeholders["inputs"], placeholders["hooks"], placeholders["sizes"]
    input_reads: dict[str, int] = {}
    object_reads: dict[str, int] = {}
    size_reads: dict[str, int] = {}
    groups: list[list[torch.fx.Node] | OpaqueStep] = []
    current: list[torch.fx.Node] = []
    output_node = None
    # the accumulations of leaves with only C++ hooks (DDP's) may wait and
    # run in groups: fewer, longer segments (see leaf_hook_groups)
    for node in leaf_hook_groups.ordered_nodes(graph, OPAQUE_TARGETS):
        if node.op == "placeholder":
            continue
        if node.op == "output":
            output_node = node
            continue
        if node.target is operator.getitem and node.args[0] is inputs_ph:
            input_reads[node.name] = node.args[1]
            continue
        if node.target is operator.getitem and node.args[0] is hooks_ph:
            object_reads[node.name] = node.args[1]
            continue
        if node.target is operator.getitem and node.args[0] is sizes_ph:
            size_reads[node.name] = node.args[1]
            continue
        if node.target in OPAQUE_TARGETS:
            if current:
                groups.append(current)
                current = []
            items = [
                (u.args[1], u.name)
                for u in node.users
                if u.target is operator.getitem and u.args[0] is node
            ]
            spec = node.meta.get("cagrad_spec")
            if isinstance(spec, list):
                free: Any = {
                    u.args[1]
                    for u in node.users
                    if u.target is operator.getitem and u.args[0] is node and layout_free(u)
                }
            else:
                free = layout_free(node)
            groups.append(
                OpaqueStep(
                    node,
                    _refs(node.args),
                    sorted(items),
                    _spec_functions(spec, to_value),
                    node.meta.get("cagrad_resume"),
                    free,
                    pos=node.meta.get("cagrad_pos"),
                )
            )
            continue
        if node.target is operator.getitem and node.args[0].target in OPAQUE_TARGETS:
            continue  # read by its opaque step
        current.append(node)
    if current:
        groups.append(current)
    assert output_node is not None  # noqa: S101 - every FX graph has one

    # which values each later step needs: its inputs, and for opaque steps the
    # values their resume points name
    needed_after: list[set[str]] = []
    later: set[str] = set()
    _used(output_node.args[0], later)
    for group in reversed(groups):
        needed_after.append(set(later))
        if isinstance(group, OpaqueStep):
            _used(group.node.args, later)
            later |= _resume_names(group)
        else:
            for node in group:
                for a in node.all_input_nodes:
                    later.add(a.name)
    needed_after.reverse()

    steps: list[Segment | OpaqueStep] = []
    computed: set[str] = set()  # values computed by the segments so far
    held = set(input_reads) | set(object_reads)  # the run's values (see run)
    for group, needed in zip(groups, needed_after):
        if isinstance(group, OpaqueStep):
            read = list(dict.fromkeys(a.name for a in group.node.all_input_nodes))
            vals = {a.name: a.meta.get("val") for a in group.node.all_input_nodes}
            plan = _restride_plan(read, vals, computed, to_value)
            group.restride = [(read[k], static, fns) for k, static, fns in plan]
            held.add(group.node.name)
            held.update(name for _, name in group.items)
            step: Segment | OpaqueStep = group
        else:
            step = _segment(gm, group, needed, size_reads)
            vals = {a.name: a.meta.get("val") for node in group for a in node.all_input_nodes}
            step.restride = _restride_plan(step.in_names, vals, computed, to_value)
            computed.update(step.out_names)
            held.update(step.out_names)
        step.release = sorted(held - needed)
        if isinstance(step, Segment):
            step.drop_before = sorted(set(step.release) & set(step.in_names))
        else:
            _plan_hand_over(step)
        held &= needed
        steps.append(step)
    _set_next_pos(steps)
    return SegmentedGraph(steps, input_reads, object_reads, _names(output_node.args[0]))


def _set_next_pos(steps: list[Segment | OpaqueStep]) -> None:
    """Sets each segment's :attr:`Segment.next_pos`."""
    next_pos: int | None = None
    for step in reversed(steps):
        if isinstance(step, OpaqueStep):
            next_pos = step.pos
        else:
            step.next_pos = next_pos


def _resume_names(step: OpaqueStep) -> set[str]:
    """The values ``step``'s resume point names (the interpreter reads them
    if the step's check fails)."""
    r = step.resume
    if r is None:
        return set()
    return {n for names in [*r.buffers.values(), r.captured, r.inputs] for n in names if n is not None}


def _plan_hand_over(step: OpaqueStep) -> None:
    """Sets ``step.drop_before`` and ``step.hands_grad`` from its release list."""
    reads = {a.name for a in step.node.all_input_nodes}
    step.drop_before = sorted((set(step.release) & reads) - _resume_names(step))
    args = step.node.args
    if step.node.target is runtime_ops.accumulate and len(args) == 3 and isinstance(args[1], torch.fx.Node):
        others: set[str] = set()
        _used([args[0], args[2]], others)
        grad = args[1].name
        step.hands_grad = grad in step.drop_before and grad not in others


def _restride_plan(
    names: list[str], vals: dict[str, Any], computed: set[str], to_value: Callable[[Any], Callable[..., int]]
) -> list[tuple[int, tuple[int, ...] | None, tuple[Callable[..., int], ...]]]:
    """Of the values ``names`` a step reads, those a segment computed
    (``computed``), by position, with the strides the trace gave them (their
    fake ``vals``; see :attr:`Segment.restride`). The lifted inputs are in
    the cache key with their strides, and opaque results are conformed to
    the trace (:func:`_check`): neither needs it."""
    plan = []
    for i, name in enumerate(names):
        val = vals.get(name)
        if name in computed and isinstance(val, torch.Tensor) and val.layout is torch.strided:
            strides = tuple(val.stride())
            static = None if any(isinstance(x, torch.SymInt) for x in strides) else tuple(int(x) for x in strides)
            try:
                plan.append((i, static, tuple(to_value(x) for x in strides)))
            except ValueError as e:  # a stride the size check cannot compute
                # left out: the backend's own check (inductor's) still
                # catches other strides at the first call
                log.debug("cagrad: %s keeps the strides it gets: %s", name, e)
    return plan


def _as_traced(
    value: Any, static: tuple[int, ...] | None, fns: tuple[Callable[..., int], ...], sym_values: Sequence[int]
) -> Any:
    """``value`` in the strides of a restride plan entry (:attr:`Segment.restride`)
    at these symbol values: itself where it has them (one tuple compare on
    the run path), else :func:`_restrided`."""
    want = static if static is not None else tuple(f(*sym_values) for f in fns)
    if isinstance(value, torch.Tensor) and value.layout is torch.strided and value.stride() != want:
        return _restrided(value, want)
    return value


def _restrided(value: Any, strides: Sequence[int]) -> Any:
    """``value`` (a strided tensor) in ``strides`` (a copy, values
    unchanged) if its strides differ from them in a dimension of more than
    one element and ``strides`` give each element a place of its own, else
    itself (an expanded layout, stride 0, cannot be written into: the
    backend's own check, if any, then decides)."""
    shape = value.shape
    if _same_places(shape, value.stride(), strides):
        return value
    if not _distinct_places(shape, strides):
        return value
    out = torch.empty_strided(shape, tuple(strides), dtype=value.dtype, device=value.device)
    out.copy_(value)
    return out


def _same_places(shape: Sequence[int], have: Sequence[int], want: Sequence[int]) -> bool:
    """Whether strides ``have`` and ``want`` address the same places for a
    ``shape`` tensor: they differ at most in dimensions of one element (or
    none)."""
    return all(n <= 1 or a == b for n, a, b in zip(shape, have, want))


def _distinct_places(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether no two elements of a ``shape`` tensor with ``strides`` share
    memory: sorted by stride, each dimension of more than one element steps
    over the whole extent of the ones before it (a sufficient test)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            return False
        extent = st * n
    return True


def _segment(
    gm: torch.fx.GraphModule,
    nodes: list[torch.fx.Node],
    needed: set[str],
    size_reads: dict[str, int],
) -> Segment:
    inside = {n.name for n in nodes}
    in_names: list[str] = []
    in_nodes: dict[str, torch.fx.Node] = {}
    sizes_used: list[str] = []
    size_nodes: dict[str, torch.fx.Node] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            if a.name in size_reads:
                if a.name not in sizes_used:
                    sizes_used.append(a.name)
                    size_nodes[a.name] = a
            elif a.name not in inside and a.name not in in_names:
                in_names.append(a.name)
                in_nodes[a.name] = a
    out_names = [n.name for n in nodes if n.name in needed]
    graph = torch.fx.Graph()
    ph = {name: graph.placeholder(name) for name in PLACEHOLDERS}
    env: dict[str, torch.fx.Node] = {}
    for name in sizes_used:
        # every segment gets the whole sizes list and reads what it uses
        env[name] = graph.call_function(operator.getitem, (ph["sizes"], size_reads[name]))
        if "val" in size_nodes[name].meta:
            env[name].meta["val"] = size_nodes[name].meta["val"]
    for i, name in enumerate(in_names):
        env[name] = graph.call_function(operator.getitem, (ph["inputs"], i))
        for key in ("val", "cagrad_requires_grad"):  # its fake value, for the backend
            if key in in_nodes[name].meta:
                env[name].meta[key] = in_nodes[name].meta[key]
    for node in nodes:
        env[node.name] = graph.node_copy(node, lambda a: env[a.name])
    graph.output([env[n] for n in out_names])
    graph.lint()
    return Segment(torch.fx.GraphModule(gm, graph, "CompiledAutogradSegment"), in_names, out_names)


def compile_segments(sg: SegmentedGraph, compile_graph: Callable[[torch.fx.GraphModule], Any]) -> None:
    for seg in sg.segments:
        seg.fn = compile_graph(seg.graph_module)


def _spec_functions(spec: Any, to_value: Callable[[Any], Callable[..., int]]) -> Any:
    """The assumed result with every size as a function of the symbol values."""
    if spec is None or spec == MUST_BE_NONE:
        return spec
    if isinstance(spec, list):
        return [_spec_functions(s, to_value) for s in spec]
    shape, dtype, device, stride = spec
    return (
        tuple(to_value(x) for x in shape),
        dtype,
        device,
        tuple(to_value(x) for x in stride),
    )


def _concrete(spec: Any, sym_values: Sequence[int]) -> Any:
    shape, dtype, device, stride = spec
    return (
        tuple(f(*sym_values) for f in shape),
        dtype,
        device,
        tuple(f(*sym_values) for f in stride),
    )


def _materialize(arg: Any, env: dict[str, Any]) -> Any:
    if isinstance(arg, _Ref):
        return env[arg]
    if isinstance(arg, list):
        return [_materialize(a, env) for a in arg]
    return arg


def _conform(value: Any, spec: Any, free: bool, learn: bool) -> Any:
    """Checks ``value`` against the trace's assumption; conforms its strides.

    A non-strided ``value`` passes as it is where ``free`` (see
    :func:`layout_free`); elsewhere it fails the check. Strides that differ
    only in dimensions of one element (or of an empty tensor) are the same
    places: the value goes on as it is (as eager's). Other strides: with ``learn``, a
    dense ``value`` fails the check (the interpreter hands it on as eager
    does, and the next capture assumes its dimension order); else, and for
    a layout with gaps or overlaps, it is copied into the assumed strides.

    Returns:
        the value to go on with, None when the check failed, or
        ``_OTHER_LAYOUT`` when it failed on the layout alone.
    """
    shape, dtype, device, stride = spec
    if tuple(value.shape) != shape or value.dtype != dtype or value.device != device:
        return None
    if value.layout is not torch.strided:
        return value if free else None
    actual = value.stride()
    if tuple(actual) == stride:
        return value
    if 0 in shape or _same_places(shape, actual, stride):
        return value  # the same places; as it is, so .grad keeps eager's strides
    if learn and dense_strides(shape, actual):
        return _OTHER_LAYOUT
    # the assumed strides are dense (cagrad.capture.layouts.spec_of)
    return _restrided(value, stride)


def _check(step: OpaqueStep, result: Any, sym_values: Sequence[int], learn: bool) -> Any:
    spec = step.spec
    if spec is None:
        return result
    # only a call with a resume point can hand its result on as it is (not
    # a tensor hook's: its resume point is for hooks it registers alone)
    learn = learn and step.resume is not None and step.resume.phase is not Phase.TENSOR_HOOKS
    if isinstance(spec, list):
        out = list(result)
        for i, s in enumerate(spec):
            if s is None:
                continue
            v = out[i]
            if s == MUST_BE_NONE:
                if v is not None:
                    raise SpeculationFailed(step, result)
                continue
            if v is None:
                raise SpeculationFailed(step, result)
            out[i] = _conformed(step, result, v, _concrete(s, sym_values), i in step.layout_free, learn)
        return out
    if result is None:
        raise SpeculationFailed(step, result)
    return _conformed(step, result, result, _concrete(spec, sym_values), step.layout_free, learn)


def _conformed(step: OpaqueStep, result: Any, value: Any, spec: Any, free: bool, learn: bool) -> Any:
    v = _conform(value, spec, free, learn)
    if v is None:
        raise SpeculationFailed(step, result)
    if v is _OTHER_LAYOUT:
        raise SpeculationFailed(step, result, layout=True)
    return v


def run(
    sg: SegmentedGraph,
    inputs: Sequence[torch.Tensor],
    sizes: list[int],
    sym_values: Sequence[int],
    objects: Sequence[Any],
    on_speculation_failed: Callable[[SpeculationFailed, dict[str, Any]], list],
    learn_layouts: bool = True,
    hand_over: bool = False,
    before_step: Callable[[Segment | OpaqueStep], None] | None = None,
    hooks_added: Callable[[OpaqueStep], bool] | None = None,
) -> list:
    """Runs the steps; returns the graph's outputs.

    ``sizes`` is the graph's ``sizes`` list (every segment gets it whole);
    ``sym_values`` the symbol values the opaque calls' assumed shapes are
    evaluated at.

    ``on_speculation_failed(failure, env)`` finishes the backward
    when a check fails and returns the outputs in place of the graph's.
    ``learn_layouts``: a dense result in another dimension order than the
    trace assumed fails the check (see :func:`_conform`).
    ``hand_over``: ``inputs`` is a list the caller needs no more; it is
    emptied, so that the run holds the only references to the inputs it
    has not released yet (each is dropped after its last reader).
    ``before_step(step)`` is called before each step runs.
    ``hooks_added(step)``, after each opaque call with a resume point that
    passed its check: whether it registered hooks the rest of the graph
    lacks; then ``on_speculation_failed`` finishes the backward
    (``SpeculationFailed.hooks_added``).
    """
    env: dict[str, Any] = {}
    for name, i in sg.input_reads.items():
        env[name] = inputs[i]
    for name, i in sg.object_reads.items():
        env[name] = objects[i]
    if hand_over:
        inputs.clear()  # type: ignore[attr-defined]
    # ids of compiled segments' outputs over memory that an earlier output of
    # their segment has (a backend may write two results into one buffer
    # where eager made two tensors): never adopted as a .grad uncopied
    overlapping: set[int] | None = set() if sg.hands_grads else None
    for step in sg.steps:
        if isinstance(step, Segment):
            if before_step is not None:
                before_step(step)
            args = [env[n] for n in step.in_names]
            if step.calls:
                # compiled (a first call may still fall back to the segment's
                # own graph, which reads them again): the call holds them now
                _release(env, step.drop_before)
            for i, static, fns in step.restride:
                args[i] = _as_traced(args[i], static, fns, sym_values)
            try:
                outs = step.fn(args, sizes, [], [], [])
            except Exception as e:
                if step.calls:
                    raise
                # the first call compiles; a backend failure runs the
                # segment's own graph instead (the same aten ops, in order)
                log.warning("cagrad: a graph segment failed to compile; running it uncompiled (%s: %s)", type(e).__name__, e)
                counters.bump("segment_compile_failures")
                step.fn = step.graph_module
                # a boxed fn may have emptied args
                outs = step.fn([env[n] for n in step.in_names], sizes, [], [], [])
            step.calls += 1
            if overlapping is not None:
                _note_overlapping(outs, overlapping)
            env.update(zip(step.out_names, outs))
            del args, outs
            _release(env, step.release)
            continue
        if before_step is not None:
            before_step(step)
        for name, static, fns in step.restride:
            # in the values themselves: every later reader, and a hook that
            # changes the gradient in place, see one tensor (as in eager)
            env[name] = _as_traced(env[name], static, fns, sym_values)
        args = _materialize(step.args, env)
        _release(env, step.drop_before)
        if step.hands_grad:
            result = runtime_ops.accumulate_handed(args, overlapping)
        else:
            result = step.node.target(*args)
        try:
            result = _check(step, result, sym_values, learn_layouts)
        except SpeculationFailed as e:
            return on_speculation_failed(e, env)
        env[step.node.name] = result
        for index, name in step.items:
            env[name] = result[index]
        if hooks_added is not None and step.resume is not None and hooks_added(step):
            # the resume reads this call's result from env like any value
            return on_speculation_failed(SpeculationFailed(step, result, hooks_added=True), env)
        del args, result
        _release(env, step.release)
    return [None if n is None else env[n] for n in sg.output]


def _note_overlapping(outs: Sequence[Any], into: set[int]) -> None:
    tensors = [t for t in outs if type(t) is torch.Tensor]
    for t, ok in zip(tensors, stealable_outputs(tensors, [False] * len(tensors))):
        if not ok:
            into.add(id(t))


def _release(env: dict[str, Any], names: Sequence[str]) -> None:
    for name in names:
        env.pop(name, None)
