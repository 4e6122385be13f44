"""Steering: each round's op weights come from what earlier rounds generated.

A round (:mod:`fuzz.campaign.rounds`) is one Hypothesis run; what it
generates is a function of the campaign seed, the round number and the
round's :class:`RoundPlan`: op weights and the op table's rotation (see
:mod:`fuzz.strategies`). The plan of round ``r`` is made from the
coverage of the programs rounds ``0 .. r-1`` *generate* (:func:`plan_round`):
an op drawn less than its share so far, or one with pairs of
:data:`fuzz.coverage.PAIRS` not seen yet (``op x dtype``, ...), weighs more
(up to :data:`MAX_BOOST` times its base weight), one drawn more weighs less;
the rotation puts the op that needs it most at slot 0, where Hypothesis's
simplest choices land.

Those counts come from generating the earlier rounds again without running
them (:func:`generated_counts`, about a second per 100 programs, in the
parent process, each round once, kept in ``state.json``), not from the
programs the workers ran: so every round's programs depend only on the
seed, the round, the round size and the generation options, never on the
worker count, the shards, timing, resumption or what the subjects did. (A
round cut short by a failure still counts whole.)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings

from fuzz import coverage
from fuzz.interpret import derived_seed
from fuzz.ir import Program
from fuzz.strategies import OP_SLOTS, GenConfig, op_slots, op_weights, programs

#: A steered op weighs at most this many times the mean base weight, and
#: at least 1/MAX_BOOST of its own.
MAX_BOOST = 10.0
#: Mean base weights an op gains per pair of :data:`fuzz.coverage.PAIRS`
#: that names it (through its name, category or in-place kind) and that no
#: program has had yet.
PAIR_BOOST = 2.0

#: Axes whose values stand for sets of ops (pairs with them steer those ops).
_OP_AXES = ("op", "category", "inplace")


def _missing_pairs(names: list[str], pair_counts: dict[str, int]) -> dict[str, float]:
    """Per op, the pairs of :data:`fuzz.coverage.PAIRS` not generated yet
    that name it: ``op=n & ...`` counts 1, and a pair naming its category
    (``category=c & ...``) or its in-place kind (``inplace=inplace & ...``)
    counts one over the number of ops it names."""
    from fuzz import ops as catalog

    members: dict[tuple[str, str], list[str]] = {}
    for n in names:
        cat = catalog.OPS[n].category
        members.setdefault(("op", n), []).append(n)
        members.setdefault(("category", cat), []).append(n)
        if cat in ("inplace", "inplace_view"):
            members.setdefault(("inplace", cat), []).append(n)
    missing = dict.fromkeys(names, 0.0)
    for pair in coverage.PAIRS:
        for p in coverage.domain_pairs()[pair.name]:
            if pair_counts.get(p, 0):
                continue
            (a_axis, a), (b_axis, b) = (side.split("=", 1) for side in p.split(" & ", 1))
            for axis, value in ((a_axis, a), (b_axis, b)):
                ops = members.get((axis, value), []) if axis in _OP_AXES else []
                for n in ops:
                    missing[n] += 1 / len(ops)
    return missing


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """What a round generates from besides its seed: ``op_weights`` (name,
    weight) pairs (None: :func:`fuzz.strategies.op_weights`' defaults) and
    ``op_rotation`` (0 <= rotation < :data:`fuzz.strategies.OP_SLOTS`)."""

    op_weights: tuple[tuple[str, float], ...] | None = None
    op_rotation: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"op_weights": None if self.op_weights is None else [list(w) for w in self.op_weights],
                "op_rotation": self.op_rotation}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> RoundPlan:
        if not d:
            return cls()
        w = d.get("op_weights")
        return cls(None if w is None else tuple((str(n), float(x)) for n, x in w), int(d.get("op_rotation", 0)))

    def gen(self, base: GenConfig) -> GenConfig:
        """``base`` as a round draws from it (the campaign prunes programs itself)."""
        return dataclasses.replace(base, prune=False, op_weights=self.op_weights or base.op_weights, op_rotation=self.op_rotation)


@contextlib.contextmanager
def _without_constants() -> Iterator[None]:
    """Hypothesis draws about one choice in twenty from a pool of constants,
    among them every integer literal in the source of the *local* modules the
    process has imported (``hypothesis.internal.conjecture.providers``),
    collected the first time a kind of choice is drawn: what a round
    generated depended on what the process had imported by then (the parent,
    a fresh worker and one that ran rounds generated different programs
    from one seed). Rounds draw no constants. This reaches into Hypothesis'
    internals; where they differ (another version), nothing is changed."""
    try:
        from hypothesis.internal.conjecture.providers import HypothesisProvider
    except ImportError:  # pragma: no cover
        yield
        return
    original = HypothesisProvider.__dict__.get("_maybe_draw_constant")
    if original is None:  # pragma: no cover
        yield
        return
    HypothesisProvider._maybe_draw_constant = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        HypothesisProvider._maybe_draw_constant = original  # type: ignore[method-assign]


def round_test(gen: GenConfig, round_seed: int, round_size: int, body: Callable[[Program], None]) -> Callable[[], None]:
    """The Hypothesis test of one round: ``body(program.pruned())`` for
    ``round_size`` programs of ``programs(gen)``, seeded with ``round_seed``,
    drawing no constants (:func:`_without_constants`). The campaign's rounds
    and :func:`generated_counts` both use it, so that they generate the
    same programs in any process."""

    @settings(
        max_examples=round_size,
        database=None,
        deadline=None,
        derandomize=False,
        phases=[Phase.generate, Phase.shrink],
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    @seed(round_seed)
    @given(programs(gen))
    def campaign_round(program: Program) -> None:
        body(program.pruned())

    def run() -> None:
        with _without_constants():
            campaign_round()

    return run


def round_seed(campaign_seed: int, r: int) -> int:
    return derived_seed(campaign_seed, f"round/{r}")


def generated_counts(gen: GenConfig, campaign_seed: int, r: int, round_size: int) -> tuple[dict[str, int], dict[str, int]]:
    """``(op uses, pair counts)`` of the programs round ``r`` generates from
    ``gen`` (a :meth:`RoundPlan.gen`), without running them."""
    ops: dict[str, int] = {}
    pairs: dict[str, int] = {}

    def body(program: Program) -> None:
        coverage.add_counts(ops, program.op_names())
        coverage.add_counts(pairs, coverage.program_coverage(program)["pairs"])

    round_test(gen, round_seed(campaign_seed, r), round_size, body)()
    return ops, pairs


def plan_round(base: GenConfig, op_counts: dict[str, int], pair_counts: dict[str, int], campaign_seed: int, r: int) -> RoundPlan:
    """The plan of round ``r`` from the counts of the rounds before it.

    Op ``n`` of base weight ``w`` (share ``s`` of the base weights) drawn
    ``c`` times out of ``C`` op uses weighs ``w * (s*C + 1) / (c + 1) + m *
    PAIR_BOOST * u``, ``m`` the mean base weight and ``u`` the pairs naming
    it never generated (:func:`_missing_pairs`; a ``rare`` op with pairs to
    cover so catches up too), at least ``w / MAX_BOOST`` and at most
    ``MAX_BOOST * m``. The rotation starts the op table at the op whose
    weight grew most over its base (ties: the catalog's order): Hypothesis's
    simplest programs get it. With no counts yet (round 0) the rotation
    comes from the seed and the weights are the base ones."""
    names = base.op_names()
    w = op_weights(names, base.op_weights)
    total_w = sum(w.values())
    uses = sum(op_counts.get(n, 0) for n in names)
    if uses == 0:
        return RoundPlan(base.op_weights, derived_seed(campaign_seed, f"rotation/{r}") % OP_SLOTS)
    missing = _missing_pairs(names, pair_counts)
    mean_w = total_w / len(names)
    need: dict[str, float] = {}
    weights_d: dict[str, float] = {}
    for n in names:
        if w[n] <= 0:
            need[n] = weights_d[n] = 0.0
            continue
        expected = w[n] / total_w * uses
        raw = w[n] * (expected + 1) / (op_counts.get(n, 0) + 1) + mean_w * PAIR_BOOST * missing[n]
        weights_d[n] = min(MAX_BOOST * mean_w, max(w[n] / MAX_BOOST, raw))
        need[n] = raw / w[n]
    weights = tuple((n, round(weights_d[n], 6)) for n in names)
    neediest = max(names, key=lambda n: (need[n], -names.index(n)))
    slots = op_slots(tuple(names), weights)
    return RoundPlan(weights, slots.index(neediest))


class Steering:
    """The parent's steering state: the generated counts of rounds
    ``0 .. next_round-1`` and the plans of rounds handed out but not done.

    Args:
        gen: the campaign's generation options.
        campaign_seed, round_size: the campaign's.
        enabled: False: every round gets the base weights and a rotation
            from the seed (:func:`plan_round` with no counts).
        saved: :meth:`to_json` of an earlier session, or None.
    """

    def __init__(self, gen: GenConfig, campaign_seed: int, round_size: int, enabled: bool = True, saved: dict[str, Any] | None = None):
        self.gen, self.seed, self.round_size, self.enabled = gen, campaign_seed, round_size, enabled
        saved = saved or {}
        self.next_round = int(saved.get("next_round", 0))
        self.op_counts: dict[str, int] = dict(saved.get("op_counts", {}))
        self.pair_counts: dict[str, int] = dict(saved.get("pair_counts", {}))
        self.plans: dict[int, RoundPlan] = {int(r): RoundPlan.from_json(p) for r, p in saved.get("plans", {}).items()}

    def plan(self, r: int) -> RoundPlan:
        """Round ``r``'s plan (generating the rounds before it first, when steering)."""
        if r in self.plans:
            return self.plans[r]
        if not self.enabled:
            return plan_round(self.gen, {}, {}, self.seed, r)
        if r < self.next_round:  # a round before the counts (an old state): count again from round 0
            self.next_round, self.op_counts, self.pair_counts = 0, {}, {}
        while self.next_round < r:
            k = self.next_round
            p = self.plans.get(k) or plan_round(self.gen, self.op_counts, self.pair_counts, self.seed, k)
            ops, prs = generated_counts(p.gen(self.gen), self.seed, k, self.round_size)
            for n, c in ops.items():
                self.op_counts[n] = self.op_counts.get(n, 0) + c
            for n, c in prs.items():
                self.pair_counts[n] = self.pair_counts.get(n, 0) + c
            self.next_round += 1
        plan = plan_round(self.gen, self.op_counts, self.pair_counts, self.seed, r)
        self.plans[r] = plan
        return plan

    def done(self, r: int) -> None:
        """Round ``r`` is done: its plan need not be kept."""
        self.plans.pop(r, None)

    def to_json(self) -> dict[str, Any]:
        return {
            "next_round": self.next_round,
            "op_counts": dict(sorted(self.op_counts.items())),
            "pair_counts": dict(sorted(self.pair_counts.items())),
            "plans": {str(r): p.to_json() for r, p in sorted(self.plans.items())},
        }


def preview(gen: GenConfig, campaign_seed: int, count: int, round_size: int = 100, enabled: bool = True) -> dict[str, Any]:
    """What the first ``count`` programs of a campaign (rounds of
    ``round_size``, steered or not) exercise, by generating them without
    running them: the programs a campaign runs unless a new failure cuts a
    round short. Returns ``{"programs", "op_counts" (uses per op),
    "coverage" (:func:`fuzz.coverage.summary`)}``."""
    steering = Steering(gen, campaign_seed, round_size, enabled)
    ops: dict[str, int] = {}
    feats: dict[str, int] = {}
    prs: dict[str, int] = {}
    done = 0

    class _Enough(BaseException):
        pass

    def body(program: Program) -> None:
        nonlocal done
        if done >= count:
            raise _Enough
        done += 1
        coverage.add_counts(ops, program.op_names())
        cov = coverage.program_coverage(program)
        coverage.add_counts(feats, cov["features"])
        coverage.add_counts(prs, cov["pairs"])

    r = 0
    while done < count:
        try:
            round_test(steering.plan(r).gen(gen), round_seed(campaign_seed, r), round_size, body)()
        except _Enough:
            break
        r += 1
    return {"programs": done, "op_counts": dict(sorted(ops.items())), "coverage": coverage.summary(feats, prs)}
