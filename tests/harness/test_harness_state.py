"""The oracle compares the process state each subject's backward leaves with
eager's (issue 36): a random stream one draw ahead, a config left changed,
is a ``mismatch`` at ``state <field>``; a subject that leaves the state as
eager does is not blamed for what an earlier one leaked."""

from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import harness
from harness import EagerSubject, Status, examples, global_state
from harness.program import ProgramRun, program, run_backward

PLANTED = runpy.run_path(str(Path(__file__).resolve().parents[1] / "fuzz" / "broken_subject.py"))


@program("exp_sum")
def exp_program(device: torch.device) -> ProgramRun:
    x = torch.rand(3, 4, device=device, requires_grad=True)
    return ProgramRun(leaves=[x], outputs=[x.exp().sum()])


@program("checkpoint_dropout")
def checkpoint_dropout(device: torch.device) -> ProgramRun:
    w = torch.rand(4, 4, dtype=torch.float64, device=device, requires_grad=True)
    x = torch.rand(3, 4, dtype=torch.float64, device=device)

    def block(h: torch.Tensor) -> torch.Tensor:
        return F.dropout(h @ w, 0.5, training=True).sin()

    return ProgramRun(leaves=[w], outputs=[checkpoint(block, x, use_reentrant=False).sum()])


@program("hook_draws")
def hook_draws(device: torch.device) -> ProgramRun:
    # a user hook that draws during the backward: the stream must advance as in eager
    w = torch.rand(4, 4, dtype=torch.float64, device=device, requires_grad=True)
    y = torch.rand(3, 4, dtype=torch.float64, device=device) @ w
    y.register_hook(lambda g: g * torch.rand_like(g))
    return ProgramRun(leaves=[w], outputs=[y.cos().sum()])


class LeaksConfig(EagerSubject):
    """Test-only: eager backward, then ``torch._dynamo.config.recompile_limit``
    raised by one and left so."""

    def __init__(self) -> None:
        super().__init__("leaks_config")

    def run(self, run):
        result = run_backward(run)
        torch._dynamo.config.recompile_limit += 1
        return result


def test_a_subject_that_draws_is_a_state_mismatch_at_cpu_rng() -> None:
    report = harness.run_differential(exp_program, [PLANTED["DrawsOnExp"](), "cagrad[eager]"], devices="cpu")
    bad = report.outcome("draws[exp]")
    assert bad.status is Status.MISMATCH
    assert [m.where for m in bad.mismatches] == ["state cpu_rng"]
    assert bad.mismatch.max_abs is None and "eager's left it at" in bad.mismatch.detail
    assert report.outcome("cagrad[eager]").status is Status.EQUAL
    # where it does not draw (no ExpBackward0), nothing differs
    other = harness.run_differential(examples.mlp_program(), [PLANTED["DrawsOnExp"]()], devices="cpu")
    assert other.ok


def test_cagrad_drawing_in_its_own_work_is_caught() -> None:
    report = harness.run_differential(examples.mlp_program(), [PLANTED["CagradDrawsOnCapture"]()], devices="cpu")
    outcome = report.outcomes[0]
    assert outcome.status is Status.MISMATCH
    assert [m.where for m in outcome.mismatches] == ["state cpu_rng"]


def test_a_leaked_config_is_blamed_on_the_subject_that_leaked_it() -> None:
    limit = torch._dynamo.config.recompile_limit
    try:
        report = harness.run_differential(examples.mlp_program(), [LeaksConfig(), "cagrad[eager]"], devices="cpu")
    finally:
        torch._dynamo.config.recompile_limit = limit
    leaked = report.outcome("leaks_config")
    assert [m.where for m in leaked.mismatches] == ["state dynamo_config"]
    assert "recompile_limit" in leaked.mismatch.detail
    assert report.outcome("cagrad[eager]").status is Status.EQUAL


@pytest.mark.parametrize("prog", [checkpoint_dropout, hook_draws, examples.hooks_program()], ids=lambda p: p.name)
def test_every_subject_leaves_the_state_eager_leaves(prog) -> None:
    report = harness.run_differential(prog, ["cagrad[eager]", "cagrad[aot_eager]", "torch_ca[eager]"], devices="cpu")
    assert report.ok, report.summary()


def test_a_many_step_subject_names_the_step_that_drew() -> None:
    class DrawsOnSecondStep(EagerSubject):
        steps = 3

        def __init__(self) -> None:
            super().__init__("draws_on_step_2")
            self.calls = 0

        def reset(self) -> None:
            self.calls = 0

        def run(self, run):
            self.calls += 1
            result = run_backward(run)
            if self.calls == 2:
                torch.rand(())
            return result

    report = harness.run_differential(examples.mlp_program(), [DrawsOnSecondStep()], devices="cpu")
    assert [m.where for m in report.outcomes[0].mismatches] == ["step 2/3: state cpu_rng"]


def test_left_differently_expects_eagers_change_and_otherwise_the_start() -> None:
    def state(**values):
        return global_state.GlobalState(values)

    eager_before, eager_after = state(cpu_rng="a", grad_enabled=True), state(cpu_rng="b", grad_enabled=True)
    # eager advanced the stream, left grad mode: the subject must do the same
    assert global_state.left_differently(eager_before, eager_after, state(cpu_rng="a", grad_enabled=False),
                                         state(cpu_rng="b", grad_enabled=False)) == []  # fmt: skip
    diffs = global_state.left_differently(eager_before, eager_after, state(cpu_rng="a", grad_enabled=True),
                                          state(cpu_rng="c", grad_enabled=False))  # fmt: skip
    assert [(d.field, d.expected, d.actual) for d in diffs] == [("cpu_rng", "b", "c"), ("grad_enabled", True, False)]


def test_a_config_is_read_only_once_its_module_is_imported(monkeypatch) -> None:
    # importing torch._dynamo takes seconds: a read must not do it (a fuzz
    # worker times each program), and a module imported between two reads
    # is no difference
    monkeypatch.delitem(__import__("sys").modules, "torch._inductor.config")
    unread = global_state.capture()
    assert unread.values["inductor_config"] is None
    monkeypatch.undo()
    read = global_state.capture()
    assert read.values["inductor_config"] is not None
    assert unread.diff(read) == [] and read.diff(unread) == []


def test_equal_sets_in_another_order_are_no_difference(monkeypatch) -> None:
    # 0 and 8 share a slot of a small set's table: which comes first in
    # iteration depends on insertion order, so the two reprs differ
    first, second = set(), set()
    first.add(0), first.add(8)
    second.add(8), second.add(0)
    assert first == second and repr(first) != repr(second)
    configs = iter([{"names": first}, {"names": second}])
    fake = types.ModuleType("fake_config_for_global_state")
    fake.get_config_copy = lambda: next(configs)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    read = global_state._config(fake.__name__)
    a = global_state.GlobalState({"fake_config": read()})
    b = global_state.GlobalState({"fake_config": read()})
    assert a.diff(b) == []


def test_a_changed_set_is_a_difference(monkeypatch) -> None:
    configs = iter([{"names": {0, 8}}, {"names": {0, 9}}])
    fake = types.ModuleType("fake_config_for_global_state")
    fake.get_config_copy = lambda: next(configs)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    read = global_state._config(fake.__name__)
    diff = global_state.GlobalState({"fake_config": read()}).diff(global_state.GlobalState({"fake_config": read()}))
    assert [d.field for d in diff] == ["fake_config"]
