"""Drawing, reducing and varying the training features
(:mod:`fuzz.features_training`).

* :func:`draw_features`: the strategies' draw (:mod:`fuzz.strategies`):
  about one program in eight trains, about one in eight gets a checkpoint
  region; both shrink to "off" (each is decided by a rare draw that
  shrinks to False), then to one step, SGD, ``foreach`` off,
  ``set_to_none=True``, no fresh leaves, a one-op non-reentrant region
  without a policy.
* :func:`reductions`: :mod:`fuzz.reduce`'s candidates: drop the feature,
  or lower it (fewer steps, fewer fresh leaves, a smaller region, plain
  options), and :func:`weight`, their part of
  :func:`fuzz.reduce.complexity`.
* :func:`neighbour_candidates`: :mod:`fuzz.neighbours`' kind ``train``:
  one changed option (steps, optimizer, ``foreach``, ``set_to_none``,
  learning rate, reentrant or not, the policy, the region's extent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from hypothesis import strategies as st

from fuzz.draws import rare
from fuzz.features_training import (
    MAX_STEPS,
    OPTIMIZERS,
    POLICIES,
    Checkpoint,
    Training,
    has_selective,
)

LEARNING_RATES = (0.1, 0.01)


def _valid(program: Any) -> bool:
    from fuzz.ir import IRError, validate

    try:
        validate(program)
    except IRError:
        return False
    return True


def draw_features(draw: Any, program: Any, train: bool = True, checkpoint: bool = True) -> Any:
    """``program`` (valid, pruned) with maybe a ``train`` and maybe a
    ``checkpoint`` field (see the module doc); always valid."""
    if checkpoint and program.ops and rare(draw, 8):
        n = len(program.ops)
        for _ in range(3):
            start = draw(st.integers(0, n - 1))
            length = draw(st.integers(1, min(3, n - start)))
            reentrant = draw(st.booleans())
            policy = None
            if not reentrant and rare(draw, 3):
                # drawn on every torch, kept only where torch has selective
                # checkpointing: the draws after it are the same either way
                policy = draw(st.sampled_from(POLICIES))
                if not has_selective():
                    policy = None
            names = tuple(op.name for op in program.ops[start : start + length])
            candidate = dataclasses.replace(program, checkpoint=Checkpoint(names, reentrant, policy))
            if _valid(candidate):
                program = candidate
                break
    if train and program.mode == "backward" and rare(draw, 8):
        fresh = []
        for leaf in program.leaves:
            if not leaf.requires_grad and not rare(draw, 4):
                fresh.append(leaf.name)  # the data: drawn anew at each step
            elif leaf.requires_grad and rare(draw, 6):
                fresh.append(leaf.name)  # an input that requires grad
        t = Training(
            steps=draw(st.integers(1, MAX_STEPS)),
            optimizer=draw(st.sampled_from(OPTIMIZERS)),
            lr=draw(st.sampled_from(LEARNING_RATES)),
            foreach=draw(st.booleans()),
            set_to_none=draw(st.sampled_from([True, False])),
            fresh=tuple(fresh),
        )
        for candidate in (dataclasses.replace(program, train=t), dataclasses.replace(program, train=dataclasses.replace(t, fresh=()))):
            if _valid(candidate):
                program = candidate
                break
    return program


# ------------------------------------------------------------------ reduce
def weight(p: Any) -> int:
    """How much of the features ``p`` carries (smaller is simpler)."""
    w = 0
    t = p.train
    if t is not None:
        w += 1 + t.steps + len(t.fresh) + int(t.foreach) + int(not t.set_to_none) + int(t.optimizer != "sgd")
    c = p.checkpoint
    if c is not None:
        w += 1 + len(c.ops) + int(c.use_reentrant) + int(c.policy is not None)
    return w


def reductions(p: Any) -> Iterator[Any]:
    """Simpler variants of ``p``'s features (not validated), most
    aggressive first."""
    t, c = p.train, p.checkpoint
    if c is not None:
        yield dataclasses.replace(p, checkpoint=None)
    if t is not None:
        yield dataclasses.replace(p, train=None)
        if t.steps > 1:
            yield dataclasses.replace(p, train=dataclasses.replace(t, steps=1))
            yield dataclasses.replace(p, train=dataclasses.replace(t, steps=t.steps - 1))
        for i in range(len(t.fresh)):
            yield dataclasses.replace(p, train=dataclasses.replace(t, fresh=t.fresh[:i] + t.fresh[i + 1 :]))
        simpler = {"foreach": False, "set_to_none": True, "optimizer": "sgd"}
        for field, value in simpler.items():
            if getattr(t, field) != value:
                yield dataclasses.replace(p, train=dataclasses.replace(t, **{field: value}))
    if c is not None:
        if len(c.ops) > 1:
            yield dataclasses.replace(p, checkpoint=dataclasses.replace(c, ops=c.ops[1:]))
            yield dataclasses.replace(p, checkpoint=dataclasses.replace(c, ops=c.ops[:-1]))
        if c.policy is not None:
            yield dataclasses.replace(p, checkpoint=dataclasses.replace(c, policy=None))
        if c.use_reentrant:
            yield dataclasses.replace(p, checkpoint=dataclasses.replace(c, use_reentrant=False))


# -------------------------------------------------------------- neighbours
def neighbour_candidates(program: Any, infos: Mapping[str, Any]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``(label, make)`` pairs, each one option of the features changed."""
    t, c = program.train, program.checkpoint

    def train_with(**changes: Any) -> Callable[[], Any]:
        return lambda: dataclasses.replace(program, train=dataclasses.replace(t, **changes))

    def checkpoint_with(**changes: Any) -> Callable[[], Any]:
        return lambda: dataclasses.replace(program, checkpoint=dataclasses.replace(c, **changes))

    if t is not None:
        for steps in (t.steps + 1, t.steps - 1):
            if 1 <= steps <= MAX_STEPS:
                yield f"train.steps: {t.steps} -> {steps}", train_with(steps=steps)
        for opt in OPTIMIZERS:
            if opt != t.optimizer:
                yield f"train.optimizer: {t.optimizer} -> {opt}", train_with(optimizer=opt)
        yield f"train.foreach: {t.foreach} -> {not t.foreach}", train_with(foreach=not t.foreach)
        yield f"train.set_to_none: {t.set_to_none} -> {not t.set_to_none}", train_with(set_to_none=not t.set_to_none)
        lr = t.lr * 0.5
        yield f"train.lr: {t.lr!r} -> {lr!r}", train_with(lr=lr)
    if c is not None:
        yield f"checkpoint.use_reentrant: {c.use_reentrant} -> {not c.use_reentrant}", checkpoint_with(
            use_reentrant=not c.use_reentrant, policy=None
        )
        for policy in (None, *POLICIES):
            if policy != c.policy and (policy is None or has_selective()):
                yield f"checkpoint.policy: {c.policy} -> {policy}", checkpoint_with(policy=policy, use_reentrant=False)
        names = [op.name for op in program.ops]
        first, last = names.index(c.ops[0]), names.index(c.ops[-1])
        if last + 1 < len(names):
            yield f"checkpoint.ops: + {names[last + 1]}", checkpoint_with(ops=(*c.ops, names[last + 1]))
        if len(c.ops) > 1:
            yield f"checkpoint.ops: - {c.ops[0]}", checkpoint_with(ops=c.ops[1:])
        elif first > 0:
            yield f"checkpoint.ops: + {names[first - 1]}", checkpoint_with(ops=(names[first - 1], *c.ops))
