"""The op table the program strategy draws ops from (:mod:`fuzz.strategies`).

Hypothesis makes many choices at their simplest value while it generates,
so ``sampled_from`` over the catalog piles up its first op. Instead each op
holds slots of a table of :data:`OP_SLOTS`, in proportion to its weight
(:func:`op_weights`) and spread evenly (:func:`op_slots`), and an op is the
slot at a point drawn as two uniform bytes plus a rotation
(:func:`draw_op`): only the all-zero point, where shrinking leads, maps to
one fixed op.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from fuzz import ops as catalog

#: Ops are drawn from a table of this many slots, each op holding a number
#: of slots proportional to its weight, spread evenly over the table.
OP_SLOTS = 4096


def op_weights(names: Sequence[str], weights: Sequence[tuple[str, float]] | None = None) -> dict[str, float]:
    """The relative weight of each op of ``names`` when drawing ops: the
    given ``weights`` (name -> weight; names not given get 0), or by default
    1 per op and 1/4 for an op the catalog marks ``rare`` (``mul_inplace``).
    Raises ValueError on a negative weight, a name not in ``names`` or all
    zeros."""
    if weights is None:
        out = {n: (0.25 if catalog.OPS[n].rare else 1.0) for n in names}
    else:
        given = dict(weights)
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(f"op_weights name op(s) {unknown} not drawn from ({len(names)} ops)")
        bad = {n: w for n, w in given.items() if not (w >= 0)}
        if bad:
            raise ValueError(f"op_weights must be >= 0, got {bad}")
        out = {n: float(given.get(n, 0.0)) for n in names}
    if not sum(out.values()) > 0:
        raise ValueError("op_weights are all 0: no op to draw")
    return out


@functools.lru_cache(maxsize=64)
def op_slots(names: tuple[str, ...], weights: tuple[tuple[str, float], ...] | None = None) -> tuple[str, ...]:
    """The op table: :data:`OP_SLOTS` op names, op ``n`` in a share of the
    slots proportional to ``op_weights(names, weights)[n]`` (at least one
    slot for a weight above 0; largest remainders), spread evenly (stride
    scheduling), so that every run of slots holds about the same mix. Ties
    go to the catalog's order: with equal weights slot 0 is ``names[0]``."""
    w = op_weights(names, weights)
    kept = [n for n in names if w[n] > 0]
    if len(kept) > OP_SLOTS:
        raise ValueError(f"more than {OP_SLOTS} ops to draw from")
    total = sum(w[n] for n in kept)
    exact = {n: w[n] / total * OP_SLOTS for n in kept}
    count = {n: max(1, int(exact[n])) for n in kept}
    by_remainder = sorted(kept, key=lambda n: (-(exact[n] - int(exact[n])), kept.index(n)))
    i = 0
    while sum(count.values()) < OP_SLOTS:
        count[by_remainder[i % len(kept)]] += 1
        i += 1
    by_size = sorted(kept, key=lambda n: (count[n], kept.index(n)), reverse=True)
    i = 0
    while sum(count.values()) > OP_SLOTS:  # ops raised to one slot pushed it over
        if count[by_size[i % len(kept)]] > 1:
            count[by_size[i % len(kept)]] -= 1
        i += 1
    slots = sorted(((k + 0.5) / count[n], j, n) for j, n in enumerate(kept) for k in range(count[n]))
    return tuple(n for _, _, n in slots)


def draw_op(draw: Any, slots: tuple[str, ...], rotation: int) -> str:
    """An op from the table: a point of [0, 65536) drawn as two bytes
    (Hypothesis draws an integer in [0, 255] uniformly, but now and then at
    its simplest value, 0), shifted by ``rotation``; shrinks toward the
    point 0, slot ``rotation``."""
    point = draw(st.integers(0, 255)) * 256 + draw(st.integers(0, 255))
    return slots[(point + rotation) % len(slots)]
