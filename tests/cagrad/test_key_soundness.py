"""Cache-key soundness over the fuzz op catalog.

Property: two one-op programs that differ only in one attribute value of
the op, built from the same leaf values, whose eager gradients differ, must
differ in what cagrad's cache compares: the key bytes (``GraphTask`` key and
every node's :class:`cagrad.CacheKey`) or the size slot values (sizes are
not key bytes but graph inputs checked per compiled variant, see
:mod:`cagrad.keys.sizes`). Where they do not, the attribute reaches the graph
another way (a scalar saved as a wrapped tensor and lifted as an input, an
index tensor, a node that runs as itself and reads its own state), and the
test proves it: the second program, run under ``cagrad.enable("eager")``
right after the first, must hit the cache and still give its own eager
gradients. A backward cagrad does not compile (``Unsupported``) runs in
eager and is left out; each op whose attributes can change gradients must
compare at least one pair, so the test cannot pass vacuously.

The loss is ``"separate"`` (a seeded ``grad_output``): with ``sum`` some
attributes cannot change the gradient (the gradient of ``softmax(x,
dim).sum()`` is zero for every ``dim``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cagrad
from cagrad.keys import compiled_node_args
from cagrad.api import backward_arguments, collect_or_raise
from cagrad.errors import Unsupported
from fuzz import ops as catalog
from fuzz.interpret import build_run, eager_grads
from fuzz.ir import IRError, Leaf, Op, Program, validate
from fuzz.neighbours import attr_alternatives

ATTR_OPS = sorted(name for name, spec in catalog.OPS.items() if spec.attrs)


def _first_shape(draw: Any, spec: catalog.OpSpec) -> tuple[int, ...]:
    ranks = [r for r in range(catalog.MAX_RANK + 1) if any(spec.accepts((d,) * r) for d in (1, 2, 3))]
    rank = draw(st.sampled_from(ranks))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    return shape if spec.accepts(shape) else next(s for s in ((3,) * rank, (2,) * rank, (1,) * rank) if spec.accepts(s))


@st.composite
def one_op_programs(draw: Any, op_name: str) -> Program:
    """``v0 = op(x0, ...)`` with drawn shapes and attributes, loss "separate"."""
    spec = catalog.OPS[op_name]
    shape = _first_shape(draw, spec)
    others, attrs = spec.plan(draw, shape)
    leaves = [Leaf("x0", shape, "float64")] + [Leaf(f"x{i + 1}", tuple(s), "float64") for i, s in enumerate(others)]
    op = Op("v0", op_name, tuple(leaf.name for leaf in leaves), attrs)
    roots = ("v0:0",) if spec.multi_output else ("v0",)
    program = Program(leaves=tuple(leaves), ops=(op,), roots=roots, loss="separate", seed=draw(st.integers(0, 3)))
    validate(program)
    return program


def variants(program: Program) -> list[tuple[str, Program]]:
    """Every valid program that changes one attribute of the op."""
    op = program.ops[0]
    spec = catalog.OPS[op.op]
    rank = len(program.leaves[0].shape)
    out = []
    for name, attr in spec.attrs.items():
        for new in attr_alternatives(attr.kind, op.attrs[name], rank, attr.choices):
            changed = dataclasses.replace(program, ops=(dataclasses.replace(op, attrs={**op.attrs, name: new}),))
            try:
                validate(changed)
            except IRError:
                continue
            out.append((f"{name}: {op.attrs[name]!r} -> {new!r}", changed))
    return out


def key_identity(program: Program) -> tuple[Any, ...] | None:
    """What the cache compares for the program's backward (key bytes, size
    slot values); None when cagrad does not compile it."""
    run = build_run(program)
    outs, grads, ins = backward_arguments(run.outputs, run.grad_outputs, None)
    try:
        collected = collect_or_raise(outs, grads, ins, accumulate_grad=True)
    except Unsupported:
        return None
    return (tuple(collected.keys), tuple(collected.collector.sizes.values))


def seeded_grads(program: Program) -> list[torch.Tensor | None]:
    """:func:`fuzz.interpret.eager_grads` from one seed: a random op
    (dropout) draws the same mask in every run, so only what changed can
    change the gradients."""
    torch.manual_seed(0)
    return eager_grads(program)


def same_grads(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None and (x.shape != y.shape or not torch.equal(x, y)):
            return False
    return True


def hit_gives_seeded_grads(first: Program, second: Program) -> bool:
    """Runs ``first`` then ``second`` under ``cagrad.enable("eager")`` from
    an empty cache; True when ``second`` hit the cache and its gradients are
    its eager ones (bit for bit: the eager backend runs the same kernels)."""
    cagrad.reset()
    try:
        with cagrad.enable("eager"):
            seeded_grads(first)
            hits = cagrad.counters["cache_hits"]
            got = seeded_grads(second)
            hit = cagrad.counters["cache_hits"] > hits
    finally:
        cagrad.reset()
    assert hit, "equal keys and sizes, yet no cache hit: the identity compared here is not the cache's"
    return same_grads(got, seeded_grads(second))


def violations(program: Program, compared: list[str]) -> list[str]:
    """Labels of attribute changes whose gradients differ while the cache
    identity does not; appends every label actually compared to ``compared``."""
    found = []
    identity = key_identity(program)
    if identity is None:
        return found
    grads = seeded_grads(program)
    for label, other in variants(program):
        other_identity = key_identity(other)
        if other_identity is None or same_grads(grads, seeded_grads(other)):
            continue
        compared.append(label)
        if other_identity == identity and not hit_gives_seeded_grads(program, other):
            found.append(f"{program.ops[0].op} {label}")
    return found


def _check_op(op_name: str, examples: int = 6) -> tuple[list[str], list[str]]:
    found: list[str] = []
    compared: list[str] = []

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(one_op_programs(op_name))
    def check(program: Program) -> None:
        found.extend(violations(program, compared))

    check()
    return found, compared


# ops no attribute change of which alters the leaves' gradients, or whose
# one-op graph cagrad does not compile: nothing to compare (a violation
# would still fail them)
NOT_COMPARED = {
    "add_scalar",  # d(x + c)/dx = 1
    "to_dtype",  # float32 <-> float64 round trip: the same float64 gradient
    "flatten",  # views: the gradient is reshaped back, same values
    "reshape",
    "view",
    "unsqueeze",
    "squeeze",  # squeezing another (non-1) dim is a no-op: same gradient
}


@pytest.mark.parametrize("op_name", ATTR_OPS)
def test_attribute_changes_that_change_gradients_change_the_key(op_name: str) -> None:
    found, compared = _check_op(op_name)
    assert not found, f"same cache key, different eager gradients: {found}"
    if op_name not in NOT_COMPARED:
        assert compared, f"{op_name}: no attribute change compared (all fell back or changed nothing)"


def test_a_key_that_leaves_out_an_attribute_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The property fails when SoftmaxBackward0's key leaves out ``dim``."""
    original = compiled_node_args.Collector._write_traced

    def faulty(self: Any, w: Any, call: Any, schema: Any) -> None:
        if schema.name == "SoftmaxBackward0":
            schema = dataclasses.replace(schema, values=tuple(a for a in schema.values if a != "dim"))
        original(self, w, call, schema)

    monkeypatch.setattr(compiled_node_args.Collector, "_write_traced", faulty)
    found, _ = _check_op("softmax")
    assert any(v.startswith("softmax dim:") for v in found), found
    cagrad.reset()
