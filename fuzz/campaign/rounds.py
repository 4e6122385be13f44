"""One campaign round, run inside a worker process.

A round is one Hypothesis run of ``@given(programs(...))`` seeded from
``(seed, round)``, drawing ops by its :class:`~fuzz.campaign.steer.RoundPlan`
(the parent's steering); it generates the same programs in every run,
whatever the worker count. Its test body runs each program through the oracle and reports
what happened through ``emit(event, payload)`` (see :mod:`fuzz.workers` for
the events). A divergence whose signature (:func:`fuzz.signature.make_signature`)
is already recorded is counted; one matched by the known-issues file is
counted under ``known``; a new one is reported at once (unshrunk, so that a
crash while shrinking loses nothing), shrunk by Hypothesis on candidates that
keep the same signature, reduced on the IR by :mod:`fuzz.reduce`, reported
again (shrunk), and the round ends.

``skip`` programs at the start of the round are generated but not run: a
round continued after a crashed worker, or resumed after an interruption.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from fuzz import coverage
from fuzz.campaign.config import CampaignConfig
from fuzz.campaign.steer import RoundPlan, round_seed, round_test
from fuzz.ir import Program
from fuzz.oracle import FailureKey, Oracle, Verdict, failure_key
from fuzz.reduce import complexity, reduce_program
from fuzz.signature import make_signature

Emit = Callable[[str, dict[str, Any]], None]


class _Diverged(Exception):
    """Raised by the test body on a new divergence, so that Hypothesis shrinks."""


class Stop(BaseException):
    """Ends a Hypothesis run at once (budget, stop request or shrink time used
    up). A BaseException, so Hypothesis does not take it for a failure."""


def load_known(spec: str | None) -> Any:
    """The :class:`fuzz.known.KnownIssues` for ``spec`` (``"default"``: the
    shipped file; a path; None: none). Raises ``fuzz.known.KnownIssuesError``."""
    if spec is None:
        return None
    from fuzz.known import KnownIssues

    return KnownIssues.default() if spec == "default" else KnownIssues.load(spec)


def make_oracle(cfg: CampaignConfig) -> Oracle:
    """The campaign's oracle; raises ValueError/KeyError on bad subjects."""
    if cfg.neighbours:
        return Oracle(cfg.subjects, cfg.plugins, cfg.devices, neighbours=cfg.neighbours)
    return Oracle(cfg.subjects, cfg.plugins, cfg.devices)


@dataclasses.dataclass
class Found:
    """A failing outcome of one program: its key, signature and outcome JSON."""

    key: FailureKey
    signature: str
    outcome: dict[str, Any]


def findings(verdict: Verdict) -> list[Found]:
    """The failing outcomes of ``verdict`` with their signatures."""
    if verdict.report is None:
        return []
    out = []
    for o in verdict.report.failures():
        key = failure_key(o)
        js = o.to_json()
        out.append(Found(key, make_signature(key.subject, key.device, key.status, key.kind, js), js))
    return out


