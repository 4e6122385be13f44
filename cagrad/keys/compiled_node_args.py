"""CompiledNodeArgs: each node's cache key, lifted tensors and runtime objects.

For every node a backward runs, in run order, the :class:`Collector` decides
how the node runs in the graph (:class:`~cagrad.autograd.walk.Kind`), writes into a
:class:`~cagrad.keys.cache_key.KeyWriter` everything the traced graph depends on
that is not a graph input, appends every tensor that becomes a graph input to
:class:`TensorArgs`, and every object an opaque call needs (hook dicts,
nodes, leaves) to the runtime objects. Two backwards with equal key
sequences trace to the same graph; that is the cache's soundness argument,
so every branch here either writes what it read into the key or raises
:class:`~cagrad.errors.Unsupported`.

Per node the key holds, in order:

1. the node's discovery id and run flags (needed, captured input slots);
2. how it runs: traced, opaque (a C++ node run as it is: its hidden state
   needs no key), custom Function, or AccumulateGrad;
3. for traced nodes, every visible non-tensor attribute (``_saved_<name>``),
   in name order, and for every saved tensor (and element of a saved tensor
   list): defined or not, and its metadata (requires_grad, dtype, device,
   layout, number of dimensions, conjugate/negative bits for complex
   dtypes); for a custom Function, whether its backward is traced and then
   its fingerprint (:mod:`cagrad.hooks.backward_tracing`), forward outputs
   and saved tensors;
4. for every edge: invalid, or the target's discovery id, input number and
   the target's input metadata there (dtype, device, number of dimensions).
   This also covers the hidden fields of the ``edge`` policy (see
   :mod:`cagrad.autograd.node_schema`);

Sizes (tensor shapes, strides, storage offsets, metadata shapes and the
``SymInt`` fields of traced nodes) are not key bytes but size slots
(:mod:`cagrad.keys.sizes`), checked per compiled variant.
5. the hooks: kinds, counts and the inputs they watch;
6. for ``AccumulateGrad``: the leaf's metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import internals
from ..autograd import custom_function, formulas, run_context, saved_variables, transforms
from ..autograd.formulas import FORMULAS
from ..autograd.graph_task import GraphTask, NodeCall
from ..autograd.node_schema import NodeKind, NodeSchema
from ..autograd.saved_variables import Slot
from ..autograd.walk import Kind, NodeHooks, NodePlan
from ..errors import EagerError, Unsupported
from ..hooks import backward_tracing, cpp_hooks, hook_tracing
from ..hooks.hooks_census import Census, FoundHooks
from .cache_key import CacheKey, KeyWriter
from .sizes import SizeInputs, is_nested_int
from .subclasses import SubclassSpec, flatten, metadata_bytes, write_subclass

_STRIDED = torch.strided
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# (a custom Function is planned as CUSTOM; whether its backward is traced is
# decided after its hooks, and written after them: see Collector.collect)
# when in a node's steps (cagrad.autograd.walk) a hook dict or code of the
# user's runs: (position in run order, step, index within the step)
_AT_TENSOR_PRE, _AT_PRE, _AT_APPLY, _AT_POST = range(4)

_KIND_TAG = {Kind.TRACED: b"t", Kind.OPAQUE: b"o", Kind.CUSTOM: b"c", Kind.AOT: b"g", Kind.ACCUMULATE: b"a"}


def _int64(v: int) -> int:
    # some bindings hand int64 fields out as uint64 (see cagrad.keys.cache_key)
    return v - (1 << 64) if v >= (1 << 63) else v


class TensorArgs:
    """The tensors a backward lifts as graph inputs, in collection order.

    ``tensors[i]`` is the real tensor for graph input ``inputs[i]``;
    ``slots[i]`` the saved-tensor slot it was read from (``None`` for root
    gradients): a trace swaps it for its fake, and a backward without
    ``retain_graph`` releases it.

    A tensor subclass is lifted as its inner tensors, flattened
    (:mod:`cagrad.keys.subclasses`): ``groups`` holds ``(index of its first
    inner tensor, its spec)``; each inner tensor repeats the subclass's slot
    and has no geometry (-1: a subclass's sizes stay static).
    """

    __slots__ = ("tensors", "slots", "geometry", "groups")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.slots: list[Slot | None] = []
        self.geometry: list[int] = []  # first size slot of each tensor's shape
        self.groups: list[tuple[int, SubclassSpec]] = []

    def add(self, t: torch.Tensor, slot: Slot | None, geometry: int) -> None:
        if type(t) not in _PLAIN_TENSOR_TYPES:
            flat: list[torch.Tensor] = []
            spec = flatten(t, "a lifted tensor", flat)
            if spec is not None:
                self.groups.append((len(self.tensors), spec))
                self.tensors.extend(flat)
                self.slots.extend([slot] * len(flat))
                self.geometry.extend([-1] * len(flat))
                return
        self.tensors.append(t)
        self.slots.append(slot)
        self.geometry.append(geometry)


def write_tensor(w: KeyWriter, t: torch.Tensor, what: str, sizes: SizeInputs, dynamic_ok: bool = True) -> int:
    """Tensor metadata that specializes a traced graph.

    The key gets dtype, device, requires_grad, the number of dimensions and
    conjugate/negative bits; sizes, strides and the storage offset become
    size slots (see :mod:`cagrad.keys.sizes`).

    Returns:
        the first size slot: ``ndim`` sizes, then ``ndim`` strides, then the
        storage offset.

    A traceable wrapper subclass (``TwoTensor``) is keyed by
    :func:`cagrad.keys.subclasses.write_subclass`: its class, flatten
    metadata and outer metadata, then each inner tensor as here; all of its
    size slots (``dynamic_ok`` False) stay static.

    Raises:
        Unsupported: sparse/mkldnn/nested layouts, tensor subclasses that
            are not traceable wrapper subclasses or whose metadata cannot be
            keyed, and tensors a functorch transform wrapped
            (``functorch_transform``).
    """
    if type(t) not in _PLAIN_TENSOR_TYPES:
        transforms.check_tensor(t, what)
        geometry = write_subclass(
            w, t, what, lambda w_, inner, what_: write_tensor(w_, inner, what_, sizes, False)
        )
        return sizes.add_static(geometry, what)
    transforms.check_tensor(t, what)
    if t.layout is not _STRIDED:
        raise Unsupported("non_strided_tensor", f"{what} has layout {t.layout}")
    w.tag(b"t" if not t.requires_grad else b"r")
    w.dtype(t.dtype)
    w.device(t.device)
    shape = t.shape
    w.size(len(shape))
    start = sizes.add((*shape, *t.stride(), t.storage_offset()), dynamic_ok, what)
    if t.is_complex():
        w.value((t.is_conj(), t.is_neg()))
    return start


def write_input_metadata(w: KeyWriter, md: Any, what: str, sizes: SizeInputs) -> int:
    """One ``_input_metadata`` entry: the shape, dtype, device a node expects.

    The shape becomes size slots; returns the first. A jagged nested
    tensor's shape holds a nested int (static slots keyed by structure:
    :meth:`~cagrad.keys.sizes.SizeInputs.nested_marker`).

    Raises:
        Unsupported: ``nested_tensor`` for a C++ nested tensor
            (``torch.nested`` with the strided layout);
            ``internal:nested_ints`` for a jagged one where torch's nested
            ints are not as cagrad expects.
    """
    if md.is_nested_tensor and getattr(md, "is_cpp_nested_tensor", True):
        raise Unsupported("nested_tensor", f"{what} receives a nested tensor of the strided layout")
    shape = md.shape
    w.size(len(shape))
    w.dtype(md.dtype)
    w.device(md.device)
    if md.is_nested_tensor:
        internals.require("nested_tensors")
        return sizes.add_static(shape, what)
    return sizes.add(shape, True, what)


class Collector:
    """Collects one backward, node by node, in run order.

    Attributes:
        args: the lifted tensors.
        objects: the runtime objects (the graph's ``hooks`` list).
        plans: one :class:`NodePlan` per collected node.
        releases: what to release after a backward without ``retain_graph``:
            saved-tensor slots of traced nodes are in ``args.slots``; these
            are the nodes run as they are.
        sizes: the backward's size slots.
        metadata_slots: ``(NodeCall.id, input_nr) -> first size slot`` of the
            input metadata shapes written into the key.
        attr_slots: ``(NodeCall.id, attr) -> the attribute's structure with
            size slots in place of its ints``, for SymInt-typed attributes
            (and an inlined AOT backward's ``symints``).
        output_slots: ``(NodeCall.id, i) -> first size slot`` of the shape of
            a non-differentiable forward output of an inlined AOT backward
            (its materialized zero gradient has that shape).
        any_opaque: some node has hooks that are not traced or runs
            opaque, so leaves are accumulated in order inside the graph.
        user_code: some code of the user's runs during the backward besides
            traceable tensor and node hooks and traced custom Function
            backwards (hooks of other kinds or not traceable, custom Functions
            run opaque, nodes run as they are). A custom Function is traced
            only while it is False up to that node's own pre-hooks.
        traced_hooks: object indices of the tensor and node hook dicts whose
            hooks are traced into the graph (set by :meth:`finish`).
        needs_host: some hook was added from C++ and may queue a callback
            from C++, so the graph runs inside a host GraphTask of torch's
            (:mod:`cagrad.run.host`).
        leaves: ``(variable, first size slot)`` of each accumulated leaf,
            for :meth:`marked_dynamic_slots`.
        ddp_python_hooks: object indices of the post-accumulate-grad dicts
            that hold DDP's python-reducer hooks only
            (:func:`cagrad.hooks.cpp_hooks.is_ddp_python_hook`; their key
            says so).
    """

    def __init__(self, task: GraphTask, census: Census) -> None:
        self.task = task
        self.census = census
        self.args = TensorArgs()
        self.objects: list[Any] = []
        self.plans: list[NodePlan] = []
        self.releases: list[NodeCall] = []
        self.any_opaque = False
        self.user_code = False
        self.traced_hooks: frozenset[int] = frozenset()
        # (object index, when it runs) of each dict whose hooks all trace
        self._traceable_dicts: list[tuple[int, tuple[int, int, int]]] = []
        # when the first code of the user's runs, or None
        self._first_user_code: tuple[int, int, int] | None = None
        self._pos = 0  # position in run order of the node being collected
        self.needs_host = False
        self.sizes = SizeInputs()
        self.metadata_slots: dict[tuple[int, int], int] = {}
        self.attr_slots: dict[tuple[int, str], Any] = {}
        self.output_slots: dict[tuple[int, int], int] = {}
        self.leaves: list[tuple[torch.Tensor, int]] = []
        self.ddp_python_hooks: set[int] = set()
        # NodeCall.id -> fingerprint of a custom Function chosen for tracing
        # in _plan (decided in collect, once its hooks are known)
        self._custom_fp: dict[int, bytes] = {}
        self._user_code_before_apply = False  # the node being collected

    def marked_dynamic_slots(self) -> list[int]:
        """The size slots of dimensions marked with
        ``torch._dynamo.mark_dynamic`` on a lifted tensor or an accumulated
        leaf (the mark is the tensor's ``_dynamo_dynamic_indices``; weak
        marks, ``maybe_mark_dynamic``, are not read). Read at capture only.
        """
        found = []
        geometry = self.args.geometry
        pairs = [*zip(self.args.tensors, geometry), *self.leaves]
        for t, start in pairs:
            if start < 0 or type(t) not in _PLAIN_TENSOR_TYPES:
                continue  # a subclass or its inner tensors: static
            dims = getattr(t, "_dynamo_dynamic_indices", None)
            if dims:
                ndim = t.dim()
                found.extend(start + d for d in dims if isinstance(d, int) and 0 <= d < ndim)
        return sorted(set(found))

    @property
    def has_subclass(self) -> bool:
        """Some lifted tensor or accumulated leaf is a tensor subclass."""
        return bool(self.args.groups) or any(type(v) not in _PLAIN_TENSOR_TYPES for v, _ in self.leaves)

    def obj(self, o: Any) -> int:
        self.objects.append(o)
        return len(self.objects) - 1

    # -- one node -----------------------------------------------------------
    def collect(self, call: NodeCall) -> CacheKey:
        """The CacheKey of ``call``; lifts what it reads.

        Raises:
            Unsupported: the node cannot be compiled (its reason says why).
            EagerError: eager would raise running this node (released graph,
                tensor modified in place).
        """
        self._pos = len(self.plans)
        w = KeyWriter()
        w.size(call.id)
        w.tag(b"T" if call.needed else b"F")
        w.size(len(call.captures))
        for input_nr, out_idx in call.captures:
            w.size(input_nr)
            w.size(out_idx)
        node = call.node
        if node is None:  # the virtual GraphRoot: its edges are the roots
            self.plans.append(NodePlan(Kind.ROOT))
            self._write_edges(w, call)
            return CacheKey("GraphRoot", w.getvalue())
        schema = call.schema
        name = schema.name
        is_sink = schema.kind is NodeKind.ACCUMULATE_GRAD
        plan = self._plan(call, schema, is_sink)
        w.tag(_KIND_TAG[plan.kind])
        self._user_code_before_apply = False
        found = None
        # with inputs=, the engine reaches a node that does not run only when
        # it is the root itself (one root edge: no GraphRoot); it still runs
        # that node's tensor pre-hooks (evaluate_function), so list them
        if call.needed or call.captures or call.id == 0:
            found = self.census.hooks_of(node, is_sink)
            self.census.check_invisible(node, found, call.needed, name)
        if found is not None:
            plan.hooks = self._hooks(w, found, plan.kind)
        else:
            w.tag(b"-")
        self.plans.append(plan)
        if plan.kind is Kind.ACCUMULATE:
            variable = node.variable
            self.leaves.append((variable, write_tensor(w, variable, f"leaf of {name}", self.sizes)))
            return CacheKey(name, w.getvalue())
        if not call.needed:
            # captured only: it never runs, only its input slots matter
            self._write_own_inputs(w, call, name)
            return CacheKey(name, w.getvalue())
        if plan.kind is Kind.TRACED:
            self._write_traced(w, call, schema)
        elif plan.kind is Kind.AOT:
            self._write_aot(w, call, plan)
        elif plan.kind is Kind.CUSTOM:
            self._write_custom_function(w, call, plan)
        else:
            self.releases.append(call)
        self._write_edges(w, call)
        return CacheKey(name, w.getvalue())

    def _plan(self, call: NodeCall, schema: NodeSchema, is_sink: bool) -> NodePlan:
        node = call.node
        kind = schema.kind
        if is_sink:
            if node.variable.grad_fn is not None:
                raise EagerError(RuntimeError("leaf variable has been moved into the graph interior"))
            return NodePlan(Kind.ACCUMULATE, node=self.obj(node.variable))
        if not call.needed:
            return NodePlan(Kind.TRACED)  # never runs
        if kind is NodeKind.UNSUPPORTED and schema.unsupported[0].startswith("internal:"):
            raise Unsupported(*schema.unsupported)  # a torch internal the schema needs is not there
        if kind is NodeKind.CUSTOM_FUNCTION:
            internals.require("custom_function")
            record = custom_function.record_of(node)
            if record is None:
                raise Unsupported(
                    "custom_function_unrecorded",
                    f"{schema.name} was applied before cagrad was imported (no forward record)",
                )
            if custom_function.aot_inline_info(node) is not None:
                if self._claim_custom(node):
                    return NodePlan(Kind.AOT, record=record)
                # its saved tensors carry foreign pack hooks (a torch.compile'd
                # module inside a non-reentrant checkpoint): reading them to
                # lift them would run those hooks here (checkpoint recomputes,
                # selective checkpointing consumes its cache), so the backward
                # runs as it is, reading them once, as PyNode would
                if custom_function.backward_state_of(node) is not None:
                    raise Unsupported(
                        "saved_tensors_hooks",
                        f"{schema.name} has saved tensors with pack/unpack hooks that are "
                        "not cagrad's and a BackwardState",
                    )
            if not self.user_code:
                fp = backward_tracing.fingerprint(node, run_context.create_graph(), metadata_bytes)
                if fp is not None and self._claim_custom(node):
                    # traced unless its own hooks run user code before it
                    self._custom_fp[call.id] = fp
                    return NodePlan(Kind.CUSTOM, record=record)
            self._user_code(_AT_APPLY)
            return NodePlan(Kind.CUSTOM, node=self.obj(node), record=record)
        if kind is NodeKind.GENERATED and self._traceable(call, schema):
            return NodePlan(Kind.TRACED)
        # hidden state, a node type with no formula to trace, or saved tensors
        # with foreign pack hooks: run the node itself at run time (its
        # unpack hooks may run the user's code: checkpointing recomputes)
        self._user_code(_AT_APPLY)
        return NodePlan(Kind.OPAQUE, node=self.obj(node))

    def _traceable(self, call: NodeCall, schema: NodeSchema) -> bool:
        if run_context.create_graph() and formulas.runs_as_is(call.node, schema.name):
            return False
        if schema.split_sizes:
            # hidden per-input sizes are determined when at most one input has
            # no valid edge (see cagrad.autograd.node_schema, policy split_sizes), and
            # traced with sizes that may change only through a formula
            if schema.name not in FORMULAS:
                return False
            if sum(1 for fn, _ in call.edges if fn is None) > 1:
                return False
        if self.census.claim_slots and saved_variables.may_have_foreign_hooks(call.node):
            node = call.node
            for attr in schema.tensors:
                if not saved_variables.claim((node, attr, -1)):
                    return False
            for attr in schema.tensor_lists:
                for i in range(len(getattr(node, "_raw_saved_" + attr))):
                    if not saved_variables.claim((node, attr, i)):
                        return False
        if schema.name in formulas.ALWAYS:
            # eager's two prod paths lay out a non-contiguous input's
            # gradient differently, chosen by the data: run the node itself
            x = saved_variables.read(call.node, "self")
            if x is not None and not x.is_contiguous():
                return False
        return True

    def _claim_custom(self, node: Any) -> bool:
        """Claims a custom Function's ``save_for_backward`` slots (see
        :meth:`_traceable`); False if one carries foreign pack hooks."""
        if not (self.census.claim_slots and saved_variables.may_have_foreign_hooks(node)):
            return True
        try:
            count = len(node._raw_saved_tensors)
        except RuntimeError as e:
            raise EagerError(e) from e
        return all(saved_variables.claim((node, "tensors", i)) for i in range(count))

    def _write_traced(self, w: KeyWriter, call: NodeCall, schema: NodeSchema) -> None:
        node = call.node
        name = schema.name
        for attr in schema.values:
            w.value(getattr(node, "_saved_" + attr))
        dynamic_ok = name in FORMULAS
        for attr in schema.sym_values:
            self.attr_slots[(call.id, attr)] = self._sym_attr(
                w, getattr(node, "_saved_" + attr), dynamic_ok, f"{name}.{attr}"
            )
        for attr in schema.tensors:
            self._lift(w, saved_variables.read(node, attr), (node, attr, -1), f"{name}.{attr}")
        for attr in schema.tensor_lists:
            values = saved_variables.read(node, attr)
            w.size(len(values))
            for i, value in enumerate(values):
                self._lift(w, value, (node, attr, i), f"{name}.{attr}[{i}]")

    def _sym_attr(self, w: KeyWriter, value: Any, dynamic_ok: bool, what: str) -> Any:
        """A SymInt-typed attribute: structure in the key, ints as size slots."""
        if value is None:
            w.tag(b"N")
            return None
        if isinstance(value, (tuple, list)):
            w.tag(b"(")
            w.size(len(value))
            start = self.sizes.add([_int64(v) for v in value], dynamic_ok, what)
            return tuple(range(start, start + len(value)))
        w.tag(b"i")
        return self.sizes.add((_int64(value),), dynamic_ok, what)

    def _lift(self, w: KeyWriter, value: Any, slot: Slot, what: str) -> None:
        if value is None:
            w.tag(b"N")
            return
        start = write_tensor(w, value, what, self.sizes)
        self.args.add(value, slot, start)

    def _write_aot(self, w: KeyWriter, call: NodeCall, plan: NodePlan) -> None:
        """An inlined AOTAutograd backward: its compiled function, saved
        tensors (lifted), symints (size slots), forward outputs, and whether
        it has a ``BackwardState`` (its tensor hooks run as opaque calls on
        this backward's state, runtime object ``plan.node``)."""
        node = call.node
        name = call.name
        record = plan.record
        self._write_custom(w, node, record)
        w.size(node._forward_cls._aot_id)
        self._write_outputs(w, call, record, False)
        self.attr_slots[(call.id, "symints")] = self._sym_attr(
            w, tuple(node.symints), True, f"{name}.symints"
        )
        state = custom_function.backward_state_of(node)
        if state is not None:
            w.tag(b"B")
            plan.node = self.obj(state)
            self._user_code(_AT_APPLY)  # its hooks may observe .grad
        else:
            w.tag(b"-")
        self._lift_saved_tensors(w, node, name)

    def _lift_saved_tensors(self, w: KeyWriter, node: Any, name: str) -> None:
        try:
            values = node.saved_tensors
        except RuntimeError as e:
            raise EagerError(e) from e
        w.size(len(values))
        for i, value in enumerate(values):
            self._lift(w, value, (node, "tensors", i), f"{name}.saved_tensors[{i}]")

    def _write_outputs(self, w: KeyWriter, call: NodeCall, record: Any, all_shapes: bool) -> None:
        """The forward outputs a materialized zero gradient is made for: the
        materialize flags, and per output its kind, dtype and device, and
        its shape as size slots (:attr:`output_slots`) where it is not
        differentiable, or for every output with ``all_shapes`` (which may
        then be dynamic: a traced backward reads them as any size; an
        inlined AOTAutograd backward's compiled code has them static)."""
        node = call.node
        w.value((node.materialize_grads, node._materialize_non_diff_grads))
        for i, info in enumerate(record.outputs):
            if info is None:
                w.tag(b"N")
                continue
            w.value(info.differentiable)
            w.dtype(info.dtype)
            w.device(info.device)
            if all_shapes or not info.differentiable:
                if any(is_nested_int(v) for v in info.shape):
                    # a jagged output: its ragged size has no slot value
                    # (a subclass in a custom Function runs in eager)
                    raise Unsupported(
                        "tensor_subclass", f"{call.name} output {i} is jagged (a nested int in its shape)"
                    )
                w.size(len(info.shape))
                self.output_slots[(call.id, i)] = self.sizes.add(
                    info.shape, all_shapes, f"{call.name} output {i}"
                )

    def _write_custom_function(self, w: KeyWriter, call: NodeCall, plan: NodePlan) -> None:
        """A custom Function run by PyNode's steps: opaque (``o``: its
        backward is not traceable, or user code ran before this node; ``O``:
        its own pre-hooks run user code), or traced
        (``T`` and its :func:`~cagrad.hooks.backward_tracing.fingerprint`,
        its forward outputs and its saved tensors, lifted) where no code of
        the user's runs before it in this backward, its own pre-hooks
        included: such code could change what the fingerprint read."""
        node = call.node
        fp = self._custom_fp.pop(call.id, None)
        if fp is None or self._user_code_before_apply:
            if fp is None:
                w.tag(b"o")  # its object was added in _plan, before its hooks'
            else:
                w.tag(b"O")  # (a distinct tag: its object follows its hooks')
                plan.node = self.obj(node)
                self._user_code(_AT_APPLY)
            self._write_custom(w, node, plan.record)
            self.releases.append(call)
            return
        plan.kind = Kind.CUSTOM_TRACED
        w.tag(b"T")
        w.text(fp.hex())
        for attr, size in backward_tracing.ctx_sizes(node, run_context.create_graph()):
            # a ctx torch.Size (the fingerprint has its length): size slots
            self.attr_slots[(call.id, "ctx." + attr)] = self._sym_attr(
                w, tuple(size), True, f"{call.name} ctx.{attr}"
            )
        self._write_custom(w, node, plan.record)
        self._write_outputs(w, call, plan.record, True)
        self._lift_saved_tensors(w, node, call.name)

    def _write_custom(self, w: KeyWriter, node: Any, record: Any) -> None:
        cls = node._forward_cls
        w.text(f"{cls.__module__}.{cls.__qualname__}")
        w.value(record.is_variable_input)

    def _user_code(self, step: int, k: int = 0) -> None:
        """Code of the user's runs at ``step`` of the node being collected
        (before its apply: a custom Function there runs opaque)."""
        self.user_code = self.any_opaque = True
        if step < _AT_APPLY:
            self._user_code_before_apply = True
        at = (self._pos, step, k)
        if self._first_user_code is None or at < self._first_user_code:
            self._first_user_code = at

    def _hook_dict(
        self, w: KeyWriter, d: Any, traceable: bool, name: str, hook_of: str, step: int, index: int = 0
    ) -> int:
        """One hook dict into the key: its length and, per hook, its
        fingerprint or ``o`` (opaque). Returns its object index; it joins
        ``_traceable_dicts`` if ``traceable`` and every hook in it can be
        traced. ``name`` (the dict) and ``hook_of`` (where a hook sits) name
        its fields in golden_graphs' decoded keys; ``step`` and ``index``
        (within the step) say when it runs in the node's steps."""
        w.size(len(d))
        fingerprints = hook_tracing.dict_fingerprints(d)
        for k, fp in enumerate(fingerprints):
            if fp is None:
                w.tag(b"o")
            else:
                w.tag(b"p")
                w.text(fp.hex())
        obj = self.obj(d)
        if traceable and None not in fingerprints:
            self._traceable_dicts.append((obj, (self._pos, step, index)))
        else:
            self._user_code(step, index)
        return obj

    def _hooks(self, w: KeyWriter, found: FoundHooks, kind: Kind) -> NodeHooks:
        hooks = NodeHooks()
        if found.cpp_post:
            # hooks added from C++ (DDP's reducer): their count, then the rest
            w.tag(b"H")
            w.size(len(found.cpp_post))
            hooks.cpp_post = self.obj(found.cpp_post)
            self.needs_host = self.any_opaque = True
        else:
            w.tag(b"h")
        w.size(len(found.tensor_pre))
        for j, (input_nr, d) in enumerate(found.tensor_pre):
            w.size(input_nr)
            where = f"at input {input_nr}"
            obj = self._hook_dict(w, d, True, f"hooks {where}", where, _AT_TENSOR_PRE, j)
            hooks.tensor_pre.append((input_nr, obj))
        w.size(len(found.retain_grad))
        for input_nr, ref in found.retain_grad:
            w.size(input_nr)
            hooks.retain_grad.append((input_nr, self.obj(ref)))
            if run_context.create_graph():
                # the gradient's .grad keeps its history: set in order, by an
                # opaque call (see BackwardWalk's retain_at_end)
                self.any_opaque = True
        # a custom Function with node pre-hooks runs opaque (Collector._write_custom_function)
        self._user_code_before_apply |= bool(found.pre)
        # node pre-hooks are traced before any node (they see its incoming
        # gradients); post-hooks only after a traced node, whose outputs the
        # trace has for every edge (an opaque node's outputs for unused edges
        # are handed on unseen)
        for field in ("pre", "post"):
            d = getattr(found, field)
            if d:
                traceable = field == "pre" or kind is Kind.TRACED
                step = _AT_PRE if field == "pre" else _AT_POST
                obj = self._hook_dict(w, d, traceable, f"{field} hooks", f"of {field} hooks", step)
                setattr(hooks, field, obj)
            else:
                w.size(0)
        field = "post_accumulate"
        d = found.post_accumulate
        if d:
            w.size(len(d))
            hooks.post_accumulate = self.obj(d)
            if all(cpp_hooks.is_ddp_python_hook(h) for h in d.values()):
                # DDP's python-reducer hooks only: movable with the
                # accumulations (cagrad.capture.leaf_hook_groups)
                w.tag(b"D")
                self.ddp_python_hooks.add(hooks.post_accumulate)
            self._user_code(_AT_APPLY)
        else:
            w.size(0)
        return hooks

    def finish(self) -> None:
        """Decides, once every node is collected, whether hooks are traced.

        A dict is when each of its hooks is accepted by
        :mod:`cagrad.hooks.hook_tracing` and it runs before any other code of
        the user's (hooks that are not traced, custom Functions, nodes run as
        they are) in the backward's run order: such code could change a hook
        dict after its fingerprint went into the key, but only for the dicts
        that run after it; between the keys and a dict that runs before it,
        only traced ops run. Later dicts run opaque like every other hook.
        The decision follows from the keys alone (run order, fingerprints,
        hook kinds and node kinds are all in them).
        """
        first = self._first_user_code
        traced = [obj for obj, at in self._traceable_dicts if first is None or at < first]
        self.traced_hooks = frozenset(traced)
        if len(traced) < len(self._traceable_dicts):
            self.any_opaque = True

    def _write_edges(self, w: KeyWriter, call: NodeCall) -> None:
        task = self.task
        edges = task.next_edges(call)
        call_of = task.call_of
        w.size(len(edges))
        for i, (fn, input_nr) in enumerate(edges):
            if fn is None:
                w.tag(b"N")
                continue
            target = call_of[fn]
            w.size(target.id)
            w.size(input_nr)
            self.write_metadata(w, target, input_nr, f"edge {i} of {call.name}")

    def write_metadata(self, w: KeyWriter, target: NodeCall, input_nr: int, what: str) -> None:
        """The input metadata of ``target`` at ``input_nr``, its shape as slots."""
        start = write_input_metadata(w, target.input_metadata[input_nr], what, self.sizes)
        self.metadata_slots.setdefault((target.id, input_nr), start)

    def _write_own_inputs(self, w: KeyWriter, call: NodeCall, name: str) -> None:
        w.size(len(call.input_metadata))
        for i in range(len(call.input_metadata)):
            self.write_metadata(w, call, i, f"input {i} of {name}")
