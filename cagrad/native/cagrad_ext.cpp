// cagrad's C++ extension: what the hit path and the hook check read from
// torch's autograd objects faster than their Python attributes can. Built on
// first need by cagrad/native/build.py; what each function does and why is
// in cagrad/native/__init__.py, the self-tests that compare each with the
// Python attributes in cagrad/native/self_tests.py.
#include <Python.h>
#if __has_include(<torch/csrc/autograd/node.h>)
#include <torch/csrc/autograd/node.h>
#else  // torch before 2.12 declares Node in function.h
#include <torch/csrc/autograd/function.h>
#endif
#include <torch/csrc/autograd/python_hook.h>
#if __has_include(<torch/csrc/autograd/utils/grad_layout_contract.h>)
#include <torch/csrc/autograd/utils/grad_layout_contract.h>
#define CAGRAD_HAS_LAYOUT_CONTRACT 1
#endif
#include <ATen/core/grad_mode.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <algorithm>
#include <cstring>
#include <vector>
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
PyObject* functionToPyObject(const c10::intrusive_ptr<Node>& cdata);
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

static PyTypeObject* tensor_type = nullptr;  // torch.Tensor, from set_tensor_types
static PyTypeObject* parameter_type = nullptr;  // nn.Parameter, from set_tensor_types

// set_tensor_types(torch.Tensor, torch.nn.Parameter)
static PyObject* set_tensor_types(PyObject*, PyObject* args) {
  PyObject* tensor;
  PyObject* parameter;
  if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &tensor, &PyType_Type, &parameter) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(parameter), reinterpret_cast<PyTypeObject*>(tensor))) {
    PyErr_SetString(PyExc_TypeError, "set_tensor_types(torch.Tensor, torch.nn.Parameter)");
    return nullptr;
  }
  Py_INCREF(tensor);
  Py_INCREF(parameter);
  tensor_type = reinterpret_cast<PyTypeObject*>(tensor);
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter);
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
static PyObject* counts_of(Node* node, int all_lists) {
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
  return counts_of(node, all_lists);
}

// hookless(nodes) -> bool: whether counts(node, True) is None for every node
// of the tuple (one call where a hit guard made one per node).
static PyObject* hookless(PyObject*, PyObject* nodes) {
  if (!PyTuple_Check(nodes)) {
    PyErr_SetString(PyExc_TypeError, "hookless(nodes: tuple)");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(nodes); ++i) {
    Node* node = node_of(PyTuple_GET_ITEM(nodes, i));
    if (node == nullptr) {
      return nullptr;
    }
    PyObject* got = counts_of(node, 1);
    if (got == nullptr) {
      return nullptr;
    }
    bool none = got == Py_None;
    Py_DECREF(got);
    if (!none) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
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

// Whether input nr's metadata has `want` (from metadata_key); if so its
// sizes are appended to the list `sizes`: 1, 0 (not), -1 (error).
static int metadata_check(const Node* node, Py_ssize_t nr, long long want, PyObject* sizes) {
  if (metadata_key_of(node, nr) != want) {
    return 0;
  }
  for (const auto& size : node->input_metadata(static_cast<size_t>(nr)).shape_as_dim_vector()) {
    if (append_int(sizes, *size.maybe_as_int()) < 0) {
      return -1;
    }
  }
  return 1;
}

// metadata(node, nr, key, sizes) -> bool: metadata_check.
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
  int r = metadata_check(node, nr, want, args[3]);
  if (r < 0) {
    return nullptr;
  }
  return PyBool_FromLong(r);
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

// Whether x is exactly of `type` and has the tensor key `want`; if so its
// sizes, strides and storage offset are appended to the list `values`: 1, 0
// (not), -1 (error).
static int tensor_check(PyObject* x, PyObject* type, long long want, PyObject* values) {
  if (Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(type)) {
    return 0;
  }
  const at::Tensor& t = tensor_of(x);
  if (tensor_key_of(t) != want) {
    return 0;
  }
  for (int64_t v : t.sizes()) {
    if (append_int(values, v) < 0) {
      return -1;
    }
  }
  for (int64_t v : t.strides()) {
    if (append_int(values, v) < 0) {
      return -1;
    }
  }
  return append_int(values, t.storage_offset()) < 0 ? -1 : 1;
}

// tensor(x, type, key, values) -> bool: tensor_check (`type` as tensor_key
// was called with).
static PyObject* tensor(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_Check(args[3]) || !is_tensor_type(args[1])) {
    PyErr_SetString(PyExc_TypeError, "tensor(x, tensor_type, key, values: list)");
    return nullptr;
  }
  long long want = PyLong_AsLongLong(args[2]);
  if (want == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  int r = tensor_check(args[0], args[1], want, args[3]);
  if (r < 0) {
    return nullptr;
  }
  return PyBool_FromLong(r);
}

// Appends `item` to `values` as an int64 if it is an int: a value a binding
// handed out as uint64 (2**63 and up) is read back as the int64 it stores.
// Returns 1 if appended, 0 if `item` is not an int in range, -1 on error.
static int append_int64_of(PyObject* values, PyObject* item) {
  if (!PyLong_Check(item)) {
    return 0;
  }
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
  if (v == -1 && PyErr_Occurred()) {
    return -1;
  }
  if (overflow < 0) {
    return 0;
  }
  if (overflow > 0) {
    unsigned long long u = PyLong_AsUnsignedLongLong(item);
    if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();  // 2**64 and up: not an int64 either way
      return 0;
    }
    v = static_cast<long long>(u);
  }
  return append_int(values, v) < 0 ? -1 : 1;
}

// Whether `a` is a tuple or list of `n` ints; if so they are appended to
// the list `values` (see append_int64_of); nothing is appended otherwise: 1,
// 0 (not), -1 (error).
static int ints_check(PyObject* a, Py_ssize_t n, PyObject* values) {
  if (!(PyTuple_Check(a) || PyList_Check(a)) || PySequence_Fast_GET_SIZE(a) != n) {
    return 0;
  }
  PyObject** items = PySequence_Fast_ITEMS(a);
  Py_ssize_t start = PyList_GET_SIZE(values);
  for (Py_ssize_t i = 0; i < n; ++i) {
    int r = append_int64_of(values, items[i]);
    if (r <= 0) {
      if (PyList_SetSlice(values, start, PyList_GET_SIZE(values), nullptr) < 0) {
        return -1;
      }
      return r;
    }
  }
  return 1;
}

// ints(a, n, values) -> bool: ints_check.
static PyObject* ints(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyList_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "ints(a, n, values: list)");
    return nullptr;
  }
  Py_ssize_t n = PyLong_AsSsize_t(args[1]);
  if (n == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  int r = ints_check(args[0], n, args[2]);
  if (r < 0) {
    return nullptr;
  }
  return PyBool_FromLong(r);
}

