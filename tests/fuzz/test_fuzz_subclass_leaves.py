"""DTensor subclass leaves in fuzz programs (fuzz/subclass_leaves.py,
``subclass_kind`` of fuzz/ir_graph.py): a hand-written program under eager
and cagrad[eager], its reproducer run alone, the IR's JSON and validation,
drawn programs, each allowed op on a one-rank DTensor, and planted faults in
DTensor gradients caught by the oracle."""

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
from torch.torch_version import TorchVersion

from fuzz import features_graph, subclass_leaves
from fuzz.campaign.steer import round_test
from fuzz.interpret import eager_grads
from fuzz.ir import IRError, Leaf, Op, Program
from fuzz.ir_graph import DTENSOR_OPS, SUBCLASS_OPS, program_features, subclass_values
from fuzz.oracle import Oracle
from fuzz.reduce import reduce_program
from fuzz.render import render_source
from fuzz.reproducer import write_reproducer
from fuzz.strategies import GenConfig, programs
from tests.conftest import run_rendered_alone

HERE = Path(__file__).resolve().parent
DRAW = GenConfig(max_ops=4, hooks=False, shapes=False, ops=("mul", "sin", "tanh", "sum", "matmul", "unbind"))
PLANTED = str(HERE / "planted_graph_faults.py")
HAS_DTENSOR, NO_DTENSOR = subclass_leaves.dtensor_support()
needs_dtensor = pytest.mark.skipif(not HAS_DTENSOR, reason=NO_DTENSOR or "DTensor available")

# seed 5 places x0 as Shard(0) and x1 as Replicate() (fuzz.subclass_leaves.placement_expr)
PROGRAM = Program(
    (Leaf("x0", (4, 3)), Leaf("x1", (3, 5)), Leaf("x2", (3,))),
    (
        Op("v0", "sin", ("x0",)),
        Op("v1", "mul", ("v0", "x0")),
        Op("v2", "matmul", ("v1", "x1")),
        Op("v3", "tanh", ("v2",)),
        Op("v4", "mul", ("x2", "x2")),  # a plain leaf beside the DTensor ones (no root: its .grad is None)
    ),
    ("v3",),
    seed=5,
    subclass_leaves=("x0", "x1"),
    subclass_kind="dtensor",
)


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    """Destroys at the end the one-rank group these tests made (where none
    ran before), so later tests of the process may make their own."""
    if not HAS_DTENSOR:
        yield
        return
    import torch.distributed as dist

    before = dist.is_initialized()
    yield
    if not before and dist.is_initialized():
        dist.destroy_process_group()


def _local_values(grads) -> list:
    """Each grad as ``(class name, placements, local values)`` (None stays None)."""
    out = []
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        out.append(None if g is None else (type(g).__name__, str(getattr(g, "placements", "")), local.tolist()))
    return out


# ------------------------------------------------------------------ IR
def test_json_round_trip_and_old_json_means_two_tensor() -> None:
    assert Program.from_json(PROGRAM.to_json()) == PROGRAM
    assert json.loads(PROGRAM.to_json())["subclass_kind"] == "dtensor"
    two = dataclasses.replace(
        PROGRAM, subclass_leaves=("x0",), subclass_kind="two_tensor", ops=PROGRAM.ops[:2], roots=("v1",)
    )
    data = json.loads(two.to_json())
    assert "subclass_kind" not in data  # the default is not written
    assert Program.from_dict(data).subclass_kind == "two_tensor"
    # a program written before the field existed
    old = {
        "schema": 2,
        "leaves": [{"name": "x0", "shape": [2, 3]}],
        "ops": [{"name": "v0", "op": "sin", "inputs": ["x0"]}],
        "roots": ["v0"],
        "subclass_leaves": ["x0"],
    }
    loaded = Program.from_dict(old)
    assert loaded.subclass_kind == "two_tensor"
    assert "graph:subclass.two_tensor" in program_features(loaded)
    assert "graph:subclass.dtensor" in program_features(PROGRAM)


@pytest.mark.parametrize(
    ("change", "where", "words"),
    [
        ({"subclass_kind": "jagged2"}, "subclass_kind", "unknown subclass kind 'jagged2'"),
        ({"subclass_kind": 3}, "subclass_kind", "expected a string"),
        ({"subclass_leaves": [], "subclass_kind": "dtensor"}, "subclass_kind", "no subclass_leaves"),
        ({"subclass_leaves": ["x0"]}, "ops[2]", "mixes DTensor values with plain tensor(s) ['x1']"),
        ({"loss": "separate"}, "loss", "loss 'separate'"),
        ({"roots": ["v3", "v4"]}, "roots", "['v4'] plain tensors"),
    ],
)
def test_bad_kinds_and_uses_name_the_field(change, where, words) -> None:
    data = {**json.loads(PROGRAM.to_json()), **change}
    with pytest.raises(IRError) as info:
        Program.from_dict(data)
    assert info.value.where == where
    assert words in info.value.message


