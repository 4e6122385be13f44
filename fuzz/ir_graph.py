"""The IR of the fuzzer's *graph features*: program fields that make graphs
a compiled autograd may get wrong, beyond ops and hooks.

Three optional :class:`~fuzz.ir.Program` fields live here (their runtime,
rendering, drawing, reduction and neighbours are in
:mod:`fuzz.features_graph`; this module imports nothing of ``fuzz.ir`` but
its shared checks, :mod:`fuzz.ir_check`, so that the IR can call it):

* ``func_terms``: :class:`FuncTerm` s, each a 0-d term
  ``transform(fn)(value)`` computed with ``torch.func`` after the forward,
  inside the subject's context (``cagrad.enable``), added to the backward's
  roots;
* ``subclass_leaves``: names of leaves built as a tensor subclass of
  ``subclass_kind`` (one of :data:`SUBCLASSES`; :mod:`fuzz.subclass_leaves`):
  ``"two_tensor"`` (the default: ``torch.testing._internal.two_tensor.TwoTensor``
  of the leaf's values and a second seeded tensor), ``"dtensor"`` (a
  ``DTensor`` on a one-rank device mesh, replicated or sharded) or
  ``"jagged"`` (a nested tensor of the jagged layout, the leaf's dims 0
  and 1 made one ragged dim), read only by the ops of
  :data:`SUBCLASS_KIND_OPS` of the kind;
* ``double_backward``: a :class:`DoubleBackward`: the first-order grads of
  the roots w.r.t. ``inputs`` with ``create_graph=True``, inside the
  subject's context, then a penalty of those grads added to the roots, so
  the compared backward runs through the grads' graph.

Two more features are ops and hook actions of the existing IR: the op
``fn_inner_grad`` (a custom ``autograd.Function`` whose backward runs
``torch.autograd.grad`` on a small graph of its own), the tensor-hook action
``inner_grad`` (the same inside a hook), and roots at outputs ``>= 1`` of
multi-output ops (``"v3:1"``; ``var_mean``, ``aminmax``, ``split``,
``unbind``, ``fn_sin_cos``; ``topk`` and ``max_dim`` roots share their node
with a non-differentiable output). :func:`program_features` lists what a
program uses, under the names ``graph:...``.

JSON: each field is written only when set (``"func_terms": [{"name",
"transform", "fn", "input"}]``, ``"subclass_leaves": ["x0"]``,
``"subclass_kind": "dtensor"`` (left out for ``"two_tensor"``, so older
programs read as they meant),
``"double_backward": {"inputs": [...], "penalty": "square"}``), so programs
without them read and write as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from fuzz.ir_check import Expect, base_name, check_identifier

TRANSFORMS = ("grad", "vjp", "jacrev", "vmap", "vmap_grad")
"""``torch.func`` forms of a :class:`FuncTerm` (see :mod:`fuzz.features_graph`)."""
FUNC_FNS = ("sin_mul", "tanh_sq")
"""The small elementwise functions ``h`` a term transforms: ``sin_mul`` is
``a.sin() * a``, ``tanh_sq`` is ``a.tanh() * a.tanh()``."""
PENALTIES = ("square", "sum")
"""How a double backward reduces each first-order grad ``g``: ``(g * g).sum()``
or ``g.sum()``."""
SUBCLASSES = ("two_tensor", "dtensor", "jagged")
"""Kinds of subclass leaves (``Program.subclass_kind``; built by
:mod:`fuzz.subclass_leaves`): ``TwoTensor``, ``DTensor`` on a one-rank
device mesh, or a jagged nested tensor (``torch.jagged`` layout)."""
DEFAULT_SUBCLASS_KIND = "two_tensor"
"""The kind of a program whose JSON has no ``subclass_kind`` (all programs
written before DTensor leaves)."""
JACREV_MAX_NUMEL = 16
"""``jacrev`` makes a ``numel x numel`` Jacobian: its input is kept small."""
SUBCLASS_OPS = frozenset(
    {
        "neg", "exp", "log", "sqrt", "sin", "cos", "tanh", "sigmoid", "relu", "gelu", "silu", "abs",
        "reciprocal", "clone", "pow", "mul_scalar", "add_scalar", "clamp", "cumsum", "softmax",
        "log_softmax", "add", "sub", "mul", "div", "maximum", "minimum", "sum", "mean", "amax", "var",
        "matmul", "mm", "reshape", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
        "flatten", "cat", "stack", "split", "unbind", "var_mean", "fn_sin_scale", "fn_cube",
    }
)
"""Ops that take a ``TwoTensor`` (or a value computed from one) under eager
(``tests/fuzz/test_fuzz_graph_features.py`` runs each)."""
DTENSOR_OPS = SUBCLASS_OPS - {"unbind"}
"""Ops that take a one-rank ``DTensor`` (or values computed from them only),
replicated or sharded on any dim, forward and backward under eager on torch
2.13 and 2.14 (``tests/fuzz/test_fuzz_subclass_leaves.py`` runs each): those
of :data:`SUBCLASS_OPS` but ``unbind``, which DTensor refuses along a
sharded dim (``Attempted to unbind along the sharded dimension``)."""
JAGGED_OPS = frozenset(
    {
        "neg", "exp", "log", "sqrt", "sin", "cos", "tanh", "sigmoid", "relu", "gelu", "silu", "abs",
        "reciprocal", "clone", "pow", "mul_scalar", "add_scalar", "clamp", "add", "sub", "mul", "div",
        "sum", "mean", "amax", "matmul", "fn_sin_scale", "fn_cube",
    }
)
"""Ops that take a jagged nested tensor (or a value computed from one),
forward and backward, under eager and cagrad on torch 2.13 and 2.14
(``tests/fuzz/test_fuzz_jagged_leaves.py`` runs each), under the rules of
:func:`check_jagged`. Left out: ``maximum``/``minimum`` (eager:
``aten.masked_fill_.Scalar`` not implemented), reductions over a dim
(``aten._nested_sum_backward``), ``log_softmax``
(``_log_softmax_backward_data``), ``cumsum``, ``var``, the shape ops (the
IR's sizes would read the ragged dim). The custom Functions
``fn_sin_scale``/``fn_cube`` are in: cagrad runs their backwards in eager
(``tensor_subclass``); it raised ``ge: relation is indeterminate`` keying
their outputs' nested-int sizes until that was fixed."""
JAGGED_REDUCTIONS = ("sum", "mean", "amax")
"""The ops of :data:`JAGGED_OPS` that take a jagged value only as a full
reduction (``dim`` None)."""
SUBCLASS_KIND_OPS = {"two_tensor": SUBCLASS_OPS, "dtensor": DTENSOR_OPS, "jagged": JAGGED_OPS}
"""The ops that may read a value computed from a subclass leaf, by kind."""

FIELDS = ("func_terms", "subclass_leaves", "subclass_kind", "double_backward")


@dataclasses.dataclass(frozen=True)
class FuncTerm:
    """``transform(fn)(input)`` reduced to a 0-d root (see module doc).

    ``input`` is a value reference that requires grad; ``vmap`` and
    ``vmap_grad`` map over its dim 0 (rank >= 1); ``jacrev`` needs at most
    :data:`JACREV_MAX_NUMEL` elements. The trace label is ``"<name> func
    <transform>"``."""

    name: str
    transform: str
    fn: str
    input: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "transform": self.transform, "fn": self.fn, "input": self.input}


