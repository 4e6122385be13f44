"""Crashes and hangs: the record of a worker that died or hung on a program,
and its shrinking by :mod:`fuzz.reduce`, each candidate program run in a
fresh interpreter (:func:`fuzz.workers.probe`) under the time limit."""

from __future__ import annotations

import time
from typing import Any

from fuzz.ir import Program
from fuzz.reduce import reduce_program
from fuzz.signature import make_signature
from fuzz.workers import probe


def crash_record(program_json: str, subject: str, device: str, outcome: dict[str, Any], plugin: str | None) -> dict[str, Any]:
    """A failure record (as :meth:`fuzz.campaign.state.CampaignState.record`
    takes) for ``program_json`` crashing or hanging under ``subject``.
    ``outcome`` is ``{"status": "crash", "signal": ...}`` or ``{"status":
    "timeout", "seconds": ...}``; status and kind are both its status."""
    status = outcome["status"]
    program = Program.from_json(program_json)
    outcome = {"subject": subject, "device": device, **outcome}
    return {
        "signature": make_signature(subject, device, status, status, outcome),
        "key": {"subject": subject, "device": device, "status": status, "kind": status},
        "first_outcome": outcome,
        "ops": list(program.op_set()),
        "hooks": list(program.hook_set()),
        "program": program.to_json(),
        "original": program.to_json(),
        "original_ops": len(program.ops),
        "shrunk_ops": len(program.ops),
        "shrink_calls": 0,
        "report": None,
        "plugin": plugin,
        "shrunk": False,
    }


def shrink_crash(
    rec: dict[str, Any], timeout_s: float, deadline: float, neighbours: int = 0, cpu_timeout_s: float | None = None
) -> dict[str, Any]:
    """Reduces the program of crash/timeout record ``rec`` until ``deadline``
    (``time.monotonic()``): a candidate is kept when it still crashes with the
    same signal (or still runs past ``timeout_s`` wall-clock or
    ``cpu_timeout_s`` CPU seconds) in a fresh interpreter under the same
    subject. Returns the shrunk record."""
    key, outcome = rec["key"], rec["first_outcome"]

    def still_fails(candidate: Program) -> bool:
        got = probe(
            candidate.to_json(), key["subject"], rec["plugin"], key["device"], timeout_s, neighbours, cpu_timeout_s
        )
        if got["status"] != key["status"]:
            return False
        return key["status"] == "timeout" or got.get("signal") == outcome.get("signal")

    best, tried = Program.from_json(rec["program"]), 0
    if key["subject"] != "harness":
        best, tried = reduce_program(best, still_fails, deadline, clock=time.monotonic)
    return {
        **rec,
        "program": best.to_json(),
        "ops": list(best.op_set()),
        "hooks": list(best.hook_set()),
        "shrunk_ops": len(best.ops),
        "shrink_calls": tried,
        "shrunk": True,
    }
