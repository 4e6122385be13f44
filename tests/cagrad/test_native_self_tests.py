"""The C++ extension's self-tests (:mod:`cagrad.native.self_tests`) reject
wrong implementations, and the Python around the extension
(:mod:`cagrad.native.guard_program`, :func:`cagrad.native.build.layout_ok`,
:func:`cagrad.native.device_frees_fn`) behaves as documented.

Each ``*_rejects_*`` test hands a self-test a reader with one plausible
defect, built from the real reader, and expects the RuntimeError that
switches the C++ function off (its callers then use Python). The defects
are those that survivors of the mutation run (docs/mutation-testing.md)
let through: a self-test whose case was weakened accepted them.
"""

from __future__ import annotations

import pathlib
import types

import pytest
import torch

from cagrad import native
from cagrad.native import build as native_build
from cagrad.native import guard_program as gp
from cagrad.native import self_tests


def _int64(u: int) -> int:
    """The int64 that the low 64 bits of ``u`` store (two's complement)."""
    u %= 2**64
    return u - 2**64 if u >= 2**63 else u


# --- ints and int_ ----------------------------------------------------------


def test_ints_self_test_rejects_a_reader_through_binary64(built):
    """A reader that converts through a double reads 2**64 - 1 as 2**64
    (wrapping to 0, not -1); 2**63 is exact in binary64, so only the
    largest uint64 shows the defect."""

    def through_double(a, n, values):
        start = len(values)
        ok = built.ints(a, n, values)
        if ok:
            values[start:] = [_int64(int(float(v % 2**64))) for v in values[start:]]
        return ok

    assert through_double((3, 2**63, 0), 3, got := []) and got == [3, -(2**63), 0]  # right where exact
    with pytest.raises(RuntimeError, match=r"ints\("):
        self_tests._ints(through_double, built.int_)


def test_int_self_test_rejects_a_reader_of_signed_values_only(built):
    """``PyLong_AsLongLong`` refuses 2**63 and up, which a binding may hand
    out as uint64 (the guard reads them back as the int64 they store)."""

    def signed_only(a, values):
        if type(a) is int and a >= 2**63:
            return False
        return built.int_(a, values)

    with pytest.raises(RuntimeError, match=r"int_\(9223372036854775808\)"):
        self_tests._ints(built.ints, signed_only)


def test_ints_self_test_rejects_a_reader_that_masks_out_of_range_items(built):
    """A reader that takes items modulo 2**64 (``PyLong_AsUnsignedLongLongMask``)
    on its path for sequences that start with a nonzero item reads (1, 2**64)
    as [1, 0]; the self-test's too-large case must reach that path."""

    def masks(a, n, values):
        if type(a) in (tuple, list) and len(a) == n and a and a[0] != 0 and all(type(v) is int for v in a):
            values.extend(_int64(v) for v in a)
            return True
        return built.ints(a, n, values)

    assert masks((3, 2**64 - 1, 0), 3, got := []) and got == [3, -1, 0]  # right on in-range items
    with pytest.raises(RuntimeError, match=r"ints\(\(1, 18446744073709551616\), 2\) read as ints"):
        self_tests._ints(masks, built.int_)


# --- order -------------------------------------------------------------------


def test_orders_self_test_rejects_less_or_equal_for_less(built):
    """An ``order`` whose ``b"<"`` accepts equal sequence numbers (two
    AccumulateGrad nodes share one), but that refuses a node given twice."""

    def le_for_lt(nodes, relation):
        if len({id(n) for n in nodes}) != len(nodes):
            return False
        seq = [n._sequence_nr() for n in nodes]
        return all(a <= b if r == ord("<") else a == b for a, b, r in zip(seq, seq[1:], relation))

    with pytest.raises(RuntimeError, match="misreads equal sequence numbers"):
        self_tests._order(le_for_lt)


# --- metadata readers --------------------------------------------------------


