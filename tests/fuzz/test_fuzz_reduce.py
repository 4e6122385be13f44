"""IR-level reduction (fuzz.reduce) with a pure predicate: no harness needed."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings

from fuzz.ir import Program, validate
from fuzz.reduce import candidates, complexity, reduce_program
from fuzz.strategies import programs
from tests.conftest import examples


def _has(op: str):
    """``op`` is on a path from a leaf to a root (as a real divergence in that
    op's backward would need)."""
    return lambda p: op in dataclasses.replace(p, inputs=None, mode="backward").pruned().op_names()


@settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(programs(max_ops=12, ops=("neg", "sin", "mul", "matmul", "sum", "cat", "split", "transpose", "where")))
def test_reduction_keeps_the_failure_and_never_grows(program: Program) -> None:
    pred = _has("mul")
    if not pred(program):
        return
    reduced, tried = reduce_program(program, pred, deadline=float("inf"))
    validate(reduced)
    assert pred(reduced)
    assert complexity(reduced) <= complexity(program.pruned())
    # a lone "mul" is always reachable: every other op can be cut to a leaf
    assert reduced.op_names() == ["mul"]
    assert len(reduced.roots) == 1 and reduced.mode == "backward" and reduced.loss == "sum"
    assert tried >= 0


def test_reduction_of_a_long_chain() -> None:
    text = {
        "schema": 1,
        "seed": 3,
        "leaves": [{"name": "x0", "shape": [2, 3]}, {"name": "x1", "shape": [3, 2], "dtype": "float32"}],
        "ops": [
            {"name": "v0", "op": "sin", "inputs": ["x0"]},
            {"name": "v1", "op": "matmul", "inputs": ["v0", "x1"]},
            {"name": "v2", "op": "exp", "inputs": ["v1"]},
            {"name": "v3", "op": "softmax", "inputs": ["v2"], "attrs": {"dim": 1}},
            {"name": "v4", "op": "mul_scalar", "inputs": ["v3"], "attrs": {"scalar": 2.0}},
            {"name": "v5", "op": "sum", "inputs": ["v4"], "attrs": {"dim": None, "keepdim": False}},
        ],
        "roots": ["v5", "v2"],
        "loss": "separate",
        "mode": "grad",
        "inputs": ["x0", "v1"],
    }
    import json

    program = Program.from_json(json.dumps(text))
    calls = []

    def pred(p: Program) -> bool:
        calls.append(p)
        return "softmax" in p.op_names()

    reduced, tried = reduce_program(program, pred, deadline=float("inf"))
    assert reduced.op_names() == ["softmax"]
    assert reduced.mode == "backward" and reduced.loss == "sum" and reduced.roots and len(reduced.roots) == 1
    assert tried == len(calls)


def test_reduction_stops_at_the_deadline() -> None:
    program = Program.from_json(
        '{"schema": 1, "leaves": [{"name": "x", "shape": [2]}],'
        ' "ops": [{"name": "a", "op": "sin", "inputs": ["x"]}, {"name": "b", "op": "cos", "inputs": ["a"]}],'
        ' "roots": ["b"]}'
    )
    reduced, tried = reduce_program(program, lambda p: True, deadline=0.0)
    assert reduced == program.pruned() and tried == 0


def test_candidates_are_mostly_valid() -> None:
    program = Program.from_json(
        '{"schema": 1, "leaves": [{"name": "x", "shape": [4, 2]}],'
        ' "ops": [{"name": "s", "op": "split", "inputs": ["x"], "attrs": {"dim": 0, "split_size": 2}},'
        ' {"name": "a", "op": "add", "inputs": ["s:0", "s:1"]}], "roots": ["a"]}'
    )
    valid = 0
    for cand in candidates(program):
        validate(cand.pruned())
        valid += 1
    assert valid >= 2