@dataclasses.dataclass(frozen=True)
class DoubleBackward:
    """First-order grads of the roots w.r.t. ``inputs`` (value references
    that require grad, unique) with ``create_graph=True``; ``penalty`` (one
    of :data:`PENALTIES`) of the grads that require grad is added as a root."""

    inputs: tuple[str, ...]
    penalty: str = "square"

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": list(self.inputs), "penalty": self.penalty}


# ------------------------------------------------------------------ JSON
def fields_to_dict(program: Any) -> dict[str, Any]:
    """The set fields of ``program`` as JSON-ready entries (none when unset)."""
    out: dict[str, Any] = {}
    if program.func_terms:
        out["func_terms"] = [t.to_dict() for t in program.func_terms]
    if program.subclass_leaves:
        out["subclass_leaves"] = list(program.subclass_leaves)
    if program.subclass_kind != DEFAULT_SUBCLASS_KIND:
        out["subclass_kind"] = program.subclass_kind
    if program.double_backward is not None:
        out["double_backward"] = program.double_backward.to_dict()
    return out


def parse_fields(data: Mapping[str, Any], expect: Expect) -> dict[str, Any]:
    """``Program`` keyword arguments from a JSON object's graph fields;
    ``expect(cond, where, message)`` raises the IR's error."""
    out: dict[str, Any] = {}
    raw = data.get("func_terms", [])
    expect(isinstance(raw, list), "func_terms", f"expected a list, got {raw!r}")
    terms = []
    for i, t in enumerate(raw):
        where = f"func_terms[{i}]"
        _check_object(t, where, {"name", "transform", "fn", "input"}, expect)
        terms.append(FuncTerm(t["name"], t["transform"], t["fn"], t["input"]))
    out["func_terms"] = tuple(terms)
    raw = data.get("subclass_leaves", [])
    expect(isinstance(raw, list), "subclass_leaves", f"expected a list of leaf names, got {raw!r}")
    out["subclass_leaves"] = tuple(raw)
    kind = data.get("subclass_kind", DEFAULT_SUBCLASS_KIND)
    expect(isinstance(kind, str), "subclass_kind", f"expected a string (one of {list(SUBCLASSES)}), got {kind!r}")
    out["subclass_kind"] = kind
    raw = data.get("double_backward")
    if raw is not None:
        _check_object(raw, "double_backward", {"inputs", "penalty"}, expect, required={"inputs"})
        inputs = raw["inputs"]
        expect(isinstance(inputs, list), "double_backward.inputs", f"expected a list, got {inputs!r}")
        out["double_backward"] = DoubleBackward(tuple(inputs), raw.get("penalty", "square"))
    return out


