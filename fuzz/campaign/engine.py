"""The campaign's parent process: schedules rounds on worker processes,
watches them, records what they find (see :mod:`fuzz.campaign`)."""

from __future__ import annotations

import json
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from fuzz import coverage
from fuzz.campaign.config import CampaignConfig, CampaignError, atomic_write
from fuzz.campaign.crash import crash_record, shrink_crash
from fuzz.campaign.rounds import load_known, make_oracle
from fuzz.campaign.state import CampaignState
from fuzz.campaign.steer import Steering
from fuzz.ir import Program
from fuzz.workers import Worker, signal_name, timeout_outcome

TIMELINE_EVERY_S = 5.0
MAX_START_FAILURES = 3


class _StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (a CI timeout, ``kill``) stop the campaign.

    The first signal only sets :attr:`requested`; the parent's loop checks it
    between steps and stops there, so a signal never lands inside code that
    cannot take an exception at any point (Hypothesis generating a round's
    steering counts asserts on one). A second signal raises
    ``KeyboardInterrupt`` at once. Installed only in the main thread.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        """Raises ``KeyboardInterrupt`` once a stop was requested."""
        if self.requested:
            raise KeyboardInterrupt

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class _Shrink(threading.Thread):
    """A crash/timeout record being shrunk (probes in subprocesses)."""

    def __init__(self, rec: dict[str, Any], cfg: CampaignConfig, slot: int, task: tuple[int, int]):
        super().__init__(name=f"shrink-{slot}", daemon=True)
        self.rec, self.cfg, self.slot, self.task = rec, cfg, slot, task
        self.result: dict[str, Any] | None = None

    def run(self) -> None:
        deadline = time.monotonic() + self.cfg.shrink_s
        self.result = shrink_crash(self.rec, self.cfg.timeout_s, deadline, self.cfg.neighbours, self.cfg.cpu_timeout_s)


