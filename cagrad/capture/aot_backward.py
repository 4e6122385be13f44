"""Running an AOTAutograd backward graph under the trace, as torch's compiled
autograd inlines it (``proxy_call_aot_backward`` in
``torch/_dynamo/compiled_autograd.py``): prologue, graph op by op,
epilogue. Used by the capture for ``CompiledFunctionBackward`` nodes and by
the interpreter that runs a graph without a backend (:mod:`cagrad.run.interpreter`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..autograd import custom_function


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
