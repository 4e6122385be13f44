"""GraphTask: which nodes a backward runs, and in which order.

This is the part of the eager engine (torch/csrc/autograd/engine.cpp) that
does not depend on tensor values, redone in Python:

* ``compute_dependencies``: from the graph root, count the incoming edges of
  every reachable node.
* ``init_to_execute``: with ``inputs=`` (``autograd.grad``, or
  ``backward(inputs=...)``), mark the nodes that lie on a path to an input as
  *needed*, and the input edges as *captures* (``autograd.grad``) or needed
  sinks (``backward``).
* the ready-queue loop: pop the ready node with the largest sequence number,
  hand its outputs along its edges, push each next node once all its
  dependencies have arrived. Which node runs when depends only on the graph's
  structure, so the whole order is known before anything runs.

When there is more than one root the engine puts a ``GraphRoot`` node in
front whose outputs are the root gradients; with one root it starts at the
root's own node. Both are replayed, since the choice changes the order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import EagerError, Unsupported
from .node_schema import NodeKind, NodeSchema, output_ranges, schema_of
from .ready_queue import ReadyQueue

Edge = tuple[Any, int]  # (node or None, input_nr)

_GRAPH_ROOT_SEQ = 0  # the virtual root is alone in the queue when it runs


class NodeCall:
    """One node in a backward, in the order the engine runs it.

    Attributes:
        node: the autograd node (``None`` for the virtual ``GraphRoot``).
        id: the node's index in discovery order (the dependency walk); edges
            in cache keys name their target by it.
        schema: what the node saves (see :mod:`cagrad.autograd.node_schema`).
        edges: the node's ``next_functions`` (read once).
        needed: the node runs (False: it only has its inputs captured).
        captures: ``(input_nr, output_index)`` pairs whose incoming gradient
            ``autograd.grad`` returns.
    """

    __slots__ = ("node", "id", "schema", "edges", "needed", "captures", "_input_metadata")

    def __init__(self, node: Any, id: int, schema: NodeSchema | None) -> None:
        self.node = node
        self.id = id
        self.schema = schema
        self.edges: tuple[Edge, ...] = ()
        self.needed = True
        self.captures: list[tuple[int, int]] = []
        self._input_metadata: tuple | None = None

    @property
    def name(self) -> str:
        return "GraphRoot" if self.node is None else type(self.node).__name__

    @property
    def input_metadata(self) -> tuple:
        """The node's ``_input_metadata`` (read once): one entry per input."""
        md = self._input_metadata
        if md is None:
            md = self._input_metadata = self.node._input_metadata
        return md


def gradient_edge(t: torch.Tensor, index: int, what: str) -> Edge:
    """The edge a gradient w.r.t. ``t`` flows into (``impl::gradient_edge``).

    For a non-leaf this is ``(t.grad_fn, t.output_nr)``; for a leaf that
    requires grad, its ``AccumulateGrad`` node, reached without creating one
    that the graph does not hold (see :func:`_leaf_accumulator`).

    Raises:
        EagerError: if ``t`` does not require grad (eager raises then).
    """
    fn = t.grad_fn
    if fn is not None:
        return fn, t.output_nr
    if not t.requires_grad:
        raise EagerError(RuntimeError(f"element {index} of {what} does not require grad"))
    return None, 0  # a leaf: resolved against the graph's AccumulateGrad nodes


