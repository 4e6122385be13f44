"""Neighbour programs: one change away from a program, for cache soundness.

A compiled autograd that reuses a cached graph for a backward it should not
(a *wrong cache hit*) gives that backward another graph's gradients. Every
program of a campaign runs in a fresh cache, so such a bug is invisible to
it. :func:`derive` makes, from a program alone, up to ``n`` *neighbours*:
programs that differ from it in exactly one thing, each labelled with what
changed. The oracle (:class:`fuzz.oracle.Oracle`, ``neighbours=N``) runs
them after the program in the same cagrad state, so a change that must
change the cache key but does not shows up as a wrong result.

Kinds of change (:data:`CHANGE_KINDS`), each a single edit of the IR:

* ``attr``: one op attribute value (a dim, a keepdim flag, an exponent, a
  scalar, an alpha, a shape or index list, a dtype);
* ``dtype``: one leaf's dtype (float32 <-> float64);
* ``size``: one leaf size, changed everywhere it occurs (as a resize step
  does, so broadcast partners follow);
* ``requires_grad``: one leaf's ``requires_grad`` flipped;
* ``hook``: a hook removed, a tensor hook added on a non-leaf value, or a
  hook's numeric argument changed;
* ``edge``: one op input replaced by another value of the same shape;
* ``values``: the seed (new leaf values, same graph: a cache hit that must
  give the new values' gradients);
* ``graph``: a graph feature (:mod:`fuzz.features_graph`): a ``torch.func``
  term's transform or function, the double backward's penalty, a subclass
  leaf made plain, or a root moved to another output of its op (the key
  must see which output a root is);
* ``train``: one option of the training features changed (a step count,
  the optimizer, ``foreach``, ``set_to_none``, the learning rate, a
  checkpoint region's reentrancy, policy or extent:
  :func:`fuzz.training_gen.neighbour_candidates`); a dropout ``p`` or a
  threshold is an ``attr`` change;
* ``alias``: which tensors are the same object, nothing else: a value that
  does not require grad and is used twice gets a twin leaf for one use
  (same shape and dtype), or one use of such a value is replaced by another
  one of the same shape and dtype. The autograd graph and every key stay
  the same (the values are saved tensors, not nodes), so the neighbour is a
  cache hit that must read each saved tensor from its own position (found
  this way: a static-size capture once read one of two saved copies of a
  tensor for both).

Some changes must change the key (an attribute the backward formula reads),
others must not (a size under ``dynamic=True``, new values); the oracle
checks every neighbour against eager either way.

Determinism: the choice is seeded by a hash of the program's JSON without
its name (:func:`fuzz.interpret.program_digest`), so shrinking and replay
re-derive the same neighbours from the same program. Attribute changes come
first (they are the ones a key is most likely to leave out), then aliasing
changes (which no key sees), then the other kinds in a seeded order, cycling until ``n`` are found; every neighbour
passes :func:`fuzz.ir.validate`, and ``resizes`` are dropped (a neighbour is
a single program).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from fuzz import features_graph, training_gen
from fuzz import ops as catalog
from fuzz.interpret import derived_seed, program_digest
from fuzz.ir import DTYPES, Hook, IRError, Leaf, Program, ValueInfo, validate

CHANGE_KINDS = ("attr", "alias", "dtype", "size", "requires_grad", "hook", "edge", "values", "graph", "train")

# a lazily built candidate: (label, thunk returning the changed program)
_Candidate = tuple[str, Callable[[], Program]]


class Neighbour(NamedTuple):
    """One neighbour of a program.

    Attributes:
        program: the changed program (named ``"<index> <label>"``, without
            ``resizes``).
        kind: one of :data:`CHANGE_KINDS`.
        label: what changed, e.g. ``"ops[2].attrs.dim: 1 -> 0"``.
    """

    program: Program
    kind: str
    label: str


def derive(program: Program, n: int) -> list[Neighbour]:
    """Up to ``n`` neighbours of ``program`` (fewer when it has fewer valid
    one-change variants), deterministic from the program (its name aside).

    Raises:
        fuzz.ir.IRError: ``program`` itself is not valid.
    """
    if n <= 0:
        return []
    base = program.without_resizes()
    infos = validate(base)
    rng = random.Random(derived_seed(0, "neighbours/" + program_digest(program)))
    pools: dict[str, list[_Candidate]] = {kind: list(_CANDIDATES[kind](base, infos)) for kind in CHANGE_KINDS}
    for pool in pools.values():
        rng.shuffle(pool)
    # (a kind with no candidate stays out of the shuffle: programs without
    # training features keep the order they had before the kind existed)
    rest = [k for k in CHANGE_KINDS if k not in ("attr", "alias") and (k != "train" or pools[k])]
    rng.shuffle(rest)
    order = ["attr", "alias", *rest]
    found: list[Neighbour] = []
    seen = {_identity(base)}
    while len(found) < n and any(pools.values()):
        for kind in order:
            if len(found) >= n:
                break
            pool = pools[kind]
            while pool:
                label, make = pool.pop()
                try:
                    changed = make()
                    validate(changed)
                except (IRError, catalog.SpecError, ValueError, KeyError, IndexError, TypeError):
                    continue
                ident = _identity(changed)
                if ident in seen:
                    continue
                seen.add(ident)
                found.append(Neighbour(changed.with_name(f"{len(found) + 1} {label}"), kind, label))
                break
    return found


def neighbours(program: Program, n: int) -> list[Program]:
    """The programs of :func:`derive` (each named after its change)."""
    return [nb.program for nb in derive(program, n)]


def _identity(program: Program) -> str:
    return program.with_name("").to_json(indent=None)


# ------------------------------------------------------------- attributes
def _fmt(v: Any) -> str:
    return repr(v) if not isinstance(v, (list, tuple)) else str(list(v))


def attr_alternatives(kind: str, value: Any, rank: int, choices: Sequence[Any] | None = None) -> list[Any]:
    """Other values of an attribute of ``kind`` (see :mod:`fuzz.ops`) than
    ``value``, for an op whose first input has ``rank`` dimensions; not all
    need be valid for the op (the caller validates). Dims are listed as
    non-negative ints, plus ``value``'s equivalent negative form (a change
    that must not change the gradients)."""
    if choices is not None:
        return [c for c in choices if c != value]
    out: list[Any] = []
    dims = list(range(max(rank, 1) + 1))  # +1: unsqueeze/stack take rank + 1 positions
    if kind == "bool":
        out = [not value]
    elif kind == "int":
        out = [value + 1, value - 1, value + 2]
    elif kind == "float":
        out = [-value, value + 1.0, 2.0 * value, 0.5]
    elif kind == "dtype":
        out = [d for d in DTYPES if d != value]
    elif kind in ("dim", "opt_dim"):
        out = [d for d in dims if value is None or d != value % max(rank, 1)]
        if isinstance(value, int) and value >= 0 and rank:
            out.append(value - rank)
        if kind == "opt_dim" and value is not None:
            out.append(None)
    elif kind in ("dims", "opt_dims"):
        current = value if isinstance(value, list) else ([value] if isinstance(value, int) else None)
        out = [[d] for d in dims[:-1] if current is None or [d] != current]
        if current is not None and len(current) > 1:
            out += [current[:-1], current[1:]]
        elif current is not None and rank > 1:
            out.append(sorted({*current, (current[0] + 1) % rank}))
        if kind == "opt_dims" and value is not None:
            out.append(None)
    elif kind in ("shape", "ints"):
        v = list(value)
        out = [v[::-1], v[1:] + v[:1]]
        if v:
            out += [[v[0] + 1, *v[1:]], [v[0] - 1, *v[1:]], v[:-1]]
    elif kind == "str":
        out = []
    return [o for o in out if o != value]


def _attr_candidates(program: Program, infos: Mapping[str, ValueInfo]) -> Iterator[_Candidate]:
    for i, op in enumerate(program.ops):
        spec = catalog.OPS.get(op.op)
        if spec is None:
            continue
        rank = len(infos[op.inputs[0]].shape) if op.inputs and op.inputs[0] in infos else 0
        for name, attr in spec.attrs.items():
            if name not in op.attrs:
                continue
            old = op.attrs[name]
            for new in attr_alternatives(attr.kind, old, rank, attr.choices):
                label = f"ops[{i}].attrs.{name}: {_fmt(old)} -> {_fmt(new)}"
                yield label, _replace_op(program, i, attrs={**op.attrs, name: new})


def _replace_op(program: Program, i: int, **changes: Any) -> Callable[[], Program]:
    def make() -> Program:
        ops = list(program.ops)
        ops[i] = dataclasses.replace(ops[i], **changes)
        return dataclasses.replace(program, ops=tuple(ops))

    return make


def _replace_leaf(program: Program, i: int, **changes: Any) -> Callable[[], Program]:
    def make() -> Program:
        leaves = list(program.leaves)
        leaves[i] = dataclasses.replace(leaves[i], **changes)
        return dataclasses.replace(program, leaves=tuple(leaves))

    return make


# ------------------------------------------------------------------ leaves
def _dtype_candidates(program: Program, infos: Mapping[str, ValueInfo]) -> Iterator[_Candidate]:
    for i, leaf in enumerate(program.leaves):
        for new in DTYPES:
            if new != leaf.dtype:
                yield f"leaves[{i}].dtype: {leaf.dtype} -> {new}", _replace_leaf(program, i, dtype=new)


def _size_candidates(program: Program, infos: Mapping[str, ValueInfo]) -> Iterator[_Candidate]:
    for old in sorted(set(program.leaf_sizes())):
        for new in (old + 1, old - 1):
            if new >= 1:
                yield f"size {old} -> {new}", (lambda old=old, new=new: program.at_sizes({old: new}))


def _requires_grad_candidates(program: Program, infos: Mapping[str, ValueInfo]) -> Iterator[_Candidate]:
    for i, leaf in enumerate(program.leaves):
        new = not leaf.requires_grad
        yield f"leaves[{i}].requires_grad: {leaf.requires_grad} -> {new}", _replace_leaf(
            program, i, requires_grad=new
        )


# ------------------------------------------------------------------- hooks
def _hook_candidates(program: Program, infos: Mapping[str, ValueInfo]) -> Iterator[_Candidate]:
    hooks = program.hooks
    for k, hook in enumerate(hooks):
        rest = hooks[:k] + hooks[k + 1 :]
        yield f"hooks: - {hook.label} {hook.action}", (lambda rest=rest: dataclasses.replace(program, hooks=rest))
        if isinstance(hook.arg, (int, float)) and hook.action in ("scale", "shift", "pure_scale", "pure_shift"):
            new_hook = dataclasses.replace(hook, arg=-hook.arg if hook.arg else 1.0)
            changed = hooks[:k] + (new_hook,) + hooks[k + 1 :]
            yield f"hooks[{k}].arg: {hook.arg!r} -> {new_hook.arg!r}", (
                lambda changed=changed: dataclasses.replace(program, hooks=changed)
            )
    taken = {h.name for h in hooks} | set(infos) | {leaf.name for leaf in program.leaves}
    name = next(f"hn{j}" for j in itertools.count() if f"hn{j}" not in taken)
    for ref, info in infos.items():
        if info.requires_grad and not info.is_leaf:
            for action, arg in (("observe", None), ("scale", 2.0), ("pure_scale", 2.0)):
                new_hook = Hook(name, "tensor", ref, action, arg)
                yield f"hooks: + {new_hook.label} {action}", (
                    lambda new_hook=new_hook: dataclasses.replace(program, hooks=(*hooks, new_hook))
                )


# ------------------------------------------------------------------- edges
def _edge_candidates(program: Program, infos: Mapping[str, ValueInfo]) -> Iterator[_Candidate]:
    order = list(infos)  # validate() fills it in definition order: leaves, then each op's outputs
    position = {ref: p for p, ref in enumerate(order)}
    for i, op in enumerate(program.ops):
        first_out = next((p for p, ref in enumerate(order) if ref.split(":", 1)[0] == op.name), len(order))
        for j, ref in enumerate(op.inputs):
            shape = infos[ref].shape if ref in infos else None
            for other in order[:first_out]:
                if other != ref and infos[other].shape == shape and position[other] < first_out:
                    inputs = op.inputs[:j] + (other,) + op.inputs[j + 1 :]
                    yield f"ops[{i}].inputs[{j}]: {ref} -> {other}", _replace_op(program, i, inputs=inputs)


def _alias_candidates(program: Program, infos: Mapping[str, ValueInfo]) -> Iterator[_Candidate]:
    order = list(infos)
    position = {ref: p for p, ref in enumerate(order)}
    uses: dict[str, int] = {}
    for op in program.ops:
        for ref in op.inputs:
            uses[ref] = uses.get(ref, 0) + 1
    names = {leaf.name for leaf in program.leaves} | {op.name for op in program.ops}
    twin = next(f"x{k}" for k in itertools.count(len(program.leaves)) if f"x{k}" not in names)
    for i, op in enumerate(program.ops):
        first_out = next((p for p, ref in enumerate(order) if ref.split(":", 1)[0] == op.name), len(order))
        for j, ref in enumerate(op.inputs):
            info = infos.get(ref)
            if info is None or info.requires_grad:
                continue
            if uses[ref] > 1:
                inputs = op.inputs[:j] + (twin,) + op.inputs[j + 1 :]
                leaf = Leaf(twin, info.shape, info.dtype, requires_grad=False)
                yield f"ops[{i}].inputs[{j}]: {ref} -> new leaf {twin}", _add_leaf_for(program, i, inputs, leaf)
            for other in order[:first_out]:
                o = infos[other]
                if other != ref and not o.requires_grad and (o.shape, o.dtype) == (info.shape, info.dtype):
                    if position[other] < first_out:
                        inputs = op.inputs[:j] + (other,) + op.inputs[j + 1 :]
                        yield f"ops[{i}].inputs[{j}]: {ref} -> {other} (same tensor)", _replace_op(program, i, inputs=inputs)


def _add_leaf_for(program: Program, i: int, inputs: tuple[str, ...], leaf: Leaf) -> Callable[[], Program]:
    def make() -> Program:
        ops = list(program.ops)
        ops[i] = dataclasses.replace(ops[i], inputs=inputs)
        return dataclasses.replace(program, leaves=(*program.leaves, leaf), ops=tuple(ops))

    return make


def _values_candidates(program: Program, infos: Mapping[str, ValueInfo]) -> Iterator[_Candidate]:
    new = program.seed + 1
    yield f"seed: {program.seed} -> {new}", (lambda: dataclasses.replace(program, seed=new))


_CANDIDATES: dict[str, Callable[[Program, Mapping[str, ValueInfo]], Iterator[_Candidate]]] = {
    "attr": _attr_candidates,
    "alias": _alias_candidates,
    "dtype": _dtype_candidates,
    "size": _size_candidates,
    "requires_grad": _requires_grad_candidates,
    "hook": _hook_candidates,
    "edge": _edge_candidates,
    "values": _values_candidates,
    "graph": features_graph.neighbour_candidates,
    "train": training_gen.neighbour_candidates,
}

__all__ = ["CHANGE_KINDS", "Neighbour", "attr_alternatives", "derive", "neighbours"]
