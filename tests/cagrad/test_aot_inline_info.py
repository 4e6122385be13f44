"""Which AOTAutograd backward nodes cagrad inlines (cagrad.autograd.custom_function).

``aot_inline_info`` and ``backward_state_hooks`` read what torch's compiled
autograd reads from an AOT backward node: the class's prologue and epilogue,
its lazily compiled ``bw_module`` and, for a forward that registered tensor
hooks under compiled autograd, the ``BackwardState`` placeholder of that
graph and its uses. Real nodes of that kind come from ``torch.compile``
(tests/cagrad/test_backward_state.py); here each rule is checked on nodes
and graphs built by hand, one defect at a time, with a node that has none
of them as the control.
"""

from __future__ import annotations

import torch
import torch._dynamo._trace_wrapped_higher_order_op as trace_wrapped_module
from torch._dynamo import external_utils
from torch.fx.experimental._backward_state import BackwardState

from cagrad.autograd.custom_function import aot_inline_info, backward_state_hooks


class _Module:
    """A stand-in for a compiled ``bw_module``: what the readers use is its
    FX graph (and that it is weakly referenceable)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph


def _graph(state_use: str, fn=None) -> _Module:
    """A backward graph ``(grad, bw_state) -> grad'`` whose state is used by
    a ``trace_wrapped`` call of ``fn`` (``state_use="hook"``) or by some
    other function (``"other"``)."""
    g = torch.fx.Graph()
    grad = g.placeholder("grad")
    grad.meta["val"] = torch.empty(3)
    state = g.placeholder("bw_state")
    state.meta["val"] = BackwardState()
    if state_use == "hook":
        out = g.call_function(
            trace_wrapped_module.trace_wrapped,
            (grad,),
            {"fn": fn, "bw_state": state, "hook_name": "hook_0"},
        )
    else:
        out = g.call_function(getattr, (state, "hook_0"))
    g.output((out,))
    return _Module(g)


def _prologue(*args):
    return args


def _epilogue(out):
    return out


def _node(bw_module, prologue=_prologue, epilogue=_epilogue, state=True):
    """An object shaped as an AOT backward node (``CompiledFunctionBackward``)."""
    cls = type(
        "CompiledFunction",
        (),
        {
            "_aot_id": 0,
            "_bw_prologue_fn": prologue,
            "_bw_epilogue_fn": epilogue,
            "_lazy_backward_info": type("Info", (), {"bw_module": bw_module})(),
            "maybe_subclass_metadata": None,
        },
    )
    node = type("CompiledFunctionBackward", (), {})()
    node._forward_cls = cls
    node._compiled_autograd_backward_state = BackwardState() if state else None
    node.opaque_objects = None
    return node


def test_a_hook_call_of_call_hook_from_backward_state_is_found():
    gm = _graph("hook", external_utils.call_hook_from_backward_state)
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert backward_state_hooks(gm) == ("bw_state", {call.name: "hook_0"})
    assert aot_inline_info(_node(gm)) == (gm, _prologue, _epilogue)


class _EqualToEverything:
    """A callable that compares equal to every object (as ``mock.ANY``)."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__

    def __call__(self, *args, **kwargs):
        raise AssertionError("never called")


def test_a_trace_wrapped_call_of_another_function_is_not_a_hook_even_if_it_compares_equal():
    # only call_hook_from_backward_state itself reads the hook from the state
    gm = _graph("hook", _EqualToEverything())
    assert backward_state_hooks(gm) == ("bw_state", None)
    assert aot_inline_info(_node(gm)) is None


def test_a_state_used_by_something_other_than_a_hook_call_is_not_inlined():
    gm = _graph("other")
    assert backward_state_hooks(gm) == ("bw_state", None)
    assert aot_inline_info(_node(gm)) is None


def test_a_node_missing_its_prologue_or_its_epilogue_is_not_inlined():
    # a graph without BackwardState: only the prologue and epilogue decide
    g = torch.fx.Graph()
    g.output((g.placeholder("grad"),))
    gm = _Module(g)
    assert aot_inline_info(_node(gm, state=False)) == (gm, _prologue, _epilogue)
    assert aot_inline_info(_node(gm, prologue=None, state=False)) is None
    assert aot_inline_info(_node(gm, epilogue=None, state=False)) is None
