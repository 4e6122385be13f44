"""Programs that train: optimizer steps, random ops, checkpoint regions and
ops whose values decide sizes (fuzz.features_training, fuzz.ops_dynamic).

Every differential check compares with eager autograd run by the harness;
the planted subjects (training_subjects.py) prove each check can fail."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.features_training import Checkpoint, Training, program_features
from fuzz.interpret import build_run
from fuzz.ir import IRError, Leaf, Op, Program, validate
from fuzz.neighbours import derive
from fuzz.oracle import Oracle, failure_key
from fuzz.reduce import reduce_program
from fuzz.render import render_source
from fuzz.reproducer import write_reproducer
from fuzz.strategies import programs
from fuzz.training_gen import draw_features
from harness.devices import seeded
from harness.program import run_backward
from tests.conftest import examples

HERE = Path(__file__).resolve().parent
PLANTED = HERE / "training_subjects.py"


def _mlp(**changes) -> Program:
    """x[4, 3] data (no grad), w1[3, 3], w2[3, 2] parameters: a two-layer
    net with a dropout between the layers."""
    p = Program(
        leaves=(Leaf("x", (4, 3), "float32", False), Leaf("w1", (3, 3)), Leaf("w2", (3, 2))),
        ops=(
            Op("h", "matmul", ("x", "w1")),
            Op("a", "tanh", ("h",)),
            Op("d", "dropout", ("a",), {"p": 0.5}),
            Op("y", "matmul", ("d", "w2")),
            Op("z", "sin", ("y",)),
        ),
        roots=("z",),
        seed=5,
        train=Training(steps=2, optimizer="adam", foreach=True, set_to_none=False, fresh=("x",)),
    )
    return dataclasses.replace(p, **changes)


def _moe(**changes) -> Program:
    """Tokens x[5, 3] through a top-1 router to 4 experts, then nonzero and
    masked_select ops: sizes decided by the values at every step."""
    p = Program(
        leaves=(Leaf("x", (5, 3), "float64", False), Leaf("r", (3, 4), "float64"), Leaf("e", (4, 3, 3), "float64")),
        ops=(
            Op("m", "moe", ("x", "r", "e"), {"top_k": 1}),
            Op("n", "nonzero_scatter", ("m",), {"threshold": 0.0}),
            Op("s", "masked_select_scatter", ("n",), {"threshold": 0.5}),
        ),
        roots=("s",),
        seed=0,
        train=Training(steps=3, optimizer="sgd", lr=0.1, fresh=("x",)),
    )
    return dataclasses.replace(p, **changes)


def _checkpointed(reentrant: bool, policy: str | None = None) -> Program:
    return _mlp(checkpoint=Checkpoint(("a", "d", "y"), reentrant, policy), train=None)


ORACLE_SUBJECTS = ["cagrad[eager]"]


@pytest.fixture(scope="module")
def cagrad_oracle() -> Oracle:
    return Oracle(ORACLE_SUBJECTS, devices=["cpu"])


def _planted(name: str) -> Oracle:
    return Oracle([], plugins=[f"{PLANTED}:{name}"], devices=["cpu"])


# ------------------------------------------------------------------- IR
@pytest.mark.parametrize(
    "changes, where, phrase",
    [
        ({"train": Training(steps=0)}, "train.steps", "1..3"),
        ({"train": Training(steps=4)}, "train.steps", "1..3"),
        ({"train": Training(optimizer="lbfgs")}, "train.optimizer", "unknown optimizer"),
        ({"train": Training(lr=-1.0)}, "train.lr", "> 0"),
        ({"train": Training(fresh=("q",))}, "train.fresh[0]", "not a leaf"),
        ({"train": Training(fresh=("x", "x"))}, "train.fresh[1]", "twice"),
        ({"train": Training(fresh=("w1", "w2"))}, "train", "no parameter"),
        ({"train": Training(), "mode": "grad", "inputs": ("w1",)}, "train", "mode 'backward'"),
        ({"checkpoint": Checkpoint(("nope",))}, "checkpoint.ops[0]", "not an op"),
        ({"checkpoint": Checkpoint(("h", "d"))}, "checkpoint.ops[1]", "contiguous"),
        ({"checkpoint": Checkpoint(("a",), True, "save_all")}, "checkpoint.policy", "use_reentrant=false"),
        ({"checkpoint": Checkpoint(("a",), False, "save_some")}, "checkpoint.policy", "unknown policy"),
        ({"checkpoint": Checkpoint(("a", "d"), False, "save_all")}, "checkpoint.ops[1]", "torch rejects that"),
        (
            {"ops": _mlp().ops + (Op("u", "cos", ("z",)),), "checkpoint": Checkpoint(("u",))},
            "checkpoint.ops",
            "nothing outside the region reads",
        ),
        ({"checkpoint": Checkpoint(("h",), True), "inputs": ("w1",)}, "checkpoint.use_reentrant", "not compatible"),
    ],
)
def test_malformed_training_fields_are_rejected_naming_the_field(changes: dict, where: str, phrase: str) -> None:
    with pytest.raises(IRError) as info:
        validate(_mlp(**changes))
    assert info.value.where == where and phrase in str(info.value), str(info.value)


def test_a_reentrant_region_needs_an_input_that_requires_grad() -> None:
    p = Program(
        leaves=(Leaf("x", (3,), "float32", False), Leaf("w", (3,))),
        ops=(Op("a", "sin", ("x",)), Op("b", "mul", ("a", "w"))),
        roots=("b",),
        checkpoint=Checkpoint(("a",), True),
    )
    with pytest.raises(IRError, match="needs an input that requires grad") as info:
        validate(p)
    assert info.value.where == "checkpoint.use_reentrant"


@pytest.mark.parametrize(
    "patch, where, phrase",
    [
        ({"train": [1]}, "train", "expected an object"),
        ({"train": {"steps": 2, "epochs": 3}}, "train", "unknown field(s) ['epochs']"),
        ({"train": {"fresh": "x"}}, "train.fresh", "list of leaf names"),
        ({"checkpoint": {"use_reentrant": True}}, "checkpoint", "missing field(s) ['ops']"),
        ({"checkpoint": {"ops": "a"}}, "checkpoint.ops", "list of op names"),
        ({"checkpoint": {"ops": ["a"], "use_reentrant": "yes"}}, "checkpoint.use_reentrant", "expected a bool"),
    ],
)
def test_malformed_training_json_is_rejected_naming_the_field(patch: dict, where: str, phrase: str) -> None:
    data = json.loads(_mlp().to_json())
    data.update(patch)
    with pytest.raises(IRError) as info:
        Program.from_dict(data)
    assert info.value.where == where and phrase in str(info.value), str(info.value)


def test_random_and_dynamic_ops_check_their_attributes_and_shapes() -> None:
    bad_p = dataclasses.replace(_mlp(), ops=(*_mlp().ops[:2], Op("d", "dropout", ("a",), {"p": 0.3}), *_mlp().ops[3:]))
    with pytest.raises(IRError, match="expected one of") as info:
        validate(bad_p)
    assert info.value.where == "ops[2].attrs.p"
    bad_k = _moe(ops=(Op("m", "moe", ("x", "r", "e"), {"top_k": 5}),), roots=("m",))
    with pytest.raises(IRError, match=r"top_k=5 must be in 1..E=4") as info:
        validate(bad_k)
    assert info.value.where == "ops[0]"


def test_training_fields_round_trip_and_programs_without_them_keep_their_json() -> None:
    p = _mlp(checkpoint=Checkpoint(("a", "d"), False, "recompute_all"), repeat=2, retain_graph=True)
    assert Program.from_json(p.to_json()) == p
    plain = dataclasses.replace(p, train=None, checkpoint=None)
    assert "train" not in plain.to_dict() and "checkpoint" not in plain.to_dict()
    assert Program.from_json(plain.to_json()) == plain
    assert {"train:steps=2", "train:adam", "train:foreach", "train:fresh_inputs", "checkpoint:non_reentrant",
            "checkpoint:policy=recompute_all", "checkpoint:random", "random:dropout"} <= program_features(p)
    assert set(program_features(p)) <= set(p.features())


def test_pruning_keeps_a_region_valid_when_its_ops_go() -> None:
    p = _mlp(checkpoint=Checkpoint(("y", "z"), False), roots=("d",))
    assert p.pruned().checkpoint is None  # y and z pruned: no region left
    q = _mlp(checkpoint=Checkpoint(("d", "y")), train=Training(fresh=("x",)))
    validate(q.pruned())


# ----------------------------------------------------------- interpreter
def test_each_step_records_outputs_grads_stream_and_parameters() -> None:
    with seeded(torch.device("cpu"), 0):
        run = build_run(_mlp())
        run_backward(run)
    labels = [entry.label for entry in run.trace]
    per_step = ["outputs", "x .grad", "w1 .grad", "w2 .grad", "x .grad kept", "w1 .grad kept", "w2 .grad kept"]
    per_step += ["state cpu_rng", "w1", "w2"]
    assert labels == [f"train step {s}/2: {what}" for s in (1, 2) for what in per_step]
    by = {e.label: e.value for e in run.trace}
    # the data is drawn anew, the parameters move, set_to_none=False zeroes in place
    assert not torch.equal(by["train step 1/2: w1"], by["train step 2/2: w1"])
    assert by["train step 1/2: x .grad"] is None
    assert run.leaves[1].grad is not None
    # no .grad before the first backward; zeroed in place, then added into, at the second
    assert by["train step 1/2: w1 .grad kept"] is None and by["train step 2/2: w1 .grad kept"] is True


def test_moe_routes_zero_and_one_token_to_some_expert() -> None:
    """The hand-written MoE program meets expert counts 0 and 1 (and more)."""
    p = _moe()
    with seeded(torch.device("cpu"), 0):
        run = build_run(p)
    x, r = run.leaves[0], run.leaves[1]
    counts = torch.bincount((x @ r).topk(1, dim=-1).indices.reshape(-1), minlength=4).tolist()
    assert 0 in counts and 1 in counts, counts


# -------------------------------------------------------- differential
@pytest.mark.parametrize(
    "program",
    [
        pytest.param(_mlp(), id="adam-foreach-keep-grads"),
        pytest.param(_mlp(train=Training(steps=3, optimizer="sgd", set_to_none=True, fresh=("x",))), id="sgd"),
        pytest.param(_moe(), id="moe-nonzero-masked-select"),
        pytest.param(_checkpointed(True), id="checkpoint-reentrant-dropout"),
        pytest.param(_checkpointed(False, "save_matmul"), id="checkpoint-selective-dropout"),
        pytest.param(_mlp(checkpoint=Checkpoint(("a", "d"), False)), id="train-checkpoint"),
    ],
)
def test_cagrad_agrees_with_eager_on_training_programs(cagrad_oracle: Oracle, program: Program) -> None:
    verdict = cagrad_oracle.run(program)
    assert verdict.build_error is None
    assert verdict.ok, [o.describe() for o in verdict.report.outcomes]


def test_a_skipped_optimizer_step_is_caught_by_the_parameters() -> None:
    p = _mlp(train=Training(steps=1, fresh=("x",)))
    verdict = _planted("SkipsOptimizerStep").run(p)
    (outcome,) = verdict.report.outcomes
    assert [m.where for m in outcome.mismatches] == ["train step 1/1: w1", "train step 1/1: w2"]
    assert failure_key(outcome).kind == "value"


def test_a_grad_written_anew_instead_of_added_into_is_caught() -> None:
    # set_to_none=False: the second step's backward finds zeroed .grad
    # tensors and must add into them; a copy in their place has eager's
    # values and strides, and only the identity tells
    verdict = _planted("ReplacesGrad").run(_mlp())
    (outcome,) = verdict.report.outcomes
    where = [m.where for m in outcome.mismatches]
    assert where == ["train step 2/2: w1 .grad kept", "train step 2/2: w2 .grad kept"], where


def test_a_grad_written_anew_by_a_repeated_backward_is_caught() -> None:
    # no optimizer: a backward run twice on one graph (repeat=2) must add
    # into the .grad the first left; a copy in its place has eager's values
    p = dataclasses.replace(_mlp(), train=None, retain_graph=True, repeat=2)
    verdict = _planted("ReplacesGrad").run(p)
    (outcome,) = verdict.report.outcomes
    where = [m.where for m in outcome.mismatches]
    grads = [i for i, leaf in enumerate(p.leaves) if leaf.requires_grad]
    assert where == [f"backward 2/2: leaf {i} .grad kept" for i in grads], where
    assert {m.detail for m in outcome.mismatches} == {"eager has True, subject has False"}
    run = build_run(p)
    run_backward(run)
    assert [e.label for e in run.trace] == [f"backward 2/2: leaf {i} .grad kept" for i in range(len(p.leaves))]


def test_a_draw_after_the_backward_is_a_state_mismatch_at_that_step() -> None:
    p = _mlp(ops=_mlp().ops[:2] + (Op("y", "matmul", ("a", "w2")), Op("z", "sin", ("y",))))
    verdict = _planted("DrawsAfterBackward").run(p)
    (outcome,) = verdict.report.outcomes
    where = [m.where for m in outcome.mismatches]
    assert where[0] == "train step 1/2: state cpu_rng", where
    assert failure_key(outcome).kind == "state"


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_recomputation_that_draws_anew_is_caught(reentrant: bool) -> None:
    verdict = _planted("RecomputeForgetsRng").run(_checkpointed(reentrant))
    (outcome,) = verdict.report.outcomes
    where = [m.where for m in outcome.mismatches]
    assert any(w.endswith(".grad") for w in where) and "state cpu_rng" in where, where


def test_a_wrong_index_add_backward_is_caught_at_the_first_step() -> None:
    verdict = _planted("BrokenIndexAdd").run(_moe())
    (outcome,) = verdict.report.outcomes
    assert "train step 1/3: r .grad" in [m.where for m in outcome.mismatches]


# --------------------------------------------------------------- reduce
def test_reduction_drops_features_the_failure_does_not_need() -> None:
    oracle = _planted("BrokenIndexAdd")
    p = _moe(checkpoint=Checkpoint(("n",), False, "recompute_all"), train=Training(steps=3, optimizer="adam", foreach=True, fresh=("x",)))
    assert not oracle.run(p).ok
    reduced, _ = reduce_program(p, lambda q: not oracle.run(q).ok, deadline=float("inf"))
    assert reduced.train is None and reduced.checkpoint is None
    assert len(reduced.ops) == 1 and reduced.ops[0].op in ("moe", "nonzero_scatter")  # both use index_add


def test_reduction_keeps_and_lowers_the_training_a_failure_needs() -> None:
    oracle = _planted("SkipsOptimizerStep")
    p = _mlp(train=Training(steps=3, optimizer="adam", foreach=True, set_to_none=False, fresh=("x",)))
    reduced, _ = reduce_program(p, lambda q: not oracle.run(q).ok, deadline=float("inf"))
    assert reduced.train == Training(steps=1, optimizer="sgd", lr=p.train.lr)
    assert len(reduced.ops) <= 1


# ------------------------------------------------------ render, reproducer
@pytest.mark.parametrize(
    "program",
    [
        pytest.param(_mlp(checkpoint=Checkpoint(("d", "y"), False, "recompute_all")), id="train-checkpoint"),
        pytest.param(_moe(), id="moe"),
        pytest.param(_checkpointed(True), id="reentrant"),
    ],
)
def test_rendered_source_stands_alone_and_records_what_the_interpreter_records(program: Program) -> None:
    namespace: dict = {}
    exec(render_source(program), namespace)  # noqa: S102 - our own rendering
    rendered: list = []
    with seeded(torch.device("cpu"), 0):
        grads = namespace["run"]("cpu", rendered)
    with seeded(torch.device("cpu"), 0):
        run = build_run(program)
        run_backward(run)
    assert [e[0] for e in rendered] == [e[0] for e in run.trace]
    for (label, a), (_, b) in zip(rendered, run.trace):
        if isinstance(a, str) or a is None:
            assert a == b, label
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=label)
    for g, leaf in zip(grads, run.leaves):
        assert (g is None) == (leaf.grad is None)
        if g is not None:
            torch.testing.assert_close(g, leaf.grad, rtol=0, atol=0)


def test_reproducer_of_a_training_failure_reproduces(tmp_path: Path) -> None:
    path = write_reproducer(tmp_path / "r.py", _mlp(), plugins=[f"{PLANTED}:SkipsOptimizerStep"], devices=["cpu"])
    proc = subprocess.run([sys.executable, str(path)], check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "train step 1/2: w1" in proc.stdout


# ------------------------------------------------- neighbours, strategies
def test_neighbours_vary_the_training_options() -> None:
    p = _mlp(checkpoint=Checkpoint(("a", "d"), True))
    labels = [nb.label for nb in derive(p, 40)]
    assert any(label.startswith("train.steps: 2 -> ") for label in labels), labels
    assert any(label.startswith("checkpoint.") for label in labels), labels
    assert "ops[2].attrs.p: 0.5 -> 0.2" in labels
    plain = dataclasses.replace(p, train=None, checkpoint=None)
    assert all(nb.kind != "train" for nb in derive(plain, 40))


FEATURE_OPS = ("sin", "mul", "matmul", "sum", "dropout", "rand_mul", "bernoulli_mask", "nonzero_scatter",
               "masked_select_scatter", "moe")


def test_strategies_draw_every_training_feature() -> None:
    seen: set[str] = set()

    @settings(max_examples=examples(250), deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(programs(ops=FEATURE_OPS, max_ops=6, shapes=False, hooks=False, modes=("backward",)))
    def collect(program: Program) -> None:
        validate(program)
        seen.update(f.split(":")[0] if f.startswith(("train:", "checkpoint:")) else f for f in program_features(program))

    collect()
    wanted = {"train", "checkpoint", "random:dropout", "random:rand_mul", "random:bernoulli_mask",
              "dynamic:nonzero_scatter", "dynamic:masked_select_scatter", "dynamic:moe"}
    assert wanted <= seen, sorted(wanted - seen)


def test_feature_draws_cover_every_option_and_stay_valid() -> None:
    base = dataclasses.replace(_mlp(), train=None)
    seen: set[str] = set()

    @settings(max_examples=examples(200), deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(st.data())
    def collect(data: st.DataObject) -> None:
        program = draw_features(data.draw, base)
        validate(program)
        seen.update(program_features(program))

    collect()
    wanted = {"train:steps=1", "train:steps=2", "train:steps=3", "train:sgd", "train:adam", "train:foreach",
              "train:set_to_none=true", "train:set_to_none=false", "train:fresh_inputs", "checkpoint:reentrant",
              "checkpoint:non_reentrant", "checkpoint:random"}
    assert wanted <= seen, sorted(wanted - seen)
    assert any(f.startswith("checkpoint:policy=") for f in seen), sorted(seen)


def test_a_selective_checkpoint_region_is_not_backpropagated_twice() -> None:
    # torch raises "Trying to backward an extra time" on the second backward
    # of a region under a save_all policy (topk's saved indices are cached);
    # one backward runs
    program = Program(
        (Leaf("x0", (3,), "float32"),),
        (Op("v0", "topk", ("x0",), {"dim": 0, "k": 1}),),
        ("v0",),
        mode="grad",
        inputs=("x0",),
        checkpoint=Checkpoint(("v0",), False, "save_all"),
    )
    from fuzz.features_training import has_selective

    if not has_selective():
        pytest.skip("no selective checkpointing in this torch")
    build_run(program)  # valid with one backward
    with pytest.raises(IRError) as info:
        validate(dataclasses.replace(program, retain_graph=True, repeat=2))
    assert info.value.where == "checkpoint.policy" and "one backward" in info.value.message
    # recompute_all saves nothing: two backwards run, and agree with eager's
    twice = dataclasses.replace(program, retain_graph=True, repeat=2, checkpoint=Checkpoint(("v0",), False, "recompute_all"))
    validate(twice)
    verdict = Oracle(["cagrad[eager]"], devices=["cpu"]).run(twice)
    assert verdict.ok, verdict.report.summary()
