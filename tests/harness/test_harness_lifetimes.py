"""The ``lifetime`` comparison (harness/lifetimes.py, on unless
CAGRAD_FUZZ_LIFETIMES=0): which storages of a program's forward a backward
leaves alive, against eager's."""

from __future__ import annotations

import pytest
import torch

import harness
from fuzz.signature import root_cause
from harness.lifetimes import ENV, ForwardStorages, Lifetimes, compare_lifetimes
from harness.program import CallableProgram, ProgramRun
from harness.subjects import make_subject
from tests.fuzz.broken_subject import KeepsSavedTensors


def _saves_an_activation() -> CallableProgram:
    """sin then a square: MulBackward0 saves sin's output, which only the
    graph holds."""

    def build(device: torch.device) -> ProgramRun:
        x = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
        h = x.sin()
        return ProgramRun(leaves=[x], outputs=[(h * h).sum()])

    return CallableProgram("saves-an-activation", build)


def test_eager_frees_the_saved_activation_at_the_end_of_the_backward() -> None:
    storages = ForwardStorages()
    with storages:
        x = torch.randn(3, dtype=torch.float64).requires_grad_()
        loss = (x.sin() * x.sin()).sum()
    before = storages.alive()
    loss.backward()
    after = storages.alive()
    # derived from eager's rules: the sin outputs are saved by MulBackward0
    # (self and other) and released by the backward; mul's output is freed
    # at once (SumBackward0 saves sizes only); the leaf and the loss are
    # held here
    assert [label.split(" ", 2)[2] for label in before] == [
        "aten.randn.default", "aten.sin.default", "aten.sin.default", "aten.sum.default",
    ]  # fmt: skip
    assert [label.split(" ", 2)[2] for label in after] == ["aten.randn.default", "aten.sum.default"]


@pytest.mark.parametrize(("value", "found"), [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_on_unless_switched_off(monkeypatch, value, found) -> None:
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    report = harness.run_differential(_saves_an_activation(), [KeepsSavedTensors()], ["cpu"])
    assert report.ok is not found, report.summary()


def test_a_peer_records_none(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    peer = harness.execute(make_subject("torch_ca[eager]"), _saves_an_activation(), torch.device("cpu"))
    assert peer.error is None and peer.lifetimes is None
    own = harness.execute(make_subject("cagrad[eager]"), _saves_an_activation(), torch.device("cpu"))
    assert own.error is None and own.lifetimes is not None and own.lifetimes.after_backward


@pytest.mark.parametrize("subject", ["cagrad[eager]", "cagrad[aot_eager]"])
def test_cagrad_leaves_eagers_lifetimes(subject: str, monkeypatch) -> None:
    monkeypatch.setenv(ENV, "1")
    report = harness.run_differential(_saves_an_activation(), [subject], ["cpu"])
    assert report.ok, report.summary()


def test_a_subject_that_keeps_saved_tensors_is_found(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "1")
    report = harness.run_differential(_saves_an_activation(), [KeepsSavedTensors()], ["cpu"])
    (outcome,) = report.outcomes
    assert outcome.status is harness.Status.MISMATCH
    (m,) = outcome.mismatches
    assert m.where == "lifetime"
    assert m.detail.startswith("forward storages alive right after the backward where eager freed them: ")
    assert "aten.sin.default" in m.detail and "aten.randn" not in m.detail
    cause = root_cause(outcome.to_json())
    assert cause == "lifetime: forward storages alive right after the backward where eager freed them"


def test_the_first_differing_point_is_named() -> None:
    eager = Lifetimes(("op 0 a",), (), ())
    leaky = Lifetimes(("op 0 a", "op 1 b"), ("op 1 b",), ("op 1 b",))
    cyclic = Lifetimes(("op 0 a",), ("op 1 b",), ())
    early = Lifetimes((), (), ())
    assert "cyclic collector ran" in compare_lifetimes(eager, leaky)[0].detail
    assert "reference cycle" in compare_lifetimes(eager, cyclic)[0].detail
    assert compare_lifetimes(eager, early)[0].detail.startswith("forward storages freed right after the backward")
    # freeing what eager leaks, once the program let go, is no fault
    assert compare_lifetimes(leaky, Lifetimes(("op 0 a", "op 1 b"), (), ())) == []
    assert compare_lifetimes(None, leaky) == []