class RoundRunner:
    """Runs rounds in this process, reporting through ``emit``.

    Args:
        cfg: the campaign settings.
        emit: called with ``(event, payload)`` for every event.
        control: called before every program; returns ``"stop"`` to end the
            round at once, and may add signatures to :attr:`settled`.
        oracle: the oracle (built from ``cfg`` when None).
    """

    def __init__(
        self,
        cfg: CampaignConfig,
        emit: Emit,
        control: Callable[[], str | None],
        exit_device_lost: Callable[[], None],
        oracle: Oracle | None = None,
    ):
        self.cfg = cfg
        self.exit_device_lost = exit_device_lost
        self.emit = emit
        self.control = control
        self.oracle = oracle or make_oracle(cfg)
        self.known = load_known(cfg.known)
        self.settled: set[str] = set()
        self.torch_version = torch.__version__
        self._deadline = float("inf")
        self._reset_round(0, 0)

    def _reset_round(self, r: int, skip: int) -> None:
        self.round, self.skip, self.index = r, skip, 0
        self.target: Found | None = None
        self.original: Program | None = None
        self.best: Program | None = None
        self.best_found: Found | None = None
        self.best_report: Any = None
        self.shrink_calls = 0
        self.found_index = -1
        self._shrink_deadline = self._reduce_deadline = 0.0

    # ------------------------------------------------------------ round
    def run_round(self, r: int, skip: int, deadline_wall: float, plan: RoundPlan | None = None) -> None:
        """Runs round ``r`` from program ``skip`` until it ends (its size, a
        new divergence, exhaustion) or ``deadline_wall`` (``time.time()``)
        passes; emits ``round`` with ``done`` and ``index`` (programs of the
        round processed, skipped ones included). ``plan``: the round's op
        weights and rotation (None: the defaults)."""
        self._reset_round(r, skip)
        self._deadline = deadline_wall
        done = True
        try:
            gen = (plan or RoundPlan()).gen(self.cfg.gen)
            round_test(gen, round_seed(self.cfg.seed, r), self.cfg.round_size, self._body)()
        except Stop:
            done = self.target is not None  # a shrink cut short still ends the round
        except Exception:
            if self.target is None:
                raise  # not a divergence: a bug in the fuzzer itself
            # _Diverged after shrinking, or Hypothesis' complaint that the
            # final replay did not fail (a flaky divergence): the smallest
            # failing program was kept on the way either way.
        if self.target is not None:
            self._reduce()
            self._emit_failure(shrunk=True)
        self.emit("round", {"round": r, "done": done, "index": self.index})

    # ------------------------------------------------------------- body
    def _check(self, program: Program, only: FailureKey | None = None, peers: bool = True) -> tuple[Verdict, list[Found]]:
        try:
            verdict = self.oracle.run(program, only, peers=peers)
        except Exception as e:  # a crash inside the harness is a finding too
            device = only.device if only else self.oracle.devices[0]
            key = FailureKey("harness", device, "error", type(e).__name__)
            outcome = {
                "subject": "harness",
                "device": device,
                "status": "error",
                "error": {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()},
            }
            return Verdict(None, [key]), [Found(key, make_signature("harness", device, "error", key.kind, outcome), outcome)]
        return verdict, findings(verdict)

    def _exit_if_device_lost(self, verdict: Verdict) -> None:
        """Ends this worker (``exit_device_lost``: the worker process exits
        with :data:`~fuzz.workers.DEVICE_LOST_EXIT`) after a device error, naming the subject that met it first: the
        parent records a crash of that subject on the program running and
        starts a fresh worker."""
        lost = device_lost(verdict)
        if lost is not None:
            self.emit("subject", {"name": lost[0], "device": lost[1]})
            self.exit_device_lost()

    def _announce(self, program: Program, phase: str) -> None:
        self.emit(
            "program",
            {"round": self.round, "index": self.index - 1, "phase": phase, "program": program.to_json(indent=None),
             "cpu": time.process_time()},
        )  # fmt: skip

    def _body(self, program: Program) -> None:
        if self.control() == "stop" and self.target is None:
            raise Stop  # a shrink that started finishes (within shrink_s)
        if self.target is not None:
            self._shrink_step(program)
            return
        self.index += 1
        if self.index <= self.skip:
            return
        if time.time() >= self._deadline:
            self.index -= 1
            raise Stop
        self._announce(program, "gen")
        verdict, found = self._check(program, peers=(self.index - 1) % max(1, self.cfg.peer_every) == 0)
        self._exit_if_device_lost(verdict)
        stats: dict[str, Any] = {
            "round": self.round,
            "index": self.index - 1,
            "ops": program.op_names(),
            "features": list(program.features()),
            "coverage": coverage.program_coverage(program),
            "outcomes": _outcome_stats(verdict),
            "build_error": verdict.build_error,
            # kept for build errors and fallbacks (samples of each, for triage)
            "program": program.to_json(indent=None) if verdict.build_error or _fell_back(verdict) else None,
            "hits": [],
            "known": [],
        }
        novel: Found | None = None
        seen: set[str] = set()
        for f in found:
            if f.signature in seen:
                continue
            seen.add(f.signature)
            if f.signature in self.settled:
                stats["hits"].append(f.signature)
                continue
            issue = self.known.match(f.signature, self.torch_version, program.op_names()) if self.known is not None else None
            if issue is not None:
                stats["known"].append(
                    {"id": issue.id, "signature": f.signature, "note": issue.note or "", "link": issue.link or ""}
                )
            elif novel is None:
                novel = f
        if novel is not None:
            self.target, self.original, self.best, self.best_found = novel, program, program, novel
            self.best_report = verdict.report
            self.found_index = self.index - 1
            stats["novel"] = self._failure_payload(shrunk=False)
            self.settled.add(novel.signature)
        self.emit("ran", stats)
        if novel is not None:
            now = time.monotonic()
            # Hypothesis shrinks for 60% of the shrink time, fuzz.reduce after
            self._shrink_deadline = now + 0.6 * self.cfg.shrink_s
            self._reduce_deadline = now + self.cfg.shrink_s
            raise _Diverged(novel.signature)

    def _still_fails(self, program: Program) -> bool:
        assert self.target is not None
        self.shrink_calls += 1
        self._announce(program, "shrink")
        verdict, found = self._check(program, self.target.key)
        self._exit_if_device_lost(verdict)
        for f in found:
            if f.signature == self.target.signature:
                if self.best is None or complexity(program) < complexity(self.best):
                    self.best, self.best_found, self.best_report = program, f, verdict.report
                return True
        return False

    def _shrink_step(self, program: Program) -> None:
        if time.monotonic() >= self._shrink_deadline:
            raise Stop
        if self._still_fails(program):
            assert self.target is not None
            raise _Diverged(self.target.signature)

    def _reduce(self) -> None:
        """IR-level reduction of Hypothesis' result (see :mod:`fuzz.reduce`)."""
        assert self.best is not None
        deadline = max(self._reduce_deadline, time.monotonic() + 1.0)

        def still_fails(candidate: Program) -> bool:
            # each accepted candidate is smaller than the best so far, so
            # _still_fails keeps best, its outcome and report in step
            return self._still_fails(candidate)

        self.best, _ = reduce_program(self.best, still_fails, deadline)

    # ---------------------------------------------------------- records
    def _failure_payload(self, shrunk: bool) -> dict[str, Any]:
        assert self.target is not None and self.best is not None and self.original is not None
        best, found = self.best, self.best_found or self.target
        return {
            "signature": self.target.signature,
            "key": self.target.key.to_json(),
            "first_outcome": found.outcome,
            "ops": list(best.op_set()),
            "hooks": list(best.hook_set()),
            "program": best.to_json(),
            "original": self.original.to_json(),
            "original_ops": len(self.original.ops),
            "shrunk_ops": len(best.ops),
            "shrink_calls": self.shrink_calls,
            "report": self.best_report.to_json() if self.best_report is not None else None,
            "plugin": self.oracle.plugin_of.get(self.target.key.subject),
            "shrunk": shrunk,
        }

    def _emit_failure(self, shrunk: bool) -> None:
        self.emit("failure", self._failure_payload(shrunk))


