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
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fuzz import features_training, ir_graph
from fuzz.ir_graph import DoubleBackward, FuncTerm

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)

DTYPES = ("float32", "float64")
MODES = ("backward", "grad")
LOSSES = ("sum", "separate")

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REF_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::([0-9]+))?$")

Shape = tuple[int, ...]


class IRError(ValueError):
    """A malformed program; ``where`` names the field (``ops[3].inputs[1]``)."""

    def __init__(self, where: str, message: str):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}" if where else message)


@dataclasses.dataclass(frozen=True)
class Leaf:
    name: str
    shape: Shape
    dtype: str = "float32"
    requires_grad: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "requires_grad": self.requires_grad,
        }


@dataclasses.dataclass(frozen=True)
class Op:
    """``name = op(*inputs, **attrs)``; ``inputs`` are value references."""

    name: str
    op: str
    inputs: tuple[str, ...]
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "inputs": list(self.inputs),
            "attrs": _jsonable(self.attrs),
        }

    def __hash__(self) -> int:  # attrs is a dict; hash by its JSON form
        return hash((self.name, self.op, self.inputs, json.dumps(_jsonable(self.attrs), sort_keys=True)))


# hook kind -> the actions it takes (the first is the simplest)
HOOK_KINDS: dict[str, tuple[str, ...]] = {
    "tensor": ("observe", "scale", "shift", "zero", "callback", "pure_scale", "pure_shift", "inner_grad"),
    "retain_grad": ("observe",),
    "pre": ("observe", "scale"),
    "post": ("observe", "scale", "drop"),
    "post_accumulate": ("observe", "callback"),
}
# actions that take an ``arg``: a number, or (drop) an index
_ARG_ACTIONS = {
    "scale": "number",
    "shift": "number",
    "pure_scale": "number",
    "pure_shift": "number",
    "drop": "index",
}


@dataclasses.dataclass(frozen=True)
class Hook:
    """An autograd hook registered on value ``target`` after the forward.

    ``kind``:

    * ``"tensor"``: ``target.register_hook(fn)``; ``fn(g)`` records ``g`` and
      returns None (``observe``), ``g * arg`` (``scale``), ``g + arg``
      (``shift``) or ``torch.zeros_like(g)`` (``zero``); ``callback``
      returns None and queues (``queue_callback``) a callback that records
      ``g`` again under ``"<label> callback"`` after the whole backward;
      ``pure_scale`` and ``pure_shift`` return ``g * arg`` and ``g + arg``
      and record nothing: pure functions of the gradient, which cagrad
      traces into its graph (``cagrad.hooks.hook_tracing``) where nothing else of
      the user's runs in the backward; ``inner_grad`` starts a backward
      inside the hook: ``torch.autograd.grad`` of ``(a.sin() * a).sum()``
      for ``a = g.detach().requires_grad_()`` (a small graph of its own),
      records that grad ``d`` and returns ``g + d``
      (:func:`fuzz.features_graph.inner_grad_hook`);
    * ``"retain_grad"``: ``target.retain_grad()`` on a non-leaf; its
      ``.grad`` is compared after the backward like a leaf's;
    * ``"pre"``: ``target.grad_fn.register_prehook(fn)``; ``fn(grad_outputs)``
      records them, returns None or (``scale``) each times ``arg``;
    * ``"post"``: ``target.grad_fn.register_hook(fn)``; ``fn(grad_inputs,
      grad_outputs)`` records both, returns None, each grad input times
      ``arg`` (``scale``), or the grad inputs with entry ``arg % len`` set to
      None (``drop``);
    * ``"post_accumulate"``: ``leaf.register_post_accumulate_grad_hook(fn)``;
      ``fn(p)`` records ``p.grad``; ``callback`` also queues a callback that
      records ``p.grad`` as it is once the whole backward is done.

    The trace label is :attr:`label` (``"h0 tensor v3"``), never an id.
    """

    name: str
    kind: str
    target: str
    action: str = "observe"
    arg: float | int | None = None

    @property
    def label(self) -> str:
        return f"{self.name} {self.kind} {self.target}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "target": self.target, "action": self.action}
        if self.arg is not None:
            out["arg"] = self.arg
        return out


