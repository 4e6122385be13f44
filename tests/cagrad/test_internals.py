"""One torch internal at a time made missing or changed (monkeypatched), as
an unknown torch could: cagrad turns off what depends on it, counts it, and
the backward gives eager's gradients without an exception (one test per row
of docs/torch-internals.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from torch.autograd.function import Function, FunctionCtx

import cagrad
from cagrad import doctor, internals, native, torch_compat
from cagrad.autograd import custom_function, node_schema, run_context


class _Double(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 + x


def _build(custom: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf through MulBackward0, SinBackward0 (and a custom Function);
    its values come from arange (no RNG draw). Returns (leaf, loss)."""
    x = torch.arange(1.0, 5.0).requires_grad_()
    y = (x * x).sin()
    if custom:
        y = _Double.apply(y)
    return x, y.sum()


def _grads(custom: bool, compiled: bool) -> torch.Tensor:
    x, loss = _build(custom)
    if compiled:
        with cagrad.enable("eager"):
            loss.backward()
    else:
        loss.backward()
    return x.grad


@pytest.fixture
def broken(monkeypatch):
    """Yields ``monkeypatch``; the test breaks an internal with it and calls
    ``internals.recheck()``. Afterwards the internal is put back and checked
    again, so later tests see a working torch."""
    yield monkeypatch
    monkeypatch.undo()
    node_schema._header_fields.cache_clear()
    node_schema._schemas.clear()
    internals.recheck()
    node_schema._header_fields()


