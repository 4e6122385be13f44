"""The fuzzer's graph features (fuzz/ir_graph.py, fuzz/features_graph.py):
IR validation and JSON, each feature on a hand-written program under eager
and cagrad[eager], planted faults caught, reduction, neighbours, drawing,
and the reproducer."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings

from fuzz import features_graph
from fuzz.interpret import eager_grads
from fuzz.ir import Hook, IRError, Leaf, Op, Program
from fuzz.ir_graph import SUBCLASS_OPS, DoubleBackward, FuncTerm, program_features
from fuzz.neighbours import derive
from fuzz.oracle import Oracle
from fuzz.reduce import reduce_program
from fuzz.render import render_source
from fuzz.reproducer import write_reproducer
from fuzz.strategies import programs

HERE = Path(__file__).resolve().parent
PLANTED = str(HERE / "planted_graph_faults.py")
BROKEN = str(HERE / "broken_subject.py")

TWO_TENSOR, NO_TWO_TENSOR = features_graph.two_tensor_class()
needs_two_tensor = pytest.mark.skipif(TWO_TENSOR is None, reason=NO_TWO_TENSOR or "TwoTensor importable")


def _chain(*ops: Op, leaves=(Leaf("x0", (2, 3)), Leaf("x1", (3,))), roots=None, **fields) -> Program:
    return Program(tuple(leaves), tuple(ops), roots or (ops[-1].name,), **fields)


MUL_TANH = (Op("v0", "mul", ("x0", "x1")), Op("v1", "tanh", ("v0",)))

# one hand-written program per feature
FEATURES = {
    "func.grad": _chain(*MUL_TANH, func_terms=(FuncTerm("f0", "grad", "sin_mul", "v0"),)),
    "func.vjp": _chain(*MUL_TANH, func_terms=(FuncTerm("f0", "vjp", "tanh_sq", "v0"),)),
    "func.jacrev": _chain(*MUL_TANH, func_terms=(FuncTerm("f0", "jacrev", "sin_mul", "x1"),)),
    "func.vmap": _chain(*MUL_TANH, func_terms=(FuncTerm("f0", "vmap", "sin_mul", "v1"),)),
    "func.vmap_grad": _chain(*MUL_TANH, func_terms=(FuncTerm("f0", "vmap_grad", "tanh_sq", "v0"),)),
    "subclass.two_tensor": _chain(*MUL_TANH, subclass_leaves=("x0",)),
    "double_backward.square": _chain(*MUL_TANH, double_backward=DoubleBackward(("x0", "v0"), "square")),
    "double_backward.sum": _chain(
        *MUL_TANH, mode="grad", inputs=("x1",), loss="separate", double_backward=DoubleBackward(("x0",), "sum")
    ),
    "inner_grad.hook": _chain(*MUL_TANH, hooks=(Hook("h0", "tensor", "v0", "inner_grad"),)),
    "inner_grad.function": _chain(Op("v0", "fn_inner_grad", ("x0",)), Op("v1", "exp", ("v0",))),
    "root.single_output1": _chain(Op("v0", "var_mean", ("x0",), {"dim": 1}), roots=("v0:1",), loss="separate"),
    "root.output_nonzero": _chain(
        Op("v0", "mul_scalar", ("x0",), {"scalar": 2.0}),
        Op("v1", "unbind", ("v0",), {"dim": 1}),
        roots=("v1:1", "v1:2"),
        loss="separate",
    ),
    "root.nondiff_sibling": _chain(
        Op("v0", "topk", ("x0",), {"dim": 1, "k": 2}), Op("v1", "max_dim", ("x0",), {"dim": 0}),
        roots=("v0", "v1"), loss="separate",
    ),
}


@pytest.fixture(scope="module")
def cagrad_oracle() -> Oracle:
    return Oracle(["cagrad[eager]"], devices=["cpu"])


# ------------------------------------------------------------- IR
@pytest.mark.parametrize(
    ("change", "where", "words"),
    [
        ({"func_terms": (FuncTerm("f0", "hessian", "sin_mul", "v0"),)}, "func_terms[0].transform", "unknown transform"),
        ({"func_terms": (FuncTerm("f0", "grad", "cube", "v0"),)}, "func_terms[0].fn", "unknown function"),
        ({"func_terms": (FuncTerm("f0", "grad", "sin_mul", "v9"),)}, "func_terms[0].input", "unknown value"),
        ({"func_terms": (FuncTerm("v0", "grad", "sin_mul", "v0"),)}, "func_terms[0].name", "taken"),
        ({"func_terms": (FuncTerm("f0", "vmap", "sin_mul", "v2"),)}, "func_terms[0].input", "0-d"),
        ({"func_terms": (FuncTerm("f0", "jacrev", "sin_mul", "x2"),)}, "func_terms[0].input", "Jacobian"),
        ({"func_terms": (FuncTerm("f0", "grad", "sin_mul", "x3"),)}, "func_terms[0].input", "does not require grad"),
        ({"subclass_leaves": ("v0",)}, "subclass_leaves[0]", "is not a leaf"),
        ({"subclass_leaves": ("x0", "x0")}, "subclass_leaves[1]", "listed twice"),
        ({"subclass_leaves": ("x2",)}, "ops[3]", "prod reads a value computed from a subclass leaf"),
        ({"double_backward": DoubleBackward((), "square")}, "double_backward.inputs", "non-empty"),
        ({"double_backward": DoubleBackward(("x0", "x0"), "square")}, "double_backward.inputs", "duplicate"),
        ({"double_backward": DoubleBackward(("x3",), "square")}, "double_backward.inputs[0]", "does not require grad"),
        ({"double_backward": DoubleBackward(("x0",), "cube")}, "double_backward.penalty", "unknown penalty"),
        (
            {"double_backward": DoubleBackward(("x0",), "square"), "subclass_leaves": ("x0",)},
            "double_backward",
            "subclass",
        ),
    ],
)
def test_validation_names_the_field(change, where, words) -> None:
    base = Program(
        (Leaf("x0", (2, 3)), Leaf("x1", (3,)), Leaf("x2", (5, 4)), Leaf("x3", (3,), requires_grad=False)),
        (
            Op("v0", "mul", ("x0", "x1")),
            Op("v1", "mul", ("x1", "x3")),
            Op("v2", "sum", ("v0",), {"dim": None, "keepdim": False}),
            Op("v3", "prod", ("x2",), {"dim": None, "keepdim": False}),
        ),
        ("v0", "v1", "v2", "v3"),
    )
    base.infer()
    with pytest.raises(IRError) as info:
        dataclasses.replace(base, **change).infer()
    assert info.value.where == where
    assert words in info.value.message


def test_json_round_trip_and_unset_fields_are_not_written() -> None:
    plain = FEATURES["root.single_output1"]
    assert not {"func_terms", "subclass_leaves", "double_backward"} & set(plain.to_dict())
    both = dataclasses.replace(
        FEATURES["double_backward.square"],
        func_terms=(FuncTerm("f0", "vjp", "tanh_sq", "v1"),),
        hooks=(Hook("h0", "tensor", "v1", "inner_grad"),),
    )
    for program in [*FEATURES.values(), both]:
        assert Program.from_json(program.to_json()) == program
    data = json.loads(both.to_json())
    data["func_terms"][0]["extra"] = 1
    with pytest.raises(IRError, match=r"func_terms\[0\]: unknown field"):
        Program.from_dict(data)
    data = json.loads(both.to_json())
    del data["double_backward"]["inputs"]
    with pytest.raises(IRError, match="double_backward: missing field"):
        Program.from_dict(data)


def test_program_features_name_every_feature() -> None:
    for name, program in FEATURES.items():
        assert f"graph:{name}" in program_features(program), name
        assert f"graph:{name}" in program.features()
    # under loss "sum" a SumBackward0 is the root, not output 1
    assert not program_features(dataclasses.replace(FEATURES["root.single_output1"], loss="sum"))


# --------------------------------------------------- each feature runs
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_feature_agrees_under_cagrad_and_renders(name: str, cagrad_oracle: Oracle) -> None:
    program = FEATURES[name]
    if name.startswith("subclass") and TWO_TENSOR is None:
        pytest.skip(NO_TWO_TENSOR)
    verdict = cagrad_oracle.run(program)
    assert verdict.build_error is None
    assert verdict.ok, [o.describe() for o in verdict.report.failures()]
    (outcome,) = verdict.report.outcomes
    trace: list = []
    grads = eager_grads(program, trace=trace)
    # the feature ran where it should
    if name.startswith("func."):
        # the transform's own backward ran inside enable (vmap alone has none)
        assert outcome.fallback_reasons.get("functorch_transform", 0) == (name != "func.vmap")
    if name.startswith("double_backward"):
        assert [label for label, _ in trace] == ["double_backward grads", "double_backward requires_grad"]
        assert outcome.counts.get("captures") == 2  # create_graph backward and the one through it
    if name.startswith("subclass"):
        assert type(grads[0]) is TWO_TENSOR
    if name == "inner_grad.hook":
        assert [label for label, _ in trace] == ["h0 tensor v0"]
    # the plain-torch rendering computes what the interpreter does
    namespace: dict = {}
    exec(render_source(program), namespace)  # noqa: S102
    rendered_trace: list = []
    got = namespace["run"](trace=rendered_trace)
    assert repr(got) == repr(grads)
    assert repr(rendered_trace) == repr(trace)


def test_func_term_gradient_matches_an_independent_formula() -> None:
    # f0 = (g * g).sum() with g = d/dx sum(x sin x) = sin x + x cos x
    program = Program((Leaf("x0", (4,), "float64"),), (), ("x0",), func_terms=(FuncTerm("f0", "grad", "sin_mul", "x0"),))
    (grad,) = eager_grads(program)
    x = features_graph_leaf(program)
    g = x.sin() + x * x.cos()
    dg = 2 * x.cos() - x * x.sin()
    torch.testing.assert_close(grad, torch.ones_like(x) + 2 * g * dg)


def features_graph_leaf(program: Program) -> torch.Tensor:
    from fuzz.interpret import make_leaf

    return make_leaf(program.leaves[0], program.seed, "cpu").detach()


@pytest.mark.slow  # about 150 s: one Hypothesis search per op
@needs_two_tensor
def test_every_subclass_op_takes_a_two_tensor() -> None:
    """SUBCLASS_OPS is what eager supports: each op, drawn alone on a
    TwoTensor first input, runs forward and backward."""
    cfg = dict(max_ops=1, hooks=False, shapes=False, graph_features=False, prune=False, mixed_dtypes=False)
    for op in sorted(SUBCLASS_OPS):
        program = find(
            programs(ops=(op,), **cfg),
            lambda p, op=op: bool(p.ops) and p.ops[0].inputs[0] in {leaf.name for leaf in p.leaves},
            settings=settings(database=None, derandomize=True, max_examples=200),
        )
        program = dataclasses.replace(program, subclass_leaves=(program.ops[0].inputs[0],))
        program.infer()
        eager_grads(program)  # raises where the op does not take one


def test_no_two_tensor_means_no_subclass_leaves(monkeypatch) -> None:
    from fuzz import subclass_leaves

    for module in (features_graph, subclass_leaves):
        monkeypatch.setattr(module, "two_tensor_class", lambda: (None, "not shipped"))
    with pytest.raises(RuntimeError, match="not shipped"):
        eager_grads(FEATURES["subclass.two_tensor"])
    assert "two_tensor" not in subclass_leaves.available_kinds()

    @settings(max_examples=40, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(programs(max_ops=3, hooks=False, shapes=False, ops=("mul", "sin")))
    def never_drawn(program: Program) -> None:
        assert not program.subclass_leaves or program.subclass_kind != "two_tensor"

    never_drawn()


# ------------------------------------------------------ planted faults
def test_planted_create_graph_fault_is_caught_only_with_a_double_backward() -> None:
    oracle = Oracle(plugins=[f"{PLANTED}:DetachedCreateGraph"], devices=["cpu"])
    for name in ("double_backward.square", "double_backward.sum"):
        verdict = oracle.run(FEATURES[name])
        assert [k.status for k in verdict.keys] == ["mismatch"], name
    assert oracle.run(dataclasses.replace(FEATURES["double_backward.square"], double_backward=None)).ok


def test_planted_root_slot_fault_is_caught_only_at_outputs_above_zero() -> None:
    oracle = Oracle(plugins=[f"{PLANTED}:RootAtOutputZero"], devices=["cpu"])
    for name in ("root.single_output1", "root.output_nonzero"):
        verdict = oracle.run(FEATURES[name])
        assert [k.status for k in verdict.keys] == ["mismatch"], name
    assert oracle.run(dataclasses.replace(FEATURES["root.single_output1"], roots=("v0:0",))).ok


# ------------------------------------------------------------ reduction
def test_reduce_drops_features_the_failure_does_not_need() -> None:
    oracle = Oracle(plugins=[f"{BROKEN}:BrokenMulSubject"], devices=["cpu"])
    program = dataclasses.replace(
        FEATURES["double_backward.square"],
        func_terms=(FuncTerm("f0", "grad", "sin_mul", "v1"),),
        hooks=(Hook("h0", "tensor", "v0", "inner_grad"),),
    )
    assert not oracle.run(program).ok
    calls = iter(range(400))
    small, _ = reduce_program(program, lambda p: not oracle.run(p).ok, deadline=400, clock=lambda: next(calls))
    assert not program_features(small)
    assert "mul" in small.op_names()


def test_reduce_keeps_the_feature_the_failure_needs() -> None:
    oracle = Oracle(plugins=[f"{PLANTED}:RootAtOutputZero"], devices=["cpu"])
    program = dataclasses.replace(
        FEATURES["root.output_nonzero"], func_terms=(FuncTerm("f0", "grad", "sin_mul", "x1"),)
    )
    calls = iter(range(400))
    small, _ = reduce_program(program, lambda p: not oracle.run(p).ok, deadline=400, clock=lambda: next(calls))
    assert "graph:root.output_nonzero" in program_features(small)
    assert not small.func_terms


# ------------------------------------------------------------ neighbours
def test_neighbours_change_graph_features() -> None:
    program = dataclasses.replace(
        FEATURES["root.output_nonzero"],
        func_terms=(FuncTerm("f0", "grad", "sin_mul", "x0"),),
        double_backward=DoubleBackward(("x0",), "square"),
    )
    labels = [nb.label for nb in derive(program, 60) if nb.kind == "graph"]
    assert "func_terms[0].transform: grad -> vjp" in labels
    assert "double_backward.penalty: square -> sum" in labels
    assert "roots[0]: v1:1 -> v1:0" in labels


# --------------------------------------------------------------- drawing
@settings(max_examples=60, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(ops=("mul", "sin", "var_mean", "unbind", "topk", "fn_inner_grad"), hook_actions=("tensor.inner_grad",)))
def test_drawn_programs_are_valid_and_run(program: Program) -> None:
    program.infer()
    eager_grads(program)


@pytest.mark.slow  # about 90 s of generation
def test_every_feature_is_drawn_and_shrinks_off() -> None:
    """Each feature shows up within a bounded number of draws (derandomized),
    and the minimal program with ops only has none."""
    strategy = programs(ops=("mul", "sin", "var_mean", "unbind", "topk", "fn_inner_grad"))
    missing = {f"graph:{name}" for name in FEATURES}
    if TWO_TENSOR is None:
        missing.discard("graph:subclass.two_tensor")

    def covers(p: Program) -> bool:
        missing.difference_update(program_features(p))
        return not missing

    with pytest.raises(Exception):  # NoSuchExample: covers() never returned True, or found it
        find(strategy, lambda p: covers(p) and False, settings=settings(database=None, derandomize=True, max_examples=3000))
    assert not missing


# ------------------------------------------------------------ reproducer
def test_reproducer_runs_standalone_and_reproduces(tmp_path: Path) -> None:
    path = write_reproducer(
        tmp_path / "repro.py",
        FEATURES["double_backward.square"],
        subjects=[],
        plugins=[f"{PLANTED}:EagerDetachedCreateGraph"],  # no cagrad import in the fresh process
        devices=["cpu"],
    )
    # -S and only site-packages: the file finds fuzz through its PROJECT_ROOT
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p.endswith("site-packages"))
    proc = subprocess.run(
        [sys.executable, "-S", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "double backward" in path.read_text()


@pytest.mark.slow  # about 20 s of shrinking
def test_features_shrink_off() -> None:
    strategy = programs(ops=("mul", "sin", "var_mean", "unbind", "topk", "fn_inner_grad"))
    minimal = find(strategy, lambda p: len(p.ops) >= 2, settings=settings(database=None, derandomize=True))
    assert not program_features(minimal)
    assert not minimal.func_terms and minimal.double_backward is None and not minimal.subclass_leaves


@needs_two_tensor
def test_subclass_grads_compare_by_class_and_inner_tensors() -> None:
    from harness.compare import compare_tensor
    from harness.tolerance import tolerance_for

    a, b = torch.ones(3), torch.zeros(3)
    tol = lambda dtype: tolerance_for(dtype, None)  # noqa: E731
    assert compare_tensor(TWO_TENSOR(a, b), TWO_TENSOR(a.clone(), b.clone()), "g", tol) is None
    m = compare_tensor(TWO_TENSOR(a, b), TWO_TENSOR(a.clone(), b + 1), "g", tol)
    assert m is not None and m.where == "g.b"
    m = compare_tensor(TWO_TENSOR(a, b), a.clone(), "g", tol)
    assert m is not None and "class differs" in m.detail


def test_double_backward_gradient_matches_an_independent_formula() -> None:
    # loss (x * x).sum(), g = 2x, penalty (g * g).sum() = 4 x^2: grad 2x + 8x
    program = Program(
        (Leaf("x0", (3,), "float64"),),
        (Op("v0", "mul", ("x0", "x0")),),
        ("v0",),
        double_backward=DoubleBackward(("x0",), "square"),
    )
    (grad,) = eager_grads(program)
    torch.testing.assert_close(grad, 10 * features_graph_leaf(program))


# ------------------------------------------- with the training features
@pytest.mark.parametrize(
    "graph",
    [
        {"func_terms": (FuncTerm("f0", "grad", "sin_mul", "v0"),)},
        {"double_backward": DoubleBackward(("x0",), "square")},
        {"subclass_leaves": ("x0",)},
    ],
    ids=["func_terms", "double_backward", "subclass_leaves"],
)
@pytest.mark.parametrize("field", ["train", "checkpoint"])
def test_stage_features_do_not_go_with_training_features(graph, field) -> None:
    from fuzz.features_training import Checkpoint, Training

    training = {"train": Training(steps=2), "checkpoint": Checkpoint(("v1",), False, None)}[field]
    plain = _chain(*MUL_TANH, **{field: training})
    plain.infer()  # each is valid on its own
    _chain(*MUL_TANH, **graph).infer()
    with pytest.raises(IRError) as info:
        dataclasses.replace(plain, **graph).infer()
    assert info.value.where == field
    assert "cannot be combined with " + next(iter(graph)) in info.value.message


def test_roots_at_other_outputs_and_inner_grads_train() -> None:
    from fuzz.features_training import Training

    program = Program(
        (Leaf("x0", (4, 3), "float64"),),
        (Op("v0", "var_mean", ("x0",), {"dim": 0}), Op("v1", "fn_inner_grad", ("v0:1",))),
        ("v1", "v0:1"),
        loss="separate",
        hooks=(Hook("h0", "tensor", "v0:1", "inner_grad"),),
        train=Training(steps=2, optimizer="sgd", lr=0.1),
    )
    assert {"graph:root.output_nonzero", "graph:inner_grad.hook", "graph:inner_grad.function"} <= program_features(program)
    trace: list = []
    eager_grads(program, trace=trace)
    # both optimizer steps ran the inner-grad hook (its own torch.autograd.grad)
    steps = [label for label, _ in trace if label.startswith("train step ") and label.endswith(" x0")]
    assert steps == ["train step 1/2: x0", "train step 2/2: x0"]
    assert sum(1 for label, _ in trace if "h0" in str(label)) >= 2


def test_pruning_away_the_only_parameter_drops_train() -> None:
    from fuzz.features_training import Training

    # x1, the only parameter, feeds nothing: pruning removes it, and an
    # optimizer with no parameter is no training (validation rejects it)
    program = Program(
        (Leaf("x0", (3,)), Leaf("x1", (3,))),
        (Op("v0", "sin", ("x0",)),),
        ("v0",),
        train=Training(steps=1, fresh=("x0",)),
    )
    program.infer()
    pruned = program.pruned()
    assert [leaf.name for leaf in pruned.leaves] == ["x0"] and pruned.train is None
    pruned.infer()