def test_metadata_self_test_rejects_sizes_in_reverse_order(built):
    """A reader that appends an input's sizes last dimension first: only a
    shape that is not a palindrome shows it."""

    def reversed_sizes(node, nr, key, sizes):
        got: list = []
        ok = built.metadata(node, nr, key, got)
        sizes.extend(reversed(got))
        return ok

    with pytest.raises(RuntimeError, match=r"metadata of a \(3, 4\)"):
        self_tests._metadata_readers(built.metadata_key, reversed_sizes)


def test_metadata_self_test_rejects_a_key_without_the_dtype(built):
    """A metadata key that leaves out the dtype (bits 0 to 7 of the packed
    key) but tells node classes apart: the self-test's two dtypes must be
    compared on nodes of one class."""
    classes: dict = {}

    def key_without_dtype(node, nr):
        key = built.metadata_key(node, nr)
        if key is None:
            return None
        return (key & ~0xFF) | (classes.setdefault(type(node), len(classes) + 1) << 48)

    def metadata(node, nr, key, sizes):
        return key == key_without_dtype(node, nr) and built.metadata(node, nr, built.metadata_key(node, nr), sizes)

    with pytest.raises(RuntimeError, match="another dtype"):
        self_tests._metadata_readers(key_without_dtype, metadata)


# --- tensor readers ----------------------------------------------------------


def test_tensor_self_test_rejects_values_without_the_storage_offset(built):
    def no_offset(x, tensor_type, key, values):
        got: list = []
        ok = built.tensor(x, tensor_type, key, got)
        values.extend(got[:-1])
        return ok

    with pytest.raises(RuntimeError, match=r"tensor \(4, 6\) read as \[4, 6, 6, 1\]"):
        self_tests._tensor_readers(built.tensor_key, no_offset)


def test_tensor_self_test_rejects_a_key_cached_by_layout(built):
    """A ``tensor_key`` that remembers the keys of tensors of one or more
    dimensions by type, sizes, strides and offset gives a tensor of another
    dtype, or requires_grad, the key of the first tensor of that layout (an
    equal int, not the same object: the key of a CPU tensor of rank 1 or more
    is above CPython's cached small ints); its ``tensor`` is the real one."""
    cache: dict = {}

    def cached(x, tensor_type):
        key = built.tensor_key(x, tensor_type)
        if key is None or x.dim() == 0:
            return key
        layout = (tensor_type, tuple(x.shape), x.stride(), x.storage_offset())
        return int(str(cache.setdefault(layout, key)))  # a new int object

    with pytest.raises(RuntimeError, match="another dtype or requires_grad"):
        self_tests._tensor_readers(cached, built.tensor)


def test_tensor_self_test_rejects_a_key_for_a_subclass(built):
    """A ``tensor_key`` that accepts an instance of a subclass of ``type``
    (isinstance where the guard needs the exact type): a Parameter read as a
    Tensor. It refuses sparse tensors, as it should."""

    def isinstance_key(x, tensor_type):
        return built.tensor_key(x, type(x)) if isinstance(x, tensor_type) else None

    def isinstance_tensor(x, tensor_type, key, values):
        return isinstance(x, tensor_type) and built.tensor(x, type(x), key, values)

    assert isinstance_key(torch.ones(2).to_sparse(), torch.Tensor) is None
    with pytest.raises(RuntimeError, match="another type has a key"):
        self_tests._tensor_readers(isinstance_key, isinstance_tensor)


# --- reclaim -----------------------------------------------------------------


def test_reclaims_self_test_rejects_a_reclaim_that_leaves_a_live_alias(built):
    """A reclaim that reports success but leaves a live alias in the graph's
    memory (the next replay would write over a user's ``.grad``); it still
    refuses an alias that a view shares."""
    real = native.reclaim_fn()

    def reports_without_moving(handed, owners):
        ok = real(handed, owners)
        if ok:
            for h, o in zip(handed, owners):
                if h.data_ptr() != o.data_ptr():  # moved: put it back
                    h.set_(o.untyped_storage(), o.storage_offset(), o.size(), o.stride())
        return ok

    with pytest.raises(RuntimeError, match="did not move a live alias"):
        self_tests.reclaim(reports_without_moving)


