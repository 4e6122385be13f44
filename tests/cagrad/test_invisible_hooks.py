"""Hooks added to autograd nodes from C++ send the backward to eager.

A test extension (built once per machine, like cagrad's own
``cagrad_hook_counts``, in the torch extensions directory) adds C++ hooks
to a node: a pre-hook, a post-hook, a tensor pre-hook, a retains-grad hook,
each multiplying the gradient by a factor and recording its call. Under
``cagrad.enable`` such a backward must give eager's gradients and hook calls
through the ``invisible_hooks`` fallback; a graph with Python hooks only must
still compile. Cold, the two builds take about 12 s (once per machine: the
torch extensions directory keeps them); warm, the file runs in about 2 s.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil

import pytest
import torch

import cagrad
from cagrad import native
from cagrad.autograd import _hook_counts
from cagrad.native import build as native_build
from cagrad.hooks import hooks_census

from .conftest import run_both_traced, same, same_trace

_TEST_SOURCE = r"""
#include <Python.h>
#if __has_include(<torch/csrc/autograd/node.h>)
#include <torch/csrc/autograd/node.h>
#else  // torch before 2.12 declares Node in function.h
#include <torch/csrc/autograd/function.h>
#endif

using torch::autograd::FunctionPostHook;
using torch::autograd::FunctionPreHook;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct CppFunctionObject {  // THPCppFunction (see cagrad/native/build.py)
  PyObject_HEAD
  c10::intrusive_ptr<Node> cdata;
};
static PyTypeObject* function_type = nullptr;
static Py_ssize_t function_cdata = 0;

static Node* node_of(PyObject* obj) {
  if (function_type != nullptr && PyObject_TypeCheck(obj, function_type)) {
    return reinterpret_cast<c10::intrusive_ptr<Node>*>(reinterpret_cast<char*>(obj) + function_cdata)->get();
  }
  return reinterpret_cast<CppFunctionObject*>(obj)->cdata.get();
}

// Calls `record` (a Python callable) and multiplies defined gradients by `factor`.
struct Action {
  double factor;
  PyObject* record;
  Action(double f, PyObject* r) : factor(f), record(r) { Py_INCREF(r); }
  ~Action() {
    if (Py_IsInitialized()) {
      PyGILState_STATE s = PyGILState_Ensure();
      Py_DECREF(record);
      PyGILState_Release(s);
    }
  }
  variable_list operator()(const variable_list& grads) const {
    PyGILState_STATE s = PyGILState_Ensure();
    PyObject* r = PyObject_CallNoArgs(record);
    if (r == nullptr) {
      PyErr_Print();
    }
    Py_XDECREF(r);
    PyGILState_Release(s);
    variable_list out;
    for (const auto& g : grads) {
      out.push_back(g.defined() ? g.mul(factor) : g);
    }
    return out;
  }
};

struct PreHook : FunctionPreHook {
  Action action;
  PreHook(double f, PyObject* r) : action(f, r) {}
  variable_list operator()(const variable_list& grads) override { return action(grads); }
};

struct PostHook : FunctionPostHook {
  Action action;
  PostHook(double f, PyObject* r) : action(f, r) {}
  variable_list operator()(const variable_list& outputs, const variable_list&) override {
    return action(outputs);
  }
};

static PyObject* init(PyObject*, PyObject* args) {
  PyObject* type;
  if (!PyArg_ParseTuple(args, "O!n", &PyType_Type, &type, &function_cdata)) {
    return nullptr;
  }
  Py_INCREF(type);
  function_type = reinterpret_cast<PyTypeObject*>(type);
  Py_RETURN_NONE;
}

