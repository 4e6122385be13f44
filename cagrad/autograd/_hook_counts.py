"""Hooks on an autograd node that the census cannot account for.

A hook added from C++ (``Node::add_pre_hook``, ``add_post_hook``,
``add_tensor_pre_hook``, ``add_retains_grad_hook``, a C++ ``Tensor::
register_hook`` or ``retain_grad``, a post-accumulate-grad hook set from C++)
is in none of the Python dicts :mod:`cagrad.hooks.hooks_census` reads, and a
compiled backward would silently skip it. This module reads a node's hook
lists in C++ and :func:`check` compares them with what the census found:
any difference sends the whole backward to eager
(``Unsupported("invisible_hooks")``) while it is collected, before any side
effect.

How Python-registered hooks appear in C++ (torch 2.13, checked by
``tests/cagrad/test_invisible_hooks.py``): all of a node's Python pre-hooks
are one ``PyFunctionPreHook`` holding the node's dict, all its post-hooks one
``PyFunctionPostHook`` (both stay, empty, once a hook was registered and
removed, or once the census probed the node); each non-leaf tensor with
``register_hook`` adds one ``PyFunctionTensorPreHook`` (its
``_backward_hooks`` dict) to its ``grad_fn``; a leaf's hooks are one
``PyFunctionTensorPreHook`` in its ``AccumulateGrad``'s tensor pre-hooks and
its post-accumulate-grad hooks one ``PyFunctionTensorPostAccGradHooks``;
``retain_grad`` is a C++ retains-grad hook whichever language called it (an
in-place op moves it to the tensor's new ``grad_fn``); DDP's ``Reducer`` adds
one C++ post-hook per parameter ``AccumulateGrad`` (:mod:`cagrad.hooks.cpp_hooks`).

So the C++ side classifies each hook by its dynamic type (its mangled name:
GCC/Clang) and returns, per list, how many hooks are of another type
("foreign"), the *non-empty* Python dicts, and the output numbers with a
retains-grad hook. :func:`check` requires that the foreign post-hooks are
exactly the ones :mod:`cagrad.hooks.cpp_hooks` knows (DDP's) and there are no
other foreign hooks; that the non-empty Python dicts are the ones the census
found (this also catches Python hooks registered before ``import cagrad``
that the import scan missed); and that the retains-grad hooks are on the
outputs the census noted ``retain_grad`` for, and on every one whose tensor
is alive. Empty Python dicts call nothing and are ignored, so the census need
not probe a node to know whether its dicts exist.

Lists eager would not run are not checked: pre- and post-hooks of a node
whose inputs are only captured (``autograd.grad(inputs=...)``); nodes that
neither run nor capture.

Cost: one C call per node the backward runs or captures, about 20 ns
(60-90 ns with the Python around it) when the node has no hook that calls
anything (measured on a chain of 2000 nodes).

The extension is compiled on first need with the C++ compiler (``$CXX`` or
``c++``; no ninja, no pybind11: one file, 5 to 8 s on a loaded 2-core
machine, nearly all of it torch's ``ATen/core/Tensor.h``) into the torch
extensions directory (``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions/pyXY_cpu``), one folder per source, flags, torch
and Python version, and reused by later processes (loading it then takes
about 40 ms). On torch whose ``THPCppFunction``/``THPFunction`` layouts are
not the ones mirrored here (see :func:`_layout_ok`) it includes torch's
Python headers instead (about 20 s). If it cannot be built or loaded, a
warning is logged once per process on the ``cagrad`` logger and detection is
off: backwards are compiled as before, without this check.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

log = logging.getLogger("cagrad")

# The layouts of THPCppFunction (python_cpp_function.h) and THPFunction
# (python_function.h) are mirrored instead of included: those headers pull in
# pybind11 and compiled autograd (about 8 s more per build). _layout_ok checks
# that the installed headers declare what the mirror assumes (torch 2.13), and
# each call that the node points back at the object it was read from. With
# other headers the source is compiled with -DCAGRAD_FULL_HEADERS, which
# includes them and reads ``cdata`` whatever its holder type.
_SOURCE = r"""
#include <Python.h>
#if __has_include(<torch/csrc/autograd/node.h>)
#include <torch/csrc/autograd/node.h>
#else  // torch before 2.12 declares Node in function.h
#include <torch/csrc/autograd/function.h>
#endif
#include <torch/csrc/autograd/python_hook.h>
#include <cstring>
#include <memory>
#include <type_traits>
#include <typeinfo>