def test_unbind_of_a_dtensor_is_rejected() -> None:
    program = Program((Leaf("x0", (2, 3)),), (Op("v0", "unbind", ("x0",), {"dim": 0}),), ("v0:0",),
                      subclass_leaves=("x0",), subclass_kind="dtensor")
    dataclasses.replace(program, subclass_kind="two_tensor").infer()
    with pytest.raises(IRError, match=r"SUBCLASS_KIND_OPS\['dtensor'\]") as info:
        program.infer()
    assert info.value.where == "ops[0]"
    assert DTENSOR_OPS == SUBCLASS_OPS - {"unbind"}


def test_dtensor_leaves_close_over_the_leaves_they_meet() -> None:
    plain = dataclasses.replace(PROGRAM, subclass_leaves=(), subclass_kind="two_tensor")
    assert features_graph.dtensor_leaves(plain, "x0") == ("x0", "x1")
    assert features_graph.dtensor_leaves(plain, "x2") == ("x2",)
    # the loss sums the roots: a plain root's leaves become DTensor leaves too
    both = dataclasses.replace(plain, roots=("v3", "v4"))
    assert features_graph.dtensor_leaves(both, "x0") == ("x0", "x1", "x2")
    unbind = dataclasses.replace(both, ops=(*both.ops, Op("v5", "unbind", ("x2",), {"dim": 0})))
    assert features_graph.dtensor_leaves(unbind, "x2") is None  # DTensor refuses unbind


# -------------------------------------------------------------- running
@needs_dtensor
def test_dtensor_program_is_equal_under_eager_and_cagrad() -> None:
    verdict = Oracle(["eager", "cagrad[eager]"], devices=["cpu"]).run(PROGRAM)
    assert verdict.build_error is None
    assert verdict.ok, [o.describe() for o in verdict.report.failures()]
    assert [o.status.value for o in verdict.report.outcomes] == ["equal", "equal"]
    cagrad_outcome = verdict.report.outcomes[1]
    assert cagrad_outcome.counts.get("captures") == 1 and not cagrad_outcome.fallback_reasons
    grads = eager_grads(PROGRAM)
    from torch.distributed.tensor import DTensor, Shard

    assert [type(g) for g in grads[:2]] == [DTensor, DTensor] and grads[2] is None
    # x1 (Replicate()) gets the matmul's Partial(sum) grad, as eager makes it;
    # x0's keeps its Shard(0) from torch 2.13 (2.11's sharding propagation
    # gives it Replicate(): seen on the H200's torch 2.11, eager and cagrad alike)
    assert grads[1].placements[0].is_partial()
    if TorchVersion(torch.__version__) >= "2.13":
        assert grads[0].placements == (Shard(0),)


@needs_dtensor
def test_rendered_code_alone_computes_the_interpreters_grads(tmp_path: Path) -> None:
    source = render_source(PROGRAM)
    assert "distribute_tensor(x0.detach(), one_rank_mesh(x0.device.type), [Shard(0)])" in source
    assert "x2 = distribute_tensor" not in source
    expected = _local_values(eager_grads(PROGRAM))
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102
    assert _local_values(namespace["run"]()) == expected
    # in a fresh process: the printed code makes its own process group
    got = run_rendered_alone(
        tmp_path, source,
        "[None if g is None else [type(g).__name__, str(getattr(g, 'placements', '')), "
        "(g.to_local() if hasattr(g, 'to_local') else g).tolist()] for g in gs]",
    )
    assert got == json.loads(json.dumps(expected))


@needs_dtensor
@pytest.mark.parametrize(("plugin", "code"), [(None, 0), ("ScaledDTensorGrad", 1)])
def test_reproducer_file_reproduces_the_verdict(tmp_path: Path, plugin, code) -> None:
    if plugin is None:
        kwargs = {"subjects": ["cagrad[eager]"], "plugins": []}
    else:
        kwargs = {"subjects": [], "plugins": [f"{PLANTED}:{plugin}"]}
    path = write_reproducer(tmp_path / "repro.py", PROGRAM, devices=["cpu"], **kwargs)
    assert "distribute_tensor" in path.read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == code, proc.stdout + proc.stderr


# ------------------------------------------------------- planted faults
def _first_unreplicated_grad() -> str:
    """Where ReplicatedDTensorGrad first shows: the first leaf whose eager
    grad is a DTensor not already Replicate() (which leaf depends on the
    torch's sharding propagation)."""
    from torch.distributed.tensor import DTensor, Replicate

    for i, g in enumerate(eager_grads(PROGRAM)):
        if isinstance(g, DTensor) and g.placements != (Replicate(),):
            return f"leaf {i} .grad"
    raise AssertionError("every DTensor grad of PROGRAM is replicated: the planted fault cannot show")