// add(node, list, factor, record[, output_nr]); list: "pre", "post",
// "tensor_pre", "retains_grad"
static PyObject* add(PyObject*, PyObject* args) {
  PyObject* obj;
  const char* list;
  double factor;
  PyObject* record;
  Py_ssize_t output_nr = 0;
  if (!PyArg_ParseTuple(args, "OsdO|n", &obj, &list, &factor, &record, &output_nr)) {
    return nullptr;
  }
  Node* node = node_of(obj);
  std::string which(list);
  if (which == "pre") {
    node->add_pre_hook(std::make_unique<PreHook>(factor, record));
  } else if (which == "post") {
    node->add_post_hook(std::make_unique<PostHook>(factor, record));
  } else if (which == "tensor_pre") {
    node->add_tensor_pre_hook(std::make_unique<PreHook>(factor, record));
  } else if (which == "retains_grad") {
    node->add_retains_grad_hook(std::make_unique<PreHook>(factor, record), output_nr);
  } else {
    PyErr_SetString(PyExc_ValueError, "unknown hook list");
    return nullptr;
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"init", init, METH_VARARGS, nullptr},
    {"add", add, METH_VARARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "MODULE_NAME", nullptr, -1, methods};
#define CONCAT2(a, b) a##b
#define CONCAT(a, b) CONCAT2(a, b)
PyMODINIT_FUNC CONCAT(PyInit_, MODULE_NAME)() { return PyModule_Create(&module); }
"""


@pytest.fixture(scope="module")
def ext():
    """The test extension; skips only where there is no C++ compiler (the
    docs/fallbacks.md documents detection as off then); a compiler that fails to build
    cagrad's own extension is a failure."""
    if _hook_counts.counts_fn() is None:
        if shutil.which(os.environ.get("CXX", "c++")) is not None:
            pytest.fail("a C++ compiler is installed but cagrad_hook_counts did not build (see the cagrad warning)")
        pytest.skip("no C++ compiler: cagrad_hook_counts cannot be built")
    if native_build.layout_ok() is not None:
        pytest.skip("the test extension mirrors torch 2.13's autograd node objects")
    module = native_build.build("cagrad_test_cpp_hooks", _TEST_SOURCE)
    module.init(torch._C._FunctionBase, torch._C._FunctionBase.__basicsize__ - 8)
    return module


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g * 3


def _fell_back_once():
    reasons = cagrad.counters["fallback_reasons"]
    assert reasons["invisible_hooks"] == 1, dict(reasons)
    assert cagrad.counters["captures"] == 0


def _compiled():
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1


def _check(build):
    (e, et), (c, ct) = run_both_traced(build)
    assert len(e) == len(c)
    for a, b in zip(e, c):
        same(a, b)
    same_trace(et, ct)
    assert et, "the hooks ran"
    return et


def _recorder(trace, label):
    return lambda: trace.append((label, None))


@pytest.mark.parametrize("which", ["pre", "post"])
@pytest.mark.parametrize("node", ["cpp", "custom", "accumulate"])
def test_cpp_node_hook_falls_back(ext, which, node):
    def build(trace):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        y = x * 2 if node != "custom" else Scale.apply(x * 2)
        z = y.exp()
        target = {"cpp": y.grad_fn, "custom": y.grad_fn, "accumulate": y.grad_fn.next_functions[0][0]}[node]
        if node == "custom":
            assert isinstance(target, torch._C._FunctionBase)
        ext.add(target, which, 10.0, _recorder(trace, which))
        y.register_hook(lambda g: trace.append(("python", g)))  # Python hooks run as well
        z.sum().backward()
        return [x.grad]

    trace = _check(build)
    assert [label for label, _ in trace] == ["python", which]
    _fell_back_once()


@pytest.mark.parametrize("which", ["pre", "post", "tensor_pre"])
def test_cpp_hook_added_after_capture_stops_the_guarded_hit(ext, which, monkeypatch):
    """The census cannot see a hook added from C++, so the hit guard checks
    every node's hook lists itself (``hookless``): a guarded hit would skip
    the hook and return unscaled gradients. (Without guard verification,
    whose full collection would find the hook on its own.)"""
    monkeypatch.setenv("CAGRAD_VERIFY_GUARDS", "0")
    gc.collect()  # graphs with hooks that earlier tests left in cycles keep guards off
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)

    def step(trace=None):
        x.grad = None
        y = x * 2
        if trace is not None:
            ext.add(y.grad_fn, which, 10.0, _recorder(trace, which))
        y.exp().sum().backward()
        return x.grad.clone()

    eager_trace: list = []
    expected = step(eager_trace)
    with cagrad.enable("eager"):
        step()
        step()
        assert cagrad.counters["guard_hits"] == 1  # a guard exists and hits
        trace: list = []
        got = step(trace)
    same(got, expected)
    assert trace == eager_trace == [(which, None)]
    assert cagrad.counters["guard_hits"] == 1
    assert cagrad.counters["fallback_reasons"]["invisible_hooks"] == 1


