"""The oracle compares the Python warnings each subject's backward emits with
eager's (:mod:`harness.warnings_seen`): one fewer (a hook's warning lost) or
one more (a compiler notice) is a ``mismatch`` at ``warnings``; a warning
torch emits once per process is not blamed on the subjects that run after
eager's reference; cagrad's subjects emit eager's warnings on a capture and
on a cache hit alike."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import harness
from harness import EagerSubject, Status
from harness.execution import execute
from harness.program import ProgramRun, program, run_backward
from harness.subjects import make_subject
from harness.warnings_seen import WarningRecord, compare_warnings, recording


class WarnsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        warnings.warn("WarnsInBackward.backward ran", UserWarning, stacklevel=1)
        return g * 2


@program("warning_hook_and_backward")
def warning_program(device: torch.device) -> ProgramRun:
    # a tensor hook that warns (opaque in cagrad: it reads the warnings
    # module) and a custom Function whose backward warns
    a = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    mid = a.sin()

    def hook(g):
        warnings.warn("hook saw a gradient", RuntimeWarning, stacklevel=1)

    mid.register_hook(hook)
    return ProgramRun(leaves=[a], outputs=[WarnsInBackward.apply(mid).cos().sum()])


@program("softmax_without_dim_hook")
def softmax_hook_program(device: torch.device) -> ProgramRun:
    # a hook cagrad's checker accepts as a pure function of the gradient
    # (torch.nn.functional only), which warns on every call: "Implicit
    # dimension choice for softmax has been deprecated"
    a = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    mid = a.sin()
    mid.register_hook(lambda g: F.softmax(g))
    return ProgramRun(leaves=[a], outputs=[mid.cos().sum()])


class Silences(EagerSubject):
    """Test-only: eager's backward with every warning ignored."""

    def __init__(self) -> None:
        super().__init__("silences")

    def run(self, run):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_backward(run)


class AddsNotice(EagerSubject):
    """Test-only: eager's backward, then a compiler-like notice."""

    def __init__(self) -> None:
        super().__init__("adds_notice")

    def run(self, run):
        result = run_backward(run)
        warnings.warn("a compiler notice", UserWarning, stacklevel=1)
        return result


def _where(report: harness.DifferentialReport, subject: str) -> list[str]:
    return [m.where for m in report.outcome(subject).mismatches]


def test_a_lost_or_an_extra_warning_is_a_mismatch() -> None:
    report = harness.run_differential(warning_program, [Silences(), AddsNotice(), EagerSubject("eager_again")], "cpu")
    silenced, noticed = report.outcome("silences"), report.outcome("adds_notice")
    assert silenced.status is Status.MISMATCH and _where(report, "silences") == ["warnings"]
    # eager's first warning (the custom backward runs before the hook of its input)
    assert "UserWarning 'WarnsInBackward.backward ran'" in silenced.mismatches[0].detail
    assert "0 time(s); eager's emitted it 1 time(s)" in silenced.mismatches[0].detail
    assert noticed.status is Status.MISMATCH and _where(report, "adds_notice") == ["warnings"]
    assert "'a compiler notice'" in noticed.mismatches[0].detail
    assert "1 time(s); eager's emitted it 0 time(s)" in noticed.mismatches[0].detail
    assert report.outcome("eager_again").status is Status.EQUAL


def test_a_warning_torch_emits_once_per_process_is_eager_references_alone() -> None:
    emitted = []

    @program("warns_once")
    def warns_once(device: torch.device) -> ProgramRun:
        x = torch.randn(3, device=device, requires_grad=True)

        def hook(g):
            if not emitted:  # as C++ TORCH_WARN_ONCE: the process's first backward only
                emitted.append(True)
                warnings.warn("first time only", UserWarning, stacklevel=1)

        y = x.exp()
        y.register_hook(hook)
        return ProgramRun(leaves=[x], outputs=[y.sum()])

    report = harness.run_differential(warns_once, [EagerSubject("later")], "cpu")
    assert report.outcome("later").status is Status.EQUAL, report.summary()


def test_compare_warnings_counts_category_and_message_not_place() -> None:
    a = WarningRecord("UserWarning", "m", "x.py:1")
    assert compare_warnings([a, a], [a._replace(origin="<eval_with_key>.3:9"), a]) == []
    (m,) = compare_warnings([a, a], [a], at="step 2/3: ")
    assert m.where == "step 2/3: warnings" and "1 time(s); eager's emitted it 2 time(s)" in m.detail
    (m,) = compare_warnings([a], [a._replace(category="DeprecationWarning")])
    assert "UserWarning 'm'" in m.detail


def test_recording_leaves_the_filters_as_they_were() -> None:
    before = list(warnings.filters)
    with recording() as seen:
        warnings.warn("inside", UserWarning, stacklevel=1)
        warnings.warn("inside", UserWarning, stacklevel=1)
    assert [r.message for r in seen] == ["inside", "inside"] and warnings.filters == before


@pytest.mark.parametrize("subject", ["cagrad[eager]", "cagrad[aot_eager]"])
@pytest.mark.parametrize("prog", [warning_program, softmax_hook_program], ids=lambda p: p.name)
def test_cagrad_emits_eagers_warnings_on_a_capture_and_on_a_hit(subject: str, prog: harness.Program) -> None:
    report = harness.run_differential(prog, [subject], "cpu")
    assert report.outcome(subject).status is Status.EQUAL, report.summary()
    reference = execute(EagerSubject(), prog, torch.device("cpu"), 0)
    assert reference.warnings, "the program warns in eager"
    s = make_subject(subject)
    s.prepare()
    capture = execute(s, prog, torch.device("cpu"), 0)
    hit = execute(s, prog, torch.device("cpu"), 0, reset=False)
    assert capture.counts["captures"] == 1 and hit.counts["cache_hits"] == 1
    want = [(r.category, r.message) for r in reference.warnings]
    assert [(r.category, r.message) for r in capture.warnings] == want
    assert [(r.category, r.message) for r in hit.warnings] == want


def test_a_peers_compiler_warnings_are_left_out_and_cagrads_are_not() -> None:
    # the TorchScript deprecation torch's compiled autograd emits while
    # Inductor compiles, attributed to torch/jit/_script.py
    notice = WarningRecord("DeprecationWarning", "`torch.jit.script_method` is deprecated.", "_script.py:365", True)
    hook = WarningRecord("UserWarning", "hook saw a gradient", "x.py:3")
    assert compare_warnings([hook], [notice, hook], peer=True) == []
    (m,) = compare_warnings([hook], [notice, hook], peer=False)
    assert "`torch.jit.script_method` is deprecated." in m.detail
    # a peer's lost warning of the program's still counts
    assert compare_warnings([hook], [notice], peer=True) != []
    with recording() as seen:
        warnings.warn_explicit("from jit", UserWarning, filename=os.path.join("x", "torch", "jit", "_script.py"), lineno=1)
        warnings.warn("from a test", UserWarning, stacklevel=1)
    assert [r.compiler for r in seen] == [True, False]
