"""Result types of the models suite: one :class:`RowOutcome` per (row,
subject), gathered in a :class:`ModelsReport`. No tensors are kept; both
convert to and from JSON (a spawned row sends its outcomes back as JSON).

Statuses are :class:`harness.stacks.outcome.StackStatus`'s, read per row:

* ``match``: every loss, ``.grad`` (values and strides), parameter after
  the step and global-state field agrees with eager's at every step;
* ``mismatch``: one differs (the first difference, its step and max abs
  diff are reported);
* ``error``: the subject raised where eager did not, the row's own eager
  run raised (nothing was compared), or the row's process died or timed out;
* ``fell_back``: everything matches, but cagrad ran at least one backward
  through eager autograd (the reasons are listed);
* ``skipped``: the row's library is not installed or does not import.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from harness.outcome import ErrorInfo, Mismatch
from harness.stacks.outcome import StackStatus

RowStatus = StackStatus

#: cagrad counters that say a run was less compiled than captured
#: (shown in a row's detail when non-zero).
DEGRADED = ("deopts", "nodes_forced_opaque", "segment_compile_failures")


@dataclasses.dataclass
class RowOutcome:
    """The verdict on one (row, subject) pair.

    Attributes:
        row, library, subject, device: what ran where.
        status: see the module docstring.
        mismatches: every differing value, in step order; ``where`` is the
            recorded name (``"step1.grad.transformer.h.0.attn.c_attn.weight"``,
            ``"step0.state.cpu_rng"``).
        error: the subject's exception (or the row's process failure).
        eager_error: the row's eager run's exception, when it raised.
        skip_reason: why it did not run.
        counts: the subject's counter deltas over the run (cagrad:
            ``backwards``, ``captures``, ``cache_hits``, ``fallbacks``,
            ``deopts``, ``recompiles``, ...).
        fallback_reasons: reason -> backwards that fell back to eager.
        forced_opaque: reason -> nodes that failed to trace and ran as they are.
        opaque_nodes: ``"<node type> (<why>)"`` -> its calls as it is, summed over the captured graphs.
        seconds: wall time of the subject's run.
        peer: a peer subject (torch's compiled autograd): never fails the suite.
    """

    row: str
    library: str
    subject: str
    device: str
    status: RowStatus
    mismatches: list[Mismatch] = dataclasses.field(default_factory=list)
    error: ErrorInfo | None = None
    eager_error: ErrorInfo | None = None
    skip_reason: str = ""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    forced_opaque: dict[str, int] = dataclasses.field(default_factory=dict)
    opaque_nodes: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    peer: bool = False

    @property
    def ok(self) -> bool:
        """True for ``match`` and ``skipped``, and for any status of a peer."""
        return self.peer or self.status in (RowStatus.MATCH, RowStatus.SKIPPED)

    @property
    def max_abs(self) -> float | None:
        """The greatest ``|subject - eager|`` over the differing tensors."""
        values = [m.max_abs for m in self.mismatches if m.max_abs is not None]
        return max(values) if values else None

    def describe(self) -> str:
        """One line: what explains the status, then what cagrad did that
        is worth knowing (deopts, forced-opaque nodes, recaptures with their
        causes from the ``recompiles_*`` counters, fallbacks)."""
        parts = []
        if self.status is RowStatus.SKIPPED:
            return self.skip_reason
        if self.status is RowStatus.MISMATCH:
            first = self.mismatches[0]
            size = "" if first.max_abs is None else f"max abs diff {first.max_abs:.3g}: "
            more = f" (+{len(self.mismatches) - 1} more)" if len(self.mismatches) > 1 else ""
            parts.append(f"first: {first.where}: {size}{first.detail}{more}")
        if self.status is RowStatus.ERROR:
            if self.eager_error is not None:
                parts.append(f"eager itself raised {self.eager_error.short(140)}")
            elif self.error is not None:
                parts.append(self.error.short(160))
        degraded = [f"{k} {self.counts[k]}" for k in DEGRADED if self.counts.get(k)]
        if degraded:
            parts.append(", ".join(degraded))
        if self.counts.get("recompiles"):
            causes = [
                f"{k[len('recompiles_') :]} {n}"
                for k, n in sorted(self.counts.items())
                if k.startswith("recompiles_") and n
            ]
            parts.append(f"recaptures {self.counts['recompiles']}" + (f" ({', '.join(causes)})" if causes else ""))
        if self.forced_opaque:
            parts.append("forced opaque: " + ", ".join(f"{r} x{n}" for r, n in sorted(self.forced_opaque.items())))
        if self.fallback_reasons:
            parts.append("fallbacks: " + ", ".join(f"{r} x{n}" for r, n in sorted(self.fallback_reasons.items())))
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "library": self.library,
            "subject": self.subject,
            "device": self.device,
            "status": self.status.value,
            "max_abs": _finite(self.max_abs),
            "mismatches": [m.to_json() for m in self.mismatches],
            "error": self.error.to_json() if self.error else None,
            "eager_error": self.eager_error.to_json() if self.eager_error else None,
            "skip_reason": self.skip_reason,
            "counts": dict(self.counts),
            "fallback_reasons": dict(self.fallback_reasons),
            "forced_opaque": dict(self.forced_opaque),
            "opaque_nodes": dict(self.opaque_nodes),
            "seconds": self.seconds,
            "peer": self.peer,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RowOutcome:
        """The inverse of :meth:`to_json` (``max_abs`` is recomputed)."""

        def num(v: Any) -> Any:
            return float(v) if isinstance(v, str) else v

        mismatches = [
            Mismatch(**{k: (num(v) if k in ("max_abs", "max_rel", "rtol", "atol") else v) for k, v in m.items()})
            for m in data.get("mismatches", [])
        ]
        err = data.get("error")
        eager = data.get("eager_error")
        return cls(
            row=data["row"],
            library=data["library"],
            subject=data["subject"],
            device=data["device"],
            status=RowStatus(data["status"]),
            mismatches=mismatches,
            error=ErrorInfo(**err) if err else None,
            eager_error=ErrorInfo(**eager) if eager else None,
            skip_reason=data.get("skip_reason", ""),
            counts=dict(data.get("counts", {})),
            fallback_reasons=dict(data.get("fallback_reasons", {})),
            forced_opaque=dict(data.get("forced_opaque", {})),
            opaque_nodes=dict(data.get("opaque_nodes", {})),
            seconds=float(data.get("seconds", 0.0)),
            peer=bool(data.get("peer", False)),
        )


def _finite(x: float | None) -> float | str | None:
    if x is None:
        return None
    return x if math.isfinite(x) else str(x)


@dataclasses.dataclass
class ModelsReport:
    """Every outcome of one suite run, rows outer, subjects inner.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        subjects: the subject names, in column order.
        versions: torch's and each library's version (``None``: not installed).
        notes: what the suite did to the process that a reader should know
            (the torchvision workaround of :mod:`harness.models.libraries`).
        outcomes: one :class:`RowOutcome` per (row, subject).
    """

    device: str
    subjects: list[str]
    versions: dict[str, str | None] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    outcomes: list[RowOutcome] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no outcome of a subject under test is ``mismatch``,
        ``error`` or ``fell_back``."""
        return all(o.ok for o in self.outcomes)

    def failures(self) -> list[RowOutcome]:
        return [o for o in self.outcomes if not o.ok]

    def outcome(self, row: str, subject: str) -> RowOutcome:
        """The outcome of ``subject`` on ``row``; ``KeyError`` if absent."""
        for o in self.outcomes:
            if o.row == row and o.subject == subject:
                return o
        raise KeyError((row, subject))

    def to_json(self) -> dict[str, Any]:
        """A dict ``json.dumps`` accepts as is (no NaN/inf literals)."""
        return {
            "device": self.device,
            "subjects": list(self.subjects),
            "versions": dict(self.versions),
            "notes": list(self.notes),
            "ok": self.ok,
            "outcomes": [o.to_json() for o in self.outcomes],
        }