class Campaign:
    """One run of a campaign (see :mod:`fuzz.campaign`).

    Args:
        config: the settings.
        console: where progress and the summary go (stderr by default).
    """

    def __init__(self, config: CampaignConfig, console: Console | None = None):
        self.cfg = config
        self.out = config.out
        self.console = console or Console(stderr=True)
        self.state = CampaignState(config)
        self.workers: dict[int, Worker] = {}
        self.shrinks: dict[int, _Shrink] = {}
        self.names: list[str] = list(config.subjects or [])
        self.devices: list[str] = list(config.devices or [])
        self.plugin_of: dict[str, str] = {}
        self._session_programs = 0
        self._start = 0.0
        self._deadline = 0.0
        self._deadline_wall = 0.0
        self._pending: list[tuple[int, int]] = []
        self._last_new = -1
        self._stopping = False
        self._signals = _StopSignals()
        self._start_failures = 0
        self._exit_status = 0
        self._settled: set[str] = set()
        self._known: Any = None  # fuzz.known.KnownIssues, or None: --known none
        self.steering = Steering(config.gen, config.seed, config.round_size, config.steer)

    @property
    def report_path(self) -> Any:
        return self.state.report_path

    # ----------------------------------------------------------- setup
    def _prepare(self) -> None:
        self.state.load()
        try:
            oracle = make_oracle(self.cfg)
        except (ValueError, KeyError, TypeError) as e:
            raise CampaignError(str(e)) from None
        self.names, self.devices, self.plugin_of = oracle.names, oracle.devices, dict(oracle.plugin_of)
        if self.cfg.devices is None:
            self.cfg.devices = self.devices  # workers use the same devices
        if self.cfg.known is not None:
            from fuzz.known import KnownIssuesError

            try:
                self._known = load_known(self.cfg.known)
            except KnownIssuesError as e:
                raise CampaignError(str(e)) from None
        self._pending = self.state.pending_rounds()
        self.steering = Steering(self.cfg.gen, self.cfg.seed, self.cfg.round_size, self.cfg.steer, self.state.s.get("steering"))
        # an unshrunk failure (a run stopped while shrinking it) is shrunk
        # again when a program hits it
        self._settled = {f["signature"] for f in self.state.s["failures"] if f.get("shrunk", True)}

    def _next_task(self) -> tuple[int, int] | None:
        if self._stopping or time.monotonic() >= self._deadline:
            return None
        if self._pending:
            return self._pending.pop(0)
        r = self.state.next_new_round(self._last_new)
        if self.cfg.rounds is not None and r >= self.cfg.rounds:
            return None
        self._last_new = r
        return r, 0

    def _spawn(self, slot: int, task: tuple[int, int] | None) -> None:
        w = Worker(self.cfg, slot)
        self.workers[slot] = w
        if self._settled:
            w.send("settled", sorted(self._settled))
        if task is not None:
            self._assign(w, task)

    def _assign(self, w: Worker, task: tuple[int, int]) -> None:
        w.assign(task[0], task[1], self._deadline_wall, self.steering.plan(task[0]).to_json())

    # ------------------------------------------------------------- run
    def run(self) -> int:
        """Runs until the budget (or ``rounds``) ends; returns the exit status
        (0 clean, 1 new failure(s), 130 interrupted without one). Raises
        CampaignError on bad settings or unwritable output."""
        self._prepare()
        s = self.state.s
        self._start = time.monotonic()
        self._deadline = self._start + self.cfg.budget_s
        self._deadline_wall = time.time() + self.cfg.budget_s
        elapsed_before = s["elapsed_s"]
        session = {"budget_s": self.cfg.budget_s, "programs_run": 0, "elapsed_s": 0.0, "workers": self.cfg.workers}
        s["sessions"].append(session)
        self.console.print(
            Text(
                f"cagrad-fuzz: seed {self.cfg.seed}, budget {self.cfg.budget_s:g}s, {self.cfg.workers} worker(s), "
                f"subjects {', '.join(self.names)}, devices {', '.join(self.devices)}, out {self.out}"
                + (f", shard {self.cfg.shard_text()}" if self.cfg.shard else "")
                + (f" (resuming after {s['programs_run']} programs)" if s["programs_run"] else "")
            )
        )
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[programs]} programs"),
            TextColumn("{task.fields[rate]} /s"),
            TextColumn("{task.fields[failures]} failures"),
            TextColumn("{task.fields[left]}"),
            console=self.console,
            disable=not self.cfg.progress,
        )
        interrupted = False
        self._elapsed_before = elapsed_before
        self._session = session
        with self._signals, progress:
            self._task = progress.add_task("fuzzing", total=self.cfg.budget_s, programs=0, rate="0.0", failures=0, left="")
            self._progress = progress
            try:
                for slot in range(self.cfg.workers):
                    self._signals.check()
                    self._spawn(slot, self._next_task())
                self._loop()
            except KeyboardInterrupt:
                interrupted = True
            finally:
                self._shutdown()
        self._exit_status = 1 if s["failures"] else (130 if interrupted else 0)
        self._finish()
        self._print_summary()
        if interrupted:
            self.console.print("interrupted; run the same command again to resume")
        return self._exit_status

    def _busy(self) -> bool:
        return any(w.round is not None for w in self.workers.values()) or bool(self.shrinks)

    def _loop(self) -> None:
        last_sample = last_save = time.monotonic()
        hard_end = self._deadline + self.cfg.shrink_s + self.cfg.timeout_s + 30
        while True:
            self._signals.check()
            for slot, w in list(self.workers.items()):
                if w.round is None and slot not in self.shrinks:
                    task = self._next_task()
                    if task is not None:
                        self._assign(w, task)
            if not self._busy():
                return
            now = time.monotonic()
            if now > hard_end:
                return
            live = [w for slot, w in self.workers.items() if slot not in self.shrinks]
            ready = wait([w.conn for w in live] + [w.process.sentinel for w in live], timeout=0.5)
            for w in live:
                if w.conn in ready:
                    self._drain(w)
            now = time.monotonic()
            for slot, w in list(self.workers.items()):
                if slot in self.shrinks:
                    continue
                if not w.process.is_alive():
                    self._drain(w)
                    self._on_death(w, w.process.exitcode or 0)
                elif (past := w.ran_past(now, self.cfg.timeout_s, self.cfg.cpu_timeout_s)) is not None:
                    w.kill()
                    self._on_death(w, None, past)
            for slot, t in list(self.shrinks.items()):
                if not t.is_alive():
                    del self.shrinks[slot]
                    if t.result is not None:
                        self.state.record(t.result)
                        self._log(f"shrank {t.result['signature']} to {t.result['shrunk_ops']} ops")
                    self._spawn(slot, t.task)
            if now - last_sample >= TIMELINE_EVERY_S:
                last_sample = now
                self.state.s["timeline"].append(
                    [round(self._elapsed_before + now - self._start, 1), self.state.s["programs_run"], len(self.state.s["failures"])]
                )
            if now - last_save >= 10:
                last_save = now
                self._save()
            self._update_progress(now)

    # ---------------------------------------------------------- events
    def _drain(self, w: Worker) -> None:
        try:
            while w.conn.poll():
                event, payload = w.conn.recv()
                self._on_event(w, event, payload)
        except (EOFError, OSError):
            pass

    def _on_event(self, w: Worker, event: str, p: Any) -> None:
        if event == "ready":
            w.ready = True
            self._start_failures = 0
        elif event == "program":
            w.program, w.phase, w.index, w.started = p["program"], p["phase"], p["index"], time.monotonic()
            w.cpu_started = p.get("cpu", 0.0)
            w.subject = w.device = None
        elif event == "subject":
            w.subject, w.device = p["name"], p["device"]
        elif event == "ran":
            w.program = None
            if self._stopping and self.cfg.max_programs is not None:
                return  # past --max-programs: not counted, run again on resume
            w.last_gen = p["index"]
            self.state.count_program(p)
            self._session_programs += 1
            if p.get("novel"):
                self._record(p["novel"])
            if self.cfg.max_programs is not None and self._session_programs >= self.cfg.max_programs:
                self._stop_all()
        elif event == "failure":
            w.program = None
            if self.state.failure(p["signature"]) is not None:
                f, _ = self.state.record(p)
                self._log(f"{f['id']} shrunk: {f['signature']} ({f['original_ops']} -> {f['shrunk_ops']} ops)")
                self._save()
        elif event == "round":
            w.program = None
            r = p["round"]
            if w.round == r:
                done = p["done"] and not (self._stopping and self.cfg.max_programs is not None and p["index"] > w.last_gen + 1)
                self.state.round_ended(r, done, min(p["index"], w.last_gen + 1) if not done else p["index"])
                if done:
                    self.steering.done(r)
                w.round = None
                self._save()
        elif event == "error":
            raise RuntimeError(f"a campaign worker failed:\n{p['traceback']}")

    def _record(self, rec: dict[str, Any]) -> dict[str, Any]:
        f, new = self.state.record(rec)
        if rec["signature"] not in self._settled:
            self._settled.add(rec["signature"])
            for other in self.workers.values():
                other.send("settled", [rec["signature"]])
        if new:
            self._log(f"recorded {f['id']}: {f['signature']} ({f['original_ops']} ops), {self.out / f['reproducer']}")
            self._save()
        return f

    def _stop_all(self) -> None:
        self._stopping = True
        for w in self.workers.values():
            w.send("stop")

    def _on_death(self, w: Worker, code: int | None, past: dict[str, Any] | None = None) -> None:
        """A worker died (``code``: its exit code) or hung (``code`` None,
        ``past`` the timeout outcome, :func:`fuzz.workers.timeout_outcome`):
        record a crash/timeout for the program it was running, shrink it in
        subprocesses, and continue its round after that program."""
        w.kill()
        slot = w.slot
        if w.round is None and w.program is None:
            self._spawn(slot, None)
            return
        if w.program is None:
            self._start_failures += 0 if w.ready else 1
            if self._start_failures >= MAX_START_FAILURES:
                raise RuntimeError(f"campaign workers die before running a program ({signal_name(code or 0)})")
            self._spawn(slot, (w.round, w.last_gen + 1) if w.round is not None else None)
            return
        subject = w.subject or "harness"
        device = w.device or self.devices[0]
        if code is None:
            outcome: dict[str, Any] = past or timeout_outcome(self.cfg.timeout_s, "wall")
            what = f"ran past {outcome['seconds']:g} s ({outcome['clock']} clock)"
        else:
            outcome = {"status": "crash", "signal": signal_name(code), "detail": f"worker exit code {code}"}
            what = f"died with {signal_name(code)}"
        self._log(f"worker {slot} {what} running {subject} on a program of round {w.round} ({w.phase}); recorded, going on")
        task = (w.round, (w.index if w.phase == "gen" else w.last_gen) + 1)
        rec = crash_record(w.program, subject, device, outcome, self.plugin_of.get(subject))
        # a crash or hang the known-issues file lists is counted there, as a
        # divergence is: not recorded, not shrunk, no effect on the exit status
        program = Program.from_json(w.program)
        issue = self._known.match(rec["signature"], torch.__version__, program.op_names()) if self._known is not None else None
        known = [] if issue is None else [
            {"id": issue.id, "signature": rec["signature"], "note": issue.note or "", "link": issue.link or ""}
        ]
        if w.phase == "gen" and not (self._stopping and self.cfg.max_programs is not None):
            self.state.count_program(
                {"ops": program.op_names(), "features": list(program.features()),
                 "coverage": coverage.program_coverage(program), "outcomes": [], "hits": [],
                 "known": known, "build_error": None}
            )
            self._session_programs += 1
        if issue is not None:
            self._log(f"known {issue.id}: {rec['signature']}")
            self._save()
            self._spawn(slot, task)
            return
        f = self._record(rec)
        if f["shrunk"] is False and f["count"] == 1 and time.monotonic() < self._deadline + self.cfg.shrink_s:
            t = _Shrink(rec, self.cfg, slot, task)
            self.shrinks[slot] = t
            t.start()
            w.round = None
        else:
            self._spawn(slot, task)

    # ---------------------------------------------------------- finish
    def _shutdown(self) -> None:
        for w in self.workers.values():
            w.send("stop")
        for w in self.workers.values():
            if w.round is not None:
                # cut short: resume after its last counted program
                self.state.round_ended(w.round, False, w.last_gen + 1)
            w.process.join(2)
            w.kill()
        self.workers.clear()

    def _throughput(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        return {"programs_per_s": round(self._session_programs / elapsed, 3), "workers": self.cfg.workers}

    def _save(self) -> None:
        now = time.monotonic() - self._start
        self._session["programs_run"] = self._session_programs
        self._session["elapsed_s"] = round(now, 3)
        self.state.s["elapsed_s"] = self._elapsed_before + now
        self.state.s["steering"] = self.steering.to_json()
        self.state.save()
        try:
            report = self.state.report(self.names, self.devices, self._throughput(), 1 if self.state.s["failures"] else 0)
            atomic_write(self.state.report_path, json.dumps(report, indent=1))
        except OSError as e:
            raise CampaignError(f"cannot write {self.state.report_path}: {e}") from None

    def _finish(self) -> None:
        self._save()
        report = json.loads(self.state.report_path.read_text())
        report["exit_status"] = self._exit_status if self._exit_status in (0, 1) else int(bool(self.state.s["failures"]))
        atomic_write(self.state.report_path, json.dumps(report, indent=1))

    # -------------------------------------------------------------- UI
    def _log(self, message: str) -> None:
        self.console.print(Text(message))

    def _update_progress(self, now: float) -> None:
        elapsed = now - self._start
        shrinking = sum(1 for w in self.workers.values() if w.phase == "shrink" and w.program) + len(self.shrinks)
        self._progress.update(
            self._task,
            completed=min(elapsed, self.cfg.budget_s),
            description=f"fuzzing, {shrinking} shrinking" if shrinking else "fuzzing",
            programs=self._session_programs,
            rate=f"{self._session_programs / max(elapsed, 1e-9):.1f}",
            failures=len(self.state.s["failures"]),
            left=f"{max(0.0, self._deadline - now):.0f}s left",
        )

    def _print_summary(self) -> None:
        r = json.loads(self.state.report_path.read_text())
        table = Table(title=Text(f"cagrad-fuzz: {r['programs_run']} programs, {len(r['failures'])} failure(s)"))
        for col in ("id", "signature", "count", "ops", "reproducer"):
            table.add_column(col, overflow="fold")
        for f in r["failures"]:
            table.add_row(
                Text(f["id"]), Text(f["signature"]), str(f["count"]),
                f"{f['original_ops']} -> {f['shrunk_ops']}", Text(str(self.out / f["reproducer"])),
            )  # fmt: skip
        self.console.print(table)
        for k in r["known"]:
            self.console.print(Text(f"known {k['id']}: {k['signature']} x{k['count']}"))
        if r.get("peer_every", 1) > 1:
            ran = {w: sum(c.values()) for w, c in r["outcome_counts"].items() if w.startswith("torch_ca[")}
            if ran:
                listed = ", ".join(f"{w} on {n}" for w, n in ran.items())
                self.console.print(Text(f"peers (one program in {r['peer_every']}, --peer-every): {listed}"))
        seq = r["sequence_captures"]
        if seq:
            listed = "; ".join(
                f"{w}: {c['captures']} captures ({c['over_first']} at new sizes) in {c['sequences']} sequences"
                for w, c in seq.items()
            )
            self.console.print(Text(f"size sequences: {listed}"))
        graphed = {w: c for w, c in r.get("engine_counts", {}).items() if c.get("cudagraph_records")}
        if graphed:
            listed = "; ".join(
                f"{w}: {c['cudagraph_records']} recorded, {c.get('cudagraph_replays', 0)} replays "
                f"({c.get('cudagraph_early_replays', 0)} early), {c.get('cudagraph_skips', 0)} run without a graph"
                for w, c in graphed.items()
            )
            self.console.print(Text(f"CUDA graphs: {listed}"))
        if r["build_errors"]:
            self.console.print(Text(f"{r['build_errors']} program(s) failed to build under eager: see {self.out / 'build_errors'}"))
        t = r["throughput"]
        self.console.print(Text(f"throughput: {t['programs_per_s']:.2f} programs/s with {t['workers']} worker(s)"))
        self.console.print(Text(f"report: {self.state.report_path}"))
