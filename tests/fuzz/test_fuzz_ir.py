"""The program IR: JSON round trip, validation errors that name the problem."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings

from fuzz.ir import SCHEMA_VERSION, IRError, Leaf, Op, Program, validate
from fuzz.strategies import programs
from tests.conftest import examples

SETTINGS = settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck), database=None)


@SETTINGS
@given(programs())
def test_json_round_trip(program: Program) -> None:
    text = program.to_json()
    again = Program.from_json(text)
    assert again == program
    assert again.to_json() == text
    assert json.loads(text)["schema"] == SCHEMA_VERSION
    assert Program.from_dict(program.to_dict()) == program


@SETTINGS
@given(programs(prune=False))
def test_unpruned_programs_round_trip_and_prune_keeps_roots(program: Program) -> None:
    assert Program.from_json(program.to_json()) == program
    pruned = program.pruned()
    validate(pruned)
    assert pruned.roots == program.roots
    assert set(pruned.op_names()) <= set(program.op_names())
    assert len(pruned.ops) <= len(program.ops)


def _base() -> dict:
    return {
        "schema": SCHEMA_VERSION,
        "seed": 7,
        "leaves": [
            {"name": "x0", "shape": [2, 3], "dtype": "float32", "requires_grad": True},
            {"name": "x1", "shape": [3], "dtype": "float32", "requires_grad": True},
        ],
        "ops": [
            {"name": "v0", "op": "mul", "inputs": ["x0", "x1"], "attrs": {}},
            {"name": "v1", "op": "split", "inputs": ["v0"], "attrs": {"dim": 1, "split_size": 2}},
            {"name": "v2", "op": "sum", "inputs": ["v1:1"], "attrs": {"dim": [0], "keepdim": False}},
        ],
        "roots": ["v2"],
        "loss": "sum",
        "mode": "backward",
        "inputs": None,
        "retain_graph": None,
        "repeat": 1,
    }


def test_base_program_is_valid_and_infers_shapes() -> None:
    p = Program.from_dict(_base())
    info = p.infer()
    assert info["v0"].shape == (2, 3)
    assert info["v1:0"].shape == (2, 2) and info["v1:1"].shape == (2, 1)
    assert info["v2"].shape == (1,)
    assert info["v2"].requires_grad


def _mutated(path: str, value) -> dict:
    """``_base()`` with one field replaced (``ops.1.attrs.dim`` style path)."""
    data = copy.deepcopy(_base())
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is _DELETE:
        del node[last if not isinstance(node, list) else int(last)]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


_DELETE = object()

MALFORMED = [
    # (path, new value, expected fragments of the message)
    ("ops.0.op", "frobnicate", ["ops[0].op", "unknown op 'frobnicate'"]),
    ("ops.2.inputs", ["v9"], ["ops[2].inputs[0]", "unknown value 'v9'"]),
    ("ops.2.inputs", ["v1"], ["ops[2].inputs[0]", "has 2 outputs", "'v1:0'"]),
    ("ops.2.inputs", ["v1:5"], ["ops[2].inputs[0]", "only 2 outputs"]),
    ("ops.2.inputs", ["x0:1"], ["ops[2].inputs[0]", "single output"]),
    ("ops.0.inputs", ["x0"], ["ops[0].inputs", "mul takes 2 input(s), got 1"]),
    ("ops.1.attrs.dim", "one", ["ops[1].attrs.dim", "expected an int"]),
    ("ops.1.attrs.dim", 5, ["ops[1]", "shape mismatch", "dim 5 out of range"]),
    ("ops.1.attrs.bogus", 1, ["ops[1].attrs.bogus", "unknown attribute 'bogus'"]),
    ("ops.2.attrs.keepdim", _DELETE, ["ops[2].attrs.keepdim", "missing attribute 'keepdim'"]),
    ("ops.2.attrs.dim", [], ["ops[2].attrs.dim", "empty dim list"]),
    ("leaves.1.shape", [4], ["ops[0]", "shape mismatch", "do not broadcast", "[2, 3], [4]"]),
    ("leaves.1.shape", [3, "a"], ["leaves[1].shape", "list of ints"]),
    ("leaves.0.dtype", "int64", ["leaves[0].dtype", "unknown dtype 'int64'"]),
    ("leaves.1.name", "x0", ["leaves[1].name", "duplicate name 'x0'"]),
    ("leaves.1.name", "1x", ["leaves[1].name", "invalid name"]),
    ("leaves.0.requires_grad", "yes", ["leaves[0].requires_grad", "expected a bool"]),
    ("roots", [], ["roots", "at least one root"]),
    ("roots", ["v7"], ["roots[0]", "unknown value 'v7'"]),
    ("mode", "jvp", ["mode", "unknown mode 'jvp'"]),
    ("mode", "grad", ["inputs", "needs a non-empty list of inputs"]),
    ("loss", "mean", ["loss", "unknown loss 'mean'"]),
    ("repeat", 2, ["repeat", "needs retain_graph=true"]),
    ("inputs", ["v0"], ["inputs[0]", "restricts inputs= to leaves"]),
    ("schema", 99, ["schema", "unsupported schema version 99"]),
    ("colour", "red", ["program", "unknown field(s) ['colour']"]),
    ("ops", {}, ["ops", "expected a list"]),
    ("ops.0.attrs", [1], ["ops[0].attrs", "expected an object"]),
    ("ops.0.extra", 1, ["ops[0]", "unknown field(s) ['extra']"]),
]


def _malformed_id(case: tuple) -> str:
    path, value, _ = case
    return f"{path}=" + ("<deleted>" if value is _DELETE else repr(value))


@pytest.mark.parametrize("path,value,fragments", MALFORMED, ids=[_malformed_id(m) for m in MALFORMED])
def test_malformed_programs_name_the_problem(path: str, value, fragments: list[str]) -> None:
    with pytest.raises(IRError) as info:
        Program.from_dict(_mutated(path, value))
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


def test_dtype_mismatch_is_named() -> None:
    data = _base()
    data["leaves"].append({"name": "x2", "shape": [3, 2], "dtype": "float64", "requires_grad": True})
    data["ops"].append({"name": "v3", "op": "mm", "inputs": ["v0", "x2"], "attrs": {}})
    data["roots"] = ["v3"]
    with pytest.raises(IRError, match=r"ops\[3\]: mm: dtype mismatch.*float32, float64"):
        Program.from_dict(data)


def test_root_that_does_not_require_grad_is_rejected() -> None:
    data = _base()
    for leaf in data["leaves"]:
        leaf["requires_grad"] = False
    with pytest.raises(IRError, match=r"roots\[0\]: root 'v2' does not require grad"):
        Program.from_dict(data)


def test_where_condition_does_not_carry_grad() -> None:
    p = Program(
        leaves=(Leaf("c", (3,), "float32", True), Leaf("a", (3,), "float32", False), Leaf("b", (3,), "float32", False)),
        ops=(Op("w", "where", ("c", "a", "b"), {}),),
        roots=("w",),
    )
    with pytest.raises(IRError, match="does not require grad"):
        validate(p)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("{", "invalid JSON at line 1"),
        ('{"schema": 1,}', "invalid JSON"),
        ("[]", "program: expected an object, got list"),
        ('{"schema": 1}', "missing field(s) ['leaves', 'ops', 'roots']"),
    ],
)
def test_bad_json_is_named(text: str, fragment: str) -> None:
    with pytest.raises(IRError) as info:
        Program.from_json(text)
    assert fragment in str(info.value)


def test_pruned_drops_dead_ops_and_unused_leaves() -> None:
    data = _base()
    data["leaves"].append({"name": "x9", "shape": [1], "dtype": "float64", "requires_grad": True})
    data["ops"].append({"name": "dead", "op": "sin", "inputs": ["x9"], "attrs": {}})
    p = Program.from_dict(data)
    q = p.pruned()
    assert [op.name for op in q.ops] == ["v0", "v1", "v2"]
    assert [leaf.name for leaf in q.leaves] == ["x0", "x1"]


# ------------------------------------------- tensor hooks on stale views
_STALE_VIEW_OPS = (
    Op("v0", "expand", ("x0",), {"shape": (1,)}),
    Op("v1", "cumsum", ("v0",), {"dim": 0}),
    Op("v2", "slice", ("v1",), {"dim": 0, "start": 0, "end": 1, "step": 1}),
    Op("v3", "mul_inplace", ("v1", "x1"), {}),
)


def _stale_view_program(hooks: tuple, ops: tuple = _STALE_VIEW_OPS) -> Program:
    return Program(
        leaves=(Leaf("x0", (), "float64", True), Leaf("x1", (), "float64", True)),
        ops=ops,
        roots=("v3", "v2"),
        loss="sum",
        hooks=hooks,
    )


def test_a_tensor_hook_on_a_view_made_before_an_in_place_write_is_rejected() -> None:
    """Found by campaign seed 51 (torch 2.14.1): the neighbour that added a
    tensor hook on ``v2`` crashed eager itself (see the canary below)."""
    from fuzz.ir import Hook

    with pytest.raises(IRError) as info:
        validate(_stale_view_program((Hook("h0", "tensor", "v2", "observe"),)))
    assert info.value.where == "hooks[0].target" and "SIGSEGV" in str(info.value)
    # the same view with a retain_grad, the base with a tensor hook, and a
    # view made after the write all stay valid (eager runs them)
    validate(_stale_view_program((Hook("h0", "retain_grad", "v2", "observe"), Hook("h1", "tensor", "v3", "observe"))))
    after = (*_STALE_VIEW_OPS[:2], _STALE_VIEW_OPS[3], Op("v2", "slice", ("v3",), {"dim": 0, "start": 0, "end": 1, "step": 1}))
    validate(_stale_view_program((Hook("h0", "tensor", "v2", "observe"),), after))


_STALE_VIEW_HOOK = """
import torch
x0 = torch.rand(1, dtype=torch.float64, requires_grad=True)
v1 = x0 * 1
v2 = v1[0:1]
v1.mul_(2.0)
v2.register_hook(lambda g: None)
"""


def test_canary_torch_crashes_on_a_tensor_hook_on_a_stale_view() -> None:
    """The torch bug the rule above avoids, in plain torch (no cagrad): a
    subprocess dies with SIGSEGV. When this fails, torch was fixed: limit
    the rule to the torch versions that crash (fuzz/ir_validate.py)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _STALE_VIEW_HOOK], capture_output=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr[-2000:])
    # reading the view's grad_fn first (which regenerates it) avoids the crash
    fixed = _STALE_VIEW_HOOK.replace("v2.register_hook", "v2.grad_fn\nv2.register_hook")
    assert subprocess.run([sys.executable, "-c", fixed], capture_output=True, timeout=120, check=False).returncode == 0