def test_cpp_tensor_pre_hook_falls_back(ext):
    def build(trace):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        y = x * 2
        ext.add(y.grad_fn, "tensor_pre", 5.0, _recorder(trace, "tensor_pre"))
        (y * y).sum().backward()
        return [x.grad]

    _check(build)
    _fell_back_once()


def test_cpp_retains_grad_hook_falls_back_under_grad_inputs(ext):
    """A node only captured (``autograd.grad(inputs=...)``) still runs its
    tensor pre- and retains-grad hooks."""

    def build(trace):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        y = x * 2
        ext.add(y.grad_fn, "retains_grad", 1.0, _recorder(trace, "retains"), 0)
        return list(torch.autograd.grad((y * y).sum(), [y]))

    _check(build)
    _fell_back_once()


def test_cpp_hook_on_node_that_does_not_run_is_ignored(ext):
    """Post-hooks of a node whose inputs are only captured never run."""

    def build(trace):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        y = x * 2
        ext.add(y.grad_fn, "post", 10.0, _recorder(trace, "post"))
        return list(torch.autograd.grad((y * y).sum(), [y]))

    (e, et), (c, ct) = run_both_traced(build)
    same(e[0], c[0])
    assert et == ct == []
    _compiled()


def test_python_hooks_only_compile():
    def build(trace):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
        y = x * w
        y.register_hook(lambda g: trace.append(("y", g)))
        y.retain_grad()
        s = Scale.apply(y)
        s.grad_fn.register_prehook(lambda g: trace.append(("s pre", g[0])))
        z = s.exp()
        z.grad_fn.register_prehook(lambda g: None).remove()  # an empty dict stays
        z.grad_fn.register_hook(lambda gi, go: None).remove()
        z.register_hook(lambda g: None).remove()
        y.grad_fn.register_hook(lambda gi, go: trace.append(("y post", gi[0])))
        x.register_hook(lambda g: trace.append(("x", g)))
        w.register_post_accumulate_grad_hook(lambda t: trace.append(("w acc", t.grad)))
        w.register_hook(lambda g: None).remove()
        z.sum().backward()
        return [x.grad, w.grad, y.grad]

    _check(build)
    _compiled()


def test_python_hooks_under_grad_inputs_compile():
    def build(trace):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        y = x.sin()
        y.register_hook(lambda g: trace.append(("y", g)))
        y.retain_grad()
        y.grad_fn.register_hook(lambda gi, go: trace.append(("never", None)))  # y's node does not run
        return list(torch.autograd.grad(y.exp().sum(), [y]))

    _check(build)
    _compiled()


def test_retain_grad_moved_by_inplace_falls_back():
    """``retain_grad`` then an in-place op: torch moves the retains-grad hook
    to the new ``grad_fn``; the census's note stays on the old one, so it is
    not the hook eager runs: eager's ``.grad`` through the fallback."""

    def build(trace):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        y = x * 2
        y.retain_grad()
        y.mul_(3)
        (y * y).sum().backward()
        trace.append(("y.grad", y.grad))
        return [x.grad, y.grad]

    _check(build)
    _fell_back_once()


def test_python_node_hook_the_census_missed_falls_back(monkeypatch):
    """A node hook registered without the census seeing it (as before
    ``import cagrad``, on a graph the import scan missed) is found too."""

    def build(trace):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        y = x * 2
        with monkeypatch.context() as m:
            m.setattr(
                torch.autograd.function._HookMixin,
                "_register_hook",
                staticmethod(hooks_census._original_node_register_hook),
            )
            y.grad_fn.register_prehook(lambda g: (g[0] * 10,))
        (y * y).sum().backward()
        return [x.grad]

    # no other node hook dict is known: the census does not probe nodes
    monkeypatch.setattr(hooks_census, "_node_hook_dicts", hooks_census._LiveDicts())
    (e, _), (c, _) = run_both_traced(build)
    same(e[0], c[0])
    _fell_back_once()


def test_detection_off_without_compiler(monkeypatch, caplog):
    """No compiler: one warning, and backwards compile as before."""
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger="cagrad"):
        for _ in range(2):
            x = torch.ones(3, requires_grad=True)
            with cagrad.enable("eager"):
                (x * 2).sum().backward()
    warnings = [r for r in caplog.records if "cannot detect hooks added from C++" in r.getMessage()]
    assert len(warnings) == 1
    assert cagrad.counters["fallbacks"] == 0
    assert _hook_counts.counts_fn() is None