// int_(a, values) -> bool: whether `a` is an int; if so it is appended to the
// list `values` (see append_int64_of).
static PyObject* int_(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "int_(a, values: list)");
    return nullptr;
  }
  int r = append_int64_of(args[1], args[0]);
  if (r < 0) {
    return nullptr;
  }
  return PyBool_FromLong(r);
}

// order(nodes, relation) -> bool: whether the sequence numbers of the nodes
// (a tuple) relate pairwise as `relation` says (relation[i] is b'<' or b'='
// for nodes[i] against nodes[i + 1]) and no node is in the tuple twice.
// Strictly increasing numbers are distinct nodes already; within a run of
// equal numbers (the AccumulateGrad nodes all have the largest) the objects
// are compared pairwise.
static PyObject* order(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[0]) || !PyBytes_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "order(nodes: tuple, relation: bytes)");
    return nullptr;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
  if (PyBytes_GET_SIZE(args[1]) != (n > 0 ? n - 1 : 0)) {
    PyErr_SetString(PyExc_ValueError, "order(): relation must have one byte per adjacent pair");
    return nullptr;
  }
  const char* rel = PyBytes_AS_STRING(args[1]);
  uint64_t prev = 0;
  Py_ssize_t run = 0;  // where the current run of equal numbers starts
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(args[0], i);
    Node* node = node_of(obj);
    if (node == nullptr) {
      return nullptr;
    }
    uint64_t seq = node->sequence_nr();
    if (i > 0) {
      if (rel[i - 1] == '<') {
        if (!(prev < seq)) {
          Py_RETURN_FALSE;
        }
        run = i;
      } else {
        if (prev != seq) {
          Py_RETURN_FALSE;
        }
        for (Py_ssize_t j = run; j < i; ++j) {
          if (PyTuple_GET_ITEM(args[0], j) == obj) {
            Py_RETURN_FALSE;
          }
        }
      }
    }
    prev = seq;
  }
  Py_RETURN_TRUE;
}

