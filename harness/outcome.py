"""Result types of the differential oracle: one :class:`Outcome` per
(subject, device), gathered into a :class:`DifferentialReport`.

Everything here is plain data: no tensors are kept (the numbers that matter
are reduced to floats), so a report is cheap to keep and converts to JSON with
:meth:`DifferentialReport.to_json`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import traceback
from typing import Any


class Status(str, enum.Enum):
    """What one subject did on one device, compared with eager autograd.

    * ``equal``: same results as eager within tolerance, or eager raised and
      the subject raised an exception of the same type (whether or not cagrad
      counted a fallback on the way).
    * ``mismatch``: a result differs (value beyond tolerance, ``None`` versus
      a tensor, dtype/shape/device, trace length), the backward left the
      process state (a random stream, a flag, a config) otherwise than
      eager's, or the subject succeeded where eager raised.
    * ``error``: the subject raised where eager did not, or raised an
      exception of another type than eager's.
    * ``fallback``: results equal, but cagrad handed at least one backward to
      eager autograd (reasons in :attr:`Outcome.fallback_reasons`).
    """

    EQUAL = "equal"
    MISMATCH = "mismatch"
    ERROR = "error"
    FALLBACK = "fallback"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class ErrorInfo:
    """An exception reduced to text.

    Attributes:
        type: the exception class, qualified (``"builtins.RuntimeError"`` is
            written as just ``"RuntimeError"``).
        message: ``str(exc)``.
        traceback: the formatted traceback, as ``traceback.format_exception``
            writes it.
    """

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorInfo:
        return cls(
            type=exception_type_name(type(exc)),
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )

    def short(self, limit: int = 120) -> str:
        """``Type: first line of message``, cut to ``limit`` characters."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        text = f"{self.type}: {first}" if first else self.type
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def exception_type_name(tp: type[BaseException]) -> str:
    """``RuntimeError`` for builtins, ``module.QualName`` otherwise."""
    if tp.__module__ == "builtins":
        return tp.__qualname__
    return f"{tp.__module__}.{tp.__qualname__}"


@dataclasses.dataclass
class Mismatch:
    """One compared value that differs from eager's.

    Attributes:
        where: which value: ``"leaf 2 .grad"``, ``"grad result 0"``,
            ``"trace[3]"``, ``"trace[3][1]"`` (a tensor nested in a trace
            event), ``"trace length"``, ``"exception"``, or ``"state
            <field>"`` (the process state the backward left differs from
            eager's in that field of :mod:`harness.global_state`:
            ``"state cpu_rng"``); a subject that
            runs the program several times prefixes the step
            (``"step 2/4: leaf 0 .grad"``).
        detail: one sentence saying what differs.
        max_abs: greatest ``|subject - eager|`` over the tensor's elements, in
            the tensor's units (``inf`` where one side is NaN/inf and the other
            is not); ``None`` when no values were compared (``None`` versus a
            tensor, shape or dtype differ).
        max_rel: greatest ``|subject - eager| / |eager|`` (``inf`` where eager
            is 0 and the subject is not); ``None`` as for ``max_abs``.
        rtol, atol: the tolerance that was applied (``None`` when no values
            were compared).
    """

    where: str
    detail: str
    max_abs: float | None = None
    max_rel: float | None = None
    rtol: float | None = None
    atol: float | None = None

    def short(self) -> str:
        if self.max_abs is None:
            return f"{self.where}: {self.detail}"
        return f"{self.where}: max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}"

    def to_json(self) -> dict[str, Any]:
        return {k: _json_float(v) for k, v in dataclasses.asdict(self).items()}