def _assert_falls_back(name: str, feature: str, custom: bool = False) -> None:
    expected = _grads(custom, compiled=False)
    got = _grads(custom, compiled=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert cagrad.counters["fallback_reasons"] == {f"internal:{name}": 1}
    assert cagrad.counters["captures"] == 0
    assert cagrad.counters["disabled_features"][feature] >= 1
    assert not internals.ok(name)


def test_all_internals_work_here():
    """On the torch the suite runs on, nothing is turned off (but the C++
    extension, on a machine without a compiler)."""
    node_schema._header_fields()
    no_compiler = shutil.which(os.environ.get("CXX", "c++")) is None
    assert native.load() is not None or no_compiler
    off = {n: r for n, r in internals.results().items() if r is not None}
    assert off == {} or (no_compiler and set(off) == {"native_extension"}), off
    assert _grads(True, compiled=True) is not None and cagrad.counters["captures"] == 1


def test_execution_engine(broken):
    """torch's backward entry no longer goes through Variable._execution_engine."""
    from torch.autograd import graph

    original = graph._engine_run_backward
    broken.setattr(graph, "_engine_run_backward", lambda *a, **k: original(*a, **k))
    internals.recheck()
    _assert_falls_back("execution_engine", "engine")


def test_graph_task_queries(broken):
    broken.delattr(torch._C, "_will_engine_execute_node")
    internals.recheck()
    _assert_falls_back("graph_task_queries", "engine")


def test_tensor_hooks(broken):
    """Tensor.register_hook is no longer a method: the census cannot wrap it."""
    broken.setattr(torch.Tensor, "register_hook", None)
    internals.recheck()
    _assert_falls_back("tensor_hooks", "engine")


def test_saved_tensor_hooks(broken):
    broken.delattr(torch._C._autograd, "_get_sequence_nr")
    internals.recheck()
    _assert_falls_back("saved_tensor_hooks", "engine")


def test_node_types(broken):
    broken.setattr(torch.autograd.function, "BackwardCFunction", None)
    internals.recheck()
    _assert_falls_back("node_types", "engine")


def test_fake_tensor_capture(broken):
    """A private tracing module that cannot be imported: import_attr hands a
    stand-in, and every backward falls back before it is used."""
    internals.recheck()
    stand_in = internals.import_attr("fake_tensor_capture", "torch._cagrad_no_such_module", "FakeTensorMode")
    with pytest.raises(cagrad.Unsupported, match="internal:fake_tensor_capture"):
        stand_in()
    _assert_falls_back("fake_tensor_capture", "engine")


def test_function_apply(broken):
    """Function.apply becomes another kind of descriptor: only backwards with
    a custom Function fall back; others still compile."""

    class _OtherDescriptor:
        def __init__(self, inner):
            self.inner = inner

        def __get__(self, obj, cls):
            return self.inner.__get__(None, cls)

    broken.setattr(Function, "apply", _OtherDescriptor(Function.__dict__["apply"]))
    internals.recheck()
    torch.testing.assert_close(_grads(False, compiled=True), _grads(False, compiled=False), rtol=0, atol=0)
    assert cagrad.counters["captures"] == 1
    cagrad.reset()
    _assert_falls_back("function_apply", "custom_function", custom=True)


def test_materialize_grads(broken):
    class _Base:  # _FunctionBase without a settable materialize_grads
        pass

    broken.setattr(torch._C, "_FunctionBase", _Base)
    internals.recheck()
    _assert_falls_back("materialize_grads", "custom_function", custom=True)


_seen_buffers: list = []  # what each _Fused backward read from ctx.input_grad_buffers


class _Fused(Function):
    """A backward written for torch 2.15's ``ctx.input_grad_buffers``: it adds
    its gradient into the engine's buffer where one is handed to it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        (buffer,) = ctx.input_grad_buffers
        _seen_buffers.append(buffer)
        grad = g * 2 + x
        if buffer is None:
            return grad
        buffer.add_(grad)
        return None


def _buffers_as_torch_215(ctx):
    """A stand-in for torch 2.15's property on a torch without it: torch's
    engine answers only for the node it runs (here: no earlier producer,
    None); outside a GraphTask of torch's the query fails, as Dynamo's
    trace of a backward did (pytorch/pytorch#197314)."""
    if run_context._original_graph_task_id() == -1:
        raise RuntimeError("input_grad_buffers is only available inside torch's backward")
    return (None,) * len(ctx.needs_input_grad)


def _fused_grads(compiled: bool) -> torch.Tensor:
    x = torch.arange(1.0, 5.0).requires_grad_()
    loss = _Fused.apply((x * x).sin()).sum()
    if compiled:
        with cagrad.enable("eager"):
            loss.backward()
    else:
        loss.backward()
    return x.grad


def test_input_grad_buffers_answered_for_cagrads_backwards(broken):
    """torch 2.15's ctx.input_grad_buffers, simulated: a custom backward that
    reads it compiles and runs; cagrad answers None (the backward returns
    its gradient), eager backwards get torch's own answer."""
    broken.setattr(FunctionCtx, "input_grad_buffers", property(_buffers_as_torch_215), raising=False)
    internals.recheck()
    assert internals.ok("input_grad_buffers")
    custom_function.install_input_grad_buffers()
    custom_function.install_input_grad_buffers()  # idempotent: one wrapper
    assert FunctionCtx.__dict__["input_grad_buffers"].fget._cagrad_original.fget is _buffers_as_torch_215
    _seen_buffers.clear()
    expected = _fused_grads(compiled=False)
    got = _fused_grads(compiled=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert _seen_buffers == [None, None]  # eager's (torch's answer), then cagrad's
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0


def test_input_grad_buffers_of_another_kind(broken):
    """The property is not a Python property (say, a C descriptor cagrad
    cannot answer through): backwards with a custom Function fall back."""

    class _Descriptor:
        def __get__(self, obj, cls):
            return ()

    broken.setattr(FunctionCtx, "input_grad_buffers", _Descriptor(), raising=False)
    internals.recheck()
    assert "_Descriptor" in internals.why("input_grad_buffers")
    _assert_falls_back("input_grad_buffers", "custom_function", custom=True)


@pytest.mark.parametrize("header", ["missing", "changed"])
def test_functions_header(broken, tmp_path, header):
    """Functions.h is gone, or declares its structs in a form the parser
    does not read: backwards with generated nodes fall back."""
    path = tmp_path / "Functions.h"
    if header == "changed":
        path.write_text("class MulBackward0 final : TraceableFunction { SavedVariable self_; };\n")
    broken.setattr(node_schema, "header_path", lambda: str(path))
    node_schema._header_fields.cache_clear()
    node_schema._schemas.clear()
    internals.recheck()
    _assert_falls_back("functions_header", "generated_nodes")


def test_native_extension(broken):
    """No extension (here: no compiler): the Python paths run, gradients are
    eager's, the feature is counted off; nothing falls back."""
    broken.setattr(native, "_native", None)
    broken.setenv("CXX", "/nonexistent/c++")
    internals.recheck()
    expected = _grads(True, compiled=False)
    torch.testing.assert_close(_grads(True, compiled=True), expected, rtol=0, atol=0)
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0
    assert cagrad.counters["disabled_features"] == {"native": 1}
    assert "FileNotFoundError" in internals.why("native_extension")


def test_ddp_reducer(broken):
    """DDP's internals changed: DDP's hooks stay visible to the extension's
    check (invisible_hooks), so backwards compile; with the extension off
    as well, every backward falls back."""
    from torch.nn.parallel import DistributedDataParallel

    broken.delattr(DistributedDataParallel, "_build_params_for_reducer")
    internals.recheck()
    torch.testing.assert_close(_grads(False, compiled=True), _grads(False, compiled=False), rtol=0, atol=0)
    assert cagrad.counters["captures"] == 1 and cagrad.counters["disabled_features"] == {"ddp_hooks": 1}
    cagrad.reset()
    broken.setattr(native, "_native", False)
    _assert_falls_back("ddp_reducer", "ddp_hooks")


def test_compiled_autograd_entry(broken):
    """torch._dynamo.compiled_autograd changed: torch_compat.install() leaves
    torch's own compiled autograd in place instead of raising."""
    import torch._dynamo.compiled_autograd as ca

    broken.delattr(ca, "active_disable_ctx")
    internals.recheck()
    before = ca._enable
    torch_compat.install()
    try:
        assert not torch_compat.is_installed() and ca._enable is before
    finally:
        torch_compat.uninstall()
    assert cagrad.counters["disabled_features"] == {"torch_compat": 1}


def test_a_check_that_raises_fails_its_internal(broken):
    def check():
        raise RuntimeError("boom")

    broken.setitem(internals.REGISTRY, "execution_engine", internals.Internal("execution_engine", "x", "y", "engine", check))
    internals.recheck()
    assert internals.why("execution_engine") == "its check raised RuntimeError: boom"
    _assert_falls_back("execution_engine", "engine")


def test_doctor_reports_and_exits(broken):
    """The doctor: exit 0 and all features working here; exit 1 and the
    failed internal named once one is removed; the CPU RNG untouched."""
    rng = torch.get_rng_state()
    result = CliRunner().invoke(doctor.main, ["--json"])
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the doctor reports the extension off (exit 1)")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and all(f["works"] for f in report["features"].values())
    broken.delattr(torch._C, "_will_engine_execute_node")
    internals.recheck()
    result = CliRunner().invoke(doctor.main, ["--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["features"]["engine"] == {"works": False, "off_by": ["graph_task_queries"]}
    assert "_will_engine_execute_node" in report["internals"]["graph_task_queries"]["why"]
    assert [f for f, s in report["features"].items() if not s["works"]] == ["engine"]
    plain = CliRunner().invoke(doctor.main, [])
    assert plain.exit_code == 1 and "turned off" in plain.output
    assert torch.equal(torch.get_rng_state(), rng)


_BROKEN_IMPORT = """
import json, torch
from torch.autograd.function import Function
del torch._C._will_engine_execute_node
del torch._C._autograd._get_sequence_nr
class _Other:
    def __init__(self, inner): self.inner = inner
    def __get__(self, obj, cls): return self.inner.__get__(None, cls)
Function.apply = _Other(Function.__dict__["apply"])
with torch.no_grad():  # the checks build tiny graphs: they must not depend on the caller's grad mode
    import cagrad
from cagrad import internals
x = torch.arange(1.0, 4.0, requires_grad=True)
(x * x).sum().backward()
expected = x.grad.clone(); x.grad = None
with cagrad.enable("eager"):
    (x * x).sum().backward()
print(json.dumps({"same": torch.equal(x.grad, expected),
                  "reasons": dict(cagrad.counters["fallback_reasons"]),
                  "off": sorted(n for n, r in internals.results().items() if r)}))
"""


def test_import_on_a_torch_without_several_internals():
    """``import cagrad`` (under no_grad) on a torch lacking internals it
    installs on at import (a fresh process: the installs run once)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", _BROKEN_IMPORT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "same": True,
        "reasons": {"internal:graph_task_queries": 1},
        "off": ["function_apply", "graph_task_queries", "saved_tensor_hooks"],
    }


def test_dynamo_preserve_rng_state(broken):
    """Dynamo's preserve_rng_state gone: the swap that keeps CUDA
    uninitialized turns off (lazy_cuda), and compiles go on unchanged."""
    import torch._dynamo.utils as dynamo_utils

    from cagrad.lazy_cuda import cuda_left_uninitialized

    broken.delattr(dynamo_utils, "preserve_rng_state")
    internals.recheck()
    broken.setattr(torch.cuda, "is_available", lambda: True)
    broken.setattr(torch.cuda, "is_initialized", lambda: False)
    with cuda_left_uninitialized():
        pass
    assert internals.why("dynamo_preserve_rng_state") == "torch._dynamo.utils lacks preserve_rng_state"
    assert cagrad.counters["disabled_features"] == {"lazy_cuda": 1}
