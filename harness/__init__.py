"""The differential oracle of cagrad.

Runs a program's backward under plain eager autograd and under each *subject*
(cagrad with a backend, torch's own compiled autograd), on CPU and CUDA, and
compares leaf ``.grad`` s, ``autograd.grad`` results and hook traces under a
per-dtype tolerance policy::

    import harness
    report = harness.run_differential(harness.examples.mlp_program(), ["cagrad[aot_eager]", "torch_ca[eager]"])
    print(report.summary())
    assert report.ok

A *size sequence* (a program with ``size_variants()``) runs the same program
at several sizes under one subject state, checks every size, and reports
each subject's captures per size; cagrad's are checked against its
recapture rule (``capture_rule``).

Modules: ``program`` (the Program contract), ``subjects``, ``devices``,
``tolerance``, ``compare``, ``execution``, ``outcome``, ``runner``,
``capture_rule``, ``examples``.
"""

from harness import examples
from harness.capture_rule import SizeVariant, allowed_captures, check_captures
from harness.devices import available_devices, resolve_devices
from harness.execution import Execution, execute
from harness.outcome import DifferentialReport, ErrorInfo, Mismatch, Outcome, Status
from harness.program import CallableProgram, Observation, Program, ProgramRun, program, run_backward
from harness.runner import ProgramBuildError, eager_reference, judge, run_differential
from harness.subjects import (
    CagradSubject,
    EagerSubject,
    Subject,
    TorchCompiledAutogradSubject,
    all_subject_names,
    default_subjects,
    make_subject,
    resolve_subjects,
)
from harness.tolerance import Tolerance, TolerancePolicy, tolerance_for

__all__ = [
    "CagradSubject",
    "CallableProgram",
    "DifferentialReport",
    "EagerSubject",
    "ErrorInfo",
    "Execution",
    "Mismatch",
    "Outcome",
    "Program",
    "ProgramBuildError",
    "Observation",
    "ProgramRun",
    "SizeVariant",
    "Status",
    "Subject",
    "Tolerance",
    "TolerancePolicy",
    "TorchCompiledAutogradSubject",
    "all_subject_names",
    "allowed_captures",
    "check_captures",
    "available_devices",
    "default_subjects",
    "eager_reference",
    "examples",
    "execute",
    "judge",
    "make_subject",
    "program",
    "resolve_devices",
    "resolve_subjects",
    "run_backward",
    "run_differential",
    "tolerance_for",
]
