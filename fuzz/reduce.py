"""IR-level reduction of a failing program, after Hypothesis' shrinking.

Hypothesis shrinks the *choices* that generated a program; some structure it
cannot undo (an op deep in a chain that the failure does not need). This pass
works on the program itself, greedily, keeping a candidate only when it still
fails and is smaller by :func:`complexity`:

* drop a root (keeping at least one);
* drop or lower the training features (optimizer steps, a checkpoint
  region: :func:`fuzz.training_gen.reductions`);
* drop the size sequence, or one resize step of it;
* cut an op: its output becomes a fresh leaf of the same shape and dtype, so
  the op and everything only it needed disappear;
* re-root: an op whose outputs are only roots is dropped and one of its
  inputs becomes the root;
* bypass an op: uses of its output read one of its inputs of the same shape
  and dtype instead;
* simplify the backward: mode ``"grad"`` -> ``"backward"``, loss
  ``"separate"`` -> ``"sum"``, no ``inputs=``, ``repeat`` 1;
* ``float64`` leaves -> ``float32``;
* drop a hook; make a hook that changes gradients only observe them;
* drop a graph feature (:func:`fuzz.features_graph.reduce_candidates`: a
  ``torch.func`` term, the double backward or one of its inputs, a subclass
  leaf; a root at output k >= 1 moves to output 0);
* replace an op by ``clone`` of its first input (same shape and dtype), so
  that failures that need *a* node there, not that op, shrink to one
  signature.

Edits that turn a hooked op output into a leaf drop the hooks that a leaf
cannot take (node hooks, ``retain_grad``); edits after which a resize step
no longer validates (a cut made a leaf whose size that step changes into
something an op rejects) drop that step. Every candidate is validated and
pruned before it is tried.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from fuzz import features_graph, ir_graph, training_gen
from fuzz.ir import IRError, Leaf, Op, Program, validate


def complexity(p: Program) -> tuple[int, ...]:
    """Smaller is simpler: ops, leaves, elements, resize steps, training
    features (:func:`fuzz.training_gen.weight`), hooks, hooks
    that change gradients, ops other than ``clone``, roots, then the
    backward's options, then float64 leaves, then the JSON's length."""
    ops, leaves, numel, json_len = p.size_key()
    return (
        ops,
        leaves,
        numel,
        len(p.resizes),
        training_gen.weight(p),
        len(p.hooks),
        features_graph.weight(p),
        sum(h.action != "observe" for h in p.hooks),
        sum(op.op != "clone" for op in p.ops),
        len(p.roots),
        int(p.mode == "grad"),
        int(p.loss == "separate"),
        int(p.inputs is not None),
        p.repeat,
        sum(leaf.dtype == "float64" for leaf in p.leaves),
        json_len,
    )


def _fresh_name(p: Program, stem: str = "c") -> str:
    taken = {leaf.name for leaf in p.leaves} | {op.name for op in p.ops}
    i = 0
    while f"{stem}{i}" in taken:
        i += 1
    return f"{stem}{i}"


def _replace_refs(p: Program, mapping: dict[str, str], drop_op: str | None) -> Program:
    def sub(ref: str) -> str:
        return mapping.get(ref, ref)

    ops = tuple(
        dataclasses.replace(op, inputs=tuple(sub(r) for r in op.inputs)) for op in p.ops if op.name != drop_op
    )
    hooks = tuple(dataclasses.replace(h, target=sub(h.target)) for h in p.hooks)
    q = dataclasses.replace(
        p,
        ops=ops,
        roots=tuple(dict.fromkeys(sub(r) for r in p.roots)),
        inputs=None if p.inputs is None else tuple(dict.fromkeys(sub(r) for r in p.inputs)),
        hooks=hooks,
        **ir_graph.replace_refs(p, sub),
    )
    if not hooks:
        return q
    try:
        return q.without_invalid_hooks()
    except IRError:
        return q  # invalid for another reason: the caller's validate() says so


def _cut(p: Program, op: Op) -> Program:
    """``op``'s outputs become fresh leaves (requires_grad=True)."""
    info = validate(p)
    refs = [r for r in info if r == op.name or r.startswith(op.name + ":")]
    mapping: dict[str, str] = {}
    leaves = list(p.leaves)
    q = p
    for ref in refs:
        name = _fresh_name(dataclasses.replace(q, leaves=tuple(leaves)))
        leaves.append(Leaf(name, info[ref].shape, info[ref].dtype, True))
        mapping[ref] = name
        q = dataclasses.replace(q, leaves=tuple(leaves))
    return _replace_refs(q, mapping, op.name)


