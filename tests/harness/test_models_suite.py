"""The models suite (harness/models): a CI-sized subset of its rows must
match eager autograd, and its judge must catch what it is there to catch.

The library rows run each in a spawned process, as ``python -m harness
models`` runs them: a process in which cagrad has not run a backward yet,
as a user's training script starts. They skip, with the reason, where the
library is not installed (``pip install -e '.[models]'``). The rest use a
plain-torch row defined here, in this process, and subjects that break one
thing each on purpose: every such test fails if the judge stops looking at
what the subject broke.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os

import pytest
import torch
from click.testing import CliRunner

from harness.__main__ import main
from harness.models import libraries, registry, run_models, run_row, run_row_isolated
from harness.models.outcome import RowOutcome, RowStatus
from harness.models.row import Setup
from harness.subjects import EagerSubject, make_subject

from .planted import KeepsWhatEagerFrees

#: The CI subset: one row per library, cheap on 2 cores, with the subjects
#: cheap for it (the rest run under ``tox -e models``): timm_convnext's
#: aot_eager compile alone took 41 s on the shared machine.
CI_ROWS = {
    "gpt2": ("cagrad[eager]", "cagrad[aot_eager]"),
    "tv_vit": ("cagrad[eager]", "cagrad[aot_eager]"),
    "timm_convnext": ("cagrad[eager]",),
}

_PARAMS: list[torch.nn.Parameter] = []


@registry.row("plain_mlp_dropout", "torch", "test row: Linear-Dropout-Tanh-Linear, float64, SGD; 3 steps")
def mlp_dropout_row(device: torch.device) -> Setup:
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).to(device=device, dtype=torch.float64)
    _PARAMS[:] = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss() -> torch.Tensor:
        x = torch.randn(5, 6, device=device, dtype=torch.float64)
        return model(x).pow(2).mean()

    return Setup(model, opt, loss)


# the same model, declared to compute in float32 inside (as LLaMA's RMSNorm does)
registry.row(
    "plain_mlp_float32_inside", "torch", "test row: plain_mlp_dropout, judged at float32", compute_dtype=torch.float32
)(mlp_dropout_row)


# the same model with gradient accumulation: 2 micro-batches, .grad zeroed in place
registry.row(
    "plain_mlp_accumulating",
    "torch",
    "test row: plain_mlp_dropout, 2 micro-batches per step, zero_grad(set_to_none=False)",
    micro_batches=2,
    set_to_none=False,
)(mlp_dropout_row)


@registry.row("plain_process_exits", "torch", "test row: its process exits with code 3 while building")
def process_exits_row(device: torch.device) -> Setup:
    os._exit(3)


@registry.row("plain_missing_library", "no_such_library_cagrad", "test row on a library that is not installed")
def missing_library_row(device: torch.device) -> Setup:
    raise AssertionError("a row whose library is missing must not be built")


class _Breaking(EagerSubject):
    """Plain eager autograd with one thing broken after each backward (eager,
    so that these tests judge the judge, whatever cagrad does)."""

    def __init__(self, name: str, after) -> None:
        super().__init__(name)
        self._after = after

    @contextlib.contextmanager
    def active(self):
        yield
        self._after()


def _scale_first_grad() -> None:
    _PARAMS[0].grad.mul_(1 + 1e-5)


def _transpose_first_grad() -> None:
    g = _PARAMS[0].grad
    _PARAMS[0].grad = g.t().contiguous().t()  # same values, column-major strides


def _replace_first_grad() -> None:
    _PARAMS[0].grad = _PARAMS[0].grad.clone()  # same values and strides, another tensor


def _draw_rng() -> None:
    torch.rand(1)


def _deterministic_on() -> None:
    torch.use_deterministic_algorithms(True)


def _grad_mode_off() -> None:
    torch.set_grad_enabled(False)


def _only(report_outcomes: list[RowOutcome]) -> RowOutcome:
    assert len(report_outcomes) == 1
    return report_outcomes[0]


@pytest.mark.parametrize("name", CI_ROWS)
def test_ci_row_matches_eager(name: str) -> None:
    row = registry.get(name)
    for library in row.libraries:
        if importlib.util.find_spec(libraries.LIBRARIES[library]) is None:
            pytest.skip(libraries.unavailable(library))
        # installed, it must import (torchvision on a CPU torch included:
        # harness.models.libraries.prepare_torchvision); a skip here would hide that
        assert libraries.unavailable(library) is None
    outcomes = run_row_isolated(row, [make_subject(s) for s in CI_ROWS[name]], torch.device("cpu"), timeout=600)
    assert [o.subject for o in outcomes] == list(CI_ROWS[name])
    for o in outcomes:
        assert o.status is RowStatus.MATCH, f"{o.row} / {o.subject}: {o.status.value}: {o.describe()}"
        # every step's backward went through cagrad: the graph does not
        # change between steps, so one capture, then hits, and no deopt
        assert o.counts["backwards"] == row.steps
        assert (o.counts["captures"], o.counts["cache_hits"]) == (1, row.steps - 1), o.counts
        assert o.counts["fallbacks"] == 0 and o.counts["deopts"] == 0, o.counts


def test_every_subject_in_a_fresh_process_matches() -> None:
    # a process per (row, subject): each cagrad subject runs the first
    # backward of its process, as a user's training script does
    report = run_models([registry.get("plain_mlp_dropout")], list(CI_ROWS["gpt2"]), per_subject=True, timeout=300)
    assert [o.subject for o in report.outcomes] == list(CI_ROWS["gpt2"])
    for o in report.outcomes:
        assert o.status is RowStatus.MATCH, f"{o.subject}: {o.describe()}"


def test_plain_row_matches_in_process() -> None:
    o = _only(run_row(registry.get("plain_mlp_dropout"), [make_subject("cagrad[eager]")], torch.device("cpu")))
    assert o.status is RowStatus.MATCH, o.describe()
    assert (o.counts["captures"], o.counts["cache_hits"]) == (1, 2)


@pytest.mark.parametrize(
    ("after", "where"),
    [
        (_scale_first_grad, "step0.grad.0.weight"),
        (_transpose_first_grad, "step0.grad_strides.0.weight"),
        (_draw_rng, "step0.state.cpu_rng"),
        (_deterministic_on, "step0.state.deterministic_algorithms"),
    ],
    ids=["grad_value", "grad_strides", "rng_draw", "flag"],
)
def test_judge_names_the_first_difference(after, where: str) -> None:
    subject = _Breaking("broken", after)
    try:
        o = _only(run_row(registry.get("plain_mlp_dropout"), [subject], torch.device("cpu")))
    finally:
        torch.use_deterministic_algorithms(False)
    assert o.status is RowStatus.MISMATCH, o.describe()
    assert o.mismatches[0].where.startswith(where), o.describe()
    if where.startswith("step0.grad."):
        # 1e-5 relative on float64: far outside the same-kernel tolerance (1e-7)
        assert o.mismatches[0].max_abs is not None and o.mismatches[0].max_abs > 0
    assert not o.ok


def test_an_accumulating_row_matches_and_records_each_micro_batch() -> None:
    row = registry.get("plain_mlp_accumulating")
    eager = run_row(row, [EagerSubject("eager")], torch.device("cpu"))
    o = _only(run_row(row, [make_subject("cagrad[eager]")], torch.device("cpu")))
    assert o.status is RowStatus.MATCH, o.describe()
    # 3 steps x 2 micro-batches: 1 capture, 5 hits
    assert (o.counts["captures"], o.counts["cache_hits"]) == (1, 5)
    assert _only(eager).status is RowStatus.MATCH


@pytest.mark.parametrize(
    ("after", "where"),
    [(_replace_first_grad, "step0.1.grad_kept.0.weight"), (_scale_first_grad, "step0.0.grad.0.weight")],
    ids=["grad_replaced", "grad_value"],
)
def test_judge_sees_accumulation_into_another_tensor(after, where: str) -> None:
    # .grad zeroed in place before each step: eager adds into the tensor a
    # backward finds, so one that leaves another tensor there (same values)
    # differs; the first backward finds none (step0.0), the second does
    o = _only(run_row(registry.get("plain_mlp_accumulating"), [_Breaking("broken", after)], torch.device("cpu")))
    assert o.status is RowStatus.MISMATCH, o.describe()
    assert o.mismatches[0].where == where, o.describe()


@pytest.mark.parametrize(
    ("name", "where", "detail"),
    [
        ("keeps-saved", "step0.lifetime", "forward storages alive right after the backward where eager freed them"),
        # step 0's loss (the mean, the last op of its forward) still alive
        # after step 1's backward, and every loss after the run
        ("leaks-loss", "step1.lifetime", "forward storages alive right after the backward where eager freed them: op "),
    ],
)
def test_judge_sees_tensors_left_alive(name: str, where: str, detail: str) -> None:
    subject = KeepsWhatEagerFrees(name, keep_graph=name == "keeps-saved")
    o = _only(run_row(registry.get("plain_mlp_dropout"), [subject], torch.device("cpu")))
    assert o.status is RowStatus.MISMATCH, o.describe()
    assert all(m.where.endswith("lifetime") for m in o.mismatches), o.describe()  # values and state agree
    assert o.mismatches[0].where == where, o.describe()
    assert o.mismatches[0].detail.startswith(detail), o.mismatches[0].detail
    if name == "leaks-loss":
        assert "aten.mean.default" in o.mismatches[0].detail
        end = o.mismatches[-1]
        assert end.where == "end.lifetime" and "cyclic collector ran" in end.detail, o.describe()


def test_a_row_needs_one_micro_batch_at_least() -> None:
    with pytest.raises(ValueError, match="micro_batches must be at least 1, got 0"):
        registry.row("plain_no_batches", "torch", "test row", micro_batches=0)(mlp_dropout_row)


def _scale_first_grad_by_1e6() -> None:
    _PARAMS[0].grad.mul_(1 + 1e-6)


@pytest.mark.parametrize(
    ("row", "status"), [("plain_mlp_dropout", RowStatus.MISMATCH), ("plain_mlp_float32_inside", RowStatus.MATCH)]
)
def test_a_row_computing_in_float32_is_judged_at_float32(row: str, status: RowStatus) -> None:
    # 1e-6 relative: outside float64's same-kernel tolerance (1e-7), inside
    # float32's (1.3e-6), which a row declares with compute_dtype
    o = _only(run_row(registry.get(row), [_Breaking("broken", _scale_first_grad_by_1e6)], torch.device("cpu")))
    assert o.status is status, o.describe()


def test_subject_that_breaks_the_next_step_is_an_error() -> None:
    # grad mode left off: the next step's loss has no grad_fn and its
    # backward raises where eager's does not
    try:
        o = _only(
            run_row(registry.get("plain_mlp_dropout"), [_Breaking("broken", _grad_mode_off)], torch.device("cpu"))
        )
    finally:
        torch.set_grad_enabled(True)
    assert o.status is RowStatus.ERROR
    assert o.error is not None and "does not require grad" in o.error.message
    assert o.eager_error is None


def test_eager_subject_is_deterministic() -> None:
    o = _only(run_row(registry.get("plain_mlp_dropout"), [EagerSubject()], torch.device("cpu")))
    assert o.status is RowStatus.MATCH, o.describe()


def test_missing_library_is_skipped_with_reason(monkeypatch) -> None:
    monkeypatch.setitem(libraries.LIBRARIES, "no_such_library_cagrad", "no_such_library_cagrad")
    o = _only(run_row(registry.get("plain_missing_library"), [make_subject("cagrad[eager]")], torch.device("cpu")))
    assert o.status is RowStatus.SKIPPED
    assert "no_such_library_cagrad is not installed" in o.skip_reason
    assert o.ok


def test_dead_row_process_is_an_error() -> None:
    o = _only(
        run_row_isolated(registry.get("plain_process_exits"), [make_subject("cagrad[eager]")], torch.device("cpu"))
    )
    assert o.status is RowStatus.ERROR
    assert o.error is not None and "exited with code 3" in o.error.message


def test_report_round_trips_through_json() -> None:
    report = run_models([registry.get("plain_mlp_dropout")], [_Breaking("broken", _scale_first_grad)], isolate=False)
    assert not report.ok
    data = json.loads(json.dumps(report.to_json()))
    back = RowOutcome.from_json(data["outcomes"][0])
    assert back.status is RowStatus.MISMATCH
    assert back.mismatches[0].where == "step0.grad.0.weight"
    assert back.max_abs == report.outcomes[0].max_abs


def test_cli_list_and_usage_errors() -> None:
    runner = CliRunner()
    listed = runner.invoke(main, ["models", "--list"])
    assert listed.exit_code == 0
    for name in (
        "gpt2",
        "mixtral_grouped_mm",
        "mixtral_expert_loop",
        "llama_ckpt_reentrant",
        "resnet",
        "timm_convnext",
    ):
        assert name in listed.output
    # each row's name, library and description stand apart (the longest
    # name ran into its library)
    lines = listed.output.splitlines()
    rows = registry.all_rows()
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows):
        assert line.split()[:2] == [row.name, row.library], line
    assert runner.invoke(main, ["models", "--rows", "no_such_row"]).exit_code == 2
    assert runner.invoke(main, ["models", "--rows", "gpt2", "--subjects", "cagrad[eager"]).exit_code == 2
    assert runner.invoke(main, ["models", "--in-process", "--process-per-subject"]).exit_code == 2


def test_cli_runs_a_row_and_writes_json(tmp_path) -> None:
    out = tmp_path / "models.json"
    args = ["models", "--rows", "plain_mlp_dropout", "--subjects", "eager", "--in-process", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["ok"] and data["outcomes"][0]["status"] == "match"
    assert data["versions"]["torch"] == torch.__version__
