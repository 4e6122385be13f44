"""Size sequences in the fuzzer: IR ``resizes``, generation, rendering,
reduction, the oracle's capture-rule failure kind and the campaign flag."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings

from fuzz.cli import main
from fuzz.interpret import eager_grads
from fuzz.ir import IRError, Leaf, Op, Program, validate
from fuzz.oracle import Oracle
from fuzz.reduce import candidates, reduce_program
from fuzz.render import render_source
from fuzz.reproducer import read_reproducer, write_reproducer
from fuzz.strategies import programs
from tests.conftest import examples

HERE = Path(__file__).resolve().parent
FORGETFUL = f"{HERE / 'broken_subject.py'}:ForgetfulCagrad"


def mm_sum(*steps: int, seed: int = 1) -> Program:
    """``mm(x[4, 3], w[3, 5]).sum()``, the batch 4 resized to each of ``steps``."""
    return Program(
        leaves=(Leaf("x", (4, 3), "float64"), Leaf("w", (3, 5), "float64")),
        ops=(Op("v0", "mm", ("x", "w")),),
        roots=("v0",),
        seed=seed,
        resizes=tuple(((4, s),) for s in steps),
    )


# ------------------------------------------------------------------ IR
def test_resizes_round_trip_and_variants() -> None:
    p = mm_sum(6, 9)
    data = json.loads(p.to_json())
    assert data["schema"] == 2 and data["resizes"] == [[[4, 6]], [[4, 9]]]
    again = Program.from_json(p.to_json())
    assert again == p and again.to_json() == p.to_json()
    shapes = [[leaf.shape for leaf in v.leaves] for v in p.size_variants()]
    assert shapes == [[(4, 3), (3, 5)], [(6, 3), (3, 5)], [(9, 3), (3, 5)]]
    assert "shapes:sequence" in p.features()
    # a program without steps is written exactly as before
    assert "resizes" not in json.loads(mm_sum().to_json())


def test_a_step_maps_every_equal_size_at_once() -> None:
    p = Program(
        leaves=(Leaf("a", (3, 4)), Leaf("b", (4, 3))),
        ops=(Op("v0", "mm", ("a", "b")),),
        roots=("v0",),
        resizes=(((3, 5), (4, 2)),),
    )
    validate(p)
    assert [leaf.shape for leaf in p.size_variants()[1].leaves] == [(5, 2), (2, 5)]


def test_a_step_that_breaks_an_op_is_rejected_naming_the_step() -> None:
    p = Program(
        leaves=(Leaf("x", (2, 3)),),
        ops=(Op("v0", "reshape", ("x",), {"shape": [6]}),),
        roots=("v0",),
        resizes=(((2, 4),), ((3, 5),)),
    )
    with pytest.raises(IRError) as info:
        validate(dataclasses.replace(p, resizes=p.resizes[1:]))
    assert info.value.where == "resizes[0]" and "at sizes 3 -> 5" in str(info.value)
    with pytest.raises(IRError, match=r"^resizes\[0\]: at sizes 2 -> 4: ops\[0\]"):
        Program.from_json(p.to_json())


@pytest.mark.parametrize(
    "resizes, message",
    [
        ([[[7, 2]]], r"resizes\[0\]: no leaf has size 7"),
        ([[[4, 6]], [[4, 4]]], r"resizes\[1\]: size 4 is mapped to itself"),
        ([[[4, 6], [4, 7]]], r"resizes\[0\]: size\(s\) resized twice"),
        ([[[4, -1]]], r"resizes\[0\]: new size -1 for 4 is negative"),
        ([[]], r"resizes\[0\]: expected a non-empty list"),
        ([[4, 6]], r"resizes\[0\]: expected a list of \[old size, new size\] pairs"),
        ({"4": 6}, r"resizes: expected a list of steps"),
    ],
)
def test_malformed_resizes_name_the_step(resizes, message) -> None:
    data = json.loads(mm_sum().to_json())
    data["resizes"] = resizes
    with pytest.raises(IRError, match=message):
        Program.from_dict(data)


def test_schema_1_cannot_carry_resizes() -> None:
    data = json.loads(mm_sum(6).to_json())
    data["schema"] = 1
    data.pop("hooks")
    with pytest.raises(IRError, match=r"unknown field\(s\) \['resizes'\]"):
        Program.from_dict(data)


def test_pruning_drops_sizes_no_kept_leaf_has() -> None:
    p = Program(
        leaves=(Leaf("x", (4,)), Leaf("y", (7,))),
        ops=(Op("v0", "sin", ("x",)), Op("v1", "sin", ("y",))),
        roots=("v0",),
        resizes=(((4, 5), (7, 2)), ((7, 3),)),
    )
    assert p.pruned().resizes == (((4, 5),),)


# ---------------------------------------------------------- generation
def test_generation_draws_valid_size_sequences() -> None:
    seen: list[Program] = []

    @settings(max_examples=examples(150), deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(programs())
    def collect(p: Program) -> None:
        validate(p)
        if p.resizes:
            seen.append(p)

    collect()
    assert len(seen) >= 10
    for p in seen:
        assert 1 <= len(p.resizes) <= 4  # up to max_resizes, and a repeated step
        sizes = set(p.leaf_sizes())
        assert all(old in sizes and old >= 2 and new >= 1 for step in p.resizes for old, new in step)
    assert any(new == 1 for p in seen for step in p.resizes for _, new in step) or len(seen) < 30
    # sizes seen before come back (no capture, no code of other sizes)
    assert any(len(set(p.resizes)) < len(p.resizes) for p in seen)

    @settings(max_examples=examples(40), deadline=None, database=None)
    @given(programs(shapes=False))
    def none(p: Program) -> None:
        assert not p.resizes

    none()


# --------------------------------------------------- render, reproducer
def test_render_loops_over_the_sizes_like_the_harness() -> None:
    p = mm_sum(6, 9)
    src = render_source(p)
    assert "RESIZES = [{}, {4: 6}, {4: 9}]" in src and "def run_sequence" in src
    ns: dict = {}
    exec(compile(src, "<rendered>", "exec"), ns)
    results = ns["run_sequence"]()
    assert len(results) == 3
    for got, variant in zip(results, p.size_variants()):
        want = eager_grads(variant)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_reproducer_replays_the_sequence(tmp_path: Path) -> None:
    path = write_reproducer(tmp_path / "r.py", mm_sum(6, 9), subjects=["cagrad[eager]"])
    rec = read_reproducer(path)
    assert rec["program"].resizes == (((4, 6),), ((4, 9),))
    verdict = Oracle(rec["subjects"], devices=["cpu"]).run(rec["program"])
    assert verdict.ok and verdict.report is not None and len(verdict.report.variants) == 3


# ---------------------------------------------------------------- oracle
@pytest.mark.parametrize(
    "subject, steps, captures",
    [
        ("cagrad[eager,dynamic]", (6, 9), [1, 0, 0]),
        ("cagrad[eager]", (6, 9), [1, 1, 0]),
        ("cagrad[eager]", (6, 9, 4), [1, 1, 0, 0]),
        ("cagrad[eager,static]", (6, 9), [1, 1, 0]),
        ("cagrad[eager,static]", (6, 9, 6), [1, 1, 0, 0]),
        # the second backward at 6 runs inductor code compiled for 6 (cagrad.compile.specialize)
        ("cagrad[inductor,dynamic]", (6, 6, 9), [1, 0, 0, 0]),
        ("cagrad[inductor]", (6, 6, 9), [1, 1, 0, 0]),
    ],
)
def test_mm_sum_sequence_agrees_and_follows_the_rule(subject, steps, captures) -> None:
    # by hand: dynamic sizes are symbols from the first capture, so 4, 6, 9
    # take one graph; the default captures 4 static and the symbolic graph
    # at 6, which 9 hits (4 hits its static graph); static sizes capture at
    # 4, make the batch dynamic at 6; sizes seen before capture nothing
    verdict = Oracle([subject], devices=["cpu"]).run(mm_sum(*steps))
    assert verdict.ok, verdict.report and verdict.report.summary()
    o = verdict.report.outcomes[0]
    assert o.captures_per_variant == captures
    assert [v["status"] for v in o.variants] == ["equal"] * len(captures)


def test_a_subject_recapturing_every_time_is_a_captures_failure() -> None:
    verdict = Oracle([], plugins=[FORGETFUL], devices=["cpu"]).run(mm_sum(6, 9))
    assert [k.text() for k in verdict.keys] == ["forgetful_cagrad[eager]@cpu mismatch captures"]
    o = verdict.outcome(verdict.keys[0])
    assert o is not None and "captures per variant [1, 1, 1], allowed [1, 0, 0]" in o.mismatch.detail
    # without the sequence the same subject is fine
    assert Oracle([], plugins=[FORGETFUL], devices=["cpu"]).run(mm_sum()).ok


def test_torch_ca_counts_are_reported_next_to_cagrads() -> None:
    verdict = Oracle(["cagrad[eager]", "torch_ca[eager]"], devices=["cpu"]).run(mm_sum(6, 9))
    assert verdict.ok and verdict.report is not None
    assert verdict.report.outcome("torch_ca[eager]").captures_per_variant[0] == 1
    assert "cagrad[eager]=1,1,0; torch_ca[eager]=" in " ".join(verdict.report.notes)


# ---------------------------------------------------------------- reduce
def test_reduction_drops_resize_steps() -> None:
    p = mm_sum(6, 9)
    cands = list(candidates(p))
    assert p.without_resizes() in cands
    assert dataclasses.replace(p, resizes=(((4, 9),),)) in cands
    # a value failure that does not need the sequence loses it
    best, _ = reduce_program(p, lambda q: True, deadline=float("inf"))
    assert best.resizes == ()
    # a capture failure keeps one step
    best, _ = reduce_program(p, lambda q: bool(q.resizes), deadline=float("inf"))
    assert len(best.resizes) == 1


# ------------------------------------------------------------------ CLI
def test_cli_documents_shapes() -> None:
    result = CliRunner().invoke(main, ["campaign", "--help"])
    assert result.exit_code == 0 and "--shapes / --no-shapes" in result.output


def test_campaign_finds_and_shrinks_a_capture_failure(tmp_path: Path) -> None:
    from fuzz.campaign import Campaign, CampaignConfig
    from fuzz.strategies import GenConfig

    cfg = CampaignConfig(
        budget_s=3600,
        seed=3,
        out=tmp_path,
        subjects=[],
        plugins=[FORGETFUL],
        devices=["cpu"],
        gen=GenConfig(ops=("sin", "mul", "sum"), max_ops=3, hooks=False, repeat=False),
        shrink_s=float("inf"),  # shrinking ends when nothing smaller fails, not by the clock
        progress=False,
        max_programs=40,
    )
    assert Campaign(cfg).run() == 1
    report = json.loads((tmp_path / "report.json").read_text())
    kinds = {f["kind"] for f in report["failures"]}
    assert kinds == {"captures"}
    f = report["failures"][0]
    shrunk = Program.from_json((tmp_path / f["program_json"]).read_text())
    assert len(shrunk.resizes) == 1 and len(shrunk.ops) <= 1
    seq = report["sequence_captures"]["forgetful_cagrad[eager]@cpu"]
    assert seq["sequences"] >= 1 and seq["rule_failures"] >= 1


def test_campaign_sums_the_engines_counters_per_subject(tmp_path: Path) -> None:
    """``engine_counts`` says what a campaign exercised: the CUDA-graph
    subject runs every program four times (so at least four backwards per
    program), and on the CPU each of its compiled backwards runs without a
    graph."""
    from fuzz.campaign import Campaign, CampaignConfig
    from fuzz.strategies import GenConfig

    cfg = CampaignConfig(
        budget_s=3600,
        seed=5,
        out=tmp_path,
        subjects=["cagrad[aot_eager,reduce-overhead]"],
        devices=["cpu"],
        gen=GenConfig(ops=("sin", "mul", "sum"), max_ops=3, hooks=False, repeat=False),
        progress=False,
        max_programs=6,
    )
    assert Campaign(cfg).run() == 0
    report = json.loads((tmp_path / "report.json").read_text())
    counts = report["engine_counts"]["cagrad[aot_eager,reduce-overhead]@cpu"]
    assert counts["backwards"] >= 4 * report["programs_run"] > 0
    assert counts["cudagraph_skips"] > 0 and "cudagraph_replays" not in counts
    assert counts["backwards"] == counts["captures"] + counts["cache_hits"] + counts.get("fallbacks", 0)
