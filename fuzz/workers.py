"""Worker processes of a campaign, and one-program probes.

A campaign's programs run in worker processes (``multiprocessing``'s
``spawn`` context: each imports torch and the subjects afresh), so that a
subject that aborts, segfaults, runs out of memory or hangs takes down only
its worker. The parent (:mod:`fuzz.campaign.engine`) hands each worker whole
rounds and reads a stream of events from it over a pipe:

``("program", {round, index, phase, program, cpu})``
    a program starts (``phase`` ``gen`` or ``shrink``; ``program`` its JSON;
    ``cpu`` the worker's CPU seconds then, for ``--cpu-timeout``);
``("subject", {name, device})``
    a subject starts its run of that program (``name`` None when it is done):
    the parent blames a crash or a hang on the subject running then;
``("ran", {...})``
    a generated program is done: ops, features, coverage
    (:func:`fuzz.coverage.program_coverage`), outcome counts, the
    signatures it hit, known issues, a ``novel`` failure (unshrunk);
``("failure", {...})``
    a failure shrunk (replaces the unshrunk record);
``("round", {round, done, index})``
    the round ended (``done``) or was cut short after ``index`` programs;
``("error", {traceback})``
    the worker itself failed (a bug in the fuzzer).

The parent sends ``("task", {round, skip, deadline, plan})`` (``plan``: the
round's :class:`~fuzz.campaign.steer.RoundPlan` as JSON), ``("settled",
[signature, ...])`` (failures recorded by any worker: count them, do not
shrink them again) and ``("stop", None)``. Workers ignore SIGINT (the parent
decides when to stop) and exit when their parent dies.

:func:`probe` runs one program under one subject in a fresh interpreter
(``python -m fuzz.workers probe``) with a time limit: how crashes and hangs
are confirmed and shrunk.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
#: Seconds a probe may take to import torch and its subjects.
STARTUP_S = 300.0
#: Exit code of a worker or probe whose CUDA context a device error broke
#: (:func:`fuzz.campaign.rounds.device_lost`): every later CUDA call in that
#: process fails, and eager would "agree" with every subject by raising
#: the same error, so the process ends and the parent records a crash.
DEVICE_LOST_EXIT = 86


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Starts a daemon thread that ends this process when its parent dies
    (the parent's pid changes: the process was re-parented)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used, from
    ``/proc/PID/stat`` (fields 14 and 15, in clock ticks: ``man 5 proc``);
    None where there is no such file (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count from its end
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_clock_available() -> bool:
    """Whether :func:`cpu_seconds` can read processes' CPU time here."""
    return cpu_seconds(os.getpid()) is not None


def timeout_outcome(seconds: float, clock: str) -> dict[str, Any]:
    """The outcome of a program stopped by a time limit: ``{"status":
    "timeout", "seconds": seconds, "clock": "wall" | "cpu"}``."""
    return {"status": "timeout", "seconds": seconds, "clock": clock}


def signal_name(code: int) -> str:
    """``SIGABRT`` for exit code -6; ``device lost`` for
    :data:`DEVICE_LOST_EXIT`; ``exit N`` for another positive code."""
    if code == DEVICE_LOST_EXIT:
        return "device lost"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


# ------------------------------------------------------------------ worker
def _wrap_subjects(oracle: Any, send: Any) -> None:
    """Makes each subject announce its runs, so that a crash names it."""
    for subject in oracle.subjects:
        inner = subject.run

        def run(run: Any, _inner: Any = inner, _name: str = subject.name) -> Any:
            leaves = getattr(run, "leaves", None) or []
            device = str(leaves[0].device) if leaves else None
            send("subject", {"name": _name, "device": device})
            try:
                return _inner(run)
            finally:
                send("subject", {"name": None, "device": None})

        subject.run = run


