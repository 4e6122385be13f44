"""Broken subjects must be caught: mismatches named and measured, errors
recorded, eager's errors expected from every subject, no leaks between runs."""

from __future__ import annotations

import json

import pytest
import torch

import harness
from harness import EagerSubject, Status, examples
from harness.program import ProgramRun, program, run_backward


class CorruptLeafGrad(EagerSubject):
    """Test-only: eager backward, then adds ``delta`` to ``leaf[index].grad[0, 0]``."""

    def __init__(self, index: int, delta: float, name: str = "corrupt_leaf") -> None:
        super().__init__(name)
        self.index, self.delta = index, delta

    def run(self, run):
        result = run_backward(run)
        with torch.no_grad():
            run.leaves[self.index].grad.view(-1)[0] += self.delta
        return result


class CorruptGradResult(EagerSubject):
    """Test-only: multiplies ``autograd.grad`` result ``index`` by ``factor``."""

    def __init__(self, index: int, factor: float) -> None:
        super().__init__("corrupt_result")
        self.index, self.factor = index, factor

    def run(self, run):
        result = list(run_backward(run))
        result[self.index] = result[self.index] * self.factor
        return tuple(result)


class Raises(EagerSubject):
    """Test-only: raises ``exc`` instead of running the backward."""

    def __init__(self, exc: BaseException, name: str = "raises") -> None:
        super().__init__(name)
        self.exc = exc

    def run(self, run):
        raise self.exc


class RetainsGraph(EagerSubject):
    """Test-only: silently turns on ``retain_graph``, so a second backward
    that eager rejects succeeds."""

    def __init__(self) -> None:
        super().__init__("retains_graph")

    def run(self, run):
        run.retain_graph = True
        return run_backward(run)


class CorruptOneStep(CorruptLeafGrad):
    """Test-only: runs each program ``steps`` times (as the CUDA-graph
    subject does) and corrupts only step ``bad`` (1-based)."""

    def __init__(self, steps: int, bad: int) -> None:
        super().__init__(0, 0.25, "corrupt_one_step")
        self.steps, self.bad, self.calls = steps, bad, 0

    def reset(self) -> None:
        self.calls = 0

    def run(self, run):
        self.calls += 1
        if self.calls == self.bad:
            return super().run(run)
        return run_backward(run)


@pytest.mark.parametrize("bad", [1, 2, 3])
def test_a_wrong_step_of_a_many_step_subject_is_a_mismatch_naming_the_step(bad):
    """A CUDA graph's warm-up, recording and replays are each compared with
    eager: a wrong gradient in any one step fails the run, not only in the
    last, and the mismatch says which step."""
    report = harness.run_differential(examples.mlp_program("backward"), [CorruptOneStep(3, bad)], devices="cpu")
    bad_outcome = report.outcome("corrupt_one_step")
    assert bad_outcome.status is Status.MISMATCH
    assert [m.where for m in bad_outcome.mismatches] == [f"step {bad}/3: leaf 0 .grad"]
    assert bad_outcome.mismatch.max_abs == pytest.approx(0.25, rel=1e-6)


def test_corrupted_grad_is_a_mismatch_naming_the_leaf_with_numbers():
    prog = examples.mlp_program("backward")
    ref = harness.execute(EagerSubject(), prog, torch.device("cpu"))
    expected = float(ref.leaf_grads[1][0])  # b1.grad[0]
    report = harness.run_differential(prog, [CorruptLeafGrad(1, 0.5), "eager"], devices="cpu")
    bad = report.outcome("corrupt_leaf")
    assert bad.status is Status.MISMATCH
    assert len(bad.mismatches) == 1
    m = bad.mismatch
    assert m.where == "leaf 1 .grad"
    assert m.max_abs == pytest.approx(0.5, rel=1e-6)
    assert m.max_rel == pytest.approx(0.5 / abs(expected), rel=1e-5)
    assert m.rtol == pytest.approx(1.3e-6) and m.atol == pytest.approx(1e-5)  # float32 same-kernel policy
    assert "leaf 1 .grad" in bad.describe()
    # the broken subject did not poison the next one
    assert report.outcome("eager").status is Status.EQUAL
    assert not report.ok
    assert report.failures() == [bad]
    assert "mismatch" in report.summary() and "FAILED" in report.summary()
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert data["ok"] is False
    assert data["outcomes"][0]["mismatches"][0]["where"] == "leaf 1 .grad"


