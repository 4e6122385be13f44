"""The fuzzer's program IR: leaves, ops, roots, and how the backward runs.

A :class:`Program` is a straight-line DAG::

    leaves  x0: float32[2, 3] requires_grad
            x1: float64[3]    requires_grad
    ops     v0 = mul(x0, x1)
            v1 = sum(v0, dim=[1], keepdim=False)
    roots   [v1]            loss "sum" -> backward of v1.sum()

Values are named. A leaf or a single-output op is referred to by its name; an
op with several outputs (``split``, ``unbind``) by ``"name:i"``. The op names
come from the catalog in :mod:`fuzz.ops` (an extensible registry), each with
an attribute schema and a shape rule, so :func:`validate` can check a program
without running it and name the field that is wrong.

Program-level fields say how the backward runs (they map one to one onto
:class:`harness.program.ProgramRun`):

* ``roots``: values the backward starts from;
* ``loss``: ``"sum"`` adds ``root.sum()`` of every root into one scalar root
  (implicit gradient); ``"separate"`` passes every root as its own root, with
  a seeded random ``grad_output`` (``None`` for a 0-d root);
* ``mode``: ``"backward"`` (``torch.autograd.backward``, compares leaf
  ``.grad``) or ``"grad"`` (``torch.autograd.grad`` with ``inputs``);
* ``inputs``: values to differentiate with respect to (mode ``"grad"``), or
  the optional ``inputs=`` restriction of mode ``"backward"`` (leaves only);
* ``retain_graph`` and ``repeat``: several backwards on one graph;
* ``seed``: every leaf value and ``grad_output`` is derived from it;
* ``hooks``: autograd hooks registered after the forward, in list order
  (:class:`Hook`): tensor hooks (``register_hook``) that observe, scale,
  shift or zero the gradient, ``retain_grad()``, node pre- and post-hooks
  on a value's ``grad_fn``, post-accumulate-grad hooks on leaves. Every hook
  but ``retain_grad`` appends ``(label, value)`` to the run's trace, which
  the harness compares with eager's; a retained ``.grad`` is compared like a
  leaf's.

* ``resizes``: a *size sequence* (:mod:`harness.capture_rule`): after a run
  at its own sizes the program runs again once per step, each step a
  mapping ``{old size: new size}`` applied to every leaf shape entry equal
  to ``old`` (so broadcast and matmul partners change together; steps are
  relative to the program's own sizes, not to the previous step). Leaf
  values at every size come from the same seed. Every step must give a
  valid program (an op whose attributes carry sizes, a ``reshape`` say, may
  rule a step out); :func:`validate` names the step (``resizes[1]``).

JSON form (:meth:`Program.to_json`) carries ``"schema": SCHEMA_VERSION`` (2);
``resizes`` is an optional schema-2 field, written only when non-empty as a
list of steps, each a list of ``[old, new]`` pairs (so programs without one
are written exactly as before; a reader without it rejects the field);
:meth:`Program.from_json` also reads version 1 (no hooks), and rejects other
versions, unknown fields and anything :func:`validate` rejects, with an
:class:`IRError` naming the place (``hooks[2].target``).

The module is the IR's front door: :class:`Program` and its JSON form live
here; the parts of a program (:class:`Leaf`, :class:`Op`, :class:`Hook`,
:class:`ValueInfo`) in :mod:`fuzz.ir_types`; :func:`validate` and shape
inference in :mod:`fuzz.ir_validate`; :class:`IRError` and the name checks
in :mod:`fuzz.ir_check`. Every name is importable from ``fuzz.ir``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from fuzz import features_training, ir_graph
from fuzz.ir_check import IRError, base_name
from fuzz.ir_check import expect as _expect
from fuzz.ir_check import is_int as _is_int
from fuzz.ir_graph import DoubleBackward, FuncTerm
from fuzz.ir_types import DEFAULT_HOOK_ACTIONS, DTYPES, HOOK_KINDS, LOSSES, MODES, Hook, Leaf, Op, Shape, ValueInfo
from fuzz.ir_validate import (
    check_hook,
    check_resizes,
    infer_outputs,
    inplace_conflicts,
    validate,
    views_made_before,
)

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)


@dataclasses.dataclass(frozen=True)
class Program:
    leaves: tuple[Leaf, ...]
    ops: tuple[Op, ...]
    roots: tuple[str, ...]
    loss: str = "sum"
    mode: str = "backward"
    inputs: tuple[str, ...] | None = None
    retain_graph: bool | None = None
    repeat: int = 1
    seed: int = 0
    name: str = ""
    hooks: tuple[Hook, ...] = ()
    # size sequence steps: each a tuple of (old size, new size) pairs
    resizes: tuple[tuple[tuple[int, int], ...], ...] = ()
    # graph features (fuzz.ir_graph): torch.func terms, subclass leaves, double backward
    func_terms: tuple[FuncTerm, ...] = ()
    subclass_leaves: tuple[str, ...] = ()
    subclass_kind: str = ir_graph.DEFAULT_SUBCLASS_KIND  # of every subclass leaf (ir_graph.SUBCLASSES)
    double_backward: DoubleBackward | None = None
    # optimizer steps and a checkpointed region (fuzz.features_training)
    train: Any = None
    checkpoint: Any = None

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "name": self.name,
            "seed": self.seed,
            "leaves": [leaf.to_dict() for leaf in self.leaves],
            "ops": [op.to_dict() for op in self.ops],
            "roots": list(self.roots),
            "loss": self.loss,
            "mode": self.mode,
            "inputs": None if self.inputs is None else list(self.inputs),
            "retain_graph": self.retain_graph,
            "repeat": self.repeat,
            "hooks": [hook.to_dict() for hook in self.hooks],
            **({"resizes": [[list(pair) for pair in step] for step in self.resizes]} if self.resizes else {}),
            **ir_graph.fields_to_dict(self),
            **features_training.to_dict(self),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> Program:
        program = _parse_program(data)
        validate(program)
        return program

    @classmethod
    def from_json(cls, text: str) -> Program:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise IRError("", f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        return cls.from_dict(data)

    # ------------------------------------------------------------ utilities
    def op_names(self) -> list[str]:
        return [op.op for op in self.ops]

    def op_set(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.op_names())))

    def hook_set(self) -> tuple[str, ...]:
        """``hook:<kind>.<action>`` of every hook, sorted, once each."""
        return tuple(sorted({f"hook:{h.kind}.{h.action}" for h in self.hooks}))

    def features(self) -> list[str]:
        """What a program exercises beyond its ops, for campaign statistics:
        hook kinds and actions, op families, and the backward's options."""
        from fuzz import ops as catalog

        out = list(self.hook_set())
        categories = {catalog.OPS[name].category for name in self.op_names() if name in catalog.OPS}
        out += [f"ops:{c}" for c in ("custom", "inplace_view", "inplace") if c in categories]
        if len(self.roots) > 1:
            out.append("roots:several")
        if self.mode == "grad":
            out.append("mode:grad")
        elif self.inputs is not None:
            out.append("backward:inputs=")
        if self.loss == "separate":
            out.append("loss:separate")
        if self.repeat > 1:
            out.append("repeat:retain_graph")
        if self.resizes:
            out.append("shapes:sequence")
        out += sorted(ir_graph.program_features(self))
        out += sorted(features_training.program_features(self))
        return out

    # ------------------------------------------------------ size sequences
    def leaf_sizes(self) -> tuple[int, ...]:
        """Every leaf shape entry, flattened, in leaf order."""
        return tuple(d for leaf in self.leaves for d in leaf.shape)

    def at_sizes(self, step: Mapping[int, int] | Sequence[tuple[int, int]]) -> Program:
        """This program (without ``resizes``) with every leaf shape entry
        ``old`` replaced by ``step[old]``; not validated."""
        mapping = dict(step.items() if isinstance(step, Mapping) else step)
        leaves = tuple(
            dataclasses.replace(leaf, shape=tuple(mapping.get(d, d) for d in leaf.shape)) for leaf in self.leaves
        )
        return dataclasses.replace(self, leaves=leaves, resizes=())

    def size_variants(self) -> list[Program]:
        """The program at its own sizes, then at each step's (all without
        ``resizes``); a single program when it has no steps."""
        return [self.at_sizes({})] + [self.at_sizes(step) for step in self.resizes]

    def without_resizes(self) -> Program:
        return dataclasses.replace(self, resizes=())

    def size_key(self) -> tuple[int, int, int, int]:
        """Ops, leaves, total leaf elements, JSON length (see also
        :func:`fuzz.reduce.complexity`)."""
        numel = 0
        for leaf in self.leaves:
            n = 1
            for d in leaf.shape:
                n *= d
            numel += n
        return (len(self.ops), len(self.leaves), numel, len(self.to_json(indent=None)))

    def infer(self) -> dict[str, ValueInfo]:
        """Shape/dtype/requires_grad of every value (validates as it goes)."""
        return validate(self)

    def pruned(self) -> Program:
        """Drops ops and leaves that no root or input depends on, and the
        hooks on values that are dropped."""
        needed: set[str] = set()
        for ref in list(self.roots) + list(self.inputs or ()) + ir_graph.referenced(self):
            needed.add(base_name(ref))
        kept: list[Op] = []
        for op in reversed(self.ops):
            if op.name in needed:
                kept.append(op)
                needed.update(base_name(r) for r in op.inputs)
        leaves = tuple(leaf for leaf in self.leaves if leaf.name in needed)
        hooks = tuple(h for h in self.hooks if base_name(h.target) in needed)
        # resize pairs of sizes no kept leaf has go, then steps left empty
        sizes = {d for leaf in leaves for d in leaf.shape}
        steps = tuple(tuple(p for p in step if p[0] in sizes) for step in self.resizes)
        resizes = tuple(step for step in steps if step)
        graph = ir_graph.pruned_fields(self, {leaf.name for leaf in leaves})
        pruned = dataclasses.replace(
            self, leaves=leaves, ops=tuple(reversed(kept)), hooks=hooks, resizes=resizes, **graph
        )
        return features_training.tidy(pruned)

    def without_invalid_hooks(self) -> Program:
        """Drops the hooks :func:`validate` would reject (after an edit that
        turned a hooked op output into a leaf, say); the rest must be valid."""
        values = validate(dataclasses.replace(self, hooks=()))
        keep = []
        for i, hook in enumerate(self.hooks):
            try:
                check_hook(hook, f"hooks[{i}]", values)
            except IRError:
                continue
            keep.append(hook)
        names = [h.name for h in keep]
        keep = [h for j, h in enumerate(keep) if h.name not in names[:j]]
        return dataclasses.replace(self, hooks=tuple(keep))

    def with_name(self, name: str) -> Program:
        return dataclasses.replace(self, name=name)