def _check_object(obj: Any, where: str, allowed: set[str], expect: Expect, required: set[str] | None = None) -> None:
    expect(isinstance(obj, dict), where, f"expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    expect(not unknown, where, f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted((allowed if required is None else required) - set(obj))
    expect(not missing, where, f"missing field(s) {missing}")


# ------------------------------------------------------------ validation
def subclass_values(program: Any) -> set[str]:
    """Refs of the values computed from a subclass leaf (the leaves too)."""
    tainted = set(program.subclass_leaves)
    for op in program.ops:
        if any(base_name(r) in tainted or r in tainted for r in op.inputs):
            tainted.add(op.name)
    return tainted


def check(program: Any, values: Mapping[str, Any], resolve: Callable[[Any, str], Any], expect: Expect) -> None:
    """Validates the graph fields of ``program`` (whose ops and roots are
    valid, ``values`` their inferred infos); ``resolve(ref, where)`` looks a
    value reference up, raising the IR's error."""
    expect(isinstance(program.func_terms, tuple), "func_terms", "expected a tuple of terms")
    expect(isinstance(program.subclass_leaves, tuple), "subclass_leaves", "expected a tuple of leaf names")
    tainted = subclass_values(program)
    taken = {leaf.name for leaf in program.leaves} | {op.name for op in program.ops} | {h.name for h in program.hooks}
    for i, term in enumerate(program.func_terms):
        where = f"func_terms[{i}]"
        expect(isinstance(term, FuncTerm), where, f"expected a FuncTerm, got {term!r}")
        check_identifier(term.name, f"{where}.name", expect)
        expect(term.name not in taken, f"{where}.name", f"name {term.name!r} is taken (a value, hook or other term)")
        taken.add(term.name)
        expect(
            term.transform in TRANSFORMS,
            f"{where}.transform",
            f"unknown transform {term.transform!r}; expected one of {list(TRANSFORMS)}",
        )
        expect(term.fn in FUNC_FNS, f"{where}.fn", f"unknown function {term.fn!r}; expected one of {list(FUNC_FNS)}")
        info = resolve(term.input, f"{where}.input")
        expect(info.requires_grad, f"{where}.input", f"{term.input!r} does not require grad: the term would be no root")
        expect(
            base_name(term.input) not in tainted,
            f"{where}.input",
            f"{term.input!r} is computed from a subclass leaf; torch.func terms take plain tensors",
        )
        if term.transform in ("vmap", "vmap_grad"):
            expect(len(info.shape) >= 1, f"{where}.input", f"{term.transform} maps over dim 0: {term.input!r} is 0-d")
        if term.transform == "jacrev":
            n = 1
            for d in info.shape:
                n *= d
            expect(
                n <= JACREV_MAX_NUMEL,
                f"{where}.input",
                f"jacrev of {term.input!r} ({n} elements) would make a {n} x {n} Jacobian; "
                f"at most {JACREV_MAX_NUMEL} elements",
            )
    leaf_names = [leaf.name for leaf in program.leaves]
    for i, name in enumerate(program.subclass_leaves):
        where = f"subclass_leaves[{i}]"
        expect(name in leaf_names, where, f"{name!r} is not a leaf of the program (leaves: {leaf_names})")
        expect(name not in program.subclass_leaves[:i], where, f"leaf {name!r} listed twice")
    check_subclass_kind(program, tainted, expect)
    db = program.double_backward
    if db is not None:
        expect(isinstance(db, DoubleBackward), "double_backward", f"expected a DoubleBackward, got {db!r}")
        expect(
            isinstance(db.inputs, tuple) and len(db.inputs) >= 1,
            "double_backward.inputs",
            "expected a non-empty list of value references",
        )
        expect(len(set(db.inputs)) == len(db.inputs), "double_backward.inputs", "duplicate entries")
        for j, ref in enumerate(db.inputs):
            info = resolve(ref, f"double_backward.inputs[{j}]")
            expect(info.requires_grad, f"double_backward.inputs[{j}]", f"{ref!r} does not require grad")
        expect(
            db.penalty in PENALTIES,
            "double_backward.penalty",
            f"unknown penalty {db.penalty!r}; expected one of {list(PENALTIES)}",
        )
        expect(
            not program.subclass_leaves,
            "double_backward",
            "a double backward is not combined with subclass leaves (their create_graph formulas are not modelled)",
        )
    check_training(program, expect)


def check_subclass_kind(program: Any, tainted: set[str], expect: Expect) -> None:
    """Validates ``subclass_kind`` and what the subclass leaves' values may
    meet: only the ops of :data:`SUBCLASS_KIND_OPS` of the kind read them;
    a DTensor (``"dtensor"``) meets no plain tensor in an op (DTensor's
    dispatch raises on ``got mixed torch.Tensor and DTensor``), and a root
    computed from one is reduced by loss ``"sum"`` (with loss
    ``"separate"`` a plain ``grad_output`` would seed a DTensor root, and
    eager then accumulates a plain ``.grad``), with no plain root beside it
    (the sum's backward would mix the two). A jagged leaf (``"jagged"``,
    one per program) has a shape ``(B, L, *rest)`` with ``B, L >= 2``; see
    :func:`check_jagged` for what its values may meet."""
    kind = program.subclass_kind
    expect(
        kind in SUBCLASSES,
        "subclass_kind",
        f"unknown subclass kind {kind!r}; expected one of {list(SUBCLASSES)}",
    )
    expect(
        kind == DEFAULT_SUBCLASS_KIND or bool(program.subclass_leaves),
        "subclass_kind",
        f"{kind!r} is set but there are no subclass_leaves (leave it out, or name the leaves)",
    )
    leaves = sorted(set(program.subclass_leaves))
    for i, op in enumerate(program.ops):
        if op.name not in tainted:
            continue
        expect(
            op.op in SUBCLASS_KIND_OPS[kind],
            f"ops[{i}]",
            f"{op.op} reads a value computed from a subclass leaf ({leaves}) and is not among the ops "
            f"that take a {kind} (fuzz.ir_graph.SUBCLASS_KIND_OPS[{kind!r}])",
        )
        if kind == "dtensor":
            plain = [r for r in op.inputs if base_name(r) not in tainted]
            expect(
                not plain,
                f"ops[{i}]",
                f"{op.op} mixes DTensor values with plain tensor(s) {plain}: make their leaves DTensor leaves too",
            )
    if kind == "dtensor":
        tainted_roots = [r for r in program.roots if base_name(r) in tainted]
        expect(
            program.loss == "sum" or not tainted_roots,
            "loss",
            f"roots {tainted_roots} are DTensors: loss {program.loss!r} would seed them with plain grad_outputs; "
            "use loss 'sum'",
        )
        plain_roots = [r for r in program.roots if r not in tainted_roots]
        expect(
            not (tainted_roots and plain_roots),
            "roots",
            f"roots {tainted_roots} are DTensors and {plain_roots} plain tensors: their sum's backward would "
            "mix them in an op",
        )
    if kind == "jagged":
        check_jagged(program, tainted, expect)


def check_jagged(program: Any, tainted: set[str], expect: Expect) -> None:
    """The rules of a jagged leaf: one per program, of a shape ``(B, L,
    *rest)`` with ``B, L >= 2`` (its lengths must be able to differ:
    :func:`fuzz.subclass_leaves.jagged_lengths`); roots computed from it
    reduced by loss ``"sum"`` (a plain ``grad_output`` has no nested int);
    with ``backward()`` no ``repeat`` above 1 (eager's second accumulation
    into a jagged ``.grad`` raises ``aten::stride``, torch 2.13 and 2.14);
    and of the ops reading its values, :data:`JAGGED_REDUCTIONS` reduce
    them whole (``dim`` None), ``matmul`` has one as its first input by a
    plain 2-d leaf, any other op of two inputs has both computed from it
    (a plain tensor does not broadcast against a nested int)."""
    n = len(program.subclass_leaves)
    expect(n <= 1, "subclass_leaves", f"{n} jagged leaves: one per program (two would have two nested ints)")
    shapes = {leaf.name: tuple(leaf.shape) for leaf in program.leaves}
    for i, name in enumerate(program.subclass_leaves):
        shape = shapes.get(name, ())
        expect(
            len(shape) >= 3 and shape[0] >= 2 and shape[1] >= 2,
            f"subclass_leaves[{i}]",
            f"jagged leaf {name!r} has shape {list(shape)}; it needs (B, L, *rest) with B, L >= 2 and rest non-empty",
        )
    roots = [r for r in program.roots if base_name(r) in tainted]
    expect(
        program.loss == "sum" or not roots,
        "loss",
        f"roots {roots} are jagged: loss {program.loss!r} would seed them with plain grad_outputs; use loss 'sum'",
    )
    expect(
        program.mode != "backward" or program.repeat <= 1,
        "repeat",
        f"repeat {program.repeat}: eager's second accumulation into a jagged .grad raises (aten::stride)",
    )
    for i, op in enumerate(program.ops):
        if op.name not in tainted:
            continue
        plain = [r for r in op.inputs if base_name(r) not in tainted]
        if op.op in JAGGED_REDUCTIONS:
            ok, why = op.attrs.get("dim") is None, f"over dim {op.attrs.get('dim')!r}: only a full reduction (dim None)"
        elif op.op == "matmul":
            first = base_name(op.inputs[0]) in tainted and len(shapes.get(op.inputs[1], ())) == 2
            ok, why = first and plain == [op.inputs[1]], "takes it as its first input and a plain 2-d leaf as its second"
        else:
            ok, why = not plain, f"mixes jagged values with plain tensor(s) {plain}"
        expect(ok, f"ops[{i}]", f"{op.op} of a jagged value {why}, got inputs {list(op.inputs)}")


def check_training(program: Any, expect: Expect) -> None:
    """Rejects the graph features that cannot go with optimizer steps or a
    checkpointed region (:mod:`fuzz.features_training`): the
    ``torch.func`` terms and the double backward run once in the backward's
    stage, not once per optimizer step, and read values a checkpointed
    region keeps to itself; a double backward's ``create_graph=True``
    grads would be stepped by the optimizer; subclass leaves are not
    parameters an optimizer steps, nor inputs of a checkpoint region."""
    used = [
        name
        for name, present in (
            ("func_terms", bool(program.func_terms)),
            ("double_backward", program.double_backward is not None),
            ("subclass_leaves", bool(program.subclass_leaves)),
        )
        if present
    ]
    for field, what in (("train", "optimizer steps"), ("checkpoint", "a checkpointed region")):
        expect(
            getattr(program, field, None) is None or not used,
            field,
            f"{what} cannot be combined with {' or '.join(used)} (graph features of the backward's stage)",
        )


# ----------------------------------------------------------- references
def referenced(program: Any) -> list[str]:
    """Every value reference the graph fields read (kept by pruning)."""
    refs = [t.input for t in program.func_terms] + list(program.subclass_leaves)
    if program.double_backward is not None:
        refs += list(program.double_backward.inputs)
    return refs


def pruned_fields(program: Any, kept_leaves: set[str]) -> dict[str, Any]:
    """The subclass leaves that survive pruning, and their kind (the
    default once none survives; the rest is kept whole)."""
    leaves = tuple(n for n in program.subclass_leaves if n in kept_leaves)
    return {"subclass_leaves": leaves, "subclass_kind": program.subclass_kind if leaves else DEFAULT_SUBCLASS_KIND}


def replace_refs(program: Any, sub: Callable[[str], str]) -> dict[str, Any]:
    """The graph fields with every value reference passed through ``sub``."""
    out: dict[str, Any] = {
        "func_terms": tuple(dataclasses.replace(t, input=sub(t.input)) for t in program.func_terms),
    }
    db = program.double_backward
    if db is not None:
        out["double_backward"] = dataclasses.replace(db, inputs=tuple(dict.fromkeys(sub(r) for r in db.inputs)))
    return out


# ------------------------------------------------------------- features
MULTI_ROOT_OPS = ("split", "unbind", "fn_sin_cos", "var_mean", "aminmax")
NONDIFF_SIBLING_OPS = ("topk", "max_dim")


def program_features(program: Any) -> set[str]:
    """The graph features ``program`` uses, named for coverage tables:
    ``graph:func.<transform>``, ``graph:subclass.<kind>`` (``two_tensor``,
    ``dtensor``, ``jagged``),
    ``graph:double_backward.<penalty>``, ``graph:inner_grad.hook``,
    ``graph:inner_grad.function``, and with loss ``"separate"`` (the roots
    start the backward themselves) ``graph:root.output_nonzero`` (a root at
    output >= 1 of a multi-output op), ``graph:root.single_output1`` (the
    only root is output 1), ``graph:root.nondiff_sibling`` (a root whose
    node has a non-differentiable output: ``topk``, ``max_dim``)."""
    out = {f"graph:func.{t.transform}" for t in program.func_terms}
    if program.subclass_leaves:
        out.add(f"graph:subclass.{program.subclass_kind}")
    if program.double_backward is not None:
        out.add(f"graph:double_backward.{program.double_backward.penalty}")
    if any(h.kind == "tensor" and h.action == "inner_grad" for h in program.hooks):
        out.add("graph:inner_grad.hook")
    kinds = {op.name: op.op for op in program.ops}
    if "fn_inner_grad" in kinds.values():
        out.add("graph:inner_grad.function")
    if program.loss == "separate":  # under "sum" a SumBackward0 is the root
        if any(":" in r and int(r.split(":", 1)[1]) >= 1 for r in program.roots):
            out.add("graph:root.output_nonzero")
        if len(program.roots) == 1 and program.roots[0].endswith(":1"):
            out.add("graph:root.single_output1")
        if any(kinds.get(r) in NONDIFF_SIBLING_OPS for r in program.roots):
            out.add("graph:root.nondiff_sibling")
    return out


__all__ = [
    "DEFAULT_SUBCLASS_KIND",
    "DTENSOR_OPS",
    "FIELDS",
    "FUNC_FNS",
    "JACREV_MAX_NUMEL",
    "JAGGED_OPS",
    "JAGGED_REDUCTIONS",
    "PENALTIES",
    "SUBCLASSES",
    "SUBCLASS_KIND_OPS",
    "SUBCLASS_OPS",
    "TRANSFORMS",
    "DoubleBackward",
    "FuncTerm",
    "check",
    "check_jagged",
    "check_subclass_kind",
    "fields_to_dict",
    "parse_fields",
    "program_features",
    "referenced",
    "replace_refs",
    "subclass_values",
]