def worker_main(conn: Connection, cfg: Any) -> None:
    """A worker: runs the rounds its parent sends until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

    def send(event: str, payload: Any) -> None:
        conn.send((event, payload))

    try:
        from fuzz.campaign.rounds import RoundRunner

        stop = False

        def control() -> str | None:
            nonlocal stop
            while conn.poll():
                event, payload = conn.recv()
                if event == "settled":
                    runner.settled.update(payload)
                elif event == "stop":
                    stop = True
            return "stop" if stop else None

        runner = RoundRunner(cfg, send, control, exit_device_lost=lambda: os._exit(DEVICE_LOST_EXIT))
        _wrap_subjects(runner.oracle, send)
        send("ready", {"pid": os.getpid()})
        while not stop:
            event, payload = conn.recv()
            if event == "settled":
                runner.settled.update(payload)
            elif event == "stop":
                break
            elif event == "task":
                from fuzz.campaign.steer import RoundPlan

                runner.run_round(payload["round"], payload["skip"], payload["deadline"], RoundPlan.from_json(payload.get("plan")))
    except (EOFError, BrokenPipeError):
        return
    except BaseException:
        try:
            send("error", {"traceback": traceback.format_exc()})
        except (OSError, ValueError):
            pass
        return


class Worker:
    """The parent's handle on one worker process.

    Attributes track what the worker is doing, for the watchdog: ``round``,
    ``skip`` (its start), ``program`` (JSON of the program running, None
    between programs), ``phase``, ``index``, ``started`` (monotonic time the
    program started), ``cpu_started`` (the worker's CPU seconds then), ``subject``/``device`` running it, ``last_gen`` (index
    of its last generated program).
    """

    def __init__(self, cfg: Any, slot: int):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, cfg), name=f"fuzz-worker-{slot}", daemon=True)
        self.process.start()
        child.close()
        self.slot = slot
        self.ready = False
        self.round: int | None = None
        self.skip = 0
        self.program: str | None = None
        self.phase = "gen"
        self.index = -1
        self.last_gen = -1
        self.started = 0.0
        self.cpu_started = 0.0
        self.subject: str | None = None
        self.device: str | None = None

    def send(self, event: str, payload: Any = None) -> None:
        try:
            self.conn.send((event, payload))
        except (OSError, ValueError):
            pass  # it died; the parent finds out from its exit code

    def assign(self, r: int, skip: int, deadline: float, plan: dict[str, Any] | None = None) -> None:
        """Hands the worker round ``r`` from program ``skip``; ``plan``: the
        round's :class:`~fuzz.campaign.steer.RoundPlan` as JSON."""
        self.round, self.skip, self.last_gen, self.program = r, skip, skip - 1, None
        self.send("task", {"round": r, "skip": skip, "deadline": deadline, "plan": plan})

    def ran_past(self, now: float, timeout_s: float, cpu_timeout_s: float | None) -> dict[str, Any] | None:
        """The timeout outcome when the running program is past either limit
        (``now``: ``time.monotonic()``), else None."""
        if self.program is None:
            return None
        if cpu_timeout_s is not None:
            cpu = cpu_seconds(self.process.pid)
            if cpu is not None and cpu - self.cpu_started > cpu_timeout_s:
                return timeout_outcome(cpu_timeout_s, "cpu")
        if now - self.started > timeout_s:
            return timeout_outcome(timeout_s, "wall")
        return None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


# ------------------------------------------------------------------- probe
def probe(
    program_json: str,
    subject: str,
    plugin: str | None,
    device: str,
    timeout_s: float,
    neighbours: int = 0,
    cpu_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Runs one program under one subject in a fresh interpreter, stopped
    after ``timeout_s`` wall-clock seconds or ``cpu_timeout_s`` CPU seconds
    (None: no CPU limit), whichever comes first, both counted once it has
    started (imported torch and the subjects).

    Returns ``{"status": "crash", "signal": "SIGABRT"}``, a
    :func:`timeout_outcome`, or ``{"status": "ran", "signatures": [...]}``
    (the failure signatures it printed).
    """
    spec = {
        "program": program_json,
        "subjects": [] if plugin else [subject],
        "plugins": [plugin] if plugin else [],
        "device": device,
        "neighbours": neighbours,
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PROJECT_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(
        [sys.executable, "-m", "fuzz.workers", "probe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        # the time limit starts once the child has imported torch and the
        # subjects (it prints "ready"), as a worker's does
        if proc.stdout.readline().strip() != "ready":
            proc.wait(STARTUP_S)
            return {"status": "crash", "signal": signal_name(proc.returncode), "detail": "died while starting"}
        ran_past = _wait(proc, timeout_s, cpu_timeout_s)
        if ran_past is not None:
            return ran_past
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode < 0:
        return {"status": "crash", "signal": signal_name(proc.returncode)}
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"status": "crash", "signal": signal_name(proc.returncode), "detail": out[-2000:]}


def _wait(proc: subprocess.Popen, timeout_s: float, cpu_timeout_s: float | None) -> dict[str, Any] | None:
    """Waits for ``proc`` to exit; the timeout outcome if it ran past a limit."""
    if cpu_timeout_s is None:
        try:
            proc.wait(timeout_s)
            return None
        except subprocess.TimeoutExpired:
            return timeout_outcome(timeout_s, "wall")
    end = time.monotonic() + timeout_s
    cpu0 = cpu_seconds(proc.pid) or 0.0
    while True:
        try:
            proc.wait(max(0.0, min(0.1, end - time.monotonic())))
            return None
        except subprocess.TimeoutExpired:
            pass
        cpu = cpu_seconds(proc.pid)
        if cpu is not None and cpu - cpu0 > cpu_timeout_s:
            return timeout_outcome(cpu_timeout_s, "cpu")
        if time.monotonic() >= end:
            return timeout_outcome(timeout_s, "wall")


def _probe_main() -> None:
    exit_with_parent()
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from fuzz.campaign.config import CampaignConfig
    from fuzz.campaign.rounds import device_lost, findings, make_oracle
    from fuzz.ir import Program

    spec = json.loads(sys.stdin.read())
    cfg = CampaignConfig(
        budget_s=0,
        seed=0,
        out=Path("."),
        subjects=spec["subjects"],
        plugins=spec["plugins"],
        devices=[spec["device"]],
        neighbours=spec.get("neighbours", 0),
    )
    oracle = make_oracle(cfg)
    for subject in oracle.subjects:
        subject.prepare()
    program = Program.from_json(spec["program"])
    print("ready", flush=True)
    verdict = oracle.run(program)
    if device_lost(verdict) is not None:
        os._exit(DEVICE_LOST_EXIT)
    print(json.dumps({"status": "ran", "signatures": [f.signature for f in findings(verdict)]}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["probe"]:
        _probe_main()
    else:
        sys.exit("usage: python -m fuzz.workers probe < spec.json")
