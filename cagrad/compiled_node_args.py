"""CompiledNodeArgs: one node's cache key and the tensors it lifts.

For every node a backward runs, in run order, :func:`collect` writes into a
:class:`~cagrad.cache_key.KeyWriter` everything the traced graph depends on
that is not a graph input, and appends to the backward's :class:`TensorArgs`
every tensor that becomes a graph input. Two backwards with equal key
sequences trace to the same graph; that is the cache's soundness argument, so
every branch here either writes what it read into the key or raises
:class:`~cagrad.errors.Unsupported`.

Per node the key holds, in order:

1. the node's discovery id and run flags (needed, captured input slots);
2. every visible non-tensor attribute (``_saved_<name>``), in name order;
3. for every saved tensor (and element of a saved tensor list): defined or
   not, and its metadata (requires_grad, dtype, device, layout, sizes,
   strides, storage offset, conjugate/negative bits for complex dtypes);
4. for every edge: invalid, or the target's discovery id, input number and
   the target's input metadata there (shape, dtype, device). This also
   covers the hidden fields of the ``edge`` policy (see
   :mod:`cagrad.node_schema`);
5. the hook census (any hook makes the backward fall back in this version);
6. for ``AccumulateGrad``: the leaf's metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from .cache_key import CacheKey, KeyWriter
from .errors import EagerError, Unsupported
from .graph_task import GraphTask, NodeCall
from .hooks_census import Census
from .node_schema import NodeKind
from . import saved_variables
from .saved_variables import Slot

_STRIDED = torch.strided
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class TensorArgs:
    """The tensors a backward lifts as graph inputs, in collection order.

    ``tensors[i]`` is the real tensor for graph input ``inputs[i]``;
    ``slots[i]`` the saved-tensor slot it was read from (``None`` for root
    gradients): a trace swaps it for its fake, and a backward without
    ``retain_graph`` releases it.
    """

    __slots__ = ("tensors", "slots")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.slots: list[Slot | None] = []

    def add(self, t: torch.Tensor, slot: Slot | None) -> int:
        self.tensors.append(t)
        self.slots.append(slot)
        return len(self.tensors) - 1


def write_tensor(w: KeyWriter, t: torch.Tensor, what: str) -> None:
    """Tensor metadata that specializes a traced graph.

    Raises:
        Unsupported: sparse/mkldnn/nested layouts and tensor subclasses.
    """
    if type(t) not in _PLAIN_TENSOR_TYPES:
        raise Unsupported("tensor_subclass", f"{what} is a {type(t).__name__}")
    if t.layout is not _STRIDED:
        raise Unsupported("non_strided_tensor", f"{what} has layout {t.layout}")
    w.tag(b"t" if not t.requires_grad else b"r")
    w.dtype(t.dtype)
    w.device(t.device)
    w.sizes(t.shape)
    w.sizes(t.stride())
    w.size(t.storage_offset())
    if t.is_complex():
        w.value((t.is_conj(), t.is_neg()))


def write_input_metadata(w: KeyWriter, md: Any, what: str) -> None:
    """One ``_input_metadata`` entry: the shape, dtype, device a node expects.

    Raises:
        Unsupported: for nested tensors.
    """
    if md.is_nested_tensor:
        raise Unsupported("nested_tensor", f"{what} receives a nested tensor")
    w.sizes(md.shape)
    w.dtype(md.dtype)
    w.device(md.device)


def _write_saved(
    w: KeyWriter, args: TensorArgs, value: Any, slot: Slot, what: str, claim: bool
) -> None:
    if value is None:
        w.tag(b"N")
        return
    if claim:
        saved_variables.claim(slot)
    write_tensor(w, value, what)
    args.add(value, slot)


def collect(task: GraphTask, call: NodeCall, args: TensorArgs, census: Census) -> CacheKey:
    """The CacheKey of ``call``; lifts its saved tensors into ``args``.

    Raises:
        Unsupported: the node cannot be compiled (its reason says why).
        EagerError: eager would raise running this node (released graph,
            tensor modified in place).
    """
    w = KeyWriter()
    w.size(call.id)
    w.tag(b"T" if call.needed else b"F")
    w.size(len(call.captures))
    for input_nr, out_idx in call.captures:
        w.size(input_nr)
        w.size(out_idx)
    node = call.node
    schema = call.schema
    if node is None:  # the virtual GraphRoot: its edges are the roots
        _write_edges(w, task, call)
        return CacheKey("GraphRoot", w.getvalue())
    kind = schema.kind
    if kind is NodeKind.UNSUPPORTED:
        raise Unsupported(*schema.unsupported)
    if kind is NodeKind.CUSTOM_FUNCTION:
        raise Unsupported("custom_function", f"{schema.name} is a Python autograd.Function backward")
    name = schema.name
    census.check(node, kind is NodeKind.ACCUMULATE_GRAD)
    if kind is NodeKind.ACCUMULATE_GRAD:
        variable = node.variable
        if variable.grad_fn is not None:
            raise EagerError(RuntimeError("leaf variable has been moved into the graph interior"))
        write_tensor(w, variable, f"leaf of {name}")
        w.value(variable.requires_grad)
        return CacheKey(name, w.getvalue())
    if not call.needed:
        # captured only: it never runs, only its input slots matter
        _write_own_inputs(w, call, name)
        return CacheKey(name, w.getvalue())
    for attr in schema.values:
        w.value(getattr(node, "_saved_" + attr))
    claim = census.claim_slots
    for attr in schema.tensors:
        value = saved_variables.read(node, attr)
        _write_saved(w, args, value, (node, attr, -1), f"{name}.{attr}", claim)
    for attr in schema.tensor_lists:
        values = saved_variables.read(node, attr)
        w.size(len(values))
        for i, value in enumerate(values):
            _write_saved(w, args, value, (node, attr, i), f"{name}.{attr}[{i}]", claim)
    _write_edges(w, task, call)
    if schema.split_sizes:
        _check_split_sizes(call.edges, name)
    return CacheKey(name, w.getvalue())


def _write_edges(w: KeyWriter, task: GraphTask, call: NodeCall) -> None:
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
        write_input_metadata(w, target.input_metadata[input_nr], f"edge {i} of {call.name}")


def _write_own_inputs(w: KeyWriter, call: NodeCall, name: str) -> None:
    metadata = call.input_metadata
    w.size(len(metadata))
    for i, md in enumerate(metadata):
        write_input_metadata(w, md, f"input {i} of {name}")


def _check_split_sizes(edges: Any, name: str) -> None:
    # the hidden per-input sizes are determined by the edges when at most one
    # input has no valid edge (see cagrad.node_schema, policy split_sizes)
    missing = sum(1 for fn, _ in edges if fn is None)
    if missing > 1:
        raise Unsupported(
            f"hidden_state:{name}",
            f"{name} has {missing} inputs without gradient edges, so its hidden "
            "per-input sizes are not determined by the key",
        )