def test_corrupted_grad_result_is_named_in_grad_mode():
    report = harness.run_differential(examples.mlp_program("grad"), [CorruptGradResult(2, 1.5)], devices="cpu")
    o = report.outcomes[0]
    assert o.status is Status.MISMATCH
    assert [m.where for m in o.mismatches] == ["grad result 2"]
    assert o.mismatch.max_rel == pytest.approx(0.5, rel=1e-5)


def test_grad_for_a_none_leaf_is_a_mismatch():
    class FillsUnused(EagerSubject):
        def run(self, run):
            run_backward(run)
            run.leaves[1].grad = torch.zeros_like(run.leaves[1])

    report = harness.run_differential(examples.unused_leaf_program("backward"), [FillsUnused("fills")], devices="cpu")
    o = report.outcomes[0]
    assert o.status is Status.MISMATCH
    assert o.mismatch.where == "leaf 1 .grad"
    assert o.mismatch.max_abs is None
    assert "eager has None" in o.mismatch.detail


def test_corrupted_trace_is_named():
    class DoublesTrace(EagerSubject):
        def run(self, run):
            run_backward(run)
            tag, g = run.trace[1]
            run.trace[1] = (tag, g * 2)
            run.trace.append(("extra", None))

    report = harness.run_differential(examples.hooks_program("backward"), [DoublesTrace("doubles")], devices="cpu")
    o = report.outcomes[0]
    assert o.status is Status.MISMATCH
    assert [m.where for m in o.mismatches] == ["trace length", "trace[1][1]"]
    assert o.mismatches[1].max_rel == pytest.approx(1.0)


def test_raising_subject_is_an_error_and_does_not_break_the_next_subjects():
    report = harness.run_differential(
        examples.mlp_program("backward"),
        [Raises(ValueError("boom from test")), "torch_ca[eager]", "eager"],
        devices="cpu",
    )
    err = report.outcome("raises")
    assert err.status is Status.ERROR
    assert err.error.type == "ValueError"
    assert err.error.message == "boom from test"
    assert "Traceback" in err.error.traceback and "boom from test" in err.error.traceback
    assert err.eager_error is None
    assert report.outcome("torch_ca[eager]").status is Status.EQUAL
    assert report.outcome("eager").status is Status.EQUAL
    assert not report.ok


def test_eager_error_expected_from_every_subject():
    prog = examples.backward_twice_program(retain_graph=None)  # 2nd backward raises in eager
    report = harness.run_differential(
        prog,
        ["eager", "torch_ca[eager]", RetainsGraph(), Raises(TypeError("wrong kind"), "raises_type")],
        devices="cpu",
    )
    assert report.eager_errors["cpu"].type == "RuntimeError"
    assert "backward through the graph a second time" in report.eager_errors["cpu"].message
    for name in ("eager", "torch_ca[eager]"):
        o = report.outcome(name)
        assert o.status is Status.EQUAL, o.describe()
        assert o.error.type == "RuntimeError" and o.eager_error.type == "RuntimeError"
    succeeded = report.outcome("retains_graph")
    assert succeeded.status is Status.MISMATCH
    assert succeeded.mismatch.where == "exception"
    other = report.outcome("raises_type")
    assert other.status is Status.ERROR
    assert other.error.type == "TypeError" and other.eager_error.type == "RuntimeError"


