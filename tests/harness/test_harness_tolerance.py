"""The tolerance policy picks numbers per dtype and backend, and the oracle
applies them: a perturbation that float32 absorbs is a float64 mismatch."""

from __future__ import annotations

import pytest
import torch

import harness
from harness import EagerSubject, Status, examples
from harness.program import CallableProgram, ProgramRun, run_backward
from harness.tolerance import Tolerance, python_float_tolerance, tolerance_for


def test_same_kernel_numbers_are_torch_testing_defaults():
    assert (tolerance_for(torch.float64, None).rtol, tolerance_for(torch.float64, None).atol) == (1e-7, 1e-7)
    assert (tolerance_for(torch.float32, "eager").rtol, tolerance_for(torch.float32, "eager").atol) == (1.3e-6, 1e-5)
    assert tolerance_for(torch.float16, "aot_eager").rtol == 1e-3
    assert tolerance_for(torch.bfloat16, "aot_eager").rtol == 1.6e-2
    assert not tolerance_for(torch.float32, "eager", "cpu").scale_atol


def test_tolerance_grows_with_lower_precision():
    for backend in (None, "aot_eager", "inductor"):
        rtols = [tolerance_for(dt, backend).rtol for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16)]
        assert rtols == sorted(rtols) and len(set(rtols)) == 4, (backend, rtols)


def test_fusing_backends_are_looser_and_scale_atol():
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        same, fused = tolerance_for(dt, "aot_eager"), tolerance_for(dt, "inductor")
        assert fused.rtol > same.rtol and fused.atol >= same.atol
        assert fused.scale_atol
    assert tolerance_for(torch.float32, "inductor").rtol == 1e-4
    # an unknown backend is assumed to fuse
    assert tolerance_for(torch.float32, "my_backend") == tolerance_for(torch.float32, "inductor")
    # cuda scales atol even for same-kernel backends (atomics reorder sums)
    assert tolerance_for(torch.float32, "eager", "cuda").scale_atol


def test_complex_integer_and_python_float_policies():
    assert tolerance_for(torch.complex128, None).rtol == tolerance_for(torch.float64, None).rtol
    assert tolerance_for(torch.complex64, "inductor").rtol == tolerance_for(torch.float32, "inductor").rtol
    exact = tolerance_for(torch.int64, "inductor")
    assert (exact.rtol, exact.atol) == (0.0, 0.0)
    assert tolerance_for(torch.bool, None).atol == 0.0
    assert python_float_tolerance("eager") == tolerance_for(torch.float32, "eager")


def test_scaled_atol():
    tol = Tolerance(1e-4, 1e-5, scale_atol=True)
    assert tol.atol_for(torch.tensor([0.5, -0.25])) == pytest.approx(1e-5)
    assert tol.atol_for(torch.tensor([100.0, float("inf"), float("nan")])) == pytest.approx(1e-3)
    assert Tolerance(1e-4, 1e-5).atol_for(torch.tensor([100.0])) == pytest.approx(1e-5)


class ScaleGrads(EagerSubject):
    """Test-only: multiplies every leaf .grad by ``1 + rel``."""

    def __init__(self, rel: float) -> None:
        super().__init__(f"scale[{rel}]")
        self.rel = rel

    def run(self, run):
        run_backward(run)
        with torch.no_grad():
            for leaf in run.leaves:
                if leaf.grad is not None:
                    leaf.grad.mul_(1 + self.rel)


@pytest.mark.parametrize(
    ("dtype", "status"),
    [(torch.float32, Status.EQUAL), (torch.float64, Status.MISMATCH)],
)
def test_relative_error_of_5e_7_passes_float32_and_fails_float64(dtype, status):
    # 5e-7 relative: inside float32's rtol 1.3e-6, outside float64's 1e-7.
    report = harness.run_differential(examples.mlp_program("backward", dtype), [ScaleGrads(5e-7)], devices="cpu")
    o = report.outcomes[0]
    assert o.status is status, o.describe()
    if status is Status.MISMATCH:
        assert o.mismatch.rtol == 1e-7
        assert o.mismatch.max_rel == pytest.approx(5e-7, rel=1e-3)


def test_custom_policy_is_applied():
    def strict(dtype, backend, device_type):
        return Tolerance(0.0, 0.0)

    prog = examples.mlp_program("backward", torch.float32)
    assert harness.run_differential(prog, [ScaleGrads(5e-7)], devices="cpu").ok
    report = harness.run_differential(prog, [ScaleGrads(5e-7)], devices="cpu", policy=strict)
    assert report.outcomes[0].status is Status.MISMATCH


def _mixed(leaf_dtype: torch.dtype) -> CallableProgram:
    """``prod(a + b)`` with ``a`` float32 [4] and ``b`` a 0-d leaf of
    ``leaf_dtype``: ``b``'s grad is a float32 sum cast to ``leaf_dtype``."""

    def build(device: torch.device) -> ProgramRun:
        g = torch.Generator().manual_seed(0)
        a = torch.rand(4, generator=g).to(device).requires_grad_()
        b = torch.rand((), generator=g, dtype=leaf_dtype).to(device).requires_grad_()
        return ProgramRun(leaves=[a, b], outputs=[torch.prod(a + b, 0)])

    return CallableProgram(f"mixed[{leaf_dtype}]", build)


def test_a_float64_leaf_fed_by_float32_values_is_judged_at_float32():
    # found by a fuzz campaign: cagrad's ProdBackward1 (the formula that is
    # safe with zeros, as torch's compiled autograd traces it too) rounds
    # differently from eager's grad * (result / input) by a few float32 ulps,
    # which then reach a float64 leaf through the float32 add
    report = harness.run_differential(_mixed(torch.float64), [ScaleGrads(5e-7)], devices="cpu")
    assert report.ok, report.summary()
    # the same error on an all-float64 program is a mismatch at 1e-7
    report = harness.run_differential(examples.mlp_program("backward", torch.float64), [ScaleGrads(5e-7)], "cpu")
    assert report.outcomes[0].status is Status.MISMATCH and report.outcomes[0].mismatch.rtol == 1e-7