// walk(starts, steps, count) -> tuple or None: a hit guard's structure
// check, from the nodes `starts` (a tuple: the roots' grad_fns), along
// `steps`, in the order the capture's dependency walk discovered the nodes.
// steps[k] is (src, edges): node `src` (an index into the discovered nodes)
// has exactly len(edges) next edges, edge j as edges[j] says: () no
// function; (i, input_nr) the node discovered as i, reached at input_nr;
// (i, input_nr, type) a node discovered here as i (the next index), whose
// Python object is exactly of `type`. Returns the `count` discovered nodes'
// Python objects by index, or None where the graph differs. One call where
// a guard unpacked each node's next_functions (a tuple of tuples per node)
// in Python.
static PyObject* walk(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "walk(starts: tuple, steps: tuple, count: int)");
    return nullptr;
  }
  Py_ssize_t count = PyLong_AsSsize_t(args[2]);
  Py_ssize_t n_starts = PyTuple_GET_SIZE(args[0]);
  if (count == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (count < n_starts) {
    PyErr_SetString(PyExc_ValueError, "walk(): count is below the number of starts");
    return nullptr;
  }
  PyObject* found = PyTuple_New(count);
  if (found == nullptr) {
    return nullptr;
  }
  std::vector<Node*> nodes(static_cast<size_t>(count), nullptr);
  for (Py_ssize_t i = 0; i < n_starts; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(args[0], i);
    nodes[i] = node_of(obj);
    if (nodes[i] == nullptr) {
      Py_DECREF(found);
      return nullptr;
    }
    Py_INCREF(obj);
    PyTuple_SET_ITEM(found, i, obj);
  }
  Py_ssize_t next_new = n_starts;
  auto fail = [&](const char* why) -> PyObject* {
    Py_DECREF(found);
    if (why != nullptr) {
      PyErr_SetString(PyExc_ValueError, why);
      return nullptr;
    }
    Py_RETURN_NONE;
  };
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(args[1]); ++k) {
    PyObject* step = PyTuple_GET_ITEM(args[1], k);
    if (!PyTuple_Check(step) || PyTuple_GET_SIZE(step) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(step, 1))) {
      return fail("walk(): a step is (src, edges: tuple)");
    }
    Py_ssize_t src = PyLong_AsSsize_t(PyTuple_GET_ITEM(step, 0));
    if (src < 0 || src >= next_new) {
      return fail(PyErr_Occurred() ? "walk(): a step's src is not an int" : "walk(): a step's src is not discovered yet");
    }
    PyObject* edges = PyTuple_GET_ITEM(step, 1);
    const auto& next = nodes[src]->next_edges();
    if (static_cast<Py_ssize_t>(next.size()) != PyTuple_GET_SIZE(edges)) {
      return fail(nullptr);
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(edges); ++j) {
      PyObject* spec = PyTuple_GET_ITEM(edges, j);
      Py_ssize_t size = PyTuple_Check(spec) ? PyTuple_GET_SIZE(spec) : -1;
      const auto& edge = next[j];
      if (size == 0) {
        if (edge.is_valid()) {
          return fail(nullptr);
        }
        continue;
      }
      if (size != 2 && size != 3) {
        return fail("walk(): an edge is (), (i, input_nr) or (i, input_nr, type)");
      }
      Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, 0));
      long long input_nr = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 1));
      if (PyErr_Occurred()) {
        return fail("walk(): an edge's index or input number is not an int");
      }
      if (!edge.is_valid() || static_cast<long long>(edge.input_nr) != input_nr) {
        return fail(nullptr);
      }
      if (size == 2) {
        if (i < 0 || i >= next_new) {
          return fail("walk(): an edge names a node not discovered yet");
        }
        if (edge.function.get() != nodes[i]) {
          return fail(nullptr);
        }
        continue;
      }
      if (i != next_new || i >= count) {
        return fail("walk(): a new node's index is not the next one");
      }
      PyObject* obj = torch::autograd::functionToPyObject(edge.function);
      if (obj == nullptr) {
        Py_DECREF(found);
        if (!PyErr_Occurred()) {
          PyErr_SetString(PyExc_RuntimeError, "walk(): no Python object for a node");
        }
        return nullptr;
      }
      PyTuple_SET_ITEM(found, i, obj);  // the new reference functionToPyObject returned
      nodes[i] = edge.function.get();
      ++next_new;
      if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != PyTuple_GET_ITEM(spec, 2)) {
        return fail(nullptr);
      }
    }
  }
  if (next_new != count) {
    return fail("walk(): the steps discover fewer nodes than count");
  }
  return found;
}

// The instructions of collect(), one tuple each: (op, i, ...), where i
// indexes the node tuple and `name` is the attribute read from node i
// (cagrad/native/guard_program.py documents each and gives its Python;
// cagrad/keys/hit_path.py writes them).
enum GuardOp : long {
  kMetadata = 0,  // (op, i, input_nr, key): metadata_check of input input_nr
  kTensor = 1,    // (op, i, name, type, key): tensor_check, and appended to the tensors
  kNone = 2,      // (op, i, name): the attribute is None
  kInts = 3,      // (op, i, name, n): ints_check
  kInt = 4,       // (op, i, name): an int, appended (append_int64_of)
  kIs = 5,        // (op, i, name, obj): the attribute is obj
  kEq = 6,        // (op, i, name, value): of exactly value's type, and equal
  kIntSeq = 7,    // (op, i, name, seq): seq's type and length, items exactly int and equal
  kFloat = 8,     // (op, i, name, value): exactly a float with value's binary64 bits
  kLeaf = 9,      // (op, i, type, key): node i's variable is a leaf without hooks, and tensor_check
};

