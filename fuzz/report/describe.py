"""Short texts about the harness outcomes recorded in a report.json."""

from __future__ import annotations

from typing import Any


def outcome_detail(outcome: dict[str, Any] | None) -> str:
    """One line saying what went wrong in a harness outcome (its error, first mismatch, signal or time)."""
    if not outcome:
        return ""
    status = outcome.get("status")
    if status == "crash":
        return f"{outcome.get('signal') or 'crash'}: {outcome.get('detail') or ''}".strip(": ")
    if status == "timeout":
        seconds = outcome.get("seconds")
        clock = " of CPU time" if outcome.get("clock") == "cpu" else ""
        return f"no answer within {seconds:g} s{clock}" if isinstance(seconds, (int, float)) else "timeout"
    error = outcome.get("error")
    if isinstance(error, dict):
        message = str(error.get("message") or "").strip().splitlines()
        return f"{error.get('type', 'error')}: {message[0] if message else ''}"
    mismatches = outcome.get("mismatches") or []
    if mismatches and isinstance(mismatches[0], dict):
        first = mismatches[0]
        more = f" (+{len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        return f"{first.get('where', '?')}: {first.get('detail', '')}{more}"
    return ""
