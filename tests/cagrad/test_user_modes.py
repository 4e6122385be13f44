"""A user's modes see what they see in eager. A backward inside a
TorchDispatchMode runs in eager, so the mode sees eager's kernels (torch's
test_torch_dispatch_mode saw cagrad's graph ops); inside a TorchFunctionMode
it compiles: the mode sees no call inside a backward, in eager or under
cagrad. cagrad's note of a custom Function's outputs in the forward is out
of a TorchFunctionMode's sight (torch's test_torch_function_mode saw six
``__get__`` s more)."""

from __future__ import annotations

import torch
from torch.overrides import BaseTorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import cagrad
from cagrad.autograd import custom_function

from .test_custom_function_traced import Cube


class LogsKernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class LogsCalls(BaseTorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def _backward(mode, compiled: bool) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    h = x.sin()
    h.register_hook(lambda g: g * 2)  # a hook cagrad would trace
    loss = (h * x).sum()
    with mode as m:
        if compiled:
            with cagrad.enable("eager"):
                loss.backward()
        else:
            loss.backward()
    return m.ops if isinstance(m, LogsKernels) else m.names


def test_a_dispatch_mode_sees_eagers_kernels() -> None:
    cagrad.reset()
    want = _backward(LogsKernels(), compiled=False)
    for _ in range(2):
        assert _backward(LogsKernels(), compiled=True) == want
    assert cagrad.counters["fallback_reasons"]["dispatch_mode"] == 2


def test_a_function_mode_sees_what_it_sees_in_eager_and_the_backward_compiles() -> None:
    cagrad.reset()
    want = _backward(LogsCalls(), compiled=False)
    for _ in range(2):
        assert _backward(LogsCalls(), compiled=True) == want
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0


def test_set_default_device_still_compiles() -> None:
    cagrad.reset()
    before = torch.get_default_device()
    torch.set_default_device("cpu")
    try:
        x = torch.randn(3, requires_grad=True)
        with cagrad.enable("eager"):
            (x.sin() * x).sum().backward()
    finally:
        torch.set_default_device(before)
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0


def test_the_forward_record_is_unseen_by_a_function_mode() -> None:
    x = torch.randn(3, requires_grad=True)
    with LogsCalls() as noted:
        Cube.apply(x)  # Function.apply, wrapped by cagrad to note the outputs
    with LogsCalls() as plain:
        custom_function._original_apply(Cube, x)
    assert noted.names == plain.names
