"""What a campaign's programs exercised: features and feature pairs.

One table (:data:`AXES`) lists the *axes* of a program the fuzzer tracks,
each with its domain (the values it can take) and a function giving the
values one program has: its ops, op categories, leaf dtypes, backward mode,
loss, hook kinds and actions, the kind of node a hook sits on, in-place
writes, backward options. :data:`PAIRS` lists the pairs of axes whose
combinations are tracked too (op x dtype, hook kind x node kind, mode x
in-place, ...), each per op or per hook where that is what it means (an
op's dtype is its first input's), else over the program's values. A
program feature added to the IR plugs in by adding an :class:`Axis` (and
pairs) here; campaigns, ``report.json`` and the HTML report pick it up.

Names: a feature is ``"axis=value"`` (``"op=neg"``, ``"hook_node=leaf"``),
a pair ``"a=x & b=y"`` (``"op=neg & dtype=float64"``).

:func:`features` and :func:`pairs` compute them from the IR alone (no torch
run); :func:`domain_features` and :func:`domain_pairs` list every one that a
program could have, so that :func:`summary` names what a campaign never
covered.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fuzz import features_training, ir_graph
from fuzz import ops as catalog
from fuzz.ir import DTYPES, HOOK_KINDS, LOSSES, MODES, Program, ValueInfo

#: The kinds of node a hook can sit on (:func:`node_kind`).
NODE_KINDS = ("leaf", "op", "view", "multi_output")
#: In-place writes a program makes: none, into views of a fresh copy (ops of
#: category ``inplace_view``), or into an earlier value (``inplace``).
INPLACE = ("none", "inplace_view", "inplace")
#: Backward and program options (names as in :meth:`fuzz.ir.Program.features`).
OPTIONS = ("roots_several", "inputs_restriction", "retain_graph", "size_sequence", "no_grad_leaf", "mixed_dtypes")


def _train_domain() -> tuple[str, ...]:
    """Every ``train:*`` name of :func:`fuzz.features_training.program_features`, prefix dropped."""
    steps = tuple(f"steps={k}" for k in range(1, features_training.MAX_STEPS + 1))
    return (*steps, *features_training.OPTIMIZERS, "foreach", "set_to_none=true", "set_to_none=false", "fresh_inputs")


def _checkpoint_domain() -> tuple[str, ...]:
    """Every ``checkpoint:*`` name, prefix dropped (the policies only where
    torch has selective checkpointing, as the strategy draws them)."""
    policies = tuple(f"policy={p}" for p in features_training.POLICIES) if features_training.has_selective() else ()
    return ("reentrant", "non_reentrant", *policies, "random")


def _graph_domain() -> tuple[str, ...]:
    """Every ``graph:*`` name of :func:`fuzz.ir_graph.program_features`,
    prefix dropped (each subclass kind only where torch has it, as the
    strategy draws them: :func:`fuzz.subclass_leaves.available_kinds`)."""
    # torch-side module, imported on use
    from fuzz.subclass_leaves import available_kinds

    subclass = tuple(f"subclass.{s}" for s in available_kinds())
    return (
        *(f"func.{t}" for t in ir_graph.TRANSFORMS),
        *subclass,
        *(f"double_backward.{p}" for p in ir_graph.PENALTIES),
        "inner_grad.hook",
        "inner_grad.function",
        "root.output_nonzero",
        "root.single_output1",
        "root.nondiff_sibling",
    )


def _prefixed(names: set[str], prefix: str) -> set[str]:
    return {n[len(prefix) :] for n in names if n.startswith(prefix)}


def node_kind(v: ValueInfo) -> str:
    """The kind of node value ``v`` is: a ``leaf``, an output of a
    multi-output op (``split``, ``unbind``, ``fn_sin_cos``: ``"v3:1"``), a
    ``view`` of another tensor, or a plain ``op`` output."""
    if v.is_leaf:
        return "leaf"
    if ":" in v.ref:
        return "multi_output"
    if v.base:
        return "view"
    return "op"


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the axes read from one program, computed once (shape inference included)."""

    program: Program
    values: Mapping[str, ValueInfo]

    @classmethod
    def of(cls, program: Program) -> Facts:
        return cls(program, program.infer())

    def op_dtypes(self) -> list[tuple[str, str]]:
        """``(op, dtype of its first input)`` per op."""
        return [(op.op, self.values[op.inputs[0]].dtype) for op in self.program.ops if op.inputs]

    def hook_nodes(self) -> list[tuple[str, str]]:
        """``(hook kind, node kind of its target)`` per hook."""
        return [(h.kind, node_kind(self.values[h.target])) for h in self.program.hooks if h.target in self.values]


