"""The fuzz campaign: generate programs, run the oracle, shrink, record.

A campaign runs in *rounds*. Each round is one Hypothesis run of
``@given(programs(...))`` seeded from ``(--seed, round number)``, with a
:class:`~hypothesis.database.DirectoryBasedExampleDatabase` of its own under
``OUT/hypothesis/round-NNNNN``. The test body runs each program through the
oracle:

* no divergence: go on (a round ends after ``round_size`` programs);
* a divergence already known: count it against its signature, go on. Known
  means the same ``(subject, device, status, kind)`` with a recorded shrunk
  program whose op set and hook kinds (``hook:<kind>.<action>``) are a
  subset of this program's;
* a new divergence: the body raises, and Hypothesis shrinks the program,
  keeping only candidates that still fail with the same
  ``(subject, device, status, kind)`` (only that subject runs while
  shrinking). The smallest failing candidate (:func:`fuzz.reduce.complexity`)
  is then reduced on the IR by :mod:`fuzz.reduce`, and recorded under the
  signature ``subject@device status kind [op,...,hook:kind.action,...]``
  with a reproducer; the next round starts.

The budget bounds generation; a shrink that started may run up to
``shrink_s`` longer (60% of it for Hypothesis, the rest for the IR pass). Everything is reproducible from ``--seed``: round ``r``
generates the same programs in every run. ``OUT/state.json`` makes a
campaign resumable: run the same command again (same ``--seed``) and it goes
on with the next round, adding to the counts; a round interrupted while
shrinking is re-run and Hypothesis replays the failing example from that
round's database first.

Files under ``OUT``: ``report.json`` (see :meth:`Campaign.report`),
``state.json``, ``failures/F001-.../{reproducer.py, program.json,
original.json, report.json}``, ``build_errors/`` (programs the catalog got
wrong: they failed under plain eager) and ``hypothesis/``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from fuzz.interpret import derived_seed
from fuzz.ir import Program
from fuzz.oracle import FailureKey, Oracle, Verdict, signature
from fuzz.reduce import complexity, reduce_program
from fuzz.reproducer import write_reproducer
from fuzz.strategies import GenConfig, programs

REPORT_SCHEMA = 1
STATE_SCHEMA = 1
MAX_BUILD_ERROR_SAMPLES = 20


class CampaignError(Exception):
    """A usage or I/O problem (exit status 2)."""


class _Diverged(Exception):
    """Raised by the test body on a divergence, so that Hypothesis shrinks."""


class _Stop(BaseException):
    """Ends a Hypothesis run at once (budget or shrink time used up).

    A BaseException that is not an Exception passes through Hypothesis
    without being taken for a failure of the test."""


@dataclasses.dataclass
class CampaignConfig:
    budget_s: float
    seed: int
    out: Path
    subjects: list[str] | None = None
    plugins: list[str] = dataclasses.field(default_factory=list)
    devices: list[str] | None = None
    gen: GenConfig = dataclasses.field(default_factory=GenConfig)
    shrink_s: float = 120.0
    round_size: int = 1000
    progress: bool = True
    max_programs: int | None = None  # stop after this many programs (this session)


def _raise_on_sigterm() -> Any:
    """SIGTERM (a CI timeout, ``kill``) ends the campaign like Ctrl-C does:
    state and report are written, and the next run resumes."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


