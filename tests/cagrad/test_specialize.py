"""Static specializations (:mod:`cagrad.compile.specialize`): a symbolic inductor
graph is compiled at capture for the capture's sizes only; its symbolic code
is compiled at the first backward at other sizes (its size guards then
checked), and a second backward at one tuple of sizes compiles a
specialization for it. Gradients are compared with eager autograd at every
step.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from torch import nn
from torch._dynamo.backends.registry import register_backend

import cagrad
from cagrad import compiled_backward
from cagrad.compile import specialize


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 12)


def _grads(lin: nn.Module, x: torch.Tensor, ctx) -> list[torch.Tensor]:
    lin.zero_grad(set_to_none=True)
    with ctx:
        a, b = lin(x).chunk(2, dim=1)  # b: a view at an offset, saved by mul
        (a.sin() * b).sum().backward()
    return [p.grad.clone() for p in lin.parameters()]


def _train(backend: str, batches: list[int], dynamic: bool | None = True) -> None:
    """Backwards at each batch size, compared with eager. ``dynamic=True``
    (here the default): the graph is symbolic from its capture, which is
    what specializations are for."""
    lin, ref = _model(), _model()
    for n in batches:
        x = torch.randn(n, 8)
        expected = _grads(ref, x, contextlib.nullcontext())
        got = _grads(lin, x, cagrad.enable(backend, dynamic=dynamic))
        torch.testing.assert_close(got, expected)


def test_each_hot_size_gets_its_own_compile_and_eager_gradients():
    """The capture compiles for its own sizes (batch 4) only; the first
    backward at batch 7 compiles the symbolic code, the second at 7 a
    specialization; one capture serves both (dynamic sizes)."""
    _train("inductor", [4])
    assert cagrad.counters["specializations"] == 1
    _train("inductor", [4, 4, 7, 7, 4, 7])
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["specializations"] == 2
    assert cagrad.counters["fallbacks"] == 0


def test_default_dynamic_captures_static_then_symbolic():
    """``enable``'s default (``dynamic=None``): batch 4 is captured with
    static sizes, the first backward at 7 captures the symbolic graph, and
    from then on 4 hits the static graph and 7 the symbolic one."""
    _train("inductor", [4, 4], dynamic=None)
    assert cagrad.counters["captures"] == 1
    _train("inductor", [4, 7, 7, 4, 7], dynamic=None)
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["cache_hits"] == 5
    assert cagrad.counters["fallbacks"] == 0


_SYMBOLIC_COMPILES: list[bool] = []


@register_backend(name="cagrad_test_static_first")
def _static_first_backend(gm, example_inputs):
    """Runs the graph as it is; compiled with symbolic sizes it branches on
    the first one (a guard in the ShapeEnv, as inductor's ``s0 <= 4096``)
    and refuses to run on the other side."""
    dims = [x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor) and x.dim()]
    if not any(isinstance(d, torch.SymInt) for d in dims):
        return gm
    small = bool(dims[0] < 10)
    _SYMBOLIC_COMPILES.append(small)

    def run(*args):
        first = next(a for a in args if isinstance(a, torch.Tensor) and a.dim())
        if (first.shape[0] < 10) != small:
            raise AssertionError("symbolic code called outside the guard its backend recorded")
        return gm(*args)

    return run


def test_symbolic_code_compiled_late_has_its_guards_checked(monkeypatch):
    """Capture at batch 4 compiles static code only. The first backward at
    32 compiles the symbolic code (its guard: batch < 10, from the capture's
    hint), which rejects 32: that backward runs in eager with the reason,
    the next one at 32 captures again; batch 6 then runs the symbolic code."""
    monkeypatch.setattr(specialize, "SPECIALIZE_BACKENDS", ("cagrad_test_static_first",))
    for guarded in (True, False):  # a generated hit guard, then the full path
        if not guarded:
            cagrad.reset()
            monkeypatch.setattr(compiled_backward.hit_path, "eligible_call", lambda call: False)
        _late_symbolic_sequence()


def _late_symbolic_sequence() -> None:
    before = len(_SYMBOLIC_COMPILES)
    _train("cagrad_test_static_first", [4, 32, 32, 6])
    assert _SYMBOLIC_COMPILES[before:] == [True]
    assert cagrad.counters["fallback_reasons"] == {"dynamic_shapes": 1}
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["cache_hits"] == 1


def test_at_most_max_specializations_per_graph(monkeypatch):
    monkeypatch.setattr(specialize, "MAX_SPECIALIZATIONS", 1)
    _train("inductor", [4, 4, 5, 5, 5, 4])
    assert cagrad.counters["specializations"] == 1


def test_off_by_environment_and_for_other_backends(monkeypatch):
    _train("eager", [4, 4, 4])
    assert cagrad.counters["specializations"] == 0
    monkeypatch.setenv("CAGRAD_SPECIALIZE", "0")
    _train("inductor", [4, 4, 4])
    assert cagrad.counters["specializations"] == 0


def test_a_failed_specialization_keeps_the_symbolic_code(monkeypatch, caplog):
    def fail(*_args, **_kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(specialize, "static_examples", fail)
    with caplog.at_level(logging.INFO, logger="cagrad"):
        _train("inductor", [4, 4, 4, 4])
    assert cagrad.counters["specializations"] == 0
    assert cagrad.counters["fallbacks"] == 0
    assert [r.getMessage() for r in caplog.records if "no static specialization" in r.getMessage()] == [
        "cagrad: no static specialization (RuntimeError: planted); the symbolic code runs"
    ]


def test_static_examples_bind_sizes_strides_and_offset():
    """A fake tensor with symbolic geometry becomes one with the numbers the
    binding gives (checked against the values computed by hand)."""
    import sympy
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    env = mode.shape_env
    s0 = env.create_symintnode(env.create_symbol(5, source=ConstantSource("s")), hint=5)
    with mode:
        base = torch.empty(s0 * 12)
        view = base.as_strided((s0, 6), (12, 1), 6)  # the second half of (s0, 12) rows
    static, n = specialize.static_examples([view, s0 * 2], {s0.node.expr: sympy.Integer(3)}, FakeTensorMode())
    assert (tuple(static.shape), static.stride(), static.storage_offset()) == ((3, 6), (12, 1), 6)
    assert n == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_record_the_specialized_code():
    """reduce-overhead warms a specializing graph up twice, so the CUDA
    graph is recorded from the specialized code; gradients stay eager's.
    (Later calls may record more graphs, for inputs the caching allocator
    put back at earlier addresses, so only the first recording's call is
    pinned.)"""
    lin, ref = _model().cuda(), copy.deepcopy(_model()).cuda()
    records_after = []
    for _ in range(5):
        x = torch.randn(4, 8, device="cuda")
        expected = _grads(ref, x, contextlib.nullcontext())
        got = _grads(lin, x, cagrad.enable("inductor", mode="reduce-overhead", dynamic=True))
        torch.testing.assert_close(got, expected)
        records_after.append(cagrad.counters["cudagraph_records"])
    assert cagrad.counters["specializations"] == 1
    assert records_after[:3] == [0, 0, 1]  # warm-ups: the symbolic call, then the specialized one
    assert cagrad.counters["cudagraph_replays"] == 3


def test_compiles_after_the_capture_show_no_warning_of_torchs(monkeypatch):
    """The symbolic code (compiled at the first backward at other sizes)
    and a specialization (at the second) are compiled inside a later
    backward, not at its capture: a warning of the compiler's there (a
    campaign saw inductor's ``torch._prims_common.check`` deprecation at a
    size variant) reached the user's program, where eager compiles nothing.
    Here every compile warns, with aot_eager specialized as inductor is."""
    from cagrad.compile import boxed

    monkeypatch.setattr(specialize, "SPECIALIZE_BACKENDS", ("aot_eager",))
    compile_once = boxed._compile_boxed

    def warning_compile(*args, **kwargs):
        import warnings

        warnings.warn("a compiler's advice", FutureWarning, stacklevel=1)
        return compile_once(*args, **kwargs)

    monkeypatch.setattr(boxed, "_compile_boxed", warning_compile)
    from harness.warnings_seen import recording

    with recording() as seen:
        _train("aot_eager", [4, 7, 7])
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["specializations"] == 2  # at capture, then for 7
    assert seen == []
