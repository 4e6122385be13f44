"""Applying a node's backward under the trace: the methods of
:class:`cagrad.capture.compiler.AutogradCompilerInstance` that
:class:`cagrad.autograd.walk.BackwardWalk` calls for a traced node (its C++
formula or cagrad's Python one, :mod:`cagrad.autograd.formulas`), an
AOTAutograd backward and a custom Function's backward, with PyNode's steps
around the latter two (:func:`cagrad.autograd.custom_function.apply`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..autograd import custom_function, formulas, run_context
from ..autograd.graph_task import NodeCall
from ..autograd.walk import NodePlan, Obj
from ..counters import counters
from ..errors import NodeTraceFailed, Unsupported
from ..hooks import backward_tracing
from ..keys import subclasses
from .aot_backward import run_aot_backward
from .warnings_in_trace import warnings_refused


class NodeApplication:
    """Mixin of :class:`~cagrad.capture.compiler.AutogradCompilerInstance`:
    reads its ``collector``, ``slot_values`` and ``symbolic``, and calls its
    ``metadata``, ``opaque``, ``_last_node`` and ``_tag_since``. Each
    ``apply_*`` returns the node's output gradients (fakes recorded in the
    graph) and tags the graph nodes it adds with the node's name and
    position; a failure other than :class:`~cagrad.errors.Unsupported`
    raises :class:`~cagrad.errors.NodeTraceFailed` (the node then runs as it
    is in the next try)."""

    collector: Any
    slot_values: list[Any]
    symbolic: bool

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
            with warnings_refused():
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
            with warnings_refused():
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