def _inplace(f: Facts) -> set[str]:
    cats = {catalog.OPS[op.op].category for op in f.program.ops if op.op in catalog.OPS}
    got = {c for c in ("inplace_view", "inplace") if c in cats}
    return got or {"none"}


def _options(f: Facts) -> set[str]:
    p = f.program
    out = set()
    if len(p.roots) > 1:
        out.add("roots_several")
    if p.mode == "backward" and p.inputs is not None:
        out.add("inputs_restriction")
    if p.repeat > 1:
        out.add("retain_graph")
    if p.resizes:
        out.add("size_sequence")
    if any(not leaf.requires_grad for leaf in p.leaves):
        out.add("no_grad_leaf")
    if len({leaf.dtype for leaf in p.leaves}) > 1:
        out.add("mixed_dtypes")
    return out


@dataclasses.dataclass(frozen=True)
class Axis:
    """One tracked axis: ``domain()`` lists its values, ``of(facts)`` those a program has."""

    name: str
    doc: str
    domain: Callable[[], tuple[str, ...]]
    of: Callable[[Facts], set[str]]


@dataclasses.dataclass(frozen=True)
class Pair:
    """Two axes tracked together. ``of(facts)`` gives a program's
    ``(a, b)`` value pairs (None: every pair of the two axes' values);
    ``possible(a, b)`` rules out pairs no program can have."""

    a: str
    b: str
    doc: str
    of: Callable[[Facts], set[tuple[str, str]]] | None = None
    possible: Callable[[str, str], bool] | None = None

    @property
    def name(self) -> str:
        return f"{self.a} x {self.b}"


def _hook_on(kind: str, node: str) -> bool:
    """Where :mod:`fuzz.strategies` puts hooks: post-accumulate-grad hooks
    on leaves only; retain_grad and node hooks on non-leaves only."""
    if kind == "post_accumulate":
        return node == "leaf"
    if kind in ("retain_grad", "pre", "post"):
        return node != "leaf"
    return True


#: The tracked axes, by name. Add an entry for a new program feature.
AXES: dict[str, Axis] = {
    a.name: a
    for a in (
        Axis("op", "ops of the catalog", lambda: tuple(catalog.OPS), lambda f: {op.op for op in f.program.ops}),
        Axis(
            "category",
            "op families (fuzz.ops categories)",
            lambda: tuple(dict.fromkeys(s.category for s in catalog.OPS.values())),
            lambda f: {catalog.OPS[op.op].category for op in f.program.ops if op.op in catalog.OPS},
        ),
        Axis("dtype", "leaf dtypes", lambda: DTYPES, lambda f: {leaf.dtype for leaf in f.program.leaves}),
        Axis("mode", "backward or autograd.grad", lambda: MODES, lambda f: {f.program.mode}),
        Axis("loss", "one summed root or separate roots", lambda: LOSSES, lambda f: {f.program.loss}),
        Axis("inplace", "in-place writes", lambda: INPLACE, _inplace),
        Axis("hook_kind", "hook kinds", lambda: tuple(HOOK_KINDS), lambda f: {h.kind for h in f.program.hooks}),
        Axis(
            "hook",
            "hook kind.action",
            lambda: tuple(f"{k}.{a}" for k, actions in HOOK_KINDS.items() for a in actions),
            lambda f: {f"{h.kind}.{h.action}" for h in f.program.hooks},
        ),
        Axis("hook_node", "node kinds hooks sit on", lambda: NODE_KINDS, lambda f: {n for _, n in f.hook_nodes()}),
        Axis("option", "backward and program options", lambda: OPTIONS, _options),
        Axis(
            "train",
            "optimizer steps (fuzz.features_training: steps, optimizer, foreach, set_to_none, fresh inputs)",
            _train_domain,
            lambda f: _prefixed(features_training.program_features(f.program), "train:"),
        ),
        Axis(
            "checkpoint",
            "checkpointed regions (fuzz.features_training: reentrancy, policy, random ops inside)",
            _checkpoint_domain,
            lambda f: _prefixed(features_training.program_features(f.program), "checkpoint:"),
        ),
        Axis(
            "graph",
            "graph features (fuzz.ir_graph: torch.func terms, subclass leaves, double backward, inner grads, roots)",
            _graph_domain,
            lambda f: _prefixed(ir_graph.program_features(f.program), "graph:"),
        ),
    )
}