using torch::autograd::FunctionPostHook;
using torch::autograd::FunctionPreHook;
using torch::autograd::Node;

#ifdef CAGRAD_FULL_HEADERS
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>

static const at::Tensor& tensor_of(PyObject* obj) {  // obj: a Tensor (checked by type)
  return THPVariable_Unpack(obj);
}

template <typename T>
static std::shared_ptr<T> strong(const std::weak_ptr<T>& p) {
  return p.lock();
}
template <typename P>
static const P& strong(const P& p) {
  return p;
}

static Node* node_of(PyObject* obj) {
  Node* node = nullptr;
  if (THPFunction_Check(obj)) {
    // a weak_ptr (older torch) is locked; the graph being collected keeps
    // the node alive after the temporary is gone
    node = strong(reinterpret_cast<THPFunction*>(obj)->cdata).get();
  } else if (torch::autograd::THPCppFunction_Check(obj)) {
    node = reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata.get();
  } else {
    PyErr_Format(PyExc_TypeError, "not an autograd node: %R", obj);
    return nullptr;
  }
  if (node == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "the autograd node was freed");
  }
  return node;
}

static PyObject* init(PyObject*, PyObject*) {
  Py_RETURN_NONE;
}
#else
namespace torch::autograd {
bool THPCppFunction_Check(PyObject* obj);
}

static_assert(std::is_base_of_v<c10::intrusive_ptr_target, Node>);

struct CppFunctionObject {  // THPCppFunction
  PyObject_HEAD
  c10::intrusive_ptr<Node> cdata;
};

struct VariableObject {  // THPVariable (its first fields)
  PyObject_HEAD
  at::Tensor cdata;
};

static const at::Tensor& tensor_of(PyObject* obj) {  // obj: a Tensor (checked by type)
  return reinterpret_cast<VariableObject*>(obj)->cdata;
}

static PyTypeObject* function_type = nullptr;  // THPFunctionType
static Py_ssize_t function_cdata = 0;  // offsetof(THPFunction, cdata): its last field

static Node* node_of(PyObject* obj) {
  Node* node = nullptr;
  if (function_type != nullptr && PyObject_TypeCheck(obj, function_type)) {
    node = reinterpret_cast<c10::intrusive_ptr<Node>*>(
               reinterpret_cast<char*>(obj) + function_cdata)->get();
  } else if (torch::autograd::THPCppFunction_Check(obj)) {
    node = reinterpret_cast<CppFunctionObject*>(obj)->cdata.get();
  } else {
    PyErr_Format(PyExc_TypeError, "not an autograd node: %R", obj);
    return nullptr;
  }
  if (node == nullptr || node->pyobj_slot()->load_pyobj() != obj) {
    PyErr_SetString(PyExc_RuntimeError, "autograd node layout is not the one compiled for");
    return nullptr;
  }
  return node;
}

// init(THPFunctionType, offset of THPFunction::cdata)
static PyObject* init(PyObject*, PyObject* args) {
  PyObject* type;
  Py_ssize_t offset;
  if (!PyArg_ParseTuple(args, "O!n", &PyType_Type, &type, &offset)) {
    return nullptr;
  }
  Py_INCREF(type);
  function_type = reinterpret_cast<PyTypeObject*>(type);
  function_cdata = offset;
  Py_RETURN_NONE;
}
#endif

static PyTypeObject* tensor_type = nullptr;  // torch.Tensor, from set_tensor_type

static PyObject* set_tensor_type(PyObject*, PyObject* type) {
  if (!PyType_Check(type)) {
    PyErr_SetString(PyExc_TypeError, "set_tensor_type(torch.Tensor)");
    return nullptr;
  }
  Py_INCREF(type);
  tensor_type = reinterpret_cast<PyTypeObject*>(type);
  Py_RETURN_NONE;
}

static bool is_tensor_type(PyObject* type) {
  return tensor_type != nullptr && PyType_Check(type) &&
         (type == reinterpret_cast<PyObject*>(tensor_type) ||
          PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), tensor_type));
}

static bool is_named(const void* type_name, const char* mangled) {
  return std::strcmp(static_cast<const char*>(type_name), mangled) == 0;
}

// The Python hook classes of python_hook.h, by mangled name: their typeinfo
// is not exported from libtorch_python.
static const char* kTensorPre = "N5torch8autograd23PyFunctionTensorPreHookE";
static const char* kPre = "N5torch8autograd17PyFunctionPreHookE";
static const char* kPost = "N5torch8autograd18PyFunctionPostHookE";
static const char* kPostAcc = "N5torch8autograd32PyFunctionTensorPostAccGradHooksE";