# --- collect and walk: what their self-tests exercise ------------------------


def test_collects_self_test_changes_each_instruction_once(built):
    """The docstring's promise: besides the hooked leaf, each program the
    self-test runs is the one that holds with exactly one instruction
    replaced by one that fails, every instruction once (a program with the
    wrong instruction inserted still fails in Python, but no longer tests
    that a runner checks the instruction it replaced; and a runner that
    ignored the last instruction's verdict would pass)."""
    real = native.collect_fn()
    seen: list = []

    def recording(nodes, program, values, tensors):
        seen.append((nodes, program))
        return real(nodes, program, values, tensors)

    self_tests.collect(recording, built)
    nodes, program = seen[0]
    variants = [p for ns, p in seen[1:] if ns is nodes]
    assert len(seen) == len(variants) + 2  # and the hooked leaf's program
    changed = []
    for p in variants:
        assert len(p) == len(program), p
        diffs = [k for k, (a, b) in enumerate(zip(p, program)) if a != b]
        assert len(diffs) == 1, p
        changed.append(diffs[0])
        assert gp.run(nodes, p, [], [], built) is False
    assert sorted(changed) == list(range(len(program)))


def _walk(starts: tuple, steps: tuple, count: int, skip: str | None) -> tuple | None:
    """``walk``'s documented semantics (each check named) through
    ``next_functions``, with the check ``skip`` left out; None where the
    graph differs or the steps are malformed."""
    found = list(starts) + [None] * (count - len(starts))
    n = len(starts)
    for src, edges in steps:
        if not 0 <= src < n:
            return None
        nxt = found[src].next_functions
        if skip != "count" and len(nxt) != len(edges):
            return None
        for (fn, input_nr), spec in zip(nxt, edges):
            if not spec:
                if fn is not None and skip != "absent":
                    return None
                continue
            if fn is None:
                return None
            if input_nr != spec[1] and skip != "input_nr":
                return None
            if len(spec) == 2:
                if fn is not found[spec[0]] and skip != "identity":
                    return None
                continue
            if spec[0] != n:
                return None
            found[n] = fn
            n += 1
            if type(fn) is not spec[2] and skip != "type":
                return None
    return tuple(found) if n == count else None


def test_walks_self_test_changes_one_thing_per_case(built):
    """Each changed case of walk()'s self-test differs from the graph in one
    respect only (it holds once that one check is left out), so that a walk
    lacking any one check disagrees with ``next_functions`` on some case;
    and every check is exercised. A case wrong in two respects (an extra
    edge with a wrong input number) lets a walk without the edge-count
    check pass it."""
    real = native.walk_fn()
    seen: list = []

    def recording(starts, steps, count):
        seen.append((starts, steps, count))
        return real(starts, steps, count)

    self_tests.walk(recording)
    starts, steps, count = seen[0]
    assert _walk(starts, steps, count, None) is not None
    changed = [case for case in seen[1:] if case[1] != steps]
    checks = ("count", "input_nr", "absent", "identity", "type")
    exercised = set()
    for s, st, c in changed:
        assert _walk(s, st, c, None) is None and gp.walk(s, st, c) is None, st
        holds_without = [check for check in checks if _walk(s, st, c, check) is not None]
        assert len(holds_without) == 1, (st, holds_without)
        exercised.add(holds_without[0])
    assert exercised == set(checks) - {"absent"}  # the absent edge is in the steps that hold


# --- guard_program -----------------------------------------------------------


@pytest.mark.parametrize("code", [-1, 10, 42])
def test_an_unknown_instruction_is_a_value_error(built, code):
    """Python's run, like the C++ collect, names an instruction outside
    METADATA..LEAF."""
    with torch.enable_grad():
        node = torch.ones(3, requires_grad=True).exp().grad_fn
    op = (code, 0, "_saved_result", 0)
    with pytest.raises(ValueError, match="unknown guard instruction"):
        gp.run((node,), (op,), [], [], built)
    with pytest.raises(ValueError, match=f"unknown instruction {code}"):
        native.collect_fn()((node,), (op,), [], [])