static PyObject* interned(PyObject** slot, const char* text) {
  if (*slot == nullptr) {
    *slot = PyUnicode_InternFromString(text);
  }
  return *slot;
}

// getattr(obj, name, None) as a new reference (nullptr: an error other than
// AttributeError).
static PyObject* attr_or_none(PyObject* obj, PyObject* name) {
  PyObject* got = PyObject_GetAttr(obj, name);
  if (got == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    Py_INCREF(Py_None);
    return Py_None;
  }
  return got;
}

// bool(a), consuming the new reference `a`: 1, 0, or -1 (a is nullptr: an
// error is set, or bool() raised).
static int truth_of(PyObject* a) {
  if (a == nullptr) {
    return -1;
  }
  int r = PyObject_IsTrue(a);
  Py_DECREF(a);
  return r;
}

// kLeaf's leaf and hook part: the variable of the AccumulateGrad node `node`
// (a new reference) if it has no grad_fn, no tensor hook and no
// post-accumulate-grad hook; Py_None (new) if it has one; nullptr on error.
static PyObject* hookless_leaf(PyObject* node) {
  static PyObject *s_variable, *s_grad_fn, *s_hooks, *s_post;
  PyObject* v = PyObject_GetAttr(node, interned(&s_variable, "variable"));
  if (v == nullptr) {
    return nullptr;
  }
  PyObject* grad_fn = PyObject_GetAttr(v, interned(&s_grad_fn, "grad_fn"));
  int bad = grad_fn == nullptr ? -1 : grad_fn != Py_None;
  Py_XDECREF(grad_fn);
  if (bad == 0) {
    bad = truth_of(PyObject_GetAttr(v, interned(&s_hooks, "_backward_hooks")));
  }
  if (bad == 0) {
    bad = truth_of(attr_or_none(v, interned(&s_post, "_post_accumulate_grad_hooks")));
  }
  if (bad == 0) {
    return v;
  }
  Py_DECREF(v);
  if (bad < 0) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

// One instruction against `node`: 1 (holds), 0 (does not), -1 (error).
static int run_op(PyObject* op, long code, PyObject* node, PyObject* values, PyObject* tensors) {
  Py_ssize_t size = PyTuple_GET_SIZE(op);
  if (code < kMetadata || code > kLeaf) {
    PyErr_Format(PyExc_ValueError, "collect(): unknown instruction %ld", code);
    return -1;
  }
  if (code == kMetadata) {
    Node* n = node_of(node);
    if (n == nullptr || size != 4) {
      if (n != nullptr) {
        PyErr_SetString(PyExc_ValueError, "collect(): a metadata instruction has 4 items");
      }
      return -1;
    }
    Py_ssize_t nr = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, 2));
    long long want = PyLong_AsLongLong(PyTuple_GET_ITEM(op, 3));
    if (PyErr_Occurred()) {
      return -1;
    }
    return metadata_check(n, nr, want, values);
  }
  if (code == kLeaf) {
    if (size != 4 || !is_tensor_type(PyTuple_GET_ITEM(op, 2))) {
      PyErr_SetString(PyExc_ValueError, "collect(): a leaf instruction is (op, i, tensor_type, key)");
      return -1;
    }
    long long want = PyLong_AsLongLong(PyTuple_GET_ITEM(op, 3));
    if (want == -1 && PyErr_Occurred()) {
      return -1;
    }
    PyObject* v = hookless_leaf(node);
    if (v == nullptr) {
      return -1;
    }
    int r = v == Py_None ? 0 : tensor_check(v, PyTuple_GET_ITEM(op, 2), want, values);
    Py_DECREF(v);
    return r;
  }
  Py_ssize_t want_size = code == kTensor ? 5 : (code == kNone || code == kInt) ? 3 : 4;
  if (size != want_size) {
    PyErr_Format(PyExc_ValueError, "collect(): instruction %ld has %zd items", code, size);
    return -1;
  }
  PyObject* a = PyObject_GetAttr(node, PyTuple_GET_ITEM(op, 2));
  if (a == nullptr) {
    return -1;
  }
  int r = -1;
  switch (code) {
    case kTensor: {
      PyObject* type = PyTuple_GET_ITEM(op, 3);
      long long want = PyLong_AsLongLong(PyTuple_GET_ITEM(op, 4));
      if (!is_tensor_type(type)) {
        PyErr_SetString(PyExc_ValueError, "collect(): a tensor instruction's type is not a tensor type");
      } else if (!(want == -1 && PyErr_Occurred())) {
        r = a == Py_None ? 0 : tensor_check(a, type, want, values);
        if (r == 1 && PyList_Append(tensors, a) < 0) {
          r = -1;
        }
      }
      break;
    }
    case kNone:
      r = a == Py_None;
      break;
    case kInts: {
      Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, 3));
      if (!(n == -1 && PyErr_Occurred())) {
        r = ints_check(a, n, values);
      }
      break;
    }
    case kInt:
      r = append_int64_of(values, a);
      break;
    case kIs:
      r = a == PyTuple_GET_ITEM(op, 3);
      break;
    case kEq: {
      PyObject* want = PyTuple_GET_ITEM(op, 3);
      r = Py_TYPE(a) == Py_TYPE(want) ? PyObject_RichCompareBool(a, want, Py_EQ) : 0;
      break;
    }
    case kIntSeq: {
      PyObject* want = PyTuple_GET_ITEM(op, 3);
      if (!(PyTuple_CheckExact(want) || PyList_CheckExact(want))) {
        PyErr_SetString(PyExc_ValueError, "collect(): an int sequence instruction's value is not a tuple or list");
        break;
      }
      Py_ssize_t n = PySequence_Fast_GET_SIZE(want);
      r = Py_TYPE(a) == Py_TYPE(want) && PySequence_Fast_GET_SIZE(a) == n;
      for (Py_ssize_t k = 0; r == 1 && k < n; ++k) {
        PyObject* item = PySequence_Fast_ITEMS(a)[k];
        r = PyLong_CheckExact(item) ? PyObject_RichCompareBool(item, PySequence_Fast_ITEMS(want)[k], Py_EQ) : 0;
      }
      break;
    }
    case kFloat: {
      PyObject* want = PyTuple_GET_ITEM(op, 3);
      if (!PyFloat_CheckExact(want)) {
        PyErr_SetString(PyExc_ValueError, "collect(): a float instruction's value is not a float");
        break;
      }
      r = 0;
      if (PyFloat_CheckExact(a)) {
        double x = PyFloat_AS_DOUBLE(a);
        double y = PyFloat_AS_DOUBLE(want);
        r = std::memcmp(&x, &y, sizeof(double)) == 0;
      }
      break;
    }
    default:
      break;
  }
  Py_DECREF(a);
  return r;
}