@needs_dtensor
@pytest.mark.parametrize(
    ("plugin", "where", "words"),
    [
        ("ScaledDTensorGrad", "leaf 0 .grad._local_tensor", ""),
        ("ReplicatedDTensorGrad", None, "placements differ"),
    ],
)
def test_planted_dtensor_grad_faults_are_caught(plugin, where, words) -> None:
    where = where or _first_unreplicated_grad()
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
    # and the reducer keeps the DTensor leaf the failure needs
    calls = iter(range(300))
    small, _ = reduce_program(PROGRAM, lambda p: not oracle.run(p).ok, deadline=300, clock=lambda: next(calls))
    assert small.subclass_kind == "dtensor" and small.subclass_leaves


# --------------------------------------------------------------- drawing
def test_drawn_batch_has_dtensor_programs_and_all_validate() -> None:
    # a campaign round's test (seeded, no constants drawn from loaded
    # modules): the same programs whatever the tests run before
    drawn: list[Program] = []
    round_test(DRAW, 7, 1000, drawn.append)()
    kinds = [p.subclass_kind for p in drawn if p.subclass_leaves]
    if HAS_DTENSOR:
        assert "dtensor" in kinds and "two_tensor" in kinds, kinds
    else:
        assert "dtensor" not in kinds
    for program in drawn:
        Program.from_json(program.to_json())  # validates, round trips
        if program.subclass_kind == "dtensor":
            dtensors = subclass_values(program)
            assert program.loss == "sum" or not {r.split(":")[0] for r in program.roots} & dtensors
            assert "unbind" not in {op.op for op in program.ops if op.name in dtensors}
            eager_grads(program)


def test_no_dtensor_means_no_dtensor_leaves(monkeypatch) -> None:
    def missing(kind: str) -> tuple[bool, str]:
        return (False, "not shipped") if kind == "dtensor" else (True, "")

    monkeypatch.setattr(features_graph, "kind_available", missing)
    monkeypatch.setattr(subclass_leaves, "dtensor_support", lambda: (False, "not shipped"))
    with pytest.raises(RuntimeError, match="dtensor subclass leaves.*not shipped"):
        eager_grads(PROGRAM)
    assert "subclass.dtensor" not in subclass_leaves.available_kinds()

    drawn: list[Program] = []
    round_test(DRAW, 7, 1000, drawn.append)()
    assert {p.subclass_kind for p in drawn if p.subclass_leaves} == {"two_tensor"}


def test_kind_shrinks_to_two_tensor() -> None:
    if subclass_leaves.two_tensor_class()[0] is None:
        pytest.skip("torch ships no TwoTensor: the only kind left is dtensor")
    strategy = programs(max_ops=3, hooks=False, shapes=False, ops=("mul", "sin", "tanh"))
    config = settings(max_examples=2000, derandomize=True, database=None)
    minimal = find(strategy, lambda p: bool(p.subclass_leaves), settings=config)
    assert minimal.subclass_kind == "two_tensor"


# ------------------------------------------------------- each op, eager
@pytest.mark.slow  # about 60 s: one Hypothesis search per op
@needs_dtensor
def test_every_dtensor_op_takes_a_dtensor_replicated_or_sharded(monkeypatch) -> None:
    """DTENSOR_OPS is what eager supports: each op on a DTensor first input
    of rank >= 2 (its other inputs DTensors too), each placement of the
    leaves in turn, runs forward and backward."""
    cfg = {"max_ops": 1, "hooks": False, "shapes": False, "graph_features": False, "prune": False}
    cfg["mixed_dtypes"] = False
    for op in sorted(DTENSOR_OPS):
        program = find(
            programs(ops=(op,), **cfg),
            lambda p: bool(p.ops) and p.ops[0].inputs[0] in {leaf.name for leaf in p.leaves}
            and len(p.leaves[0].shape) >= 2 and min(p.leaves[0].shape) >= 2,
            settings=settings(max_examples=300, derandomize=True, database=None),
        )
        leaves = features_graph.dtensor_leaves(program, program.ops[0].inputs[0])
        program = dataclasses.replace(program, subclass_leaves=leaves, subclass_kind="dtensor", loss="sum")
        program.infer()
        for choice in ("Replicate()", "Shard(0)", "Shard(1)"):
            monkeypatch.setattr(
                subclass_leaves, "placement_expr", lambda seed, name, rank, c=choice: c if rank >= 2 else "Replicate()"
            )
            eager_grads(program)  # raises where the op does not take one