class GraphTask:
    """The structure of one backward: roots, dependencies, execution order.

    Args:
        roots: the tensors whose gradients start the backward (the
            ``tensors`` of ``run_backward``), each requiring grad.
        inputs: the ``inputs`` of ``run_backward`` (possibly empty).
        accumulate_grad: True for ``backward()`` (gradients go to ``.grad``),
            False for ``autograd.grad`` (they are returned).

    Raises:
        EagerError: for arguments eager rejects (a root or input that does
            not require grad), so that eager raises its own error.
        Unsupported: for cases cagrad does not compile yet.
    """

    def __init__(
        self,
        roots: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        accumulate_grad: bool,
    ) -> None:
        self.accumulate_grad = accumulate_grad
        root_edges: list[Edge] = []
        leaf_roots: list[tuple[int, torch.Tensor]] = []
        for i, t in enumerate(roots):
            if not isinstance(t, torch.Tensor):
                raise Unsupported("gradient_edge", "a root given as a GradientEdge")
            fn, nr = gradient_edge(t, i, "tensors")
            if fn is None:
                leaf_roots.append((i, t))
            root_edges.append((fn, nr))
        self.root_edges = root_edges
        self.has_graph_root = len(root_edges) != 1

        self.calls: list[NodeCall] = []  # discovery order, GraphRoot first if any
        self.call_of: dict[Any, NodeCall] = {}
        self._dependencies: dict[Any, int] = {}
        self._leaf_accumulators: dict[int, Any] = {}
        self._discover(leaf_roots)

        self.output_edges: list[Edge] = []
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise Unsupported("gradient_edge", "an input given as a GradientEdge")
            if not t.requires_grad:
                raise EagerError(RuntimeError("One of the differentiated Tensors does not require grad"))
            if t.grad_fn is not None:
                if accumulate_grad:
                    # eager's run_backward makes a non-leaf input retain its
                    # grad, for good; the census then finds that hook
                    t.retain_grad()
                self.output_edges.append((t.grad_fn, t.output_nr))
            else:
                self.output_edges.append((self._leaf_accumulators.get(id(t)), 0))
        self.num_captures = 0 if accumulate_grad else len(self.output_edges)
        if inputs:
            self._init_to_execute()
        self.order: list[NodeCall] = self._run_order()

    # -- compute_dependencies ----------------------------------------------
    def _add(self, node: Any) -> NodeCall:
        call = NodeCall(node, len(self.calls), schema_of(node) if node is not None else None)
        self.calls.append(call)
        self.call_of[node] = call
        if call.schema is not None and call.schema.kind is NodeKind.ACCUMULATE_GRAD:
            self._leaf_accumulators[id(node.variable)] = node
        return call

    def _discover(self, leaf_roots: list[tuple[int, torch.Tensor]]) -> None:
        deps = self._dependencies
        if self.has_graph_root:
            self._add(None)
        if leaf_roots:
            # a leaf root flows straight into its AccumulateGrad; find it the
            # way the engine does (the one the tensor already has), via a view
            for i, t in leaf_roots:
                with torch.enable_grad():
                    acc = t.view_as(t).grad_fn.next_functions[0][0]
                self.root_edges[i] = (acc, 0)
        stack: list[Any] = []
        if self.has_graph_root:
            first_edges = self.root_edges
        else:
            root = self.root_edges[0][0]
            self._add(root)
            deps[root] = 0
            stack.append(root)
            first_edges = []
        for fn, _ in first_edges:
            if fn is None:
                continue
            if fn not in deps:
                deps[fn] = 0
                self._add(fn)
                stack.append(fn)
            deps[fn] += 1
        call_of = self.call_of
        while stack:
            fn = stack.pop()
            edges = call_of[fn].edges = fn.next_functions
            for nxt, _ in edges:
                if nxt is None:
                    continue
                if nxt in deps:
                    deps[nxt] += 1
                else:
                    deps[nxt] = 1
                    self._add(nxt)
                    stack.append(nxt)

    # -- init_to_execute -----------------------------------------------------
    def _init_to_execute(self) -> None:
        call_of = self.call_of
        for call in self.calls:
            call.needed = False  # the graph root too: it runs only if it leads to an input
        for out_idx, (fn, input_nr) in enumerate(self.output_edges):
            call = call_of.get(fn) if fn is not None else None
            if call is None:
                continue  # unreachable: the engine gives it an Identity edge
            if self.accumulate_grad:
                call.needed = True
            else:
                call.captures.append((input_nr, out_idx))

        def should_execute(c: NodeCall) -> bool:
            return c.needed or bool(c.captures)

        # a node is needed when any of its children should execute; visit
        # children before parents (iterative post-order over the DAG)
        done: set[int] = set()
        for start in self.calls:
            if start.id in done:
                continue
            stack = [(start, iter(self._children(start)))]
            while stack:
                call, children = stack[-1]
                for child in children:
                    if child.id not in done:
                        stack.append((child, iter(self._children(child))))
                        break
                else:
                    stack.pop()
                    done.add(call.id)
                    if not call.needed and any(should_execute(c) for c in self._children(call)):
                        call.needed = True

    def _children(self, call: NodeCall) -> list[NodeCall]:
        return [self.call_of[fn] for fn, _ in self.next_edges(call) if fn is not None]

    def executes(self, fn: Any) -> bool:
        """Whether a gradient sent to node ``fn`` is used: the edge is valid
        and, with ``inputs=``, its target runs or has an input captured (the
        engine's ``exec_info[fn].should_execute()``)."""
        if fn is None:
            return False
        if not self.output_edges:
            return True
        target = self.call_of[fn]
        return target.needed or bool(target.captures)

    def will_execute(self, fn: Any) -> bool:
        """``torch._C._will_engine_execute_node(fn)`` for this backward: ``fn``
        is in the graph and, with ``inputs=``, runs or has an input captured
        (``exec_info[fn].should_execute()``)."""
        call = self.call_of.get(fn)
        if call is None:
            return False
        return not self.output_edges or call.needed or bool(call.captures)

    def computed_outputs(self, call: NodeCall) -> list[bool] | None:
        """Which outputs C++ node ``call`` computes in this backward, where
        that differs from what calling it from Python computes.

        Called from Python the node sees no graph task, so
        ``Node::task_should_compute_output`` only asks whether an edge of the
        argument's range is valid; under ``inputs=`` the engine also asks
        whether the edge leads to a node that runs (its ``exec_info``), so an
        output for a node that does not run is not computed unless another
        edge of its range is used (see
        :func:`cagrad.autograd.node_schema.output_ranges`).

        Returns:
            one flag per edge (False: eager's node returns None there), or
            None when the call from Python computes what eager does.

        Raises:
            Unsupported: the node's ranges are not known and some valid edge
                leads to a node that does not run.
        """
        if not self.output_edges:
            return None
        edges = call.edges
        used = [self.executes(fn) for fn, _ in edges]
        if all(u or fn is None for u, (fn, _) in zip(used, edges)):
            return None
        ranges = output_ranges(call.node)
        if ranges is None:
            raise Unsupported(
                "post_hook_outputs",
                f"which outputs {call.name} computes under inputs= is not known, "
                "and a node post-hook sees them",
            )
        out = [False] * len(edges)
        for r in ranges:
            if any(used[i] for i in r):
                for i in r:
                    out[i] = True
        return out

    def next_edges(self, call: NodeCall) -> Sequence[Edge]:
        """The edges a node hands its outputs along (root edges for GraphRoot)."""
        if call.node is None:
            return self.root_edges
        return call.edges

    # -- the ready-queue loop --------------------------------------------------
    def _run_order(self) -> list[NodeCall]:
        deps = dict(self._dependencies)
        call_of = self.call_of
        has_exec_info = bool(self.output_edges)
        queue: ReadyQueue[NodeCall] = ReadyQueue()
        first = self.calls[0]
        queue.push(_GRAPH_ROOT_SEQ if first.node is None else first.node._sequence_nr(), first)
        not_ready: set[int] = set()
        order: list[NodeCall] = []
        while queue:
            call = queue.pop()
            order.append(call)
            if has_exec_info and not call.needed:
                continue  # captured only: the engine returns before running it
            for fn, _ in self.next_edges(call):
                if fn is None:
                    continue
                nxt = call_of[fn]
                deps[fn] -= 1
                ready = deps[fn] == 0
                if nxt.id in not_ready:
                    if ready:
                        not_ready.discard(nxt.id)
                        queue.push(fn._sequence_nr(), nxt)
                    continue
                if has_exec_info and not (nxt.needed or nxt.captures):
                    continue
                if ready:
                    queue.push(fn._sequence_nr(), nxt)
                else:
                    not_ready.add(nxt.id)
        return order