// Appends the hook's dict to `*dicts` (a list made on first need) if it is
// a Python hook of type `py` with a non-empty dict; returns 1 if it is not a
// Python hook, -1 on error.
static int append(PyObject** list, PyObject* item) {
  if (*list == nullptr && (*list = PyList_New(0)) == nullptr) {
    return -1;
  }
  return PyList_Append(*list, item);
}

template <typename Hook, typename PyHook>
static int classify(const Hook* hook, const char* py, PyObject** dicts) {
  if (hook == nullptr) {
    return 0;
  }
  const char* name = typeid(*hook).name();
  if (*name == '*') {
    ++name;
  }
  if (!is_named(name, py)) {
    return 1;
  }
  PyObject* dict = static_cast<const PyHook*>(hook)->dict;
  if (dict != nullptr && PyDict_Check(dict) && PyDict_Size(dict) > 0) {
    if (append(dicts, dict) < 0) {
      return -1;
    }
  }
  return 0;
}

// counts(node, all_lists) -> None if the node has no hook that calls
// anything, or (tensor_pre_foreign, tensor_pre_dicts, retains_grad_outputs,
// pre_foreign, pre_dicts, post_foreign, post_dicts, post_acc_foreign,
// post_acc_dict): *_foreign: how many hooks are not Python hooks; *_dicts:
// the non-empty dicts of the Python hooks; retains_grad_outputs: the output
// numbers with a retains-grad hook; post_acc_dict: the non-empty dict of a
// Python post-accumulate-grad hook, or None. Without all_lists only the
// tensor pre-hooks and retains-grad hooks are read (a node whose inputs are
// only captured runs no others).
static PyObject* counts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "counts(node, all_lists)");
    return nullptr;
  }
  Node* node = node_of(args[0]);
  if (node == nullptr) {
    return nullptr;
  }
  int all_lists = PyObject_IsTrue(args[1]);
  if (all_lists < 0) {
    return nullptr;
  }
  auto& tensor_pre = node->tensor_pre_hooks();
  auto& retains = node->retains_grad_hooks();
  auto& pre = node->pre_hooks();
  auto& post = node->post_hooks();
  const auto& post_acc = node->tensor_post_acc_grad_hooks();
  if (tensor_pre.empty() && retains.empty() &&
      (!all_lists || (pre.empty() && post.empty() && !post_acc))) {
    Py_RETURN_NONE;
  }
  PyObject* lists[4] = {nullptr, nullptr, nullptr, nullptr};
  long foreign[4] = {0, 0, 0, 0};
  PyObject* acc_dict = Py_None;
  bool failed = false;
  auto add = [&](int i, int r) {
    if (r < 0) {
      failed = true;
    } else {
      foreign[i] += r;
    }
  };
  for (const auto& h : tensor_pre) {
    if (!failed) {
      add(0, classify<FunctionPreHook, torch::autograd::PyFunctionTensorPreHook>(
                 h.get(), kTensorPre, &lists[0]));
    }
  }
  for (const auto& kv : retains) {
    if (!failed && kv.second) {
      PyObject* nr = PyLong_FromSize_t(kv.first);
      failed = nr == nullptr || append(&lists[3], nr) < 0;
      Py_XDECREF(nr);
    }
  }
  if (all_lists) {
    for (const auto& h : pre) {
      if (!failed) {
        add(1, classify<FunctionPreHook, torch::autograd::PyFunctionPreHook>(h.get(), kPre, &lists[1]));
      }
    }
    for (const auto& h : post) {
      if (!failed) {
        add(2, classify<FunctionPostHook, torch::autograd::PyFunctionPostHook>(h.get(), kPost, &lists[2]));
      }
    }
    if (post_acc) {
      const char* name = typeid(*post_acc).name();
      if (*name == '*') {
        ++name;
      }
      if (is_named(name, kPostAcc)) {
        using PyPostAcc = torch::autograd::PyFunctionTensorPostAccGradHooks;
        PyObject* dict = static_cast<const PyPostAcc*>(post_acc.get())->dict;
        if (dict != nullptr && PyDict_Check(dict) && PyDict_Size(dict) > 0) {
          acc_dict = dict;
        }
      } else {
        foreign[3] = 1;
      }
    }
  }
  PyObject* result = nullptr;
  if (!failed) {
    if (foreign[0] == 0 && foreign[1] == 0 && foreign[2] == 0 && foreign[3] == 0 &&
        acc_dict == Py_None && !lists[0] && !lists[1] && !lists[2] && !lists[3]) {
      result = Py_None;
      Py_INCREF(result);
    } else {
      for (PyObject*& l : lists) {
        if (l == nullptr) {
          l = PyTuple_New(0);
        }
      }
      if (lists[0] && lists[1] && lists[2] && lists[3]) {
        result = Py_BuildValue("(lOOlOlOlO)", foreign[0], lists[0], lists[3], foreign[1], lists[1],
                               foreign[2], lists[2], foreign[3], acc_dict);
      }
    }
  }
  for (PyObject* l : lists) {
    Py_XDECREF(l);
  }
  return result;
}

