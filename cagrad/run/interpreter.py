"""The interpreter: the walk on real tensors, eager's engine redone in Python.

It finishes a compiled backward whose run-time check failed (a hook or an
opaque node returned None where the trace assumed a gradient): from the
:class:`~cagrad.autograd.walk.ResumePoint` of that call, with the values the compiled
part computed, it runs the remaining steps exactly as the engine would, each
node by its own ``apply``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..autograd import custom_function, run_context
from ..autograd.graph_task import GraphTask, NodeCall
from ..autograd.validate import real_metadata, validate_outputs
from ..autograd.walk import BackwardWalk, NodePlan, Obj
from ..capture import runtime_ops
from ..capture.aot_backward import run_aot_backward
from ..hooks import added_hooks, hooks_census


class Interpreter:
    """An Executor that runs each step on real tensors.

    Args:
        objects: the backward's runtime objects (the graph's ``hooks``).
    """

    def __init__(self, objects: Sequence[Any]) -> None:
        self.objects = objects
        #: called with a node's position after each opaque call (user code
        #: may have registered hooks; see :mod:`cagrad.hooks.added_hooks`)
        self.after_opaque: Callable[[int], None] | None = None

    def metadata(self, fn: Any, input_nr: int) -> tuple:
        return real_metadata(fn, input_nr)

    def validate(self, name: str, edges: Sequence[Any], grads: list, origin: str) -> list:
        return validate_outputs(name, edges, grads)

    def add(self, a: Any, b: Any, origin: str) -> Any:
        # InputBuffer::accumulate: a sparse gradient is added to a dense one,
        # never the reverse (sparse + dense is not defined)
        if a.is_sparse and not b.is_sparse:
            return b + a
        return a + b

    def apply_traced(self, pos: int, call: NodeCall, inputs: list) -> list:
        with run_context.grad_mode():
            out = call.node(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def apply_aot(self, pos: int, call: NodeCall, plan: NodePlan, inputs: list) -> list:
        node = call.node
        if custom_function.backward_state_of(node) is None:
            # on real tensors an AOT backward runs as PyNode runs it
            return custom_function.apply(node, plan.record, call.edges, inputs)
        # one with a BackwardState refuses to run that way: its graph runs
        # with the hooks called as in the compiled graph
        info = custom_function.aot_inline_info(node)
        state = self.objects[plan.node]

        def call_hook(name: str, grad: torch.Tensor) -> torch.Tensor:
            return runtime_ops.backward_state_hook(state, name, grad)

        def backward(args: list) -> Any:
            saved = list(node.saved_tensors)
            return run_aot_backward(info, saved, list(node.symints), args, call_hook)

        return custom_function.apply(node, plan.record, call.edges, inputs, backward)

    def apply_custom(self, pos: int, call: NodeCall, plan: NodePlan, inputs: list) -> list:
        # on real tensors a traced custom Function's backward runs as PyNode runs it
        return custom_function.apply(call.node, plan.record, call.edges, inputs)

    def _arg(self, a: Any) -> Any:
        if isinstance(a, Obj):
            return self.objects[a.index]
        if isinstance(a, (list, tuple)):
            return [self._arg(x) for x in a]
        return a

    def opaque(self, op: str, args: tuple, result: Any, origin: str, resume: Any, pos: int) -> Any:
        out = getattr(runtime_ops, op)(*(self._arg(a) for a in args))
        if self.after_opaque is not None:
            self.after_opaque(pos)
        return out


def resume(
    task: GraphTask,
    plans: Sequence[NodePlan],
    objects: Sequence[Any],
    point: Any,
    env: dict[str, Any],
    result: Any,
    accumulate_at_end: bool,
    observe: Callable[[tuple, Any], None] | None = None,
) -> list:
    """Finishes a backward from ``point`` on real values.

    Args:
        point: the :class:`~cagrad.autograd.walk.ResumePoint` of the call that failed.
        env: the values computed so far, by graph value name.
        result: what that call really returned.
        observe: called with ``((pos, phase), results)`` after each later
            speculative call (:attr:`BackwardWalk.observe`).

    Returns:
        the ``autograd.grad`` results (None where no gradient arrived).
    """
    ex = Interpreter(list(objects))
    walk = BackwardWalk(task, list(plans), ex, accumulate_at_end)
    walk.observe = observe
    registrations = hooks_census.Registrations()

    def after_opaque(pos: int) -> None:
        # a hook registered by the user code just run, on a node that has
        # not run and had none: its plan gains it (cagrad.hooks.added_hooks)
        if not registrations.moved():
            return
        nodes = [c.node for c in task.order]
        found = added_hooks.plans_with_added(walk.plans, nodes, ex.objects, pos + 1)
        if found is not None:
            walk.plans[:], ex.objects[:] = found

    ex.after_opaque = after_opaque
    value = env.__getitem__
    walk.buffers = {
        k: [None if n is None else value(n) for n in names] for k, names in point.buffers.items()
    }
    walk.captured = [None if n is None else value(n) for n in point.captured]
    if point.phase.name == "APPLY":
        state = (result, [None if n is None else value(n) for n in point.inputs])
    elif point.phase.name == "TENSOR_HOOKS":
        # the node's inputs after its tensor hooks (the last call's result in env)
        state = [None if n is None else value(n) for n in point.inputs]
    else:
        state = result
    try:
        walk.run(point.pos, point.phase, state)
        return walk.captured
    finally:
        # after_opaque refers to ex: a cycle through the runtime objects
        # (the leaves among them) that only Python's cyclic collector would
        # free, where eager frees them when the program drops them
        ex.after_opaque = None