@dataclasses.dataclass(frozen=True)
class ValueInfo:
    """What shape inference knows about one value.

    ``is_leaf``: the tensor is a leaf (a leaf itself, or an op that returned
    a leaf unchanged, like ``x.to(x.dtype)``); ``fresh``: a newly allocated
    tensor that is not a view of anything (in-place ops may write to it).

    The view model (what eager allows after an in-place op, see
    :func:`inplace_conflicts`): ``base`` is the value whose memory this
    tensor shares, resolved through views and ops that return their input
    (torch's ``._base``, or the tensor itself); empty for a value that owns
    its memory (:attr:`memory` is then its own ref). ``multi_view``: a view
    made by a multi-output view op (``split``, ``unbind``), or a view of one;
    torch forbids using such a view, or modifying it, once its base was
    modified in place.
    """

    ref: str
    shape: Shape
    dtype: str
    requires_grad: bool
    is_leaf: bool = False
    fresh: bool = False
    base: str = ""
    multi_view: bool = False

    @property
    def memory(self) -> str:
        """The ref of the value that owns this tensor's memory."""
        return self.base or self.ref


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


def base_name(ref: str) -> str:
    return ref.split(":", 1)[0]


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


def _expect(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise IRError(where, message)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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


# ------------------------------------------------------------- validation
def validate(program: Program) -> dict[str, ValueInfo]:
    """Checks every field and runs shape inference.

    Returns the inferred :class:`ValueInfo` of every value reference; raises
    :class:`IRError` naming the first problem found.
    """
    from fuzz import ops as catalog

    _expect(isinstance(program.name, str), "name", f"expected a string, got {program.name!r}")
    _expect(_is_int(program.seed) and program.seed >= 0, "seed", f"expected an int >= 0, got {program.seed!r}")
    _expect(program.loss in LOSSES, "loss", f"unknown loss {program.loss!r}; expected one of {list(LOSSES)}")
    _expect(program.mode in MODES, "mode", f"unknown mode {program.mode!r}; expected one of {list(MODES)}")
    _expect(
        program.retain_graph is None or isinstance(program.retain_graph, bool),
        "retain_graph",
        f"expected a bool or null, got {program.retain_graph!r}",
    )
    _expect(_is_int(program.repeat) and program.repeat >= 1, "repeat", f"expected an int >= 1, got {program.repeat!r}")
    _expect(
        program.repeat == 1 or program.retain_graph is True,
        "repeat",
        f"repeat={program.repeat} needs retain_graph=true",
    )

    values: dict[str, ValueInfo] = {}
    names: set[str] = set()
    multi: dict[str, int] = {}

    def declare(name: Any, where: str) -> None:
        _expect(
            isinstance(name, str) and bool(_NAME_RE.match(name)),
            where,
            f"invalid name {name!r} (expected an identifier)",
        )
        _expect(name not in names, where, f"duplicate name {name!r}")
        names.add(name)

    for i, leaf in enumerate(program.leaves):
        where = f"leaves[{i}]"
        declare(leaf.name, f"{where}.name")
        _expect(
            leaf.dtype in DTYPES, f"{where}.dtype", f"unknown dtype {leaf.dtype!r}; expected one of {list(DTYPES)}"
        )
        _expect(
            isinstance(leaf.shape, tuple) and all(_is_int(d) and d >= 0 for d in leaf.shape),
            f"{where}.shape",
            f"expected non-negative ints, got {list(leaf.shape)!r}",
        )
        _expect(isinstance(leaf.requires_grad, bool), f"{where}.requires_grad", "expected a bool")
        values[leaf.name] = ValueInfo(leaf.name, leaf.shape, leaf.dtype, leaf.requires_grad, is_leaf=True)

    def resolve(ref: Any, where: str) -> ValueInfo:
        _expect(isinstance(ref, str), where, f"expected a value reference (string), got {ref!r}")
        m = _REF_RE.match(ref)
        _expect(m is not None, where, f"malformed value reference {ref!r}")
        base, index = m.group(1), m.group(2)
        if base in multi:
            n = multi[base]
            _expect(
                index is not None,
                where,
                f"{base!r} has {n} outputs; refer to one as '{base}:0' .. '{base}:{n - 1}'",
            )
            _expect(int(index) < n, where, f"{ref!r}: {base!r} has only {n} outputs")
        else:
            _expect(index is None or base not in values, where, f"{base!r} has a single output; write {base!r}")
        _expect(ref in values, where, f"unknown value {ref!r} (not a leaf or an earlier op's output)")
        return values[ref]

    for i, op in enumerate(program.ops):
        where = f"ops[{i}]"
        declare(op.name, f"{where}.name")
        _expect(isinstance(op.op, str) and op.op in catalog.OPS, f"{where}.op", f"unknown op {op.op!r}")
        spec = catalog.OPS[op.op]
        n_in = len(op.inputs)
        _expect(
            spec.min_arity <= n_in <= spec.max_arity,
            f"{where}.inputs",
            f"{op.op} takes {spec.arity_text()} input(s), got {n_in}",
        )
        infos = [resolve(ref, f"{where}.inputs[{j}]") for j, ref in enumerate(op.inputs)]
        try:
            catalog.check_attrs(spec, op.attrs)
            outs = infer_outputs(spec, op.name, op.attrs, infos)
        except catalog.AttrError as e:
            raise IRError(f"{where}.attrs" + (f".{e.attr}" if e.attr else ""), f"{op.op}: {e}") from None
        except catalog.DTypeError as e:
            dtypes = ", ".join(info.dtype for info in infos)
            raise IRError(where, f"{op.op}: dtype mismatch: {e} (input dtypes {dtypes})") from None
        except catalog.ShapeError as e:
            shapes = ", ".join(str(list(info.shape)) for info in infos)
            raise IRError(where, f"{op.op}: shape mismatch: {e} (input shapes {shapes})") from None
        if spec.inplace_first:
            _expect(
                infos[0].fresh and infos[0].requires_grad and not infos[0].is_leaf,
                f"{where}.inputs[0]",
                f"{op.op} writes into its first input in place: {infos[0].ref!r} must be a fresh (non-view) "
                "op output that requires grad, not a leaf or a view",
            )
            for j, info in enumerate(infos[1:], 1):
                _expect(
                    info.fresh or info.is_leaf,
                    f"{where}.inputs[{j}]",
                    f"{op.op}: {info.ref!r} may be a view overlapping the written tensor; use a fresh value or a leaf",
                )
            stale = inplace_conflicts(infos[0], values)
            _expect(
                not stale,
                f"{where}.inputs[0]",
                f"{op.op} writes into {infos[0].ref!r} in place, but {stale[0] if stale else ''!r} is a view of it "
                "made by a multi-output view op (split, unbind): eager rejects such a view once its base is "
                "modified in place",
            )
        if spec.multi_output:
            multi[op.name] = len(outs)
        for info in outs:
            values[info.ref] = info

    _expect(len(program.roots) >= 1, "roots", "at least one root is needed")
    for j, ref in enumerate(program.roots):
        info = resolve(ref, f"roots[{j}]")
        _expect(
            info.requires_grad,
            f"roots[{j}]",
            f"root {ref!r} does not require grad (no leaf with requires_grad reaches it)",
        )
    if program.mode == "grad":
        _expect(bool(program.inputs), "inputs", "mode 'grad' needs a non-empty list of inputs")
    if program.inputs is not None:
        _expect(len(program.inputs) >= 1, "inputs", "an empty inputs= list is not allowed (use null)")
        for j, ref in enumerate(program.inputs):
            info = resolve(ref, f"inputs[{j}]")
            _expect(info.requires_grad, f"inputs[{j}]", f"input {ref!r} does not require grad")
            if program.mode == "backward":
                _expect(
                    any(leaf.name == ref for leaf in program.leaves),
                    f"inputs[{j}]",
                    f"mode 'backward' restricts inputs= to leaves; {ref!r} is not a leaf",
                )
        _expect(len(set(program.inputs)) == len(program.inputs), "inputs", "duplicate entries")
    _expect(isinstance(program.hooks, tuple), "hooks", "expected a list of hooks")
    hook_names: set[str] = set()
    for i, hook in enumerate(program.hooks):
        where = f"hooks[{i}]"
        _expect(isinstance(hook, Hook), where, f"expected a hook, got {hook!r}")
        _expect(
            isinstance(hook.name, str) and bool(_NAME_RE.match(hook.name)),
            f"{where}.name",
            f"invalid name {hook.name!r} (expected an identifier)",
        )
        _expect(hook.name not in hook_names, f"{where}.name", f"duplicate hook name {hook.name!r}")
        _expect(hook.name not in names, f"{where}.name", f"hook name {hook.name!r} is also a value's name")
        hook_names.add(hook.name)
        check_hook(hook, where, values, resolve)
    ir_graph.check(program, values, resolve, _expect)
    features_training.validate(program, values, _expect)
    check_resizes(program)
    return values


def check_resizes(program: Program) -> None:
    """Raises :class:`IRError` naming ``resizes[i]`` unless every step is a
    non-empty tuple of ``(old, new)`` int pairs (``old`` a size some leaf
    has, at most once per step, ``new`` >= 0 and not ``old``) whose program
    validates without emptying a value that is not empty at the program's
    own sizes (reductions such as ``amax`` reject empty dims)."""
    _expect(isinstance(program.resizes, tuple), "resizes", "expected a tuple of steps")
    sizes = set(program.leaf_sizes())
    own: dict[str, ValueInfo] | None = None
    for i, step in enumerate(program.resizes):
        where = f"resizes[{i}]"
        _expect(
            isinstance(step, tuple)
            and bool(step)
            and all(isinstance(p, tuple) and len(p) == 2 and all(_is_int(v) for v in p) for p in step),
            where,
            f"expected a non-empty list of (old size, new size) int pairs, got {step!r}",
        )
        olds = [old for old, _ in step]
        _expect(len(set(olds)) == len(olds), where, f"size(s) resized twice in one step: {olds}")
        for old, new in step:
            _expect(old in sizes, where, f"no leaf has size {old} (leaf sizes: {sorted(sizes)})")
            _expect(new >= 0, where, f"new size {new} for {old} is negative")
            _expect(new != old, where, f"size {old} is mapped to itself")
        text = ", ".join(f"{old} -> {new}" for old, new in step)
        try:
            resized = validate(program.at_sizes(step))
        except IRError as e:
            raise IRError(where, f"at sizes {text}: {e}") from None
        if own is None:
            own = validate(dataclasses.replace(program, resizes=()))
        for ref, info in resized.items():
            before = own.get(ref)
            _expect(
                before is None or 0 not in info.shape or 0 in before.shape,
                where,
                f"at sizes {text}: {ref} becomes empty {tuple(info.shape)}",
            )


def check_hook(hook: Hook, where: str, values: Mapping[str, ValueInfo], resolve: Any = None) -> None:
    """Raises :class:`IRError` (naming ``where.<field>``) unless ``hook`` is
    valid on the program whose values are ``values``."""
    _expect(
        hook.kind in HOOK_KINDS,
        f"{where}.kind",
        f"unknown hook kind {hook.kind!r}; expected one of {list(HOOK_KINDS)}",
    )
    actions = HOOK_KINDS[hook.kind]
    _expect(
        hook.action in actions,
        f"{where}.action",
        f"a {hook.kind} hook does not take action {hook.action!r}; expected one of {list(actions)}",
    )
    need = _ARG_ACTIONS.get(hook.action)
    arg = hook.arg
    if need is None:
        _expect(arg is None, f"{where}.arg", f"action {hook.action!r} takes no arg, got {arg!r}")
    elif need == "number":
        ok = (_is_int(arg) or isinstance(arg, float)) and math.isfinite(arg)
        _expect(ok, f"{where}.arg", f"action {hook.action!r} needs a finite number, got {arg!r}")
    else:
        _expect(_is_int(arg) and arg >= 0, f"{where}.arg", f"action {hook.action!r} needs an int >= 0, got {arg!r}")
    if resolve is not None:
        info = resolve(hook.target, f"{where}.target")
    else:
        _expect(
            isinstance(hook.target, str) and hook.target in values,
            f"{where}.target",
            f"unknown value {hook.target!r}",
        )
        info = values[hook.target]
    _expect(
        info.requires_grad,
        f"{where}.target",
        f"{hook.target!r} does not require grad; a {hook.kind} hook cannot be registered on it",
    )
    if hook.kind in ("retain_grad", "pre", "post"):
        _expect(
            not info.is_leaf,
            f"{where}.target",
            f"a {hook.kind} hook needs a non-leaf value (one with a grad_fn); {hook.target!r} is a leaf",
        )
    if hook.kind == "post_accumulate":
        _expect(
            info.is_leaf,
            f"{where}.target",
            f"a post_accumulate hook needs a leaf; {hook.target!r} is not one",
        )


def infer_outputs(spec: Any, name: str, attrs: Mapping[str, Any], infos: Sequence[ValueInfo]) -> list[ValueInfo]:
    """The :class:`ValueInfo` of every output of op ``name`` (a ``spec`` from
    :mod:`fuzz.ops`) on inputs ``infos``; raises the catalog's ``SpecError`` s."""
    shapes = [info.shape for info in infos]
    dtypes = [info.dtype for info in infos]
    out_shapes = spec.infer(shapes, attrs)
    out_dtype = spec.out_dtype(dtypes, attrs, shapes)
    rg = spec.differentiable and any(info.requires_grad for j, info in enumerate(infos) if j not in spec.nondiff_inputs)
    first = infos[0] if infos else None
    if first is not None and spec.is_identity(shapes, dtypes, attrs):
        return [
            ValueInfo(
                name,
                tuple(out_shapes[0]),
                out_dtype,
                rg,
                is_leaf=first.is_leaf,
                fresh=first.fresh,
                base=first.memory,
                multi_view=first.multi_view,
            )
        ]
    fresh = spec.is_fresh(attrs)
    # a view (or split output) shares its first input's memory; a
    # multi-output view op taints its outputs and every view of them
    shares = first is not None and spec.category in ("view", "split")
    base = first.memory if shares and first is not None else ""
    multi = shares and first is not None and (spec.category == "split" or first.multi_view)
    if spec.multi_output:
        return [
            ValueInfo(f"{name}:{k}", tuple(shape), out_dtype, rg, is_leaf=not rg, fresh=fresh, base=base, multi_view=multi)
            for k, shape in enumerate(out_shapes)
        ]
    return [ValueInfo(name, tuple(out_shapes[0]), out_dtype, rg, is_leaf=not rg, fresh=fresh, base=base, multi_view=multi)]


def inplace_conflicts(written: ValueInfo, values: Mapping[str, ValueInfo]) -> list[str]:
    """The refs among ``values`` (the values made before an in-place op)
    that eager would reject once ``written`` is modified in place: views of
    its memory made by a multi-output view op (``split``, ``unbind``, or a
    view of their outputs). Using one afterwards (as an op input, a root, a
    hook target, ``inputs=``, or even reading ``is_leaf``) raises "... is a
    view and its base or another view of its base has been modified
    inplace", and so does eager's backward when an op saved one before; so
    the model never writes into such a base. Views made by single-output
    ops (``slice``, ``view``, ...) stay usable: autograd regenerates their
    ``grad_fn``."""
    memory = written.memory
    return [ref for ref, v in values.items() if v.multi_view and v.memory == memory]


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


__all__ = [
    "DTYPES",
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
    "validate",
]