#: The tracked pairs of axes. Add an entry for a new combination.
PAIRS: tuple[Pair, ...] = (
    Pair("op", "dtype", "each op at each dtype (of its first input)", lambda f: set(f.op_dtypes())),
    Pair("hook_kind", "hook_node", "each hook kind on each node kind it can sit on", lambda f: set(f.hook_nodes()), _hook_on),
    Pair("category", "mode", "each op family under each mode"),
    Pair("category", "loss", "each op family with each loss"),
    Pair("hook_kind", "mode", "each hook kind under each mode"),
    Pair("mode", "inplace", "in-place writes under each mode"),
    Pair("loss", "mode", "each loss under each mode"),
    Pair("option", "mode", "each option under each mode", None, lambda o, m: not (o == "inputs_restriction" and m == "grad")),
)


def feature_name(axis: str, value: str) -> str:
    return f"{axis}={value}"


def pair_name(pair: Pair, a: str, b: str) -> str:
    return f"{pair.a}={a} & {pair.b}={b}"


def program_coverage(program: Program) -> dict[str, list[str]]:
    """``{"features": [...], "pairs": [...]}`` of ``program``, each sorted
    (a campaign worker's per-program record). Raises
    :class:`fuzz.ir.IRError` on an invalid program."""
    f = Facts.of(program)
    vals = {name: axis.of(f) for name, axis in AXES.items()}
    feats = {feature_name(a, v) for a, vs in vals.items() for v in vs}
    prs = set()
    for pair in PAIRS:
        got = pair.of(f) if pair.of is not None else {(x, y) for x in vals[pair.a] for y in vals[pair.b]}
        prs.update(pair_name(pair, x, y) for x, y in got)
    return {"features": sorted(feats), "pairs": sorted(prs)}


def features(program: Program) -> set[str]:
    """Every ``"axis=value"`` of :data:`AXES` that ``program`` has."""
    return set(program_coverage(program)["features"])


def pairs(program: Program) -> set[str]:
    """Every ``"a=x & b=y"`` of :data:`PAIRS` that ``program`` has."""
    return set(program_coverage(program)["pairs"])


@functools.cache
def domain_features() -> dict[str, tuple[str, ...]]:
    """Per axis, every feature name it can have (the current catalog's)."""
    return {name: tuple(feature_name(name, v) for v in axis.domain()) for name, axis in AXES.items()}


@functools.cache
def domain_pairs() -> dict[str, tuple[str, ...]]:
    """Per pair (``"op x dtype"``), every pair name a program can have."""
    out = {}
    for pair in PAIRS:
        a_dom, b_dom = AXES[pair.a].domain(), AXES[pair.b].domain()
        out[pair.name] = tuple(
            pair_name(pair, x, y) for x in a_dom for y in b_dom if pair.possible is None or pair.possible(x, y)
        )
    return out


def _grouped(counts: Mapping[str, int], domain: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    groups = {}
    for group, names in domain.items():
        seen = {n: counts.get(n, 0) for n in names}
        groups[group] = {
            "total": len(names),
            "covered": sum(1 for n in names if seen[n] > 0),
            "uncovered": [n for n in names if seen[n] == 0],
        }
    return groups


def summary(feature_counts: Mapping[str, int], pair_counts: Mapping[str, int]) -> dict[str, Any]:
    """The ``coverage`` section of ``report.json`` from per-name program
    counts: ``features`` and ``pairs`` (name -> programs that had it),
    ``feature_groups`` (per axis) and ``pair_groups`` (per pair): ``total``
    names the current catalog allows, ``covered``, ``uncovered`` (names)."""
    return {
        "features": dict(sorted(feature_counts.items())),
        "pairs": dict(sorted(pair_counts.items())),
        "feature_groups": _grouped(feature_counts, domain_features()),
        "pair_groups": _grouped(pair_counts, domain_pairs()),
    }


def add_counts(into: dict[str, int], names: Iterable[str]) -> None:
    for n in names:
        into[n] = into.get(n, 0) + 1