def _restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:60]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Campaign:
    def __init__(self, config: CampaignConfig, console: Console | None = None):
        self.cfg = config
        self.out = Path(config.out)
        self.console = console or Console(stderr=True)
        self.state: dict[str, Any] = {}
        self.oracle: Oracle | None = None
        self._session_programs = 0
        self._last_save = 0.0
        self._progress: Progress | None = None
        self._task: Any = None
        # per-round shrinking state
        self._target: FailureKey | None = None
        self._original: Program | None = None
        self._best: Program | None = None
        self._best_verdict: Verdict | None = None
        self._shrink_deadline = 0.0
        self._reduce_deadline = 0.0
        self._shrink_calls = 0
        self._deadline = 0.0
        self._start = 0.0

    # ----------------------------------------------------------- state
    @property
    def state_path(self) -> Path:
        return self.out / "state.json"

    @property
    def report_path(self) -> Path:
        return self.out / "report.json"

    def _new_state(self) -> dict[str, Any]:
        return {
            "schema": STATE_SCHEMA,
            "seed": self.cfg.seed,
            "next_round": 0,
            "open_round": None,
            "programs_run": 0,
            "op_counts": {},
            "feature_counts": {},
            "build_errors": 0,
            "outcome_counts": {},
            "fallback_reasons": {},
            "elapsed_s": 0.0,
            "failures": [],
            "sessions": [],
        }

    def _load_state(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CampaignError(f"cannot create output directory {self.out}: {e}") from None
        if not self.state_path.exists():
            self.state = self._new_state()
            return
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CampaignError(f"cannot read {self.state_path}: {e}") from None
        if state.get("schema") != STATE_SCHEMA:
            raise CampaignError(f"{self.state_path}: unsupported state schema {state.get('schema')!r}")
        if state.get("seed") != self.cfg.seed:
            raise CampaignError(
                f"{self.out} holds a campaign with seed {state.get('seed')}; "
                f"resume it with --seed {state.get('seed')} or use another --out"
            )
        self.state = state

    def _save_state(self) -> None:
        try:
            _atomic_write(self.state_path, json.dumps(self.state, indent=1, sort_keys=True))
        except OSError as e:
            raise CampaignError(f"cannot write {self.state_path}: {e}") from None
        self._last_save = time.monotonic()

    # ---------------------------------------------------------- report
    def report(self) -> dict[str, Any]:
        """The ``report.json`` document.

        ``schema`` (1), ``seed``, ``budget_s`` (this run's), ``elapsed_s``
        and ``programs_run`` (the whole campaign, resumed runs added up),
        ``op_counts`` (op -> uses in the programs run), ``feature_counts``
        (:meth:`fuzz.ir.Program.features` -> programs that had it: hook
        kinds and actions, custom Functions, in-place ops, several roots,
        ``autograd.grad``, ``inputs=``, retain_graph reruns), ``subjects``,
        ``devices``, ``failures`` (one per signature: ``id``, ``signature``,
        ``count`` of programs that hit it, ``subject``, ``device``,
        ``status``, ``kind``, ``ops``, ``hooks`` (hook kinds and actions of
        the shrunk program), ``original_ops`` and ``shrunk_ops``,
        ``reproducer`` and ``program_json`` as paths relative to ``OUT``,
        ``first_outcome``: the harness outcome of the shrunk program),
        ``build_errors`` (programs that failed under plain eager: fuzz
        bugs), ``outcome_counts`` and ``fallback_reasons`` per
        ``subject@device``, ``rounds``, ``sessions``, ``torch_version``.
        """
        s = self.state
        failures = [
            {
                "id": f["id"],
                "signature": f["signature"],
                "count": f["count"],
                "subject": f["key"]["subject"],
                "device": f["key"]["device"],
                "status": f["key"]["status"],
                "kind": f["key"]["kind"],
                "ops": f["ops"],
                "hooks": f.get("hooks", []),
                "original_ops": f["original_ops"],
                "shrunk_ops": f["shrunk_ops"],
                "reproducer": f["reproducer"],
                "program_json": f["program_json"],
                "first_outcome": f["first_outcome"],
            }
            for f in s["failures"]
        ]
        return {
            "schema": REPORT_SCHEMA,
            "seed": self.cfg.seed,
            "budget_s": self.cfg.budget_s,
            "elapsed_s": round(s["elapsed_s"], 3),
            "programs_run": s["programs_run"],
            "op_counts": dict(sorted(s["op_counts"].items())),
            "feature_counts": dict(sorted(s.get("feature_counts", {}).items())),
            "subjects": self.oracle.names if self.oracle else (self.cfg.subjects or []),
            "devices": self.oracle.devices if self.oracle else (self.cfg.devices or []),
            "failures": failures,
            "build_errors": s["build_errors"],
            "outcome_counts": s.get("outcome_counts", {}),
            "fallback_reasons": s.get("fallback_reasons", {}),
            "sequence_captures": s.get("sequence_captures", {}),
            "rounds": s["next_round"],
            "sessions": s["sessions"],
            "torch_version": torch.__version__,
        }

    def _write_report(self) -> None:
        try:
            _atomic_write(self.report_path, json.dumps(self.report(), indent=1))
        except OSError as e:
            raise CampaignError(f"cannot write {self.report_path}: {e}") from None

    # ------------------------------------------------------------- run
    def run(self) -> int:
        """Runs until the budget ends; returns the exit status (0 clean, 1 divergence)."""
        self._load_state()
        try:
            self.oracle = Oracle(self.cfg.subjects, self.cfg.plugins, self.cfg.devices)
        except (ValueError, KeyError) as e:
            raise CampaignError(str(e)) from None
        self._start = time.monotonic()
        self._deadline = self._start + self.cfg.budget_s
        elapsed_before = self.state["elapsed_s"]
        session = {"budget_s": self.cfg.budget_s, "programs_run": 0, "elapsed_s": 0.0}
        self.state["sessions"].append(session)
        self._session_programs = 0

        def finish() -> None:
            now = time.monotonic() - self._start
            session["programs_run"] = self._session_programs
            session["elapsed_s"] = round(now, 3)
            self.state["elapsed_s"] = elapsed_before + now

        self.console.print(
            Text(
                f"cagrad-fuzz: seed {self.cfg.seed}, budget {self.cfg.budget_s:g}s, "
                f"subjects {', '.join(self.oracle.names)}, devices {', '.join(self.oracle.devices)}, out {self.out}"
                + (f" (resuming after {self.state['programs_run']} programs)" if self.state["programs_run"] else "")
            )
        )
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[programs]} programs"),
            TextColumn("{task.fields[failures]} failures"),
            TextColumn("{task.fields[left]}"),
            console=self.console,
            disable=not self.cfg.progress,
        )
        self._progress = progress
        interrupted = False
        previous_term = _raise_on_sigterm()
        with progress:
            self._task = progress.add_task(
                "fuzzing", total=self.cfg.budget_s, programs=0, failures=len(self.state["failures"]), left=""
            )
            try:
                while time.monotonic() < self._deadline and not self._enough():
                    self._run_round()
                    finish()
                    self._save_state()
            except KeyboardInterrupt:
                interrupted = True
            finally:
                _restore_sigterm(previous_term)
                finish()
                self._save_state()
                self._write_report()
        self._print_summary()
        if interrupted:
            self.console.print("interrupted; run the same command again to resume")
        return 1 if self.state["failures"] else (130 if interrupted else 0)

    def _enough(self) -> bool:
        return self.cfg.max_programs is not None and self._session_programs >= self.cfg.max_programs

    def _round_db(self, r: int) -> Path:
        return self.out / "hypothesis" / f"round-{r:05d}"

    def _run_round(self) -> None:
        s = self.state
        r = s["open_round"]
        if r is not None and not any(self._round_db(r).rglob("*")):
            # interrupted without a divergence in hand: its programs ran, go on
            s["next_round"] = max(s["next_round"], r + 1)
            r = None
        if r is None:
            r = s["next_round"]
        s["open_round"] = r
        self._save_state()
        db_dir = self._round_db(r)
        self._target = self._original = self._best = self._best_verdict = None
        self._shrink_calls = 0
        test = self._make_test(derived_seed(self.cfg.seed, f"round/{r}"), DirectoryBasedExampleDatabase(str(db_dir)))
        try:
            test()
        except _Stop:
            pass
        except Exception:
            if self._target is None:
                raise  # not a divergence: a bug in the fuzzer itself
            # _Diverged after shrinking, or Hypothesis' complaint that the
            # final replay did not fail (a flaky divergence): the smallest
            # failing program was recorded on the way either way.
        if self._target is not None:
            self._reduce()
            self._record_failure()
        s["open_round"] = None
        s["next_round"] = r + 1
        self._save_state()
        shutil.rmtree(db_dir, ignore_errors=True)

    def _make_test(self, round_seed: int, db: DirectoryBasedExampleDatabase) -> Any:
        # @settings goes outside @seed on purpose: @seed alone turns the
        # database off (Hypothesis' choice for plain tests); here the round's
        # seed makes generation reproducible and the database keeps a
        # divergence found before an interruption for the resumed round.
        @settings(
            max_examples=self.cfg.round_size,
            database=db,
            deadline=None,
            derandomize=False,
            phases=[Phase.reuse, Phase.generate, Phase.shrink],
            report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
            print_blob=False,
        )
        @seed(round_seed)
        @given(programs(dataclasses.replace(self.cfg.gen, prune=False)))
        def campaign_round(program: Program) -> None:
            self._body(program.pruned())

        return campaign_round

    # ------------------------------------------------------------ body
    def _check(self, program: Program, only: FailureKey | None = None) -> Verdict:
        assert self.oracle is not None
        try:
            return self.oracle.run(program, only)
        except Exception as e:  # a crash inside the harness is a finding too
            device = only.device if only else self.oracle.devices[0]
            key = FailureKey("harness", device, "crash", type(e).__name__)
            self.console.print(Text(f"harness raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
            return Verdict(None, [key])

    def _covered(self, key: FailureKey, program: Program) -> dict[str, Any] | None:
        have = set(program.op_names()) | set(program.hook_set())
        for f in self.state["failures"]:
            if FailureKey.from_json(f["key"]) == key and set(f["ops"]) | set(f.get("hooks", [])) <= have:
                return f
        return None

    def _body(self, program: Program) -> None:
        now = time.monotonic()
        if self._target is not None:
            # shrinking: does this candidate still fail the same way?
            if now >= self._shrink_deadline:
                raise _Stop
            self._shrink_calls += 1
            self._update_progress(now)
            verdict = self._check(program, self._target)
            if self._target in verdict.keys:
                assert self._best is not None
                if complexity(program) < complexity(self._best):
                    self._best, self._best_verdict = program, verdict
                raise _Diverged(self._target.text())
            return

        if now >= self._deadline or self._enough():
            raise _Stop
        s = self.state
        s["programs_run"] += 1
        self._session_programs += 1
        for name in program.op_names():
            s["op_counts"][name] = s["op_counts"].get(name, 0) + 1
        features = s.setdefault("feature_counts", {})
        for name in program.features():
            features[name] = features.get(name, 0) + 1
        verdict = self._check(program)
        self._count_outcomes(verdict)
        if verdict.build_error is not None:
            self._record_build_error(program, verdict.build_error)
        novel = None
        counted: set[str] = set()
        for key in verdict.keys:
            known = self._covered(key, program)
            if known is None:
                novel = novel or key
            elif known["id"] not in counted:
                known["count"] += 1
                counted.add(known["id"])
        self._update_progress(now)
        if time.monotonic() - self._last_save > 10:
            self._save_state()
        if novel is not None:
            self._target, self._original, self._best, self._best_verdict = novel, program, program, verdict
            # Hypothesis shrinks for 60% of the shrink time, fuzz.reduce after
            self._shrink_deadline = time.monotonic() + 0.6 * self.cfg.shrink_s
            self._reduce_deadline = time.monotonic() + self.cfg.shrink_s
            self._log(f"divergence: {novel.text()} on a {len(program.ops)}-op program; shrinking")
            raise _Diverged(novel.text())

    def _reduce(self) -> None:
        """IR-level reduction of Hypothesis' result (see :mod:`fuzz.reduce`)."""
        assert self._target is not None and self._best is not None
        target = self._target

        def still_fails(candidate: Program) -> bool:
            self._shrink_calls += 1
            self._update_progress(time.monotonic())
            verdict = self._check(candidate, target)
            if target in verdict.keys:
                self._best_verdict = verdict
                return True
            return False

        before = len(self._best.ops)
        deadline = max(self._reduce_deadline, time.monotonic() + 1.0)
        self._best, _ = reduce_program(self._best, still_fails, deadline)
        if self._best_verdict is None or len(self._best.ops) != before:
            self._best_verdict = self._check(self._best, target)

    # --------------------------------------------------------- records
    def _count_outcomes(self, verdict: Verdict) -> None:
        """Per ``subject@device``: how many programs ended in each status, and
        why cagrad fell back (a subject that always falls back tests nothing)."""
        if verdict.report is None:
            return
        counts = self.state.setdefault("outcome_counts", {})
        reasons = self.state.setdefault("fallback_reasons", {})
        sequences = self.state.setdefault("sequence_captures", {})
        for o in verdict.report.outcomes:
            where = f"{o.subject}@{o.device}"
            if o.variants:
                seq = sequences.setdefault(
                    where, {"sequences": 0, "variants": 0, "captures": 0, "over_first": 0, "rule_failures": 0}
                )
                caps = [c or 0 for c in o.captures_per_variant]
                seq["sequences"] += 1
                seq["variants"] += len(caps)
                seq["captures"] += sum(caps)
                seq["over_first"] += sum(caps[1:])  # recaptures at new sizes
                seq["rule_failures"] += int(any(m.where == "captures" for m in o.mismatches))
            per = counts.setdefault(where, {})
            per[o.status.value] = per.get(o.status.value, 0) + 1
            for reason, n in o.fallback_reasons.items():
                r = reasons.setdefault(where, {})
                r[reason] = r.get(reason, 0) + n

    def _record_build_error(self, program: Program, error: str) -> None:
        s = self.state
        s["build_errors"] += 1
        if s["build_errors"] <= MAX_BUILD_ERROR_SAMPLES:
            d = self.out / "build_errors"
            d.mkdir(exist_ok=True)
            _atomic_write(d / f"B{s['build_errors']:03d}.json", program.to_json())
            _atomic_write(d / f"B{s['build_errors']:03d}.txt", error)
        self._log(f"a program failed to build under eager (a fuzz catalog bug): {error.splitlines()[0]}")

    def _record_failure(self) -> None:
        assert self._target and self._best and self._original and self.oracle
        key, best = self._target, self._best
        ops = list(best.op_set())
        hooks = list(best.hook_set())
        sig = signature(key, ops + hooks)
        for f in self.state["failures"]:
            if f["signature"] == sig:
                f["count"] += 1
                self._log(f"shrank to the known {f['id']}: {sig}")
                return
        fid = f"F{len(self.state['failures']) + 1:03d}"
        d = self.out / "failures" / f"{fid}-{_slug(key.text())}"
        d.mkdir(parents=True, exist_ok=True)
        best = best.with_name(fid)
        _atomic_write(d / "program.json", best.to_json())
        _atomic_write(d / "original.json", self._original.with_name(f"{fid}-original").to_json())
        first_outcome = None
        if self._best_verdict is not None and self._best_verdict.report is not None:
            _atomic_write(d / "report.json", json.dumps(self._best_verdict.report.to_json(), indent=1))
            outcome = self._best_verdict.outcome(key)
            first_outcome = outcome.to_json() if outcome is not None else None
        if first_outcome is None:
            first_outcome = {"subject": key.subject, "device": key.device, "status": key.status, "kind": key.kind}
        plugin = self.oracle.plugin_of.get(key.subject)
        header = (
            f"Signature: {sig}\n"
            f"Found by cagrad-fuzz campaign --seed {self.cfg.seed} (torch {torch.__version__});\n"
            f"shrunk from {len(self._original.ops)} ops to {len(best.ops)}."
        )
        write_reproducer(
            d / "reproducer.py",
            best,
            subjects=[] if plugin else ([] if key.subject == "harness" else [key.subject]),
            plugins=[plugin] if plugin else [],
            devices=[key.device],
            header=header,
        )
        self.state["failures"].append(
            {
                "id": fid,
                "signature": sig,
                "key": key.to_json(),
                "ops": ops,
                "hooks": hooks,
                "count": 1,
                "original_ops": len(self._original.ops),
                "shrunk_ops": len(best.ops),
                "shrink_calls": self._shrink_calls,
                "reproducer": str((d / "reproducer.py").relative_to(self.out)),
                "program_json": str((d / "program.json").relative_to(self.out)),
                "first_outcome": first_outcome,
            }
        )
        self._log(f"recorded {fid}: {sig} ({len(self._original.ops)} -> {len(best.ops)} ops), {d / 'reproducer.py'}")
        self._save_state()
        self._write_report()

    # ------------------------------------------------------------- UI
    def _log(self, message: str) -> None:
        self.console.print(Text(message))

    def _update_progress(self, now: float) -> None:
        if self._progress is None or self._task is None:
            return
        elapsed = now - self._start
        if self._target is not None:
            desc = f"shrinking ({self._shrink_calls} tries)"
            left = f"shrink {max(0.0, self._shrink_deadline - now):.0f}s left"
        else:
            desc = "fuzzing"
            left = f"{max(0.0, self._deadline - now):.0f}s left"
        self._progress.update(
            self._task,
            completed=min(elapsed, self.cfg.budget_s),
            description=desc,
            programs=self._session_programs,
            failures=len(self.state["failures"]),
            left=left,
        )

    def _print_summary(self) -> None:
        r = self.report()
        table = Table(title=Text(f"cagrad-fuzz: {r['programs_run']} programs, {len(r['failures'])} failure(s)"))
        for col in ("id", "signature", "count", "ops", "reproducer"):
            table.add_column(col, overflow="fold")
        for f in r["failures"]:
            table.add_row(
                Text(f["id"]),
                Text(f["signature"]),
                str(f["count"]),
                f"{f['original_ops']} -> {f['shrunk_ops']}",
                Text(str(self.out / f["reproducer"])),
            )
        self.console.print(table)
        seq = r["sequence_captures"]
        if seq:
            listed = "; ".join(
                f"{w}: {c['captures']} captures ({c['over_first']} at new sizes) in {c['sequences']} sequences"
                for w, c in seq.items()
            )
            self.console.print(Text(f"size sequences: {listed}"))
        if r["build_errors"]:
            self.console.print(Text(f"{r['build_errors']} program(s) failed to build under eager: see {self.out / 'build_errors'}"))
        self.console.print(Text(f"report: {self.report_path}"))