// collect(nodes, program, values, tensors) -> bool: runs the instructions of
// `program` (a tuple of tuples, see GuardOp) in order against the tuple
// `nodes`, appending size values to the list `values` and lifted tensors to
// the list `tensors` as they go; False at the first that does not hold (what
// was appended stays). One call where a hit guard ran a line of Python per
// instruction.
static PyObject* collect(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1]) || !PyList_Check(args[2]) ||
      !PyList_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "collect(nodes: tuple, program: tuple, values: list, tensors: list)");
    return nullptr;
  }
  PyObject* nodes = args[0];
  PyObject* program = args[1];
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(program); ++k) {
    PyObject* op = PyTuple_GET_ITEM(program, k);
    if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) < 2) {
      PyErr_SetString(PyExc_ValueError, "collect(): an instruction is a tuple (op, node index, ...)");
      return nullptr;
    }
    long code = PyLong_AsLong(PyTuple_GET_ITEM(op, 0));
    Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, 1));
    if (PyErr_Occurred()) {
      return nullptr;
    }
    if (i < 0 || i >= PyTuple_GET_SIZE(nodes) || PyTuple_GET_ITEM(nodes, i) == Py_None) {
      PyErr_Format(PyExc_ValueError, "collect(): instruction %zd names no node (index %zd)", k, i);
      return nullptr;
    }
    int r = run_op(op, code, PyTuple_GET_ITEM(nodes, i), args[2], args[3]);
    if (r < 0) {
      return nullptr;
    }
    if (r == 0) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// Copies and in-place sums that accumulate() does for several leaves in one
// multi-tensor kernel each (_foreach_copy_, _foreach_add_) instead of one
// kernel per leaf: on a GPU each launch costs the host several us.
struct Pending {
  std::vector<at::Tensor> copy_to, copy_from, add_to, add_from;
  std::vector<at::Tensor> copied;  // the leaves whose new .grad is in copy_to
};