def _json_float(v: Any) -> Any:
    """JSON has no inf/nan; write them as strings so ``json.dumps`` stays strict."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


@dataclasses.dataclass
class Outcome:
    """The result of one subject on one device.

    Attributes:
        subject: the subject's name (``"cagrad[aot_eager]"``).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
        status: see :class:`Status`.
        mismatches: every differing value (empty unless ``status`` is
            ``mismatch``); :attr:`mismatch` is the first.
        error: the subject's exception, when it raised.
        eager_error: the reference's exception, when eager raised.
        counts: the subject's counter deltas over this run (``captures``,
            ``cache_hits``, ``fallbacks``, ``recompiles``, ... as the subject
            reports them; empty for plain eager).
        fallback_reasons: reason -> number of backwards that fell back.
        seconds: wall time of build + backward, for information only.
        variants: for a size sequence (:mod:`harness.capture_rule`), one
            dict per size variant: ``label``, ``sizes``, ``status``,
            ``counts`` (that variant's counter deltas) and, for a subject
            whose captures are checked, ``allowed_captures``; empty for a
            single program. ``counts`` then sums the variants.
    """

    subject: str
    device: str
    status: Status
    mismatches: list[Mismatch] = dataclasses.field(default_factory=list)
    error: ErrorInfo | None = None
    eager_error: ErrorInfo | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    variants: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def captures_per_variant(self) -> list[int | None]:
        """Captures of each size variant (empty for a single program)."""
        return [v["counts"].get("captures") for v in self.variants]

    @property
    def mismatch(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None

    @property
    def ok(self) -> bool:
        return self.status in (Status.EQUAL, Status.FALLBACK)

    @property
    def captures(self) -> int | None:
        return self.counts.get("captures")

    @property
    def recompiles(self) -> int | None:
        return self.counts.get("recompiles")

    @property
    def fallbacks(self) -> int | None:
        return self.counts.get("fallbacks")

    def describe(self) -> str:
        """One line: the status and what explains it."""
        if self.status is Status.MISMATCH and self.mismatch is not None:
            more = f" (+{len(self.mismatches) - 1} more)" if len(self.mismatches) > 1 else ""
            return f"{self.mismatch.short()}{more}"
        if self.status is Status.ERROR and self.error is not None:
            if self.eager_error is not None:
                return f"{self.error.short()} (eager raised {self.eager_error.type})"
            return self.error.short()
        if self.status is Status.FALLBACK:
            return ", ".join(f"{r} x{n}" for r, n in sorted(self.fallback_reasons.items()))
        if self.eager_error is not None:
            return f"both raised {self.eager_error.type}"
        return ""

    def to_json(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "device": self.device,
            "status": self.status.value,
            "mismatches": [m.to_json() for m in self.mismatches],
            "error": self.error.to_json() if self.error else None,
            "eager_error": self.eager_error.to_json() if self.eager_error else None,
            "counts": dict(self.counts),
            "fallback_reasons": dict(self.fallback_reasons),
            "seconds": self.seconds,
            **({"variants": [dict(v) for v in self.variants]} if self.variants else {}),
        }


@dataclasses.dataclass
class DifferentialReport:
    """Every outcome of one program.

    Attributes:
        program: the program's name.
        devices: the devices it ran on, as strings.
        outcomes: one :class:`Outcome` per (subject, device), subjects in the
            order given, devices outer.
        eager_errors: device -> the reference run's exception (absent where
            eager succeeded).
        notes: observations that do not fail the report (e.g. two compiled
            subjects disagree on how many graphs they captured).
        variants: the labels of a size sequence's variants, in run order
            (empty for a single program).
    """

    program: str
    devices: list[str]
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    eager_errors: dict[str, ErrorInfo] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    variants: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no outcome is ``mismatch`` or ``error``."""
        return all(o.ok for o in self.outcomes)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def outcome(self, subject: str, device: str = "cpu") -> Outcome:
        """The outcome of ``subject`` on ``device``; ``KeyError`` if absent."""
        for o in self.outcomes:
            if o.subject == subject and o.device == device:
                return o
        raise KeyError((subject, device))

    def summary(self) -> str:
        """A short table (one row per outcome) as plain text, rendered by rich."""
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        # Text objects, not str: subject names contain brackets that rich
        # would otherwise parse as markup ("torch_ca[eager]").
        table = Table(title=Text(f"{self.program}: {'OK' if self.ok else 'FAILED'}"), title_justify="left")
        columns = ["subject", "device", "status", "captures", "fallbacks", "detail"]
        if self.variants:
            columns.insert(4, "per size variant")
        for col in columns:
            table.add_column(col, overflow="fold")
        for o in self.outcomes:
            cells = [
                o.subject,
                o.device,
                o.status.value,
                "" if o.captures is None else str(o.captures),
                "" if o.fallbacks is None else str(o.fallbacks),
                o.describe(),
            ]
            if self.variants:
                cells.insert(4, _per_variant(o.captures_per_variant))
            table.add_row(*(Text(c) for c in cells))
        console = Console(width=140, record=True, file=_NullFile(), color_system=None)
        console.print(table)
        if self.variants:
            console.print(Text("size variants: " + " -> ".join(self.variants)))
        for note in self.notes:
            console.print(Text(f"note: {note}"))
        return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"

    def __str__(self) -> str:
        return self.summary()

    def to_json(self) -> dict[str, Any]:
        """A dict that ``json.dumps`` accepts as is (no NaN/inf literals)."""
        return {
            "program": self.program,
            "ok": self.ok,
            "devices": list(self.devices),
            "outcomes": [o.to_json() for o in self.outcomes],
            "eager_errors": {d: e.to_json() for d, e in self.eager_errors.items()},
            "notes": list(self.notes),
            **({"variants": list(self.variants)} if self.variants else {}),
        }


def _per_variant(captures: list[int | None]) -> str:
    """``"1,0,0"``: captures of each size variant (``-`` where not counted)."""
    return ",".join("-" if c is None else str(c) for c in captures)


class _NullFile:
    """A write sink: rich records the table, we export the recorded text."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass
