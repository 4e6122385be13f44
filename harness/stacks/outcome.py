"""Result types of the stacks suite: one :class:`StackRun` per run of a
stack (per rank), one :class:`StackOutcome` per (stack, subject), gathered in
a :class:`StacksReport`. Outcomes keep no tensors; they convert to JSON."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from harness.lifetimes import Lifetimes
from harness.outcome import ErrorInfo, Mismatch


class StackStatus(str, enum.Enum):
    """What one subject did on one stack, compared with eager autograd.

    * ``match``: every recorded value agrees within tolerance on every rank,
      or eager raised and the subject raised the same exception type (on
      that rank). Fallbacks cagrad counted on the way are recorded, not
      judged.
    * ``mismatch``: a recorded value differs, a value is missing or extra,
      or the subject succeeded where eager raised.
    * ``error``: the subject raised where eager did not, raised another
      type, timed out, or never entered its engine.
    * ``fell_back``: every value matches, but cagrad ran at least one
      backward of a stack that must compile (:attr:`Stack.expect_compiled`)
      through eager autograd instead (the reasons are in the outcome).
    * ``skipped``: not run (:attr:`StackOutcome.skip_reason` says why).
    """

    MATCH = "match"
    MISMATCH = "mismatch"
    ERROR = "error"
    FELL_BACK = "fell_back"
    SKIPPED = "skipped"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class RankRun:
    """What one rank (the only one for a single-process stack) produced.

    Attributes:
        results: the values the stack recorded (name -> snapshot), in
            recording order; partial when it raised.
        error: its exception reduced to text (``None`` when it finished).
        lifetimes: ``(where, Lifetimes)``: the storages the stack's own
            code made (forwards, optimizer steps) alive after each backward
            on the main thread (``backward<k>``, from 0) and once the stack
            returned (``end``); empty where not recorded (a peer, or
            ``CAGRAD_FUZZ_LIFETIMES=0``), see :mod:`harness.stacks.execute`.
    """

    results: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: ErrorInfo | None = None
    lifetimes: list[tuple[str, Lifetimes]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StackRun:
    """One run of one stack under one subject.

    Attributes:
        ranks: one :class:`RankRun` per rank, rank order.
        counts: the subject's counter deltas over the run (rank 0's for a
            distributed stack, but ``fallbacks`` summed over the ranks), as :func:`harness.subjects.counter_deltas`
            gives them; ``captures``, ``cache_hits``, ``fallbacks`` for cagrad.
        fallback_reasons: reason -> backwards that fell back (all ranks).
        engine_entries: times the stack entered the subject's engine (rank 0).
        seconds: wall time of the run (rank 0), for information.
    """

    ranks: list[RankRun] = dataclasses.field(default_factory=list)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    engine_entries: int = 0
    seconds: float = 0.0

    @property
    def error(self) -> ErrorInfo | None:
        """The first rank's error (``None`` when every rank finished)."""
        return next((r.error for r in self.ranks if r.error is not None), None)


#: cagrad counters that say a backward ran less compiled than captured
#: (written into a match's detail when non-zero).
_DEGRADED = ("segment_compile_failures", "nodes_forced_opaque", "deopts")