// One leaf's gradient into its .grad with grad mode off, where both are plain
// dense tensors: 1 if done (or queued in `pending`), 0 if the caller must do
// it (another case), -1 on error. What happens follows
// AccumulateGrad::accumulateGrad (torch/csrc/autograd/functions/
// accumulate_grad.h) for these cases: .grad unset: the gradient itself where
// `stealable` and it obeys the layout contract, else a copy laid out by the
// contract (the leaf's strides where they are non-overlapping and dense,
// else contiguous: clone_obey_contract's layout); .grad set: added in place.
static int accumulate_one(PyObject* var_obj, PyObject* grad_obj, bool stealable, Pending& pending) {
#ifdef CAGRAD_HAS_LAYOUT_CONTRACT
  PyTypeObject* vt = Py_TYPE(var_obj);
  if ((vt != tensor_type && vt != parameter_type) || Py_TYPE(grad_obj) != tensor_type) {
    return 0;
  }
  const at::Tensor& variable = tensor_of(var_obj);
  const at::Tensor& grad = tensor_of(grad_obj);
  if (!variable.defined() || !grad.defined()) {
    return 0;
  }
  if (!variable.requires_grad()) {
    return 1;  // requires_grad was switched off after the forward: nothing to do
  }
  if (variable.layout() != c10::kStrided || grad.layout() != c10::kStrided || variable.is_nested() ||
      grad.is_nested() || grad.requires_grad() || grad.scalar_type() != variable.scalar_type() ||
      grad.device() != variable.device() || !grad.sizes().equals(variable.sizes()) ||
      variable.unsafeGetTensorImpl()->is_python_dispatch() || grad.unsafeGetTensorImpl()->is_python_dispatch()) {
    return 0;  // another case, or a tensor whose ops Python handles (__torch_dispatch__)
  }
  at::Tensor& old = variable.mutable_grad();
  if (!old.defined()) {
    if (stealable && torch::autograd::utils::obeys_layout_contract(grad, variable)) {
      old = grad.is_view() ? grad.detach() : grad;  // eager's .grad is never a view
    } else {
      old = variable.is_non_overlapping_and_dense()
                ? at::empty_strided(variable.sizes(), variable.strides(), grad.options())
                : at::empty(grad.sizes(), grad.options());
      pending.copy_to.push_back(old);
      pending.copy_from.push_back(grad);
      pending.copied.push_back(variable);
    }
    return 1;
  }
  if (old.layout() != c10::kStrided || old.is_nested() || old.scalar_type() != grad.scalar_type() ||
      old.device() != grad.device() || old.unsafeGetTensorImpl()->is_python_dispatch()) {
    return 0;
  }
  pending.add_to.push_back(old);
  pending.add_from.push_back(grad);
  return 1;
#else
  return 0;
#endif
}

// Whether two of the tensors have one storage.
static bool shares_storage(const std::vector<at::Tensor>& tensors) {
  std::vector<const void*> seen;
  seen.reserve(tensors.size());
  for (const auto& t : tensors) {
    const void* impl = t.storage().unsafeGetStorageImpl();
    for (const void* other : seen) {
      if (other == impl) {
        return true;
      }
    }
    seen.push_back(impl);
  }
  return false;
}

// accumulate(variables, grads, stealable) -> list: accumulate_one for each
// (variables[i], grads[i], stealable[i]) (three lists of one length), grad
// mode off, then the queued copies and sums; returns the indices it left to
// the caller.
static PyObject* accumulate(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2]) ||
      PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1]) ||
      PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[2])) {
    PyErr_SetString(PyExc_TypeError, "accumulate(variables: list, grads: list, stealable: list), one length");
    return nullptr;
  }
  PyObject* left = PyList_New(0);
  if (left == nullptr) {
    return nullptr;
  }
  Pending pending;
  bool copies_done = false;
  try {
    at::NoGradGuard no_grad;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[0]); ++i) {
      int steal = PyObject_IsTrue(PyList_GET_ITEM(args[2], i));
      int r = steal < 0 ? -1
                        : accumulate_one(PyList_GET_ITEM(args[0], i), PyList_GET_ITEM(args[1], i), steal, pending);
      if (r < 0 || (r == 0 && append_int(left, i) < 0)) {
        Py_DECREF(left);
        return nullptr;
      }
    }
    if (!pending.copy_to.empty()) {
      at::_foreach_copy_(pending.copy_to, pending.copy_from);
    }
    copies_done = true;
    if (!pending.add_to.empty()) {
      if (shares_storage(pending.add_to)) {
        // two leaves with one .grad storage (a user's assignment): one
        // kernel would add into it concurrently; one add after the other,
        // as the engine does
        for (size_t k = 0; k < pending.add_to.size(); ++k) {
          pending.add_to[k].add_(pending.add_from[k]);
        }
      } else {
        at::_foreach_add_(pending.add_to, pending.add_from);
      }
    }
  } catch (const std::exception& e) {
    // no leaf keeps an uninitialized .grad: where the copies did not run,
    // the leaves they were to fill are unset again (they were unset before)
    if (!copies_done) {
      for (size_t k = 0; k < pending.copied.size(); ++k) {
        if (pending.copied[k].grad().is_same(pending.copy_to[k])) {
          pending.copied[k].mutable_grad().reset();
        }
      }
    }
    Py_DECREF(left);
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return left;
}

