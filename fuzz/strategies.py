"""Hypothesis strategies for random autograd programs.

:func:`programs` builds a DAG op by op: it picks an op from the catalog, a
first input among the values made so far whose shape the op accepts (or a new
leaf), then lets the op's ``plan`` draw the shapes of its other inputs and its
attributes; each other input reuses a value of that shape or is a new leaf.
Every draw is ordered so that Hypothesis' shrinking moves toward simpler
programs: fewer ops, fewer and smaller leaves, reuse of existing values, the
first ops of the catalog, loss ``"sum"``, mode ``"backward"``, one root.

Ops are drawn by weight (:func:`op_weights`: 1 each, ``rare`` ops 1/4, or a
campaign's per-round ``GenConfig.op_weights``), not by Hypothesis' taste:
while generating, Hypothesis makes many choices at their simplest value (the
first programs of a run extend a short random prefix with simplest choices),
so a plain ``sampled_from`` over the catalog piles up its first op. Here an
op is a slot of a table of 4096 (:mod:`fuzz.op_table`: every op in
slots proportional to its weight, spread evenly) picked by a point drawn as
two bytes, shifted by ``GenConfig.op_rotation`` (a campaign sets one per
round): only the all-zero point maps to one fixed op, slot ``op_rotation``.
Shrinking lowers the point, toward that slot; with rotation 0 and the
default weights it is the catalog's first op. The "another op?" flag stops
on its simplest value, so those simplest programs have one op.

After the roots and the backward options, hooks are drawn on values the
roots depend on (:func:`_draw_hooks`). Custom ``autograd.Function`` s and
in-place ops on views are ops of the catalog and drawn like the others (the
``rare`` ``mul_inplace`` a quarter as often).

Some programs then become a *size sequence* (:func:`_draw_resizes`):
resize steps that re-run it at new leaf sizes.

The result is validated, so it always type-checks, and pruned (ops that no
root or input needs are dropped) unless ``GenConfig.prune`` is off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from fuzz import features_graph
from fuzz import ops as catalog
from fuzz import training_gen
from fuzz.draws import rare
from fuzz.ir import (
    DTYPES,
    DEFAULT_HOOK_ACTIONS,
    HOOK_KINDS,
    LOSSES,
    MODES,
    Hook,
    IRError,
    Leaf,
    Op,
    Program,
    ValueInfo,
    base_name,
    infer_outputs,
    inplace_conflicts,
    validate,
    views_made_before,
)
from fuzz.op_table import OP_SLOTS, draw_op, op_slots, op_weights


@dataclasses.dataclass(frozen=True)
class GenConfig:
    """Knobs of :func:`programs`; the defaults are what a campaign uses."""

    max_ops: int = 12
    max_leaves: int = 5
    dtypes: tuple[str, ...] = DTYPES
    ops: tuple[str, ...] | None = None  # None: the whole catalog
    modes: tuple[str, ...] = MODES
    losses: tuple[str, ...] = LOSSES
    max_roots: int = 3
    mixed_dtypes: bool = True  # now and then a leaf of the other dtype
    no_grad_leaves: bool = True  # now and then a leaf with requires_grad=False
    inputs_restriction: bool = True  # now and then backward(inputs=...)
    repeat: bool = True  # now and then two backwards with retain_graph=True
    hooks: bool = True  # most programs get hooks (see _draw_hooks)
    max_hooks: int = 4
    # "kind.action" pairs to draw hooks from (None: every one in
    # DEFAULT_HOOK_ACTIONS; named here, also the opt-in ones of HOOK_KINDS),
    # e.g. to leave out what a peer subject does not support
    hook_actions: tuple[str, ...] | None = None
    # At most one retain_grad() per tensor. A second call is a no-op in
    # eager, but with cagrad imported it raises RuntimeError ("Boolean value
    # of Tensor with more than one value is ambiguous": the hook census keeps
    # a WeakSet of tensors, and WeakSet membership compares tensors with ==).
    # That hits the eager reference too (the census patches Tensor.retain_grad
    # process-wide), so every such program is a "build error". Set False to
    # generate the double call again once cagrad handles it.
    retain_grad_once: bool = True
    # Drop ops that no root needs. A campaign turns this off and prunes each
    # program itself: then the number of ops the shrinker sees only goes down
    # as it deletes choices (pruning first would let a simpler choice make
    # more ops live).
    prune: bool = True
    # Size sequences: some programs get 1..max_resizes resize
    # steps (see _draw_resizes): it runs again at new sizes, and cagrad's
    # captures over the sequence are checked (harness.capture_rule).
    shapes: bool = True
    max_resizes: int = 3
    # Graph features (fuzz.ir_graph): torch.func terms, double backward,
    # TwoTensor leaves, roots at outputs >= 1 (each rare; see
    # features_graph.draw_graph_features). The inner_grad hook action and
    # the ops of fuzz.ops_graph are drawn as hooks and ops.
    graph_features: bool = True
    # Op weights: (name, weight) pairs, weight >= 0 (an op left out or of
    # weight 0 is never drawn; None: op_weights' defaults). A campaign
    # passes per-round weights that steer toward ops drawn less so far
    # (fuzz.campaign.steer).
    op_weights: tuple[tuple[str, float], ...] | None = None
    # Shifts the op table (see the module docstring), 0 <= op_rotation <
    # OP_SLOTS: the simplest op choice is slot op_rotation.
    op_rotation: int = 0
    # Optimizer steps and checkpoint regions, each in about one program in
    # eight (fuzz.training_gen); the random and data-dependent-size ops are
    # ops of the catalog (fuzz.ops_dynamic).
    training: bool = True
    checkpoint: bool = True

    def allowed_actions(self, kind: str) -> list[str]:
        if self.hook_actions is None:
            return list(DEFAULT_HOOK_ACTIONS[kind])
        return [a for a in HOOK_KINDS[kind] if f"{kind}.{a}" in self.hook_actions]

    def op_names(self) -> list[str]:
        names = list(self.ops) if self.ops is not None else list(catalog.OPS)
        unknown = [n for n in names if n not in catalog.OPS]
        if unknown:
            raise ValueError(f"unknown op(s) {unknown}; known: {sorted(catalog.OPS)}")
        if not names:
            raise ValueError("no ops to generate from")
        return names

    def op_table(self) -> tuple[str, ...]:
        """The :data:`OP_SLOTS` slots ops are drawn from (see :func:`op_slots`).
        Raises ValueError on unknown ops, or weights negative or all 0."""
        return op_slots(tuple(self.op_names()), self.op_weights)


def _first_shape(draw: Any, spec: catalog.OpSpec) -> tuple[int, ...] | None:
    ranks = [
        r for r in range(catalog.MAX_RANK + 1) if spec.accepts((1,) * r) or spec.accepts((2,) * r)
    ]
    if not ranks:
        return None
    rank = draw(st.sampled_from(ranks))
    for _ in range(3):
        shape = tuple(draw(st.integers(1, catalog.MAX_DIM)) for _ in range(rank))
        if spec.accepts(shape):
            return shape
    for fallback in ((2,) * rank, (1,) * rank):
        if spec.accepts(fallback):
            return fallback
    return None  # pragma: no cover


class _Builder:
    def __init__(self, draw: Any, cfg: GenConfig):
        self.draw = draw
        self.cfg = cfg
        self.leaves: list[Leaf] = []
        self.ops: list[Op] = []
        self.pool: list[ValueInfo] = []
        self.alias: dict[str, str] = {}  # value -> the value whose tensor it is (identity ops)
        # views whose base an in-place op wrote into after they were made:
        # no tensor hook on them (fuzz.ir_validate: eager crashes)
        self.stale: set[str] = set()
        self.dtype = draw(st.sampled_from(list(cfg.dtypes)))

    def new_leaf(self, shape: tuple[int, ...], dtype: str | None = None) -> ValueInfo | None:
        if len(self.leaves) >= self.cfg.max_leaves:
            return None
        draw = self.draw
        if dtype is None:
            dtype = self.dtype
            others = [d for d in self.cfg.dtypes if d != dtype]
            if self.cfg.mixed_dtypes and others and rare(draw):
                dtype = draw(st.sampled_from(others))
        requires_grad = not (self.leaves and self.cfg.no_grad_leaves and rare(draw, 6))
        leaf = Leaf(f"x{len(self.leaves)}", tuple(shape), dtype, requires_grad)
        self.leaves.append(leaf)
        info = ValueInfo(leaf.name, leaf.shape, dtype, requires_grad, is_leaf=True)
        self.pool.append(info)
        return info

    def tensor_of(self, ref: str) -> str:
        return self.alias.get(ref, ref)

    def pick(self, candidates: Sequence[ValueInfo], shape: tuple[int, ...], dtype: str | None) -> ValueInfo | None:
        """Reuses a candidate (most recent first) or makes a new leaf."""
        draw = self.draw
        if candidates:
            i = draw(st.integers(0, len(candidates)))
            if i < len(candidates) or len(self.leaves) >= self.cfg.max_leaves:
                return candidates[-1 - min(i, len(candidates) - 1)]
        return self.new_leaf(shape, dtype)

    def add_op(self, op_name: str) -> None:
        draw = self.draw
        spec = catalog.OPS[op_name]
        if spec.inplace_first:
            # writes into an earlier fresh value that requires grad; never a
            # new leaf, and never a base that split/unbind made views of
            # (eager rejects those views once the base changes: ir.inplace_conflicts)
            made = {v.ref: v for v in self.pool}
            firsts = [
                v
                for v in self.pool
                if spec.accepts(v.shape)
                and v.fresh
                and v.requires_grad
                and not v.is_leaf
                and not inplace_conflicts(v, made)
            ]
            if not firsts:
                return
        else:
            firsts = [v for v in self.pool if spec.accepts(v.shape)]
        first: ValueInfo | None
        if firsts and (spec.inplace_first or not (len(self.leaves) < self.cfg.max_leaves and rare(draw))):
            # mostly the newest value, so that programs grow deep, not wide
            back = 0 if len(firsts) == 1 or not rare(draw, 3) else draw(st.integers(1, len(firsts) - 1))
            first = firsts[-1 - back]
        else:
            shape = _first_shape(draw, spec)
            first = None if shape is None else self.new_leaf(shape)
        if first is None:
            return
        other_shapes, attrs = spec.plan(draw, first.shape)
        inputs = [first]
        same_dtype = first.dtype if spec.dtype_rule == "same" else None
        for shape in other_shapes:
            cands = [
                v
                for v in self.pool
                if v.shape == tuple(shape)
                and (same_dtype is None or v.dtype == same_dtype)
                and (not spec.inplace_first or v.fresh or v.is_leaf)  # no view of the written tensor
            ]
            chosen = self.pick(cands, tuple(shape), same_dtype)
            if chosen is None:
                return
            inputs.append(chosen)
        if spec.inplace_first:
            self.stale.update(views_made_before(first, {v.ref: v for v in self.pool}))
        name = f"v{len(self.ops)}"
        # The catalog's rules must agree with its plans; a SpecError here is a
        # bug in fuzz/ops.py and is left to surface.
        outs = infer_outputs(spec, name, attrs, inputs)
        if spec.is_identity([v.shape for v in inputs], [v.dtype for v in inputs], attrs):
            self.alias[name] = self.tensor_of(first.ref)
        self.ops.append(Op(name, op_name, tuple(v.ref for v in inputs), attrs))
        self.pool.extend(outs)


def _ancestry(ops: Sequence[Op], refs: Sequence[str]) -> set[str]:
    needed = {base_name(r) for r in refs}
    for op in reversed(ops):
        if op.name in needed:
            needed.update(base_name(r) for r in op.inputs)
    return needed


@st.composite
def _programs(draw: Any, cfg: GenConfig) -> Program:
    b = _Builder(draw, cfg)
    b.new_leaf(draw(st.lists(st.integers(1, catalog.MAX_DIM), max_size=catalog.MAX_RANK).map(tuple)))
    slots = cfg.op_table()
    for i in range(cfg.max_ops):
        # An "another op?" flag before each op but the first, as st.lists
        # has: the shrinker deletes an op together with its flag, or ends the
        # program there (0 stops); random generation goes on 4 times in 5.
        # The simplest programs Hypothesis runs while generating (a random
        # prefix, then simplest choices) so have one op, at slot op_rotation,
        # which a campaign's steering gives to the op that needs it most.
        if i and draw(st.integers(0, 4)) == 0:
            break
        b.add_op(draw_op(draw, slots, cfg.op_rotation))

    op_values = [v for v in b.pool if v.requires_grad and base_name(v.ref) not in {leaf.name for leaf in b.leaves}]
    leaf_values = [v for v in b.pool if v.requires_grad and v not in op_values]
    main = op_values[-1] if op_values else leaf_values[0]
    consumed = {r for op in b.ops for r in op.inputs}
    sinks = [v.ref for v in op_values if v.ref not in consumed and v.ref != main.ref]
    roots = [main.ref]
    for ref in reversed(sinks):  # most other sinks become roots too
        if len(roots) < cfg.max_roots and not rare(draw, 4):
            roots.append(ref)
    loss = draw(st.sampled_from(list(cfg.losses)))
    mode = draw(st.sampled_from(list(cfg.modes)))

    needed = _ancestry(b.ops, roots)
    rg_needed = [v.ref for v in b.pool if v.requires_grad and base_name(v.ref) in needed]
    rg_leaves = [leaf.name for leaf in b.leaves if leaf.requires_grad and leaf.name in needed]
    inputs: list[str] | None = None
    if mode == "grad":
        inputs = draw(st.lists(st.sampled_from(rg_needed), min_size=1, max_size=3, unique=True))
    elif cfg.inputs_restriction and rg_leaves and rare(draw, 5):
        inputs = draw(st.lists(st.sampled_from(rg_leaves), min_size=1, max_size=3, unique=True))

    retain_graph, repeat = None, 1
    if cfg.repeat and rare(draw, 6):
        retain_graph, repeat = True, 2
    hooks = _draw_hooks(draw, cfg, b, needed) if cfg.hooks else []
    seed = draw(st.integers(0, 2**32 - 1))
    program = Program(
        leaves=tuple(b.leaves),
        ops=tuple(b.ops),
        roots=tuple(roots),
        loss=loss,
        mode=mode,
        inputs=None if inputs is None else tuple(inputs),
        retain_graph=retain_graph,
        repeat=repeat,
        seed=seed,
        hooks=tuple(hooks),
    )
    if cfg.graph_features:
        program = features_graph.draw_graph_features(draw, program, b.pool)
    if cfg.prune:
        program = program.pruned()
    # (training features are drawn only where validation allows them: not
    # with a graph feature that runs in the backward's stage, see
    # fuzz.ir_graph.check)
    program = training_gen.draw_features(draw, program, cfg.training, cfg.checkpoint)
    # (a program that trains is no size sequence: the capture rule counts
    # one backward per size, and later steps may capture anew by design)
    if (
        cfg.shapes
        and cfg.max_resizes >= 1
        and program.train is None
        and not features_graph.stage_features(program)
    ):
        program = _draw_resizes(draw, cfg, program)
    validate(program)
    return program


_NEW_SIZES = tuple(range(2, catalog.MAX_DIM + 4))


def _draw_resizes(draw: Any, cfg: GenConfig, program: Program) -> Program:
    """A program becomes a size sequence on one draw in three (Hypothesis's
    draw, whose bias makes it fewer: with the programs that train or have
    graph-stage features, which never do, 56 of seed 1's first 500 programs
    were, ``python -m fuzz coverage --seed 1``): 1..``max_resizes``
    steps, each mapping one or two leaf sizes >= 2 to new values (>= 2, and
    now and then 1, which torch and cagrad specialize). A step whose program
    does not validate (an op's attributes carry that size) is left out.
    About one sequence in three then repeats one of its steps: sizes seen
    before must cost no capture, must not run code compiled for other
    sizes (a wrong cache hit), and a second call at the same sizes is when
    inductor graphs get their static compile (:mod:`cagrad.compile.specialize`).
    Shrinks to no steps."""
    olds = sorted({d for d in program.leaf_sizes() if d >= 2})
    if not olds or draw(st.integers(0, 2)) != 2:
        return program
    steps: list[tuple[tuple[int, int], ...]] = []
    for _ in range(draw(st.integers(1, cfg.max_resizes))):
        chosen = draw(st.lists(st.sampled_from(olds), min_size=1, max_size=min(2, len(olds)), unique=True))
        step = []
        for old in sorted(chosen):
            new = 1 if rare(draw, 6) else draw(st.sampled_from([n for n in _NEW_SIZES if n != old]))
            step.append((old, new))
        candidate = dataclasses.replace(program, resizes=(tuple(step),))
        try:
            validate(candidate)
        except IRError:
            continue
        steps.append(tuple(step))
    if steps and draw(st.integers(0, 2)) == 0:
        steps.append(draw(st.sampled_from(steps)))
    return dataclasses.replace(program, resizes=tuple(steps))


_SCALE_ARGS = (2.0, 0.5, -1.0)
_SHIFT_ARGS = (0.5, -1.0)


def _hook_targets(kind: str, values: Sequence[ValueInfo], stale: set[str]) -> list[ValueInfo]:
    if kind in ("retain_grad", "pre", "post"):
        return [v for v in values if not v.is_leaf]
    if kind == "post_accumulate":
        return [v for v in values if v.is_leaf]
    return [v for v in values if v.ref not in stale]


def _draw_hooks(draw: Any, cfg: GenConfig, b: _Builder, needed: set[str]) -> list[Hook]:
    """Hooks on values the roots depend on: about three programs in four get
    1..``max_hooks``. Now and then a hook goes on the tensor the previous one
    hooked (several hooks on one tensor), and a hook on one output of a
    multi-output op (split, unbind, fn_sin_cos) mostly gets a twin on another
    output. Shrinks to no hooks, then to ``tensor``/``observe``."""
    values = [v for v in b.pool if v.requires_grad and base_name(v.ref) in needed]
    if not values or cfg.max_hooks < 1 or rare(draw, 4):
        return []
    count = draw(st.integers(1, cfg.max_hooks))
    hooks: list[Hook] = []
    retained: set[str] = set()
    for i in range(count):
        # tensor hooks (seven actions) twice as likely as each other kind
        kinds = [k for k in ("tensor", *HOOK_KINDS) if _hook_targets(k, values, b.stale) and cfg.allowed_actions(k)]
        if not kinds:
            break
        kind = draw(st.sampled_from(kinds))
        targets = _hook_targets(kind, values, b.stale)
        target: ValueInfo | None = None
        if hooks and rare(draw, 3):
            prev = hooks[-1].target
            base, _, index = prev.partition(":")
            siblings = [v for v in targets if index and v.ref.startswith(base + ":") and v.ref != prev]
            same = [v for v in targets if v.ref == prev]
            choice = draw(st.sampled_from(["same", "sibling"]))
            pool = (same or siblings) if choice == "same" else (siblings or same)
            if pool:
                target = pool[draw(st.integers(0, len(pool) - 1))]
        if target is None:
            target = targets[-1 - draw(st.integers(0, len(targets) - 1))]  # the newest first
        if kind == "retain_grad" and cfg.retain_grad_once:
            if b.tensor_of(target.ref) in retained:
                continue
            retained.add(b.tensor_of(target.ref))
        action = features_graph.draw_hook_action(draw, cfg.allowed_actions(kind))
        arg: float | int | None = None
        if action in ("scale", "pure_scale"):
            arg = draw(st.sampled_from(_SCALE_ARGS))
        elif action in ("shift", "pure_shift"):
            arg = draw(st.sampled_from(_SHIFT_ARGS))
        elif action == "drop":
            arg = draw(st.integers(0, 2))
        hooks.append(Hook(f"h{i}", kind, target.ref, action, arg))
        base, _, index = target.ref.partition(":")
        siblings = [v for v in _hook_targets(kind, values, b.stale) if index and v.ref.startswith(base + ":") and v.ref != target.ref]
        if kind == "retain_grad" and cfg.retain_grad_once:
            siblings = [v for v in siblings if b.tensor_of(v.ref) not in retained]
        if siblings and len(hooks) < cfg.max_hooks and not rare(draw, 3):
            # a hook of the same kind on another output of that multi-output op
            other = siblings[draw(st.integers(0, len(siblings) - 1))]
            hooks.append(Hook(f"h{i}s", kind, other.ref, action, arg))
            if kind == "retain_grad":
                retained.add(b.tensor_of(other.ref))
    return hooks


def programs(config: GenConfig | None = None, **overrides: Any) -> st.SearchStrategy[Program]:
    """Random valid programs; ``overrides`` replace :class:`GenConfig` fields."""
    cfg = dataclasses.replace(config or GenConfig(), **overrides)
    cfg.op_table()  # fail early on unknown names and bad weights
    if not 0 <= cfg.op_rotation < OP_SLOTS:
        raise ValueError(f"op_rotation must be in [0, {OP_SLOTS}), got {cfg.op_rotation}")
    known = {f"{k}.{a}" for k, actions in HOOK_KINDS.items() for a in actions}
    unknown = sorted(set(cfg.hook_actions or ()) - known)
    if unknown:
        raise ValueError(f"unknown hook action(s) {unknown}; known: {sorted(known)}")
    return _programs(cfg)