def _device_error(error: Any) -> bool:
    """A CUDA error: ``torch.AcceleratorError`` (torch >= 2.8), or the
    ``RuntimeError("CUDA error: ...")`` of older versions. After one (an
    illegal address, a device-side assert) the process's CUDA context is
    unusable (CUDA's "sticky" errors)."""
    return error is not None and (error.type.endswith("AcceleratorError") or "CUDA error:" in error.message)


def device_lost(verdict: Verdict) -> tuple[str, str] | None:
    """``(subject, device)`` of the first run of ``verdict`` that met a CUDA
    error (eager's reference run: ``"eager"``), or None."""
    report = verdict.report
    if report is None:
        return None
    for device, error in report.eager_errors.items():
        if _device_error(error):
            return "eager", device
    for o in report.outcomes:
        if _device_error(o.error):
            return o.subject, o.device
    return None


def _fell_back(verdict: Verdict) -> bool:
    """Whether some subject ran part of the program in eager (a fallback,
    or a graph segment its backend failed to compile)."""
    return verdict.report is not None and any(
        o.fallback_reasons or o.counts.get("segment_compile_failures") for o in verdict.report.outcomes
    )


def _outcome_stats(verdict: Verdict) -> list[dict[str, Any]]:
    """Per outcome: where, status, fallback reasons, size-sequence captures
    and the engine's integer counters over the run (cagrad's: captures,
    cache and guard hits, CUDA graphs recorded and replayed, ...)."""
    if verdict.report is None:
        return []
    out = []
    for o in verdict.report.outcomes:
        caps = [c or 0 for c in o.captures_per_variant] if o.variants else None
        out.append(
            {
                "where": f"{o.subject}@{o.device}",
                "status": o.status.value,
                "fallback_reasons": dict(o.fallback_reasons),
                "captures": caps,
                "rule_failure": any(m.where == "captures" for m in o.mismatches),
                "counts": {k: int(v) for k, v in o.counts.items() if isinstance(v, int) and v > 0},
            }
        )
    return out