@dataclasses.dataclass
class StackOutcome:
    """The verdict on one (stack, subject) pair.

    Attributes:
        stack, subject, device: what ran where (``"cpu"``, ``"cuda"``).
        status: see :class:`StackStatus`.
        mismatches: every differing value; ``where`` is the recorded name
            (``"step1.grad.0.weight"``), prefixed ``"rank1/"`` on distributed
            stacks.
        error: the subject's exception (prefixed with its rank when
            distributed), when it raised.
        eager_error: the reference's exception, when eager raised.
        skip_reason: why it did not run (status ``skipped``).
        counts, fallback_reasons: the subject's counters over the run.
        seconds: wall time of the subject's run.
        peer: the subject is a peer (:attr:`harness.subjects.Subject.peer`):
            its outcome is reported and never fails the suite.
    """

    stack: str
    subject: str
    device: str
    status: StackStatus
    mismatches: list[Mismatch] = dataclasses.field(default_factory=list)
    error: ErrorInfo | None = None
    eager_error: ErrorInfo | None = None
    skip_reason: str = ""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    peer: bool = False

    @property
    def ok(self) -> bool:
        """True for ``match`` and ``skipped``, and for any status of a peer."""
        return self.peer or self.status in (StackStatus.MATCH, StackStatus.SKIPPED)

    @property
    def first_differing(self) -> str | None:
        """The name of the first differing value (``None`` without one)."""
        return self.mismatches[0].where if self.mismatches else None

    @property
    def max_abs(self) -> float | None:
        """The greatest ``|subject - eager|`` over the differing values whose
        elements were compared (``None`` when none were)."""
        values = [m.max_abs for m in self.mismatches if m.max_abs is not None]
        return max(values) if values else None

    def describe(self) -> str:
        """One line: what explains the status."""
        if self.status is StackStatus.SKIPPED:
            return self.skip_reason
        if self.status is StackStatus.MISMATCH:
            first = self.mismatches[0]
            size = "" if self.max_abs is None else f"max abs diff {self.max_abs:.3g}; "
            more = f" (+{len(self.mismatches) - 1} more)" if len(self.mismatches) > 1 else ""
            return f"{size}first: {first.where}: {first.detail}{more}"
        if self.status is StackStatus.ERROR and self.error is not None:
            eager = f" (eager raised {self.eager_error.type})" if self.eager_error else ""
            return self.error.short(160) + eager
        parts = []
        degraded = {k: self.counts.get(k, 0) for k in _DEGRADED}
        if any(degraded.values()):
            parts.append(", ".join(f"{k} {n}" for k, n in degraded.items() if n))
        if self.eager_error is not None:
            parts.append(f"both raised {self.eager_error.type}")
        if self.fallback_reasons:
            parts.append("fallbacks: " + ", ".join(f"{r} x{n}" for r, n in sorted(self.fallback_reasons.items())))
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "stack": self.stack,
            "subject": self.subject,
            "device": self.device,
            "status": self.status.value,
            "max_abs": self.max_abs if self.max_abs is None else _finite(self.max_abs),
            "first_differing": self.first_differing,
            "mismatches": [m.to_json() for m in self.mismatches],
            "error": self.error.to_json() if self.error else None,
            "eager_error": self.eager_error.to_json() if self.eager_error else None,
            "skip_reason": self.skip_reason,
            "counts": dict(self.counts),
            "fallback_reasons": dict(self.fallback_reasons),
            "seconds": self.seconds,
            "peer": self.peer,
        }


def _finite(x: float) -> float | str:
    return x if x == x and abs(x) != float("inf") else str(x)


@dataclasses.dataclass
class StacksReport:
    """Every outcome of one suite run, stacks outer, subjects inner.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        subjects: the subject names, in column order.
        outcomes: one :class:`StackOutcome` per (stack, subject).
    """

    device: str
    subjects: list[str]
    outcomes: list[StackOutcome] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no outcome of a subject under test (not a peer) is
        ``mismatch``, ``error`` or ``fell_back``."""
        return all(o.ok for o in self.outcomes)

    def failures(self) -> list[StackOutcome]:
        return [o for o in self.outcomes if not o.ok]

    def outcome(self, stack: str, subject: str) -> StackOutcome:
        """The outcome of ``subject`` on ``stack``; ``KeyError`` if absent."""
        for o in self.outcomes:
            if o.stack == stack and o.subject == subject:
                return o
        raise KeyError((stack, subject))

    def to_json(self) -> dict[str, Any]:
        """A dict ``json.dumps`` accepts as is (no NaN/inf literals)."""
        return {
            "device": self.device,
            "subjects": list(self.subjects),
            "ok": self.ok,
            "outcomes": [o.to_json() for o in self.outcomes],
        }