// release(nodes): Node::release_variables() on each node (None skipped), as
// the engine does after running a node without keep_graph.
static PyObject* release(PyObject*, PyObject* nodes) {
  PyObject* fast = PySequence_Fast(nodes, "release() expects a sequence of autograd nodes");
  if (fast == nullptr) {
    return nullptr;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (items[i] == Py_None) {
      continue;
    }
    Node* node = node_of(items[i]);
    if (node == nullptr) {
      Py_DECREF(fast);
      return nullptr;
    }
    try {
      node->release_variables();
    } catch (const std::exception& e) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  Py_DECREF(fast);
  Py_RETURN_NONE;
}

static int append_int(PyObject* list, int64_t value) {
  PyObject* v = PyLong_FromLongLong(value);
  if (v == nullptr) {
    return -1;
  }
  int r = PyList_Append(list, v);
  Py_DECREF(v);
  return r;
}

// dtype, device type and index, and rank in one integer (the hit guards'
// constants); bits 40 and up are free for more
static long long pack_key(c10::ScalarType dtype, c10::Device device, size_t rank) {
  return static_cast<long long>(static_cast<int>(dtype)) |
         (static_cast<long long>(static_cast<int>(device.type())) << 8) |
         (static_cast<long long>(device.index() + 1) << 16) |
         (static_cast<long long>(rank) << 24);
}

// The key of input `nr`'s InputMetadata as the hit guards compare it: dtype,
// device type and index, and rank packed in one integer; -1 for metadata a
// guard does not compare this way (nested, a symbolic size, no such input).
static long long metadata_key_of(const Node* node, Py_ssize_t nr) {
  if (nr < 0 || static_cast<size_t>(nr) >= node->num_inputs()) {
    return -1;
  }
  const auto& m = node->input_metadata(static_cast<size_t>(nr));
  if (m.is_nested_tensor()) {
    return -1;
  }
  const auto shape = m.shape_as_dim_vector();
  for (const auto& size : shape) {
    if (!size.maybe_as_int().has_value()) {
      return -1;
    }
  }
  return pack_key(m.dtype().toScalarType(), m.device(), shape.size());
}

// metadata_key(node, nr) -> int or None (see metadata_key_of).
static PyObject* metadata_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "metadata_key(node, input_nr)");
    return nullptr;
  }
  Node* node = node_of(args[0]);
  Py_ssize_t nr = PyLong_AsSsize_t(args[1]);
  if (node == nullptr || (nr == -1 && PyErr_Occurred())) {
    return nullptr;
  }
  long long key = metadata_key_of(node, nr);
  if (key < 0) {
    Py_RETURN_NONE;
  }
  return PyLong_FromLongLong(key);
}

// metadata(node, nr, key, sizes) -> bool: whether input nr's metadata has
// `key` (from metadata_key); if so its sizes are appended to the list `sizes`.
static PyObject* metadata(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "metadata(node, input_nr, key, sizes: list)");
    return nullptr;
  }
  Node* node = node_of(args[0]);
  Py_ssize_t nr = PyLong_AsSsize_t(args[1]);
  long long want = PyLong_AsLongLong(args[2]);
  if (node == nullptr || PyErr_Occurred()) {
    return nullptr;
  }
  if (metadata_key_of(node, nr) != want) {
    Py_RETURN_FALSE;
  }
  for (const auto& size : node->input_metadata(static_cast<size_t>(nr)).shape_as_dim_vector()) {
    if (append_int(args[3], *size.maybe_as_int()) < 0) {
      return nullptr;
    }
  }
  Py_RETURN_TRUE;
}

// The key of a strided tensor's metadata as the hit guards compare it:
// layout, dtype, device type and index, requires_grad and rank packed in one
// integer; -1 for a tensor a guard does not compare this way (not strided,
// nested, symbolic sizes or strides, undefined).
static long long tensor_key_of(const at::Tensor& t) {
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() ||
      t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return -1;
  }
  return pack_key(t.scalar_type(), t.device(), t.dim()) | (static_cast<long long>(t.requires_grad()) << 40);
}

