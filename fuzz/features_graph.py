"""Graph features of fuzz programs: running, rendering, drawing, reducing.

The fields are described in :mod:`fuzz.ir_graph`. Here:

* the runtime: :func:`wrap_subclass_leaves` (subclass leaves, from
  :mod:`fuzz.subclass_leaves`, which also prints their code),
  :func:`stage` (the ``torch.func`` terms and the double backward, run by
  :func:`harness.program.run_backward` inside the subject's context), and
  :func:`inner_grad_hook` (the tensor-hook action ``inner_grad``);
* the reproducer's code for each (:func:`stage_source`,
  :func:`inner_grad_hook_source`): the runtime
  executes the very code the reproducer prints, so the two cannot drift;
* :func:`draw_graph_features` for :mod:`fuzz.strategies` (each feature rare,
  each drawn by an integer that shrinks to "off");
* :func:`reduce_candidates` and :func:`weight` for :mod:`fuzz.reduce`, and
  :func:`neighbour_candidates` for :mod:`fuzz.neighbours` (kind ``graph``);
* :func:`program_features` (from :mod:`fuzz.ir_graph`): the names of the
  features a program uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from fuzz.draws import rare
from fuzz.ir import Hook, IRError, Program, ValueInfo, base_name, validate
from fuzz.ir_graph import (
    DEFAULT_SUBCLASS_KIND,
    FUNC_FNS,
    PENALTIES,
    SUBCLASS_KIND_OPS,
    SUBCLASSES,
    TRANSFORMS,
    DoubleBackward,
    FuncTerm,
    program_features,
    subclass_values,
)
from fuzz.subclass_leaves import kind_available, two_tensor_class, wrap_subclass_leaves

# ---------------------------------------------------------- torch.func terms
_FN_CODE = {"sin_mul": "a.sin() * a", "tanh_sq": "a.tanh() * a.tanh()"}
_TERM_CODE = {
    "grad": "torch.func.grad(lambda a: ({h}).sum())({x})",
    "vjp": "(lambda out, fn: fn(out)[0])(*torch.func.vjp(lambda a: {h}, {x}))",
    "jacrev": "torch.func.jacrev(lambda a: {h})({x})",
    "vmap": "torch.func.vmap(lambda a: ({h}) * a.sum())({x})",
    "vmap_grad": "torch.func.vmap(torch.func.grad(lambda a: ({h}).sum()))({x})",
}


def term_expr(term: FuncTerm, x: str) -> str:
    """The 0-d root of ``term`` as a torch expression of the value ``x``:
    the transform's result ``r``, as ``(r * r).sum()``."""
    inner = _TERM_CODE[term.transform].format(h=_FN_CODE[term.fn], x=x)
    return f"(lambda r: (r * r).sum())({inner})"


# ------------------------------------------------------------ the stage
_PENALTY_CODE = {"square": "(g * g).sum()", "sum": "g.sum()"}


def _ref_expr(ref: str) -> str:
    base, _, index = ref.partition(":")
    return f"{base}[{index}]" if index else base


def stage_source(program: Program) -> list[str]:
    """The statements that extend ``outputs`` (and ``grad_outputs``, a list
    or None) with the program's ``torch.func`` terms and double-backward
    penalty, reading the program's values by name and appending to
    ``trace``; empty when the program has neither."""
    lines: list[str] = []
    for term in program.func_terms:
        lines.append(f"# {term.name}: torch.func {term.transform} of {term.fn}, a 0-d root")
        lines.append(f"outputs.append({term_expr(term, _ref_expr(term.input))})")
        lines.append("grad_outputs = None if grad_outputs is None else [*grad_outputs, None]")
    db = program.double_backward
    if db is not None:
        ins = ", ".join(_ref_expr(r) for r in db.inputs)
        lines += [
            "# double backward: first-order grads with create_graph=True, then a penalty of them as a root",
            f"gs = torch.autograd.grad(outputs, [{ins}], grad_outputs=grad_outputs, create_graph=True, allow_unused=True)",
            "trace.append(('double_backward grads', tuple(None if g is None else g.detach().clone() for g in gs)))",
            "trace.append(('double_backward requires_grad', tuple(g is not None and g.requires_grad for g in gs)))",
            f"penalties = [{_PENALTY_CODE[db.penalty]} for g in gs if g is not None and g.requires_grad]",
            "if penalties:",
            "    penalty = penalties[0]",
            "    for p in penalties[1:]:",
            "        penalty = penalty + p",
            "    outputs.append(penalty)",
            "    grad_outputs = None if grad_outputs is None else [*grad_outputs, None]",
        ]
    return lines