// stealable(outs, inputs) -> list[bool]: for each tensor of `outs` (a
// list), whether it may become a .grad without a copy: inputs[i] (a list of
// bools, one per output: the output is a graph input itself) is False and its
// bytes overlap no earlier output that may (a backend may hand back one
// buffer for two outputs; disjoint views of one buffer may all).
// cagrad.autograd.accumulate._stealable_outputs is the same rule in Python.
static PyObject* stealable(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
      PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
    PyErr_SetString(PyExc_TypeError, "stealable(outs: list, inputs: list), one length");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(args[0]);
  PyObject* result = PyList_New(n);
  if (result == nullptr) {
    return nullptr;
  }
  struct Span {
    const void* storage;
    int64_t first;
    int64_t end;
  };
  std::vector<Span> taken;
  taken.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* out = PyList_GET_ITEM(args[0], i);
    if (!is_tensor_type(reinterpret_cast<PyObject*>(Py_TYPE(out)))) {
      Py_DECREF(result);
      PyErr_Format(PyExc_TypeError, "stealable(): output %zd is not a tensor", i);
      return nullptr;
    }
    int is_input = PyObject_IsTrue(PyList_GET_ITEM(args[1], i));
    if (is_input < 0) {
      Py_DECREF(result);
      return nullptr;
    }
    bool ok = !is_input;
    const at::Tensor& t = tensor_of(out);
    try {
      const void* ptr = t.defined() && t.has_storage() ? t.storage().data() : nullptr;
      if (ok && ptr != nullptr && t.numel() != 0) {
        int64_t last = t.storage_offset();
        auto sizes = t.sizes();
        auto strides = t.strides();
        for (size_t d = 0; d < sizes.size(); ++d) {
          last += (sizes[d] - 1) * strides[d];
        }
        int64_t item = static_cast<int64_t>(t.itemsize());
        Span span{ptr, t.storage_offset() * item, (last + 1) * item};
        for (const Span& s : taken) {
          if (s.storage == ptr && span.first < s.end && s.first < span.end) {
            ok = false;
            break;
          }
        }
        if (ok) {
          taken.push_back(span);
        }
      }
    } catch (const std::exception& e) {
      Py_DECREF(result);
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
    PyObject* b = ok ? Py_True : Py_False;
    Py_INCREF(b);
    PyList_SET_ITEM(result, i, b);
  }
  return result;
}

