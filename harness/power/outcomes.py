"""What became of one mutant, read from cosmic-ray's WorkResult.

Outcomes: ``killed`` (a killer failed; its name comes with it), ``timeout``
(the killers ran past the run's per-mutant timeout and were killed: counted
as killed in the score, listed apart), ``survived`` (every killer passed),
``incompetent`` (the mutant could not be tested: cosmic-ray or the killer
runner itself failed), ``no-test`` (cosmic-ray found nothing to mutate at
that occurrence), ``pending`` (not run yet). A survivor listed in the
equivalents file is reported as ``equivalent`` (:mod:`harness.power.report`).
"""

from __future__ import annotations

import re

from harness.power.kill import MARK

OUTCOMES = ("killed", "timeout", "survived", "equivalent", "incompetent", "no-test", "pending")

_KILLED = re.compile(rf"^{re.escape(MARK)} killed-by (\S+)", re.M)


def classify(result) -> tuple[str, str | None]:
    """``(outcome, killer)`` for a cosmic-ray ``WorkResult`` (killer: the
    killing killer's name, else None)."""
    worker = str(getattr(result.worker_outcome, "value", result.worker_outcome))
    test = result.test_outcome
    test = None if test is None else str(getattr(test, "value", test))
    if worker == "no-test":
        return "no-test", None
    if worker != "normal" or test == "incompetent":
        return "incompetent", None
    if test == "survived":
        return "survived", None
    output = result.output or ""
    if output == "timeout":  # cosmic-ray's own marker for a command it killed at the timeout
        return "timeout", None
    found = _KILLED.findall(output)
    if not found:  # a non-zero exit without the runner's last line: the runner itself failed
        return "incompetent", None
    return "killed", found[-1]