def _namespace(values: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Values by the names the rendered code uses (a multi-output op's name
    is the tuple of its outputs)."""
    ns: dict[str, Any] = {"torch": torch}
    multi: dict[str, dict[int, torch.Tensor]] = {}
    for ref, t in values.items():
        base, _, index = ref.partition(":")
        if index:
            multi.setdefault(base, {})[int(index)] = t
        else:
            ns[base] = t
    for base, outs in multi.items():
        ns[base] = tuple(outs[i] for i in range(len(outs)))
    return ns


def stage(program: Program, values: Mapping[str, torch.Tensor], trace: list) -> Callable[[Any], None] | None:
    """The ``before_backward`` of the program's run
    (:class:`harness.program.ProgramRun`): runs :func:`stage_source` on the
    run's ``outputs`` and ``grad_outputs``; None without terms or a double
    backward."""
    lines = stage_source(program)
    if not lines:
        return None
    code = compile("\n".join(lines), f"<graph features of {program.name or 'program'}>", "exec")

    def before_backward(run: Any) -> None:
        ns = _namespace(values)
        ns.update(outputs=list(run.outputs), grad_outputs=None if run.grad_outputs is None else list(run.grad_outputs))
        ns["trace"] = trace
        exec(code, ns)  # noqa: S102 - the code is stage_source's, also printed in reproducers
        run.outputs, run.grad_outputs = ns["outputs"], ns["grad_outputs"]

    return before_backward


# ------------------------------------------------------ inner-grad hooks
def inner_grad_hook_source(hook: Hook) -> list[str]:
    """``def <hook name>(g): ...``: the tensor hook of action ``inner_grad``."""
    label = repr(hook.label)
    return [
        f"def {hook.name}(g):",
        "    if g is None:",
        f"        trace.append(({label}, None))",
        "        return None",
        "    with torch.enable_grad():  # a backward started inside the running one",
        "        a = g.detach().requires_grad_()",
        "        (d,) = torch.autograd.grad((a.sin() * a).sum(), a)",
        f"    trace.append(({label}, d.detach().clone()))",
        "    return g + d",
    ]


def inner_grad_hook(trace: list, hook: Hook) -> Callable[[Any], Any]:
    """The hook function of :func:`inner_grad_hook_source`, recording into ``trace``."""
    ns: dict[str, Any] = {"torch": torch, "trace": trace}
    exec(compile("\n".join(inner_grad_hook_source(hook)), f"<hook {hook.name}>", "exec"), ns)  # noqa: S102
    return ns[hook.name]


# -------------------------------------------------------------- drawing
def _multi_index(ref: str) -> int:
    return int(ref.split(":", 1)[1]) if ":" in ref else -1


def draw_graph_features(draw: Any, program: Program, pool: Sequence[ValueInfo]) -> Program:
    """``program`` (unpruned, valid) with graph features drawn in: roots at
    outputs >= 1 of multi-output ops (about 1 in 6 programs that have one),
    a ``torch.func`` term (1 in 12), a double backward (1 in 12) and a
    subclass leaf (1 in 20 of the programs whose ops all take a
    ``TwoTensor``), of a kind drawn after the leaf (so programs without one
    draw as before): ``two_tensor``, ``dtensor`` or ``jagged``, each as
    likely, among the kinds torch has and with which the program validates
    (for ``dtensor``: loss ``"sum"``, no plain tensor meeting a DTensor; for
    ``jagged``: :func:`fuzz.ir_graph.check_jagged`), else ``two_tensor``,
    else the first left; no kind is drawn where none is.
    Each shrinks to off (a kind to ``two_tensor``); a drawn feature that
    does not validate is left out."""
    values = [v for v in pool if v.requires_grad]
    nonzero = [v.ref for v in values if _multi_index(v.ref) >= 1]
    if nonzero and rare(draw, 6):
        ones = [r for r in nonzero if r.endswith(":1")]
        if ones and draw(st.booleans()):
            roots: tuple[str, ...] = (draw(st.sampled_from(ones)),)
        else:
            roots = tuple(draw(st.lists(st.sampled_from(nonzero), min_size=1, max_size=3, unique=True)))
        # loss "separate": the roots themselves start the backward (under
        # "sum" a SumBackward0 would be the root and output k a mere edge)
        program = _try(
            program, roots=roots, loss="separate", inputs=None if program.mode == "backward" else program.inputs
        )
    if values and rare(draw, 12):
        info = values[-1 - draw(st.integers(0, len(values) - 1))]
        transform = TRANSFORMS[draw(st.integers(0, len(TRANSFORMS) - 1))]
        term = FuncTerm("f0", transform, draw(st.sampled_from(FUNC_FNS)), info.ref)
        program = _try(program, func_terms=(term,))
        if not program.func_terms:
            program = _try(program, func_terms=(dataclasses.replace(term, transform="grad"),))
    if values and rare(draw, 12):
        refs = tuple(draw(st.lists(st.sampled_from([v.ref for v in values]), min_size=1, max_size=2, unique=True)))
        program = _try(program, double_backward=DoubleBackward(refs, draw(st.sampled_from(PENALTIES))))
    if program.double_backward is None:
        eligible = [leaf.name for leaf in program.leaves if _subclass_ok(program, leaf.name)]
        if eligible and rare(draw, 20):
            # drawn on every torch, kept only where torch ships the kind:
            # the draws after them are the same either way
            leaf = draw(st.sampled_from(eligible))
            options = _subclass_options(program, leaf)
            if options:  # the kind is drawn only where a leaf is set: shrinks to two_tensor
                kind = SUBCLASSES[draw(st.integers(0, len(SUBCLASSES) - 1))]
                program = options.get(kind) or options.get(DEFAULT_SUBCLASS_KIND) or next(iter(options.values()))
    return program


def _subclass_options(program: Program, leaf: str) -> dict[str, Program]:
    """``program`` with subclass leaf ``leaf``, by kind: each kind torch
    has and with which the program validates (a DTensor leaf brings the
    leaves it meets: :func:`dtensor_leaves`)."""
    out: dict[str, Program] = {}
    for kind in SUBCLASSES:
        leaves = dtensor_leaves(program, leaf) if kind == "dtensor" else (leaf,)
        if kind_available(kind)[0] and leaves is not None:
            candidate = _try(program, subclass_leaves=leaves, subclass_kind=kind)
            if candidate.subclass_leaves:
                out[kind] = candidate
    return out


def dtensor_leaves(program: Program, leaf: str) -> tuple[str, ...] | None:
    """The leaves that must be DTensors with ``leaf`` (in program order):
    ``leaf``, then every leaf of a plain value that meets a DTensor value
    in an op or among the roots (the loss sums them), until none does;
    None where such a value comes from no leaf, a ``torch.func`` term reads
    a DTensor value, or an op on the way does not take a DTensor
    (:data:`fuzz.ir_graph.SUBCLASS_KIND_OPS`)."""
    chosen = {leaf}
    leaf_names = [x.name for x in program.leaves]
    while True:
        tainted = subclass_values(dataclasses.replace(program, subclass_leaves=tuple(chosen)))
        if any(base_name(t.input) in tainted for t in program.func_terms):
            return None
        added = set()
        for op in program.ops:
            if op.name not in tainted:
                continue
            if op.op not in SUBCLASS_KIND_OPS["dtensor"]:
                return None
            for ref in op.inputs:
                if base_name(ref) not in tainted:
                    added |= _leaf_ancestors(program, base_name(ref))
        roots = [base_name(r) for r in program.roots]
        if any(r in tainted for r in roots):  # the loss sums the roots: they meet there
            for r in roots:
                if r not in tainted:
                    added |= _leaf_ancestors(program, r)
        if not added:
            return tuple(n for n in leaf_names if n in chosen)
        if not added <= set(leaf_names):
            return None
        chosen |= added


def _leaf_ancestors(program: Program, name: str) -> set[str]:
    """The leaves ``name`` is computed from (``name`` itself for a leaf;
    an op of no input yields the op's name, which is no leaf)."""
    ops = {op.name: op for op in program.ops}
    out: set[str] = set()
    stack = [name]
    while stack:
        n = stack.pop()
        op = ops.get(n)
        if op is None or not op.inputs:
            out.add(n)
        else:
            stack.extend(base_name(r) for r in op.inputs)
    return out


def draw_hook_action(draw: Any, actions: Sequence[str]) -> str:
    """A hook action from ``actions``, each as likely as the others but
    ``inner_grad``, which replaces ``observe`` 1 time in 4 (so that adding
    it left the other actions about as frequent as before); shrinks to
    the first action."""
    common = [a for a in actions if a != "inner_grad"] or list(actions)
    action = draw(st.sampled_from(common))
    if action == "observe" and "inner_grad" in actions and rare(draw, 4):
        return "inner_grad"
    return action


def _subclass_ok(program: Program, leaf: str) -> bool:
    tainted = subclass_values(dataclasses.replace(program, subclass_leaves=(leaf,)))
    if any(base_name(t.input) in tainted for t in program.func_terms):
        return False
    return all(op.op in SUBCLASS_KIND_OPS[DEFAULT_SUBCLASS_KIND] for op in program.ops if op.name in tainted)


def _try(program: Program, **changes: Any) -> Program:
    candidate = dataclasses.replace(program, **changes)
    try:
        validate(candidate)
    except IRError:
        return program
    return candidate


def stage_features(program: Program) -> bool:
    """Whether ``program`` adds roots in its backward's stage (a size
    sequence is not drawn for it: the capture rule's graph probe reads the
    roots before the stage)."""
    return bool(program.func_terms) or program.double_backward is not None or bool(program.subclass_leaves)


# ------------------------------------------------------------ reduction
def weight(program: Program) -> int:
    """How many graph features ``program`` has (fewer is simpler; a kind
    of subclass leaves other than ``two_tensor`` counts one more)."""
    nonzero = sum(_multi_index(r) >= 1 for r in program.roots)
    db = program.double_backward
    kind = int(bool(program.subclass_leaves) and program.subclass_kind != DEFAULT_SUBCLASS_KIND)
    return (
        len(program.func_terms) + len(program.subclass_leaves) + kind + nonzero + (0 if db is None else len(db.inputs))
    )


def reduce_candidates(program: Program) -> Iterator[Program]:
    """Simpler variants without one graph feature (or with less of one)."""
    for i in range(len(program.func_terms)):
        yield dataclasses.replace(program, func_terms=program.func_terms[:i] + program.func_terms[i + 1 :])
    db = program.double_backward
    if db is not None:
        yield dataclasses.replace(program, double_backward=None)
        for i in range(len(db.inputs)):
            if len(db.inputs) > 1:
                yield dataclasses.replace(program, double_backward=dataclasses.replace(db, inputs=db.inputs[:i] + db.inputs[i + 1 :]))
    for i in range(len(program.subclass_leaves)):
        yield _without_subclass_leaf(program, i)
    if program.subclass_leaves and program.subclass_kind != DEFAULT_SUBCLASS_KIND:
        yield dataclasses.replace(program, subclass_kind=DEFAULT_SUBCLASS_KIND)
    for i, ref in enumerate(program.roots):
        if _multi_index(ref) >= 1:
            roots = program.roots[:i] + (f"{base_name(ref)}:0",) + program.roots[i + 1 :]
            yield dataclasses.replace(program, roots=tuple(dict.fromkeys(roots)))


def _without_subclass_leaf(program: Program, i: int) -> Program:
    """``program`` without subclass leaf ``i`` (the default kind once none is left)."""
    rest = program.subclass_leaves[:i] + program.subclass_leaves[i + 1 :]
    kind = program.subclass_kind if rest else DEFAULT_SUBCLASS_KIND
    return dataclasses.replace(program, subclass_leaves=rest, subclass_kind=kind)


# ------------------------------------------------------------ neighbours
def neighbour_candidates(
    program: Program, infos: Mapping[str, ValueInfo]
) -> Iterator[tuple[str, Callable[[], Program]]]:
    """One-change variants of the graph features, labelled: a term's
    transform or function, the penalty, a subclass leaf made plain, a root
    moved to another output of its op."""
    for i, term in enumerate(program.func_terms):
        for field, options in (("transform", TRANSFORMS), ("fn", FUNC_FNS)):
            for new in options:
                if new != getattr(term, field):
                    changed = dataclasses.replace(term, **{field: new})
                    terms = program.func_terms[:i] + (changed,) + program.func_terms[i + 1 :]
                    yield (
                        f"func_terms[{i}].{field}: {getattr(term, field)} -> {new}",
                        lambda terms=terms: dataclasses.replace(program, func_terms=terms),
                    )
    db = program.double_backward
    if db is not None:
        for new in PENALTIES:
            if new != db.penalty:
                changed_db = dataclasses.replace(db, penalty=new)
                yield (
                    f"double_backward.penalty: {db.penalty} -> {new}",
                    lambda changed_db=changed_db: dataclasses.replace(program, double_backward=changed_db),
                )
    for i, name in enumerate(program.subclass_leaves):
        yield f"subclass_leaves: - {name}", (lambda i=i: _without_subclass_leaf(program, i))
    if program.subclass_leaves:
        for kind in SUBCLASSES:
            if kind != program.subclass_kind and kind_available(kind)[0]:
                yield (
                    f"subclass_kind: {program.subclass_kind} -> {kind}",
                    lambda kind=kind: dataclasses.replace(program, subclass_kind=kind),
                )
    for i, ref in enumerate(program.roots):
        if _multi_index(ref) < 0:
            continue
        base = base_name(ref)
        for other in infos:
            if other != ref and base_name(other) == base and other not in program.roots and infos[other].requires_grad:
                roots = program.roots[:i] + (other,) + program.roots[i + 1 :]
                yield f"roots[{i}]: {ref} -> {other}", (lambda roots=roots: dataclasses.replace(program, roots=roots))


__all__ = [
    "draw_graph_features",
    "dtensor_leaves",
    "inner_grad_hook",
    "inner_grad_hook_source",
    "neighbour_candidates",
    "program_features",
    "reduce_candidates",
    "stage",
    "stage_features",
    "stage_source",
    "term_expr",
    "two_tensor_class",
    "weight",
    "wrap_subclass_leaves",
]