def test_cagrad_raises_eagers_error_on_second_backward():
    report = harness.run_differential(
        examples.backward_twice_program(retain_graph=None), ["cagrad[eager]", "cagrad[aot_eager]"], devices="cpu"
    )
    for o in report.outcomes:
        assert o.status is Status.EQUAL, f"{o.subject}: {o.describe()}"
        assert o.error is not None and o.error.type == "RuntimeError"


def test_retained_double_backward_accumulates_equally():
    report = harness.run_differential(
        examples.backward_twice_program(retain_graph=True), ["eager", "torch_ca[eager]"], devices="cpu"
    )
    assert report.ok and all(o.status is Status.EQUAL for o in report.outcomes)


def test_broken_program_build_raises_program_build_error():
    @program("broken")
    def build(device):
        raise KeyError("no such tensor")

    with pytest.raises(harness.ProgramBuildError, match="no such tensor"):
        harness.run_differential(build, ["eager"], devices="cpu")


def test_fallback_outcome_reports_reasons():
    class FakeFallback(EagerSubject):
        """Test-only: pretends one backward fell back (a cagrad-like counter)."""

        def __init__(self):
            super().__init__("fake_fallback")
            self.n = 0

        def counters(self):
            return {"fallbacks": self.n, "captures": 0, "fallback_reasons": {"custom_function": self.n}}

        def run(self, run):
            self.n += 1
            return run_backward(run)

    report = harness.run_differential(examples.mlp_program(), [FakeFallback()], devices="cpu")
    o = report.outcomes[0]
    assert o.status is Status.FALLBACK
    assert o.fallback_reasons == {"custom_function": 1}
    assert o.fallbacks == 1 and o.captures == 0
    assert report.ok  # a fallback is honest: eager's own grads
    assert "custom_function x1" in o.describe()


def test_unknown_program_mode_errors_are_type_checked():
    @program("grad_without_inputs")
    def build(device):
        w = torch.ones(2, device=device, requires_grad=True)
        return ProgramRun(leaves=[w], outputs=[w.sum()], mode="grad", inputs=None)

    report = harness.run_differential(build, ["eager"], devices="cpu")
    assert report.eager_errors["cpu"].type == "ValueError"
    assert report.outcomes[0].status is Status.EQUAL


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


@program("custom_function")
def _custom_function_program(device):
    a = torch.randn(4, device=device, requires_grad=True)
    return ProgramRun(leaves=[a], outputs=[_Square.apply(a).sin().sum()])


def test_cagrad_fallback_or_capture_is_reported_consistently():
    # Whether cagrad compiles custom autograd.Functions or falls back, the
    # outcome must be honest: equal grads, and a fallback carries its reasons.
    report = harness.run_differential(_custom_function_program, ["cagrad[eager]", "torch_ca[eager]"], devices="cpu")
    assert report.ok, report.summary()
    o = report.outcome("cagrad[eager]")
    assert o.status in (Status.EQUAL, Status.FALLBACK)
    assert o.captures + o.fallbacks == 1, o.counts
    if o.status is Status.FALLBACK:
        assert o.fallbacks == sum(o.fallback_reasons.values()) == 1
    else:
        assert o.fallback_reasons == {}
    assert report.outcome("torch_ca[eager]").status is Status.EQUAL


@program("modified_saved_tensor")
def _modified_saved_tensor_program(device):
    a = torch.randn(4, device=device, requires_grad=True)
    b = a * 1
    c = b.sin()  # saves b
    b.add_(1)  # ... which is then modified in place
    return ProgramRun(leaves=[a], outputs=[c.sum()])


def test_modified_saved_tensor_error_parity():
    report = harness.run_differential(
        _modified_saved_tensor_program, ["torch_ca[eager]", "cagrad[eager]", "cagrad[aot_eager]"], devices="cpu"
    )
    assert "modified by an inplace operation" in report.eager_errors["cpu"].message
    for o in report.outcomes:
        assert o.status is Status.EQUAL, f"{o.subject}: {o.describe()}"
        assert o.error.type == "RuntimeError"