# ---------------------------------------------------------------- parsing
_PROGRAM_FIELDS_V1 = {
    "schema", "name", "seed", "leaves", "ops", "roots", "loss", "mode",
    "inputs", "retain_graph", "repeat",
}
_PROGRAM_FIELDS = {
    1: _PROGRAM_FIELDS_V1,
    2: _PROGRAM_FIELDS_V1 | {"hooks", "resizes", *ir_graph.FIELDS, *features_training.FIELDS},
}
_REQUIRED_FIELDS = {"schema", "leaves", "ops", "roots"}
_LEAF_FIELDS = {"name", "shape", "dtype", "requires_grad"}
_OP_FIELDS = {"name", "op", "inputs", "attrs"}
_HOOK_FIELDS = {"name", "kind", "target", "action", "arg"}


def _check_fields(obj: Any, where: str, allowed: set[str], required: set[str]) -> None:
    _expect(isinstance(obj, dict), where, f"expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    _expect(not unknown, where, f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(obj))
    _expect(not missing, where, f"missing field(s) {missing}")


def _parse_program(data: Any) -> Program:
    _expect(isinstance(data, dict), "program", f"expected an object, got {type(data).__name__}")
    schema = data.get("schema")
    _expect(
        "schema" not in data or (_is_int(schema) and schema in READABLE_SCHEMAS),
        "schema",
        f"unsupported schema version {schema!r} (this fuzz reads {list(READABLE_SCHEMAS)})",
    )
    _check_fields(data, "program", _PROGRAM_FIELDS.get(schema, _PROGRAM_FIELDS[SCHEMA_VERSION]), _REQUIRED_FIELDS)
    leaves_raw = data["leaves"]
    _expect(isinstance(leaves_raw, list), "leaves", "expected a list")
    leaves = []
    for i, raw in enumerate(leaves_raw):
        where = f"leaves[{i}]"
        _check_fields(raw, where, _LEAF_FIELDS, {"name", "shape"})
        shape = raw["shape"]
        _expect(
            isinstance(shape, list) and all(_is_int(d) for d in shape),
            f"{where}.shape",
            f"expected a list of ints, got {shape!r}",
        )
        rg = raw.get("requires_grad", True)
        _expect(isinstance(rg, bool), f"{where}.requires_grad", f"expected a bool, got {rg!r}")
        leaves.append(Leaf(raw["name"], tuple(shape), raw.get("dtype", "float32"), rg))
    ops_raw = data["ops"]
    _expect(isinstance(ops_raw, list), "ops", "expected a list")
    ops = []
    for i, raw in enumerate(ops_raw):
        where = f"ops[{i}]"
        _check_fields(raw, where, _OP_FIELDS, {"name", "op", "inputs"})
        inputs = raw["inputs"]
        _expect(isinstance(inputs, list), f"{where}.inputs", f"expected a list, got {inputs!r}")
        attrs = raw.get("attrs", {})
        _expect(isinstance(attrs, dict), f"{where}.attrs", f"expected an object, got {attrs!r}")
        ops.append(Op(raw["name"], raw["op"], tuple(inputs), dict(attrs)))
    roots = data["roots"]
    _expect(isinstance(roots, list), "roots", f"expected a list, got {roots!r}")
    inputs = data.get("inputs")
    _expect(inputs is None or isinstance(inputs, list), "inputs", f"expected a list or null, got {inputs!r}")
    hooks_raw = data.get("hooks", [])
    _expect(isinstance(hooks_raw, list), "hooks", f"expected a list, got {hooks_raw!r}")
    hooks = []
    for i, raw in enumerate(hooks_raw):
        where = f"hooks[{i}]"
        _check_fields(raw, where, _HOOK_FIELDS, {"name", "kind", "target"})
        hooks.append(Hook(raw["name"], raw["kind"], raw["target"], raw.get("action", "observe"), raw.get("arg")))
    resizes_raw = data.get("resizes", [])
    _expect(isinstance(resizes_raw, list), "resizes", f"expected a list of steps, got {resizes_raw!r}")
    resizes = []
    for i, raw in enumerate(resizes_raw):
        where = f"resizes[{i}]"
        _expect(
            isinstance(raw, list)
            and all(isinstance(p, list) and len(p) == 2 and all(_is_int(v) for v in p) for p in raw),
            where,
            f"expected a list of [old size, new size] pairs of ints, got {raw!r}",
        )
        resizes.append(tuple((p[0], p[1]) for p in raw))
    return Program(
        **ir_graph.parse_fields(data, _expect),
        resizes=tuple(resizes),
        hooks=tuple(hooks),
        leaves=tuple(leaves),
        ops=tuple(ops),
        roots=tuple(roots),
        loss=data.get("loss", "sum"),
        mode=data.get("mode", "backward"),
        inputs=None if inputs is None else tuple(inputs),
        retain_graph=data.get("retain_graph"),
        repeat=data.get("repeat", 1),
        seed=data.get("seed", 0),
        name=data.get("name", ""),
        **features_training.parse(data, _expect),
    )


__all__ = [
    "DTYPES",
    "DEFAULT_HOOK_ACTIONS",
    "HOOK_KINDS",
    "Hook",
    "IRError",
    "Leaf",
    "LOSSES",
    "MODES",
    "Op",
    "Program",
    "READABLE_SCHEMAS",
    "SCHEMA_VERSION",
    "Shape",
    "ValueInfo",
    "base_name",
    "check_hook",
    "check_resizes",
    "infer_outputs",
    "inplace_conflicts",
    "views_made_before",
    "validate",
]