// reclaim(handed, owners) -> bool: before a CUDA graph replays into its
// output memory, frees that memory of the aliases handed out after its last
// replay (handed[i] aliases owners[i], the graph's own output tensor). An
// alias that only the list `handed` refers to is dead. A live one (a leaf's
// .grad, say) is moved out: its TensorImpl gets a copy of the data in new
// memory (set_), which every holder of it sees; one whose elements share
// memory (stride 0: an expanded gradient), which no copy can write, gets a
// copy of its storage span, read through its own strides. Returns False, moving
// nothing more, where a live alias's memory is also held by a tensor not in
// the two lists (a view the user made of a .grad): the caller must not
// replay then.
static PyObject* reclaim(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
      PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
    PyErr_SetString(PyExc_TypeError, "reclaim(handed: list, owners: list), one length");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(args[0]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* h = PyList_GET_ITEM(args[0], i);
    PyObject* o = PyList_GET_ITEM(args[1], i);
    if (!is_tensor_type(reinterpret_cast<PyObject*>(Py_TYPE(h))) ||
        !is_tensor_type(reinterpret_cast<PyObject*>(Py_TYPE(o)))) {
      continue;  // an output that is not a tensor holds no memory
    }
    const at::Tensor& handed = tensor_of(h);
    const at::Tensor& owner = tensor_of(o);
    if (!handed.defined() || !handed.has_storage() || !owner.has_storage() ||
        handed.storage().unsafeGetStorageImpl() != owner.storage().unsafeGetStorageImpl()) {
      continue;  // moved already, or given other memory: holds none of the graph's
    }
    if (Py_REFCNT(h) == 1 && handed.use_count() == 1) {
      continue;  // dead: only the list refers to it
    }
    // live: every tensor over this memory must be one of ours
    const c10::StorageImpl* memory = handed.storage().unsafeGetStorageImpl();
    std::vector<const c10::TensorImpl*> known;
    for (Py_ssize_t j = 0; j < n; ++j) {
      for (PyObject* obj : {PyList_GET_ITEM(args[0], j), PyList_GET_ITEM(args[1], j)}) {
        if (!is_tensor_type(reinterpret_cast<PyObject*>(Py_TYPE(obj)))) {
          continue;
        }
        const at::Tensor& t = tensor_of(obj);
        if (t.defined() && t.has_storage() && t.storage().unsafeGetStorageImpl() == memory &&
            std::find(known.begin(), known.end(), t.unsafeGetTensorImpl()) == known.end()) {
          known.push_back(t.unsafeGetTensorImpl());
        }
      }
    }
    if (handed.storage().use_count() != known.size()) {
      Py_RETURN_FALSE;
    }
    try {
      at::NoGradGuard no_grad;
      if (at::has_internal_overlap(handed) == at::MemOverlap::Yes) {
        int64_t span = 1;
        for (int64_t d = 0; d < handed.dim(); ++d) {
          span += (handed.size(d) - 1) * handed.stride(d);  // torch's strides are >= 0
        }
        at::Tensor flat = at::empty({span}, handed.options());
        flat.copy_(handed.as_strided({span}, {1}, handed.storage_offset()));
        handed.set_(flat.storage(), 0, handed.sizes(), handed.strides());
      } else {
        at::Tensor fresh = at::empty_strided(handed.sizes(), handed.strides(), handed.options());
        fresh.copy_(handed);
        handed.set_(fresh);
      }
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  Py_RETURN_TRUE;
}

// sole(box: list) -> bool: whether box[0], a tensor, is held by nothing but
// the list: one Python reference (the list's) and one reference to its
// TensorImpl (its Python object's; a view of it holds another, through its
// view metadata). Such a gradient may become a leaf's .grad without a copy,
// as eager's AccumulateGrad adopts a gradient whose use_count shows that no
// one else holds it (accumulateGrad in
// torch/csrc/autograd/functions/accumulate_grad.h): a view of other memory
// and a tensor whose memory a detached alias shares are adopted too, as
// eager adopts them. Outputs of a compiled segment over one buffer, which
// eager would have made apart, are the caller's to exclude
// (cagrad.capture.segments).
static PyObject* sole(PyObject*, PyObject* box) {
  if (!PyList_Check(box) || PyList_GET_SIZE(box) != 1) {
    PyErr_SetString(PyExc_TypeError, "sole(box): a list of one item");
    return nullptr;
  }
  PyObject* obj = PyList_GET_ITEM(box, 0);
  if (!is_tensor_type(reinterpret_cast<PyObject*>(Py_TYPE(obj))) || Py_REFCNT(obj) != 1) {
    Py_RETURN_FALSE;
  }
  const at::Tensor& t = tensor_of(obj);
  if (!t.defined() || t.use_count() != 1 || !t.has_storage()) {
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// device_frees(device: int) -> int: how many times the CUDA caching allocator
// has given memory of this device back to the driver (cudaFree, or pages of
// an expandable segment unmapped): its DeviceStats.num_device_free. While the
// count stands still, every address the allocator handed out since it last
// moved is still mapped; a CUDA graph may read it before the graph's inputs
// are confirmed (cagrad/compile/cuda_graphs.py, early replays). Raises
// RuntimeError (torch's) where there is no CUDA allocator.
static PyObject* device_frees(PyObject*, PyObject* arg) {
  long index = PyLong_AsLong(arg);
  if (index == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  try {
    auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    return PyLong_FromLongLong(allocator->getDeviceStats(static_cast<c10::DeviceIndex>(index)).num_device_free);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

static PyMethodDef methods[] = {
    {"reclaim", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(reclaim)), METH_FASTCALL, nullptr},
    {"stealable", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(stealable)), METH_FASTCALL, nullptr},
    {"ints", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ints)), METH_FASTCALL, nullptr},
    {"int_", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(int_)), METH_FASTCALL, nullptr},
    {"order", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(order)), METH_FASTCALL, nullptr},
    {"accumulate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(accumulate)), METH_FASTCALL, nullptr},
    {"set_tensor_types", set_tensor_types, METH_VARARGS, nullptr},
    {"tensor_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tensor_key)), METH_FASTCALL, nullptr},
    {"tensor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tensor)), METH_FASTCALL, nullptr},
    {"init", init, METH_VARARGS, nullptr},
    {"metadata_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(metadata_key)), METH_FASTCALL, nullptr},
    {"metadata", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(metadata)), METH_FASTCALL, nullptr},
    {"counts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(counts)), METH_FASTCALL, nullptr},
    {"release", release, METH_O, nullptr},
    {"hookless", hookless, METH_O, nullptr},
    {"device_frees", device_frees, METH_O, nullptr},
    {"sole", sole, METH_O, nullptr},
    {"collect", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(collect)), METH_FASTCALL, nullptr},
    {"walk", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(walk)), METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef module = {PyModuleDef_HEAD_INIT, "MODULE_NAME", nullptr, -1, methods};

#define CONCAT2(a, b) a##b
#define CONCAT(a, b) CONCAT2(a, b)
PyMODINIT_FUNC CONCAT(PyInit_, MODULE_NAME)() {
  return PyModule_Create(&module);
}
