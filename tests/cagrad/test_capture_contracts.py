"""Small contracts of cagrad.capture's helpers, each against eager autograd or
values derived here (no compile, no capture: fast enough for the mutation
killer ``tests``, harness/power/kill.py).

* ``_AotBackward`` (the interpreter of an inlined AOTAutograd backward
  graph): a node named in ``hooks`` runs through ``call_hook`` instead of
  its own target, and ``aten.view`` runs as ``aten.reshape``.
* ``runtime_ops.backward_state_hook``: a ``BackwardState`` hook's result
  replaces the gradient as a tensor hook's does in eager.
* ``shells.shells``: shells only for tensors whose type *is*
  ``torch.Tensor`` or ``torch.nn.Parameter``.
"""

from __future__ import annotations

import types

import pytest
import torch

from cagrad.capture import runtime_ops
from cagrad.capture.aot_backward import _AotBackward
from cagrad.capture.shells import LiftedShell, shells


def _must_not_run(*args):
    raise AssertionError("a hooked node's own target ran instead of call_hook")


def _hooked_graph() -> tuple[torch.fx.GraphModule, str]:
    """``grad, state -> view(hook(grad), [6])``, the hook node's target being
    one that must not run (as ``call_hook_from_backward_state`` cannot run on
    the placeholder state the inlined graph gets)."""
    g = torch.fx.Graph()
    grad = g.placeholder("grad")
    state = g.placeholder("state")
    hooked = g.call_function(_must_not_run, (grad, state))
    g.output(g.call_function(torch.ops.aten.view.default, (hooked, [6])))
    return torch.fx.GraphModule(torch.nn.Module(), g), hooked.name


def test_aot_backward_runs_a_hooked_node_through_call_hook():
    """The hook doubles a transposed (non-contiguous) gradient: the result is
    that gradient doubled and flattened, which ``view`` alone refuses
    (reshape copies), and ``call_hook`` saw the hook's name once."""
    gm, node_name = _hooked_graph()
    calls = []

    def call_hook(name, grad):
        calls.append(name)
        return grad * 2  # keeps the transposed strides

    grad = torch.arange(6.0).reshape(2, 3).t()
    assert not grad.is_contiguous()
    with pytest.raises(RuntimeError):
        (grad * 2).view([6])  # what view itself would do
    out = _AotBackward(gm, {node_name: "hook0"}, call_hook).run(grad, object())
    torch.testing.assert_close(out, torch.tensor([0.0, 6.0, 2.0, 8.0, 4.0, 10.0]), rtol=0, atol=0)
    assert calls == ["hook0"]


def _eager_grad(hook, grad: torch.Tensor) -> torch.Tensor:
    """What eager leaves in ``x.grad`` when ``hook`` is a tensor hook on
    ``y = x * 1`` and ``grad`` flows into ``y``."""
    x = torch.zeros_like(grad, requires_grad=True)
    y = x * 1
    y.register_hook(hook)
    y.backward(grad)
    return x.grad


@pytest.mark.parametrize(
    "hook",
    [lambda g: g * 2, lambda g: g.flip(0), lambda g: None, lambda g: g],
    ids=["scales", "flips", "returns_none", "returns_grad"],
)
def test_backward_state_hook_result_replaces_the_gradient_as_in_eager(hook):
    grad = torch.tensor([1.0, -2.0, 3.0])
    state = types.SimpleNamespace(hook0=hook)
    out = runtime_ops.backward_state_hook(state, "hook0", grad)
    torch.testing.assert_close(out, _eager_grad(hook, grad), rtol=0, atol=0)


def test_backward_state_hook_that_changes_the_size_raises_like_eager():
    def hook(g):
        return g[:1]

    grad = torch.tensor([1.0, -2.0, 3.0])
    with pytest.raises(RuntimeError, match="has changed the size of value"):
        _eager_grad(hook, grad)
    state = types.SimpleNamespace(hook0=hook)
    with pytest.raises(RuntimeError, match="hook 'hook' has changed the size of value"):
        runtime_ops.backward_state_hook(state, "hook0", grad)


class _ClaimsToBeTensor(torch._C._TensorMeta):
    """A metaclass whose classes compare equal to ``torch.Tensor`` (as a
    subclass library may define ``==`` on its classes): the type is still
    not ``torch.Tensor``, and its tensors' fakes need the tensor itself."""

    def __eq__(cls, other):
        return other is torch.Tensor or type.__eq__(cls, other)

    def __ne__(cls, other):
        return not cls.__eq__(other)

    __hash__ = type.__hash__


class _Subclass(torch.Tensor, metaclass=_ClaimsToBeTensor):
    pass


def test_shells_only_of_plain_tensors_and_parameters():
    plain = torch.zeros(2, 3).t()
    param = torch.nn.Parameter(torch.zeros(4))
    out = shells([plain, param])
    assert [type(s) for s in out] == [LiftedShell, LiftedShell]
    assert (out[0].shape, out[0].strides, out[1].requires_grad) == ((3, 2), (1, 3), True)
    sub = torch.zeros(2).as_subclass(_Subclass)
    assert type(sub) == torch.Tensor and type(sub) is not torch.Tensor
    assert shells([plain, sub]) is None