def _bypasses(p: Program, op: Op) -> Iterator[Program]:
    info = validate(p)
    if op.name not in info:  # multi-output ops are only cut
        return
    out = info[op.name]
    for ref in dict.fromkeys(op.inputs):
        src = info[ref]
        if src.shape == out.shape and src.dtype == out.dtype:
            yield _replace_refs(p, {op.name: ref}, op.name)


def _reroots(p: Program, op: Op) -> Iterator[Program]:
    """An op whose outputs are only roots: root one of its inputs instead."""
    outs = {op.name} | {r for r in p.roots if r.startswith(op.name + ":")}
    used = {r for o in p.ops for r in o.inputs} | set(p.inputs or ())
    if outs & used or not outs & set(p.roots):
        return
    info = validate(p)
    for ref in dict.fromkeys(op.inputs):
        if info[ref].requires_grad:
            roots = [r for r in p.roots if r not in outs]
            q = dataclasses.replace(
                p, ops=tuple(o for o in p.ops if o.name != op.name), roots=tuple(dict.fromkeys([ref] + roots))
            )
            yield q.pruned()


def _clones(p: Program, op: Op) -> Iterator[Program]:
    """``op`` becomes ``clone(first input)`` when that keeps shape and dtype."""
    if op.op == "clone" or not op.inputs:
        return
    info = validate(p)
    if op.name not in info:  # multi-output ops stay
        return
    src, out = info[op.inputs[0]], info[op.name]
    if src.shape == out.shape and src.dtype == out.dtype:
        ops = tuple(dataclasses.replace(o, op="clone", inputs=o.inputs[:1], attrs={}) if o is op else o for o in p.ops)
        yield dataclasses.replace(p, ops=ops)


def candidates(p: Program) -> Iterator[Program]:
    """Simpler variants of ``p`` (not yet validated), most aggressive first."""
    for i in range(len(p.roots)):
        if len(p.roots) > 1:
            yield dataclasses.replace(p, roots=p.roots[:i] + p.roots[i + 1 :])
    yield from training_gen.reductions(p)
    if p.resizes:
        yield p.without_resizes()
    if len(p.resizes) > 1:
        for i in range(len(p.resizes)):
            yield dataclasses.replace(p, resizes=p.resizes[:i] + p.resizes[i + 1 :])
    for i in range(len(p.hooks)):
        yield dataclasses.replace(p, hooks=p.hooks[:i] + p.hooks[i + 1 :])
    yield from features_graph.reduce_candidates(p)
    for op in reversed(p.ops):
        yield _cut(p, op)
    for op in reversed(p.ops):
        yield from _reroots(p, op)
    for op in reversed(p.ops):
        yield from _bypasses(p, op)
    for op in reversed(p.ops):
        yield from _clones(p, op)
    if p.mode == "grad":
        yield dataclasses.replace(p, mode="backward", inputs=None)
    if p.loss == "separate":
        yield dataclasses.replace(p, loss="sum")
    if p.inputs is not None and p.mode == "backward":
        yield dataclasses.replace(p, inputs=None)
    if p.repeat != 1:
        yield dataclasses.replace(p, repeat=1, retain_graph=None)
    for i, hook in enumerate(p.hooks):
        if hook.action != "observe":
            hooks = list(p.hooks)
            hooks[i] = dataclasses.replace(hook, action="observe", arg=None)
            yield dataclasses.replace(p, hooks=tuple(hooks))
    for j, leaf in enumerate(p.leaves):
        if leaf.dtype == "float64":
            leaves = list(p.leaves)
            leaves[j] = dataclasses.replace(leaf, dtype="float32")
            yield dataclasses.replace(p, leaves=tuple(leaves))


def _valid_steps(p: Program) -> Program:
    """``p`` without the resize steps that do not validate (the rest of
    ``p`` may still be invalid: the caller's validate() says so)."""
    if not p.resizes:
        return p
    keep = []
    for step in p.resizes:
        try:
            validate(p.at_sizes(step))
        except IRError:
            continue
        keep.append(step)
    return dataclasses.replace(p, resizes=tuple(keep))


def reduce_program(
    program: Program,
    still_fails: Callable[[Program], bool],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Program, int]:
    """Greedy reduction until no candidate helps or ``deadline`` passes.

    Returns the smallest failing program found and the number of candidates
    tried (each one a call of ``still_fails``).
    """
    best = program.pruned()
    tried = 0
    seen: set[str] = set()
    improved = True
    while improved and clock() < deadline:
        improved = False
        for cand in candidates(best):
            if clock() >= deadline:
                break
            try:
                cand = _valid_steps(cand.pruned())
                validate(cand)
            except IRError:
                continue
            if complexity(cand) >= complexity(best):
                continue
            key = cand.to_json(indent=None)
            if key in seen:
                continue
            seen.add(key)
            tried += 1
            if still_fails(cand):
                best = cand
                improved = True
                break
    return best, tried
