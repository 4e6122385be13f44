"""Programs on which every correct subject must agree with eager autograd."""

from __future__ import annotations

import json

import pytest
import torch

import harness
from harness import Status, examples
from harness.program import ProgramRun, program

# torch's compiled autograd, a peer implementation: it must agree on these
# simple programs, which checks the harness end to end without cagrad.
TORCH_CA = ["eager", "torch_ca[eager]", "torch_ca[aot_eager]"]
CAGRAD = ["cagrad[eager]", "cagrad[aot_eager]"]


def _assert_all_equal(report: harness.DifferentialReport, allowed=(Status.EQUAL,)) -> None:
    assert report.outcomes, "no outcomes"
    for o in report.outcomes:
        assert o.status in allowed, f"{o.subject} on {o.device}: {o.status} {o.describe()}\n{report.summary()}"
    assert report.ok


@pytest.mark.parametrize("mode", ["backward", "grad"])
def test_mlp_agrees_under_torch_compiled_autograd(mode, cuda_ready_for_torch_ca):
    report = harness.run_differential(examples.mlp_program(mode), TORCH_CA, devices="cpu")
    _assert_all_equal(report)
    assert [o.subject for o in report.outcomes] == TORCH_CA
    assert report.devices == ["cpu"]
    # eager runs nothing compiled; torch CA traced one graph per backward.
    assert report.outcome("eager").counts == {}
    assert report.outcome("torch_ca[eager]").captures == 1
    assert report.outcome("torch_ca[eager]").recompiles == 0
    assert report.eager_errors == {}


@pytest.mark.parametrize("mode", ["backward", "grad"])
def test_mlp_agrees_under_cagrad(mode):
    report = harness.run_differential(examples.mlp_program(mode), CAGRAD, devices="cpu")
    _assert_all_equal(report)
    for name in CAGRAD:
        o = report.outcome(name)
        assert o.captures == 1, o.counts
        assert o.fallbacks == 0, o.counts


def test_default_subjects_agree_on_mlp():
    report = harness.run_differential(examples.mlp_program("backward", torch.float64), devices="cpu")
    assert [o.subject for o in report.outcomes] == ["cagrad[eager]", "cagrad[aot_eager]", "torch_ca[eager]"]
    _assert_all_equal(report)


@pytest.mark.parametrize("mode", ["backward", "grad"])
def test_hook_traces_agree(mode):
    report = harness.run_differential(examples.hooks_program(mode), TORCH_CA, devices="cpu")
    _assert_all_equal(report)
    # the reference really recorded tensors: re-run eager and look at the trace.
    ex = harness.execute(harness.EagerSubject(), examples.hooks_program(mode), torch.device("cpu"))
    tags = [t for t, _ in ex.trace]
    assert tags == (["mid", "b.post_acc", "a"] if mode == "backward" else ["mid", "a"])


@pytest.mark.parametrize("mode", ["backward", "grad"])
def test_hook_programs_under_cagrad_are_equal_or_honest_fallbacks(mode):
    report = harness.run_differential(examples.hooks_program(mode), CAGRAD, devices="cpu")
    _assert_all_equal(report, allowed=(Status.EQUAL, Status.FALLBACK))
    for o in report.outcomes:
        if o.status is Status.FALLBACK:
            assert o.fallback_reasons and o.fallbacks == sum(o.fallback_reasons.values()) == 1
        else:
            assert o.captures == 1


def test_static_and_dynamic_variants_run():
    names = ["cagrad[eager,static]", "cagrad[aot_eager,dynamic]", "torch_ca[eager,static]", "torch_ca[eager,dynamic]"]
    report = harness.run_differential(examples.mlp_program("backward"), names, devices="cpu")
    assert [o.subject for o in report.outcomes] == names
    _assert_all_equal(report)


@pytest.mark.parametrize("mode", ["backward", "grad"])
def test_none_grad_leaf_matches_none(mode):
    prog = examples.unused_leaf_program(mode)
    ex = harness.execute(harness.EagerSubject(), prog, torch.device("cpu"))
    assert ex.error is None
    if mode == "backward":
        assert ex.leaf_grads[0] is not None and ex.leaf_grads[1] is None and ex.leaf_grads[2] is None
    else:
        assert ex.grad_results[0] is not None and ex.grad_results[1] is None
        assert all(g is None for g in ex.leaf_grads)  # autograd.grad leaves .grad alone
    report = harness.run_differential(prog, TORCH_CA + CAGRAD, devices="cpu")
    _assert_all_equal(report)


def test_unseeded_program_builds_identically_and_caller_rng_is_untouched():
    @program("unseeded")
    def build(device):
        w = torch.randn(6, device=device, requires_grad=True)  # no manual_seed here
        return ProgramRun(leaves=[w], outputs=[(w * w).sum()])

    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    report = harness.run_differential(build, ["eager", "torch_ca[eager]"], devices="cpu")
    assert torch.equal(torch.rand(3), expected_next)
    _assert_all_equal(report)
    a = harness.execute(harness.EagerSubject(), build, torch.device("cpu"), seed=7)
    b = harness.execute(harness.EagerSubject(), build, torch.device("cpu"), seed=7)
    c = harness.execute(harness.EagerSubject(), build, torch.device("cpu"), seed=8)
    assert torch.equal(a.leaf_grads[0], b.leaf_grads[0])
    assert not torch.equal(a.leaf_grads[0], c.leaf_grads[0])


def test_report_json_and_summary():
    report = harness.run_differential(examples.mlp_program("grad"), ["eager", "torch_ca[eager]"], devices="cpu")
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert data["program"] == "mlp[grad,float32]"
    assert data["ok"] is True
    assert [(o["subject"], o["device"], o["status"]) for o in data["outcomes"]] == [
        ("eager", "cpu", "equal"),
        ("torch_ca[eager]", "cpu", "equal"),
    ]
    assert data["outcomes"][1]["counts"]["captures"] == 1
    text = report.summary()
    assert "torch_ca[eager]" in text and "equal" in text and "mlp[grad,float32]: OK" in text