// tensor_key(x, type) -> int or None: tensor_key_of for x of exactly `type`
// (torch.Tensor or a subclass that keeps its layout, e.g. nn.Parameter).
static PyObject* tensor_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !is_tensor_type(args[1])) {
    PyErr_SetString(PyExc_TypeError, "tensor_key(tensor, tensor_type)");
    return nullptr;
  }
  if (Py_TYPE(args[0]) != reinterpret_cast<PyTypeObject*>(args[1])) {
    Py_RETURN_NONE;
  }
  long long key = tensor_key_of(tensor_of(args[0]));
  if (key < 0) {
    Py_RETURN_NONE;
  }
  return PyLong_FromLongLong(key);
}

// tensor(x, type, key, values) -> bool: whether x is exactly of `type` (from
// tensor_key's call) and has `key`; if so its sizes, strides and storage
// offset are appended to the list `values`.
static PyObject* tensor(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_Check(args[3]) || !is_tensor_type(args[1])) {
    PyErr_SetString(PyExc_TypeError, "tensor(x, tensor_type, key, values: list)");
    return nullptr;
  }
  long long want = PyLong_AsLongLong(args[2]);
  if (want == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (Py_TYPE(args[0]) != reinterpret_cast<PyTypeObject*>(args[1])) {
    Py_RETURN_FALSE;
  }
  const at::Tensor& t = tensor_of(args[0]);
  if (tensor_key_of(t) != want) {
    Py_RETURN_FALSE;
  }
  for (int64_t v : t.sizes()) {
    if (append_int(args[3], v) < 0) {
      return nullptr;
    }
  }
  for (int64_t v : t.strides()) {
    if (append_int(args[3], v) < 0) {
      return nullptr;
    }
  }
  if (append_int(args[3], t.storage_offset()) < 0) {
    return nullptr;
  }
  Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"set_tensor_type", set_tensor_type, METH_O, nullptr},
    {"tensor_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tensor_key)), METH_FASTCALL, nullptr},
    {"tensor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tensor)), METH_FASTCALL, nullptr},
    {"init", init, METH_VARARGS, nullptr},
    {"metadata_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(metadata_key)), METH_FASTCALL, nullptr},
    {"metadata", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(metadata)), METH_FASTCALL, nullptr},
    {"counts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(counts)), METH_FASTCALL, nullptr},
    {"release", release, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef module = {PyModuleDef_HEAD_INIT, "MODULE_NAME", nullptr, -1, methods};

#define CONCAT2(a, b) a##b
#define CONCAT(a, b) CONCAT2(a, b)
PyMODINIT_FUNC CONCAT(PyInit_, MODULE_NAME)() {
  return PyModule_Create(&module);
}
"""

_NAME = "cagrad_hook_counts"


def _layout_ok() -> str | None:
    """None if the installed headers declare the layouts the source mirrors,
    else what differs."""
    base = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "autograd")
    try:
        cpp, py, var = (
            pathlib.Path(base, name).read_text()
            for name in ("python_cpp_function.h", "python_function.h", "python_variable.h")
        )
    except OSError as e:
        return f"cannot read torch's headers: {e}"
    if "struct THPCppFunction {\n  PyObject_HEAD\n  c10::intrusive_ptr<Node> cdata;\n};" not in cpp:
        return "THPCppFunction is not {PyObject_HEAD; intrusive_ptr<Node> cdata}"
    if "struct THPVariable {\n  PyObject_HEAD\n  // Payload\n  at::Tensor cdata;" not in var:
        return "THPVariable does not begin {PyObject_HEAD; at::Tensor cdata}"
    struct = py[py.find("struct THPFunction {") :]
    struct = struct[: struct.find("\n};")]
    if not struct.rstrip().endswith("c10::intrusive_ptr<torch::autograd::Node> cdata;"):
        return "THPFunction does not end with intrusive_ptr<Node> cdata"
    return None


def _compile_flags() -> list[str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths("cpu"), sysconfig.get_paths()["include"]]
    libs = cpp_extension.library_paths("cpu")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-shared",
        "-fPIC",
        "-O2",
        "-std=c++20",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-isystem{p}" for p in includes),
        *(f"-L{p}" for p in libs),
        *(f"-Wl,-rpath,{p}" for p in libs),
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        "-ltorch_python",
    ]


def build_root() -> str:
    """Where extensions are built: ``$TORCH_EXTENSIONS_DIR`` or torch's
    default root, per Python version."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        cpp_extension.get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    )
    return root


def build(name: str, source: str, defines: tuple[str, ...] = ()) -> Any:
    """Compiles ``source`` (which defines ``PyInit_<MODULE_NAME>``) into an
    extension module and imports it; reuses an earlier build of the same
    source, flags, torch and Python.

    Args:
        defines: more compiler flags (``-DNAME``).

    Raises:
        OSError, subprocess.CalledProcessError, ImportError: no compiler, a
            compile error (its output in the message), or a load failure.
    """
    cxx = os.environ.get("CXX", "c++")
    flags = [*defines, *_compile_flags()]
    digest = hashlib.sha256(
        "\0".join([source, cxx, *flags, torch.__version__, sys.version]).encode()
    ).hexdigest()[:16]
    folder = os.path.join(build_root(), f"{name}_{digest}")
    path = os.path.join(folder, name + ".so")
    if not os.path.exists(path):
        if shutil.which(cxx) is None:
            raise FileNotFoundError(f"no C++ compiler {cxx!r}")
        os.makedirs(folder, exist_ok=True)
        src = os.path.join(folder, f"{name}.cpp")
        tmp_src = f"{src}.{os.getpid()}.tmp"
        with open(tmp_src, "w") as f:
            f.write(source)
        os.replace(tmp_src, src)
        tmp = os.path.join(folder, f"{name}.{os.getpid()}.{threading.get_ident()}.so.tmp")
        start = time.perf_counter()
        proc = subprocess.run(
            [cxx, src, "-o", tmp, f"-DMODULE_NAME={name}", *flags],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cxx, proc.stdout, proc.stderr[-2000:])
        os.replace(tmp, path)  # atomic: concurrent builders write the same file
        log.info("cagrad built %s in %.1f s (%s)", name, time.perf_counter() - start, path)
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class MetadataReaders(NamedTuple):
    """The extension's readers for the hit guards (see :func:`metadata_fns`)."""

    metadata_key: Callable[[Any, int], int | None]
    metadata: Callable[[Any, int, int, list], bool]
    tensor_key: Callable[[torch.Tensor, type], int | None]
    tensor: Callable[[torch.Tensor, type, int, list], bool]


_lock = threading.Lock()
_counts: Any = None  # the C++ counts function once built; False: unavailable
_release: Any = None  # the C++ release function once built; None: unavailable
_metadata: MetadataReaders | None = None  # once built and self-tested; None: unavailable
_enabled = True


def counts_fn() -> Any:
    """The C++ ``counts(node, all_lists)``, built on first call; None if it
    cannot be built (warned once) or detection is switched off."""
    global _counts
    if not _enabled:
        return None
    if _counts is None:
        with _lock:
            if _counts is None:
                _counts = _load()
    return _counts or None


def release_fn() -> Any:
    """The C++ ``release(nodes)`` of the same extension: each node's
    ``Node::release_variables()`` (None items skipped), what the engine
    calls after running a node without ``retain_graph`` (``call_function``
    in ``torch/csrc/autograd/engine.cpp``), about 20 ns a node. Built on
    first call, with hook detection on or off; None if it cannot be built
    (:mod:`cagrad.autograd.saved_variables` then releases slot by slot in Python).

    Raises (the returned function):
        TypeError: an item is not an autograd node.
    """
    global _counts
    if _counts is None:
        with _lock:
            if _counts is None:
                _counts = _load()
    return _release


def metadata_fns() -> MetadataReaders | None:
    """The C++ readers of a node's ``InputMetadata`` for the hit guards
    (:mod:`cagrad.keys.hit_path`), built on first call like
    :func:`release_fn`; None if unavailable.

    ``metadata_key(node, input_nr) -> int | None`` packs what a guard compares
    of input ``input_nr``'s metadata (dtype, device, rank) into one integer;
    None for metadata it does not compare this way (nested, a symbolic size,
    no such input). ``metadata(node, input_nr, key, sizes) -> bool``: whether
    the metadata has ``key`` now; if so its sizes are appended to the list
    ``sizes``. About 60 ns a call where the Python attributes of
    ``node._input_metadata`` cost about 600 ns. ``tensor_key(x, type) -> int |
    None`` packs a strided tensor's layout, dtype, device, requires_grad and
    rank (None: ``x`` is not exactly of ``type``, not strided, nested, or
    symbolic); ``tensor(x, type, key, values) -> bool``: whether ``x`` is of
    ``type`` with ``key`` now; if so its sizes, strides and storage offset
    are appended to ``values``.

    Raises (the returned functions):
        TypeError: ``node`` is not an autograd node, or another argument type.
    """
    release_fn()
    return _metadata


def _load(full_headers: bool | None = None) -> Any:
    if full_headers is None:
        why = _layout_ok()
        full_headers = why is not None
        if full_headers:
            log.info("cagrad builds %s with torch's Python headers (slower): %s", _NAME, why)
    try:
        module = build(_NAME, _SOURCE, ("-DCAGRAD_FULL_HEADERS",) if full_headers else ())
        module.init(torch._C._FunctionBase, torch._C._FunctionBase.__basicsize__ - 8)
        module.set_tensor_type(torch.Tensor)
        _self_test(module.counts)
        _self_test_release(module.release)
    except Exception as e:  # noqa: BLE001  (no compiler, a compile or load error)
        detail = getattr(e, "stderr", None) or e
        log.warning(
            "cagrad cannot detect hooks added from C++ (%s: %s): they would not run in compiled backwards; "
            "install a C++ compiler to enable the check",
            type(e).__name__,
            detail,
        )
        return False
    global _release, _metadata
    _release = module.release
    try:
        _self_test_metadata(module.metadata_key, module.metadata)
        _self_test_tensor(module.tensor_key, module.tensor)
        _metadata = MetadataReaders(module.metadata_key, module.metadata, module.tensor_key, module.tensor)
    except Exception as e:  # noqa: BLE001  (guards read the metadata in Python then)
        log.warning("cagrad's C++ metadata reader failed its self-test (%s); hit guards read it in Python", e)
    return module.counts


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def _self_test_release(release: Any) -> None:
    """``release`` frees a C++ node's saved tensors as the engine does."""
    with torch.inference_mode(False), torch.enable_grad():
        y = torch.ones(1, requires_grad=True).exp()  # ExpBackward0 saves its result
    release([None, y.grad_fn])
    try:
        y.grad_fn._saved_result
    except RuntimeError:
        return
    raise RuntimeError("release() left ExpBackward0's saved result in place")


def _self_test_metadata(metadata_key: Any, metadata: Any) -> None:
    """The C++ reader sees the same InputMetadata as ``node._input_metadata``."""
    with torch.inference_mode(False), torch.enable_grad():
        a = torch.ones(3, 4, requires_grad=True)
        b = torch.ones(5, dtype=torch.float64, requires_grad=True)
        node = torch.cat([a.flatten(), b.float()]).grad_fn  # CatBackward0: inputs a's view and b's cast
    for x in (a, b):
        y = (x * 2).grad_fn
        key = metadata_key(y, 0)
        sizes: list = []
        if key is None or not metadata(y, 0, key, sizes) or sizes != list(x.shape):
            raise RuntimeError(f"metadata of a {tuple(x.shape)} {x.dtype} input read as {key}, {sizes}")
        other = metadata_key((x.float() if x.dtype == torch.float64 else x.double()).mul(2).grad_fn, 0)
        if other == key or metadata(y, 0, other, sizes) or metadata_key(y, 1) is not None:
            raise RuntimeError("metadata of another dtype or a missing input reads as the same key")
    if metadata_key(node, 0) is None or metadata_key(node, 1) is not None:
        raise RuntimeError("CatBackward0 has one input")


def _self_test_tensor(tensor_key: Any, tensor: Any) -> None:
    """The C++ reader sees a tensor's metadata as its Python attributes do."""
    base = torch.zeros(4, 6, dtype=torch.float64)
    param = torch.nn.Parameter(torch.ones(2, 3))
    for x in (base, base[1:, ::2].t(), param, torch.ones(()), param.detach()):
        key = tensor_key(x, type(x))
        values: list = []
        if key is None or not tensor(x, type(x), key, values):
            raise RuntimeError(f"tensor {tuple(x.shape)} {type(x).__name__} not read")
        if values != [*x.shape, *x.stride(), x.storage_offset()]:
            raise RuntimeError(f"tensor {tuple(x.shape)} read as {values}")
        others = (x.float() if x.dtype == torch.float64 else x.double(), x.detach().requires_grad_(not x.requires_grad))
        for other in others:
            if tensor_key(other, type(x)) == key or tensor(other, type(x), key, values):
                raise RuntimeError(f"another dtype or requires_grad reads as {key}")
    if tensor_key(torch.ones(2).to_sparse(), torch.Tensor) is not None or tensor_key(param, torch.Tensor) is not None:
        raise RuntimeError("a sparse tensor or another type has a key")


def _self_test(counts: Any) -> None:
    """The extension reads a C++ node and a custom Function node as expected."""
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.ones(1, requires_grad=True)
        outs = (leaf.neg(), _Identity.apply(leaf))  # neither saves a tensor
    for out in outs:
        node = out.grad_fn
        if counts(node, True) is not None:
            raise RuntimeError(f"a fresh {node.name()} reports hooks")
        handle = node.register_prehook(lambda *a: None)
        got = counts(node, True)
        handle.remove()
        if got is None or got[3] != 0 or len(got[4]) != 1:
            raise RuntimeError(f"{node.name()} with one Python pre-hook reports {got}")
        if counts(node, True) is not None:  # the dict stays, empty
            raise RuntimeError(f"{node.name()} with an empty hook dict reports hooks")


def check(got: Any, node: Any, found: Any, runs: bool, name: str, notes_key: str) -> None:
    """Raises Unsupported("invisible_hooks") unless the hooks ``node`` runs
    are exactly the ones the census found.

    Args:
        got: what ``counts(node, runs)`` (:func:`counts_fn`) returned.
        found: what ``Census.hooks_of(node)`` found (a FoundHooks or None).
        runs: the node runs (all its lists matter); else only its captured
            inputs' tensor pre-hooks and retains-grad hooks run.
        name: the node's type name, for the detail.
        notes_key: the key of the census's notes in ``node.metadata``
            (``(kind, output_nr, obj)``), read if the node has retains-grad
            hooks.

    Raises:
        Unsupported: a hook the census did not find (added from C++, or a
            Python hook dict it did not see), or one it found that eager
            would not call (a ``retain_grad`` moved by an in-place op).
    """
    if got is None:
        if found is None or not _found_any(found, runs):
            return
        got = (0, [], [], 0, [], 0, [], 0, None)
    tp_foreign, tp_dicts, retains, pre_foreign, pre_dicts, post_foreign, post_dicts, acc_foreign, acc_dict = (
        got
    )
    if tp_foreign:
        _raise(name, f"{tp_foreign} tensor pre-hook(s) added from C++ (tensor_pre_hooks)")
    if not _same(tp_dicts, [d for _, d in found.tensor_pre] if found is not None else []):
        _raise(name, "Python tensor hooks other than the census found (tensor_pre_hooks)")
    alive = {nr for nr, _ in found.retain_grad} if found is not None else set()
    if retains or alive:
        noted = {nr for kind, nr, _ in node.metadata.get(notes_key, ()) if kind == "retain_grad"}
        extra = set(retains) - noted
        if extra:
            _raise(
                name,
                f"retains_grad hooks on outputs {sorted(extra)} the census did not note "
                "(added from C++, or moved here by an in-place op) (retains_grad_hooks)",
            )
        missing = alive - set(retains)
        if missing:
            _raise(name, f"no retains_grad hook on outputs {sorted(missing)} (retains_grad_hooks)")
    if not runs:
        return
    if pre_foreign:
        _raise(name, f"{pre_foreign} pre-hook(s) added from C++ (pre_hooks)")
    if not _same(pre_dicts, [found.pre] if found is not None and found.pre else []):
        _raise(name, "Python pre-hooks other than the census found (pre_hooks)")
    known = len(found.cpp_post) if found is not None else 0
    if post_foreign != known:
        _raise(name, f"{post_foreign} post-hook(s) added from C++, {known} of them DDP's (post_hooks)")
    if not _same(post_dicts, [found.post] if found is not None and found.post else []):
        _raise(name, "Python post-hooks other than the census found (post_hooks)")
    if acc_foreign:
        _raise(name, "a post-accumulate-grad hook set from C++ (tensor_post_acc_grad_hooks)")
    expected = found.post_accumulate if found is not None else None
    if (acc_dict is None) != (expected is None) or (acc_dict is not None and acc_dict is not expected):
        _raise(name, "Python post-accumulate-grad hooks other than the census found")


def _found_any(found: Any, runs: bool) -> bool:
    if found.tensor_pre or found.retain_grad:
        return True
    return runs and bool(found.pre or found.post or found.post_accumulate or found.cpp_post)


def _same(dicts: list, known: list) -> bool:
    return {id(d) for d in dicts} == {id(d) for d in known if d}


def _raise(name: str, what: str) -> None:
    from ..errors import Unsupported

    raise Unsupported("invisible_hooks", f"{name} has {what}")
