"""Contracts of small cagrad.autograd helpers, each against an independent
definition.

* :func:`cagrad.autograd.accumulate.dense_strides` against the definition
  of a non-overlapping and dense layout: the offsets of its elements are
  exactly ``0 .. numel - 1`` (enumerated here by brute force);
* :func:`cagrad.autograd._hook_counts.check`: a hook the census found that
  the node's C++ hook lists do not hold (eager would not call it) sends the
  backward to eager;
* :func:`cagrad.autograd.custom_function.backward_state_hooks` on
  hand-built AOT backward graphs: only ``trace_wrapped`` calls of
  ``call_hook_from_backward_state`` on exactly one tensor are inlined.

(Survivors of the mutation run, docs/mutation-testing.md.)
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cagrad.autograd import _hook_counts, custom_function
from cagrad.autograd.accumulate import dense_strides
from cagrad.errors import Unsupported
from cagrad.hooks.hooks_census import FoundHooks


def _dense_by_offsets(shape, strides) -> bool:
    numel = 1
    for s in shape:
        numel *= s
    offsets = sorted(sum(i * st for i, st in zip(idx, strides)) for idx in itertools.product(*map(range, shape)))
    return offsets == list(range(numel))


LAYOUTS = [
    ((2, 3), (3, 1)),  # contiguous
    ((2, 3), (1, 2)),  # column-major, a dim of size 2
    ((3, 2), (1, 3)),
    ((2, 2), (1, 2)),
    ((2, 2), (4, 1)),  # a gap between the rows
    ((2, 2), (2, 2)),  # overlapping
    ((2, 1, 3), (1, 7, 2)),  # a dim of size 1 takes any stride
    ((2, 2, 2), (1, 4, 2)),
    ((2, 2, 2), (1, 2, 2)),
    ((4, 2), (1, 4)),
    ((4, 2), (2, 8)),
    ((0, 3), (5, 9)),  # no element
    ((), ()),
]


@pytest.mark.parametrize("shape, strides", LAYOUTS)
def test_dense_strides_is_exactly_the_non_overlapping_dense_layouts(shape, strides):
    assert dense_strides(shape, strides) == _dense_by_offsets(shape, strides)


def test_a_hook_the_census_found_but_cpp_does_not_hold_falls_back():
    """``counts`` returns None (no hook in the node's C++ lists) while the
    census found a Python tensor pre-hook: eager would not call it, so the
    check must raise rather than let a compiled backward call it."""
    x = torch.randn(2, requires_grad=True)
    node = (x * 2).grad_fn
    hooks = {0: lambda g: g}
    found = FoundHooks(tensor_pre=[(0, hooks)], retain_grad=[], pre=None, post=None, post_accumulate=None)
    with pytest.raises(Unsupported) as e:
        _hook_counts.check(None, node, found, True, "MulBackward0", "cagrad_tensor_hooks")
    assert e.value.reason == "invisible_hooks"
    # nothing found and nothing in C++: nothing to check
    _hook_counts.check(None, node, None, True, "MulBackward0", "cagrad_tensor_hooks")


def _state_graph(args_of_call):
    """An AOT-style backward graph: a tensor input, a BackwardState last, one
    ``trace_wrapped`` call of ``call_hook_from_backward_state``."""
    from torch._dynamo._trace_wrapped_higher_order_op import trace_wrapped
    from torch._dynamo.external_utils import call_hook_from_backward_state
    from torch.fx.experimental._backward_state import BackwardState

    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2)
    state = g.placeholder("state")
    state.meta["val"] = BackwardState()
    call = g.call_function(
        trace_wrapped,
        args_of_call(x),
        {"fn": call_hook_from_backward_state, "bw_state": state, "hook_name": "hook0"},
    )
    g.output((call,))
    return _Module(g), call.name


class _Module:
    """What the function reads of an AOT backward module: its graph (a real
    GraphModule cannot generate code for a function-valued kwarg)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph


def test_backward_state_hook_on_one_tensor_is_inlined():
    gm, call = _state_graph(lambda x: (x,))
    assert custom_function.backward_state_hooks(gm) == ("state", {call: "hook0"})


@pytest.mark.parametrize("args_of_call", [lambda x: (), lambda x: (x, x)], ids=["no_tensor", "two_tensors"])
def test_backward_state_hook_on_other_than_one_tensor_is_not_inlined(args_of_call):
    gm, _ = _state_graph(args_of_call)
    assert custom_function.backward_state_hooks(gm) == ("state", None)
