"""Jagged nested tensor subclass leaves in fuzz programs
(fuzz/subclass_leaves.py, ``subclass_kind: "jagged"`` of fuzz/ir_graph.py):
hand-written programs under eager and every cagrad subject, their
reproducer run alone, the IR's JSON and validation, drawn programs, each
op of ``JAGGED_OPS`` on a jagged leaf, and planted faults in jagged
gradients caught by the oracle.

The planted faults ``ScaledJaggedGrad`` and ``ReoffsetJaggedGrad`` are
subjects of tests/fuzz/planted_graph_faults.py (loaded as
``--plugin tests/fuzz/planted_graph_faults.py:NAME``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import find, settings

from fuzz import features_graph, subclass_leaves
from fuzz.campaign.steer import round_test
from fuzz.interpret import eager_grads, run_forward
from fuzz.ir import IRError, Leaf, Op, Program
from fuzz.ir_graph import (
    JAGGED_OPS,
    JAGGED_REDUCTIONS,
    SUBCLASS_OPS,
    program_features,
    subclass_values,
)
from fuzz.oracle import Oracle
from fuzz.reduce import reduce_program
from fuzz.render import render_source
from fuzz.reproducer import write_reproducer
from fuzz.strategies import GenConfig, programs
from tests.conftest import run_rendered_alone

HERE = Path(__file__).resolve()
PLANTED = str(HERE.parent / "planted_graph_faults.py")
# a jagged leaf validates rarely (rank >= 3, full reductions only, loss "sum"):
# this config's round 10 draws three
DRAW = GenConfig(max_ops=4, hooks=False, shapes=False, ops=("mul", "sin", "tanh", "mean", "exp"))
HAS_JAGGED, NO_JAGGED = subclass_leaves.jagged_support()
needs_jagged = pytest.mark.skipif(not HAS_JAGGED, reason=NO_JAGGED or "jagged nested tensors available")
CAGRAD_CPU = ["cagrad[eager]", "cagrad[aot_eager]"]

# seed 5 splits x0 (2 x 3 rows) into components of 4 and 2 rows
# (fuzz.subclass_leaves.jagged_lengths): offsets [0, 4, 6]
PROGRAM = Program(
    (Leaf("x0", (2, 3, 4)), Leaf("x2", (3,))),
    (
        Op("v0", "sin", ("x0",)),
        Op("v1", "mul", ("v0", "x0")),
        Op("v2", "tanh", ("v1",)),
        Op("v3", "mean", ("v2",), {"dim": None, "keepdim": False}),
        Op("v4", "mul", ("x2", "x2")),  # a plain leaf beside the jagged one, a root too
    ),
    ("v2", "v3", "v4"),
    seed=5,
    subclass_leaves=("x0",),
    subclass_kind="jagged",
)
# matmul by a plain weight: cagrad runs a node as it is there, so the
# backward falls back (tensor_subclass), eager's grads all the same
MATMUL = Program(
    (Leaf("x0", (3, 2, 4), "float64"), Leaf("x1", (4, 5), "float64")),
    (Op("v0", "matmul", ("x0", "x1")), Op("v1", "sigmoid", ("v0",))),
    ("v1",),
    seed=11,
    subclass_leaves=("x0",),
    subclass_kind="jagged",
)


def _grads_as_lists(grads) -> list:
    """Each grad as ``(class name, offsets, values)`` (None stays None)."""
    out = []
    for g in grads:
        if g is None:
            out.append(None)
        elif g.layout == torch.jagged:
            out.append([type(g).__name__, g.offsets().tolist(), g.values().tolist()])
        else:
            out.append([type(g).__name__, None, g.tolist()])
    return out


# ------------------------------------------------------------------ IR
def test_json_round_trip_and_features() -> None:
    assert Program.from_json(PROGRAM.to_json()) == PROGRAM
    assert json.loads(PROGRAM.to_json())["subclass_kind"] == "jagged"
    assert "graph:subclass.jagged" in program_features(PROGRAM)
    assert JAGGED_OPS <= SUBCLASS_OPS and "jagged" in subclass_leaves.available_kinds() or not HAS_JAGGED


def test_lengths_come_from_the_seed_and_name_and_differ() -> None:
    assert subclass_leaves.jagged_lengths(5, "x0", (2, 3, 4)) == [4, 2]
    assert subclass_leaves.offsets_expr(5, "x0", (2, 3, 4)) == "[0, 4, 6]"
    for seed in range(40):
        for shape in ((2, 2, 1), (3, 4, 2), (4, 3, 2, 2)):
            lengths = subclass_leaves.jagged_lengths(seed, "x1", shape)
            assert len(lengths) == shape[0] and sum(lengths) == shape[0] * shape[1]
            assert min(lengths) >= 1 and len(set(lengths)) > 1
    with pytest.raises(ValueError, match=r"\(B, L, \*rest\)"):
        subclass_leaves.jagged_lengths(5, "x0", (2, 3))
    assert subclass_leaves.offsets_expr(5, "x0", (1, 3, 2)) == ""


@pytest.mark.parametrize(
    ("change", "where", "words"),
    [
        ({"ops": [{"name": "v0", "op": "cumsum", "inputs": ["x0"], "attrs": {"dim": 2}}], "roots": ["v0"]},
         "ops[0]", "SUBCLASS_KIND_OPS['jagged']"),
        ({"ops": [{"name": "v0", "op": "maximum", "inputs": ["x0", "x0"]}], "roots": ["v0"]},
         "ops[0]", "not among the ops that take a jagged"),
        ({"ops": [{"name": "v0", "op": "sum", "inputs": ["x0"], "attrs": {"dim": [2], "keepdim": False}}],
          "roots": ["v0"]}, "ops[0]", "only a full reduction"),
        ({"leaves": [{"name": "x0", "shape": [2, 3, 4]}, {"name": "x1", "shape": [2, 3, 4]}],
          "ops": [{"name": "v0", "op": "mul", "inputs": ["x0", "x1"]}], "roots": ["v0"]},
         "ops[0]", "mixes jagged values with plain tensor(s) ['x1']"),
        ({"leaves": [{"name": "x0", "shape": [2, 3, 4]}, {"name": "x1", "shape": [2, 4, 5]}],
          "ops": [{"name": "v0", "op": "matmul", "inputs": ["x0", "x1"]}], "roots": ["v0"]},
         "ops[0]", "plain 2-d leaf as its second"),
        ({"loss": "separate"}, "loss", "loss 'separate'"),
        ({"repeat": 2, "retain_graph": True}, "repeat", "second accumulation into a jagged .grad"),
        ({"leaves": [{"name": "x0", "shape": [1, 3, 4]}, {"name": "x2", "shape": [3]}]},
         "subclass_leaves[0]", "B, L >= 2"),
        ({"leaves": [{"name": "x0", "shape": [6, 4]}, {"name": "x2", "shape": [3]}]},
         "subclass_leaves[0]", "needs (B, L, *rest)"),
        ({"subclass_leaves": ["x0", "x2"]}, "subclass_leaves", "one per program"),
        ({"subclass_leaves": []}, "subclass_kind", "no subclass_leaves"),
    ],
)
def test_bad_jagged_programs_name_the_field(change, where, words) -> None:
    data = {**json.loads(PROGRAM.to_json()), **change}
    with pytest.raises(IRError) as info:
        Program.from_dict(data)
    assert info.value.where == where, info.value
    assert words in info.value.message, info.value.message
    # the same program with a TwoTensor leaf is valid where only the jagged rules reject it
    if where == "ops[0]" and "SUBCLASS_KIND_OPS" not in words and "not among" not in words:
        Program.from_dict({**data, "subclass_kind": "two_tensor"})


# -------------------------------------------------------------- running
@needs_jagged
def test_jagged_program_is_equal_under_eager_and_every_cagrad_subject() -> None:
    verdict = Oracle(["eager", *CAGRAD_CPU], devices=["cpu"]).run(PROGRAM)
    assert verdict.build_error is None
    assert verdict.ok, [o.describe() for o in verdict.report.failures()]
    assert [o.status.value for o in verdict.report.outcomes] == ["equal", "equal", "equal"]
    for outcome in verdict.report.outcomes[1:]:
        assert outcome.counts.get("captures") == 1 and not outcome.fallback_reasons
    grads = eager_grads(PROGRAM)
    assert grads[0].layout == torch.jagged and grads[0].offsets().tolist() == [0, 4, 6]
    assert grads[1].layout == torch.strided and grads[1].shape == (3,)


@needs_jagged
def test_matmul_by_a_plain_weight_falls_back_with_eagers_grads() -> None:
    verdict = Oracle(["eager", *CAGRAD_CPU], devices=["cpu"]).run(MATMUL)
    assert verdict.ok, [o.describe() for o in verdict.report.failures()]
    assert {o.status.value for o in verdict.report.outcomes[1:]} <= {"equal", "fallback"}
    grads = eager_grads(MATMUL)
    assert grads[0].layout == torch.jagged and grads[1].shape == (4, 5)


@needs_jagged
def test_the_leaf_is_the_seeded_values_split_by_the_offsets() -> None:
    values = run_forward(PROGRAM)
    x0 = values["x0"]
    assert x0.layout == torch.jagged and x0.is_leaf and x0.requires_grad
    assert x0.offsets().tolist() == [0, 4, 6] and x0.shape[0] == 2 and x0.shape[2] == 4
    plain = run_forward(dataclasses.replace(PROGRAM, subclass_leaves=(), subclass_kind="two_tensor"))["x0"]
    assert torch.equal(x0.values(), plain.detach().flatten(0, 1))


@needs_jagged
def test_rendered_code_alone_builds_the_leaf_and_computes_the_grads(tmp_path: Path) -> None:
    source = render_source(PROGRAM)
    assert (
        "x0 = torch.nested.nested_tensor_from_jagged(x0.detach().flatten(0, 1), "
        "offsets=torch.tensor([0, 4, 6], device=x0.device)).requires_grad_(True)"
    ) in source
    assert "x2 = torch.nested" not in source
    expected = _grads_as_lists(eager_grads(PROGRAM))
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102
    assert _grads_as_lists(namespace["run"]()) == expected
    got = run_rendered_alone(
        tmp_path, source,
        "[None if g is None else [type(g).__name__, g.offsets().tolist(), g.values().tolist()] "
        "if g.is_nested else [type(g).__name__, None, g.tolist()] for g in gs]",
    )
    assert got == json.loads(json.dumps(expected))


@needs_jagged
@pytest.mark.parametrize(("plugin", "code"), [(None, 0), ("ScaledJaggedGrad", 1), ("ReoffsetJaggedGrad", 1)])
def test_reproducer_file_reproduces_the_verdict(tmp_path: Path, plugin, code) -> None:
    if plugin is None:
        kwargs = {"subjects": CAGRAD_CPU, "plugins": []}
    else:
        kwargs = {"subjects": [], "plugins": [f"{PLANTED}:{plugin}"]}
    path = write_reproducer(tmp_path / "repro.py", PROGRAM, devices=["cpu"], **kwargs)
    assert "nested_tensor_from_jagged" in path.read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == code, proc.stdout + proc.stderr


# ------------------------------------------------------- planted faults
@needs_jagged
@pytest.mark.parametrize(
    ("plugin", "where", "words"),
    [
        ("ScaledJaggedGrad", "leaf 0 .grad.values()", ""),
        ("ReoffsetJaggedGrad", "leaf 0 .grad.offsets()", "offsets differ: eager [0, 4, 6]"),
    ],
)
def test_planted_jagged_grad_faults_are_caught(plugin, where, words) -> None:
    oracle = Oracle(plugins=[f"{PLANTED}:{plugin}"], devices=["cpu"])
    verdict = oracle.run(PROGRAM)
    assert [k.status for k in verdict.keys] == ["mismatch"]
    (outcome,) = verdict.report.failures()
    first = outcome.mismatches[0]
    assert first.where == where, first
    assert words in first.detail
    # the same program with plain leaves: nothing to see
    plain = dataclasses.replace(PROGRAM, subclass_leaves=(), subclass_kind="two_tensor")
    assert oracle.run(plain).ok
    # and the reducer keeps the jagged leaf the failure needs
    calls = iter(range(300))
    small, _ = reduce_program(PROGRAM, lambda p: not oracle.run(p).ok, deadline=300, clock=lambda: next(calls))
    assert small.subclass_kind == "jagged" and small.subclass_leaves == ("x0",)
    assert len(small.ops) < len(PROGRAM.ops)


def test_a_grad_of_another_layout_or_offsets_is_a_mismatch() -> None:
    from harness.compare import compare_tensor
    from harness.tolerance import tolerance_for

    if not HAS_JAGGED:
        pytest.skip(NO_JAGGED)
    values = torch.arange(12.0).reshape(6, 2)
    eager = torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, 4, 6]))
    same = torch.nested.nested_tensor_from_jagged(values.clone(), offsets=torch.tensor([0, 4, 6]))
    other = torch.nested.nested_tensor_from_jagged(values.clone(), offsets=torch.tensor([0, 3, 6]))
    assert compare_tensor(eager, same, "g", tolerance_for) is None
    assert compare_tensor(eager, other, "g", tolerance_for).where == "g.offsets()"
    dense = compare_tensor(eager, values.reshape(2, 3, 2), "g", tolerance_for)
    assert dense is not None and "class differs" in dense.detail
    moved = compare_tensor(eager, torch.nested.nested_tensor_from_jagged(values + 1, offsets=eager.offsets()), "g",
                           tolerance_for)
    assert moved is not None and moved.where == "g.values()"


# --------------------------------------------------------------- drawing
def test_drawn_batch_has_jagged_programs_and_all_validate() -> None:
    drawn: list[Program] = []
    round_test(DRAW, 10, 1000, drawn.append)()
    kinds = [p.subclass_kind for p in drawn if p.subclass_leaves]
    if HAS_JAGGED:
        assert "jagged" in kinds and "two_tensor" in kinds, kinds
    else:
        assert "jagged" not in kinds
    for program in drawn:
        Program.from_json(program.to_json())  # validates, round trips
        if program.subclass_kind == "jagged":
            jagged = subclass_values(program)
            assert {op.op for op in program.ops if op.name in jagged} <= JAGGED_OPS
            assert program.loss == "sum" or not {r.split(":")[0] for r in program.roots} & jagged
            grads = eager_grads(program)
            assert grads[[leaf.name for leaf in program.leaves].index(program.subclass_leaves[0])].is_nested


def test_no_jagged_means_no_jagged_leaves(monkeypatch) -> None:
    def missing(kind: str) -> tuple[bool, str]:
        return (False, "not shipped") if kind == "jagged" else (True, "")

    monkeypatch.setattr(features_graph, "kind_available", missing)
    monkeypatch.setattr(subclass_leaves, "jagged_support", lambda: (False, "not shipped"))
    with pytest.raises(RuntimeError, match="jagged subclass leaves.*not shipped"):
        eager_grads(PROGRAM)
    assert "jagged" not in subclass_leaves.available_kinds()

    drawn: list[Program] = []
    round_test(DRAW, 10, 1000, drawn.append)()
    assert "jagged" not in {p.subclass_kind for p in drawn if p.subclass_leaves}


def test_jagged_kind_shrinks_to_two_tensor() -> None:
    if subclass_leaves.two_tensor_class()[0] is None:
        pytest.skip("torch ships no TwoTensor")
    candidates = list(features_graph.reduce_candidates(PROGRAM))
    assert dataclasses.replace(PROGRAM, subclass_kind="two_tensor") in candidates
    assert features_graph.weight(PROGRAM) == 2
    strategy = programs(max_ops=3, hooks=False, shapes=False, ops=("mul", "sin", "tanh"))
    config = settings(max_examples=2000, derandomize=True, database=None)
    minimal = find(strategy, lambda p: bool(p.subclass_leaves), settings=config)
    assert minimal.subclass_kind == "two_tensor"


# ------------------------------------------------- each op, eager and cagrad
def _op_program(op: str, dtype: str) -> Program:
    """A program where ``op`` reads the jagged leaf ``x0`` (or ``sin(x0)``
    beside it, for an op of two inputs), as the rules of JAGGED_OPS allow."""
    leaves: tuple[Leaf, ...] = (Leaf("x0", (3, 2, 4), dtype),)
    attrs = {
        "pow": {"exponent": 3}, "mul_scalar": {"scalar": 1.5}, "add_scalar": {"scalar": -0.25},
        "clamp": {"min": -0.5, "max": 0.5}, "fn_sin_scale": {"scale": 0.5},
    }.get(op, {})
    ops: tuple[Op, ...]
    if op in JAGGED_REDUCTIONS:
        ops = (Op("v0", "sin", ("x0",)), Op("v1", op, ("v0",), {"dim": None, "keepdim": True}))
    elif op == "matmul":
        leaves += (Leaf("x1", (4, 3), dtype),)
        ops = (Op("v0", "matmul", ("x0", "x1")), Op("v1", "mul", ("v0", "v0")))
    elif op in ("add", "sub", "mul", "div"):
        ops = (Op("v0", "sin", ("x0",)), Op("v1", op, ("v0", "x0")))
    else:
        ops = (Op("v0", op, ("x0",), attrs), Op("v1", "mul", ("v0", "x0")))
    return Program(leaves, ops, ("v1",), seed=3, subclass_leaves=("x0",), subclass_kind="jagged")


@needs_jagged
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_jagged_op_is_equal_under_eager_and_cagrad(dtype) -> None:
    """JAGGED_OPS is what eager and cagrad support: each op on the jagged
    leaf runs forward and backward, a jagged .grad of the leaf's offsets,
    and every cagrad subject agrees with eager (or falls back to it)."""
    oracle = Oracle(["eager", *CAGRAD_CPU], devices=["cpu"])
    failed = {}
    for op in sorted(JAGGED_OPS):
        program = _op_program(op, dtype)
        program.infer()
        grads = eager_grads(program)
        offsets = json.loads(subclass_leaves.offsets_expr(program.seed, "x0", program.leaves[0].shape))
        assert grads[0].layout == torch.jagged and grads[0].offsets().tolist() == offsets, op
        verdict = oracle.run(program)
        if not verdict.ok or verdict.build_error is not None:
            failed[op] = [o.describe() for o in verdict.report.failures()] or verdict.build_error
    assert not failed, failed