def test_describe_names_the_node_and_attribute():
    """The guard listing's line of an instruction: node name, attribute, check."""
    assert gp.describe((gp.NONE, 1, "_saved_weight"), ["n0", "n1"]) == "n1._saved_weight: None"
    assert gp.describe((gp.INTS, 0, "_saved_self_sym_sizes", 2), ["n0"]) == "n0._saved_self_sym_sizes: 2 ints"
    assert gp.describe((gp.METADATA, 0, 1, 7), ["n0"]) == "n0 input 1: metadata key=7"


# --- build.layout_ok -----------------------------------------------------------

_CPP = "struct THPCppFunction {\n  PyObject_HEAD\n  c10::intrusive_ptr<Node> cdata;\n};\n"
_VAR = "struct THPVariable {\n  PyObject_HEAD\n  // Payload\n  at::Tensor cdata;\n  PyObject* backward_hooks;\n};\n"
_PY = "struct THPFunction {\n  PyObject_HEAD\n  PyObject* needs_input_grad;\n  c10::intrusive_ptr<torch::autograd::Node> cdata;\n};\n"


@pytest.mark.parametrize(
    "headers, expected",
    [
        pytest.param((_CPP, _VAR, _PY), None, id="mirrored"),
        pytest.param((_CPP.replace("Node>", "Node >"), _VAR, _PY), "THPCppFunction is not", id="cpp-function"),
        pytest.param((_CPP, _VAR.replace("at::Tensor cdata", "c10::MaybeOwned<at::Tensor> cdata"), _PY),
                     "THPVariable does not begin", id="variable"),
        pytest.param((_CPP, _VAR, _PY.replace("  c10::intrusive_ptr", "  int extra;\n  c10::intrusive_ptr")
                      .replace("cdata;\n", "cdata;\n  int last;\n")), "THPFunction does not end", id="function"),
    ],
)  # fmt: skip
def test_layout_ok_reads_the_installed_headers(tmp_path, monkeypatch, headers, expected):
    """layout_ok() against headers written here: None where all three
    structs begin (end) as the extension's mirror assumes, else which one
    differs."""
    folder = pathlib.Path(tmp_path, "torch", "include", "torch", "csrc", "autograd")
    folder.mkdir(parents=True)
    for name, text in zip(("python_cpp_function.h", "python_variable.h", "python_function.h"), headers):
        pathlib.Path(folder, name).write_text(text)
    monkeypatch.setattr(torch, "__file__", str(pathlib.Path(tmp_path, "torch", "__init__.py")))
    got = native_build.layout_ok()
    assert got is None if expected is None else got.startswith(expected), got


# --- device_frees_fn ----------------------------------------------------------


@pytest.mark.parametrize("backend, agrees, used", [("native", True, True), ("native", False, False),
                                                    ("cudaMallocAsync", True, False)])  # fmt: skip
def test_device_frees_is_used_only_with_the_native_allocator_when_it_agrees(monkeypatch, backend, agrees, used):
    """With CUDA faked (torch.cuda's functions patched): the C++ count is
    used where the caching allocator is torch's native one and the count
    agrees with ``memory_stats``, on this call and later ones; otherwise
    never (cudaMallocAsync frees on its own terms)."""
    calls: list = []

    def device_frees(device):
        calls.append(device)
        return 5 if agrees else 4

    monkeypatch.setattr(native, "_frees_checked", None)
    monkeypatch.setattr(native, "load", lambda: types.SimpleNamespace(device_frees=device_frees))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_device_free": 5})
    for _ in range(2):
        assert native.device_frees_fn() is (device_frees if used else None)
    assert calls == ([0] if backend == "native" else [])
