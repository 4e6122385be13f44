"""Subjects that take their process down, for testing the campaign's workers.

``AbortOnSin`` is eager autograd that calls :func:`os.abort` (SIGABRT, as a
failed C++ assert in a backend would) when the backward graph holds a
``SinBackward0`` node. ``HangOnExp`` loops forever, using CPU (so that
``--cpu-timeout`` stops it however busy the machine is), when it holds an
``ExpBackward0`` node; ``SleepOnExp`` sleeps forever instead (only the
wall-clock ``--timeout`` stops it). ``DeviceErrorOnNeg`` raises the error CUDA gives
after an illegal memory access (``torch.AcceleratorError``) when it holds a
``NegBackward0`` node. Every other program agrees with eager. Load them
with ``--plugin PATH/crashing_subject.py:AbortOnSin`` (or ``:HangOnExp``,
``:SleepOnExp``, ``:DeviceErrorOnNeg``).
"""

from __future__ import annotations

import os
import runpy
import time
from pathlib import Path

import torch

import harness
from harness.program import ProgramRun, run_backward

graph_has = runpy.run_path(str(Path(__file__).with_name("broken_subject.py")))["graph_has"]


class AbortOnSin(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("abort[sin]")

    def run(self, run: ProgramRun):
        if graph_has(run.outputs, "SinBackward0"):
            os.abort()
        return run_backward(run)


class HangOnExp(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("hang[exp]")

    def run(self, run: ProgramRun):
        if graph_has(run.outputs, "ExpBackward0"):
            while True:
                pass
        return run_backward(run)


class SleepOnExp(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("sleep[exp]")

    def run(self, run: ProgramRun):
        if graph_has(run.outputs, "ExpBackward0"):
            while True:
                time.sleep(1)
        return run_backward(run)


class DeviceErrorOnNeg(harness.EagerSubject):
    def __init__(self) -> None:
        super().__init__("device_error[neg]")

    def run(self, run: ProgramRun):
        if graph_has(run.outputs, "NegBackward0"):
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return run_backward(run)
