"""The stacks suite (harness/stacks): training-step programs under eager and
cagrad, compared; the compare layer on planted failures; the CLI.

Stacks whose cagrad support is still being written are asserted to match
all the same: they pass when it lands. Distributed stacks spawn 2 ranks on
127.0.0.1 (gloo) and are bounded by the suite's per-run timeout.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch
from click.testing import CliRunner

from harness.outcome import ErrorInfo
from harness.stacks import (
    RankRun,
    StackContext,
    StackRun,
    StackStatus,
    get,
    judge,
    register,
    run_stack,
    run_stacks,
)
from harness.stacks.cli import stacks as stacks_command
from harness.subjects import EagerSubject, make_subject

from .planted import KeepsWhatEagerFrees

CPU = torch.device("cpu")
TIMEOUT_S = 120.0

LOCAL = [
    "mlp_sgd",
    "grad_accumulation",
    "checkpoint_nonreentrant",
    "checkpoint_reentrant",
    "selective_checkpoint",
    "queue_callback",
    "double_backward",
    "functional_jacobian",
    "sparse_embedding",
    "threads",
]


def only(stack: str, subject, **kwargs):
    """The one outcome of ``subject`` on ``stack`` (CPU)."""
    subject = make_subject(subject) if isinstance(subject, str) else subject
    (outcome,) = run_stack(get(stack), [subject], CPU, **kwargs)
    return outcome


def assert_match(outcome) -> None:
    where = f"{outcome.stack} / {outcome.subject}"
    assert outcome.status is StackStatus.MATCH, f"{where}: {outcome.status}: {outcome.describe()}"


@pytest.mark.parametrize("subject", ["cagrad[eager]", "cagrad[aot_eager]"])
@pytest.mark.parametrize("stack", LOCAL)
def test_local_stack_matches_eager(stack, subject):
    outcome = only(stack, subject)
    assert_match(outcome)
    # every backward went through cagrad: at least one graph, no fallback
    assert outcome.counts.get("captures", 0) >= 1, outcome.counts
    assert outcome.counts.get("fallbacks", 0) == 0, outcome.fallback_reasons


def test_func_grad_penalty_matches_eager_and_its_outer_backward_hits():
    """torch.func.grad's own backward runs in eager (functorch_transform, a
    stack allowed to fall back); the outer backward compiles once, then hits."""
    outcome = only("func_grad_penalty", "cagrad[eager]")
    assert_match(outcome)
    assert outcome.fallback_reasons == {"functorch_transform": 3}
    assert (outcome.counts["captures"], outcome.counts["cache_hits"]) == (1, 2)


@pytest.mark.inductor
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit deprecation inside inductor
def test_mlp_sgd_matches_eager_under_inductor():
    outcome = only("mlp_sgd", "cagrad[inductor]")
    assert_match(outcome)
    assert outcome.counts["captures"] == 1 and outcome.counts["cache_hits"] == 2


DISTRIBUTED = [
    "ddp_default",
    "ddp_static_graph",
    "ddp_find_unused",
    "ddp_no_sync",
    "ddp_python_reducer",
    "fsdp2",
    "fsdp2_no_reshard",
    "fsdp2_grad_accumulation",
    "tensor_parallel",
]

# stacks whose backward compiles as one graph per capture (no opaque call)
WHOLE_GRAPH = {"ddp_default", "tensor_parallel"}


# also in tests/cagrad/test_distributed.py (the default run): here slow only
SLOW_DISTRIBUTED = {"ddp_python_reducer"}


@pytest.mark.parametrize(
    "stack", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_DISTRIBUTED else s for s in DISTRIBUTED]
)
def test_distributed_stack_matches_eager_on_every_rank(stack):
    outcome = only(stack, "cagrad[eager]", timeout=TIMEOUT_S)
    assert_match(outcome)
    assert outcome.counts.get("captures", 0) >= 1 and outcome.counts.get("fallbacks", 0) == 0, outcome.counts
    if stack in WHOLE_GRAPH:
        assert outcome.counts["graph_segments"] == outcome.counts["captures"], outcome.counts


def test_cuda_stack_is_skipped_with_a_reason_on_cpu():
    outcome = only("amp_grad_scaler", "cagrad[eager]")
    assert outcome.status is StackStatus.SKIPPED and outcome.ok
    assert "CUDA" in outcome.skip_reason


# ---------------------------------------------------------------- planted failures


class PerturbOneGrad(EagerSubject):
    """Test-only: eager autograd, then adds ``delta`` to element 0 of the
    ``.grad`` of every leaf of shape ``shape`` the backward reached (through
    a wrapper around ``Variable._execution_engine``)."""

    def __init__(self, shape: tuple[int, ...], delta: float = 0.25) -> None:
        super().__init__("perturb_one_grad")
        self.shape, self.delta = shape, delta

    @contextlib.contextmanager
    def active(self):
        variable = torch.autograd.Variable
        inner = variable._execution_engine
        subject = self

        class Engine:
            def run_backward(self, roots, *args, **kwargs):
                leaves = subject.leaves(roots)
                if not leaves:  # the planted fault must be planted, or the test means nothing
                    raise AssertionError(f"no leaf of shape {subject.shape} reached from the roots {roots!r}")
                result = inner.run_backward(roots, *args, **kwargs)
                with torch.no_grad():
                    for leaf in leaves:
                        leaf.grad.view(-1)[0] += subject.delta
                return result

            def queue_callback(self, cb):
                return inner.queue_callback(cb)

        variable._execution_engine = Engine()
        try:
            yield
        finally:
            variable._execution_engine = inner

    def leaves(self, roots):
        # seen holds the node objects, not only their ids: where torch makes
        # a new Python object for a node each time (a freed one's id can be
        # reused), ids alone would skip nodes never visited
        seen, out = {}, []
        # a root is a tensor or a GradientEdge (its ``node``)
        roots = roots if isinstance(roots, (tuple, list)) else (roots,)
        stack = [getattr(r, "grad_fn", None) or getattr(r, "node", None) for r in roots]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            var = getattr(node, "variable", None)
            if var is not None and tuple(var.shape) == self.shape:
                out.append(var)
            stack.extend(fn for fn, _ in node.next_functions)
        return out


class RaisesOnEntry(EagerSubject):
    """Test-only: its engine raises ``exc`` where the stack enters it."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__("raises_on_entry")
        self.exc = exc

    @contextlib.contextmanager
    def active(self):
        raise self.exc
        yield  # pragma: no cover


@register("test_raises_value_error", "test-only: one backward, then a ValueError")
def _raises_value_error(ctx: StackContext) -> None:
    w = torch.ones(3, requires_grad=True)
    with ctx.engine():
        (w * 2).sum().backward()
    ctx.record("w.grad", w.grad)
    raise ValueError("planted by the stack")


def test_planted_mismatch_is_named_and_measured():
    # mlp_sgd's middle Linear(16, 16) is the only (16, 16) leaf
    outcome = only("mlp_sgd", PerturbOneGrad((16, 16), delta=0.25))
    assert outcome.status is StackStatus.MISMATCH and not outcome.ok
    assert outcome.first_differing == "step0.grad.2.weight"
    assert outcome.mismatches[0].max_abs == pytest.approx(0.25, rel=1e-4)
    assert outcome.max_abs >= outcome.mismatches[0].max_abs
    assert "step0.grad.2.weight" in outcome.describe() and "max abs diff" in outcome.describe()
    # in the first step only that grad and the parameter SGD updated with it
    # differ (later steps start from the changed parameter)
    first_step = {m.where for m in outcome.mismatches if m.where.startswith("step0.")}
    assert first_step == {"step0.grad.2.weight", "step0.param.2.weight"}


class DrawsAfterBackward(EagerSubject):
    """Test-only: eager autograd that draws one number from the global CPU
    generator as its engine context exits (right gradients)."""

    def __init__(self) -> None:
        super().__init__("draws_after_backward")

    @contextlib.contextmanager
    def active(self):
        yield
        torch.rand(())


def test_a_subject_that_draws_is_caught_at_the_first_backward():
    outcome = only("mlp_sgd", DrawsAfterBackward())
    assert outcome.status is StackStatus.MISMATCH
    # the grads of the first step match; the stream after its backward does
    # not (and the later steps' data are drawn from a ctx generator: equal)
    assert outcome.first_differing == "rng after backward 0['cpu_rng']"
    assert [m.where for m in outcome.mismatches] == [f"rng after backward {k}['cpu_rng']" for k in range(3)]


@pytest.mark.parametrize(
    ("keep_graph", "where", "detail"),
    [
        # mlp_sgd holds its loss across the backward: with the graph kept, its
        # saved activations are alive where eager had freed them
        (True, "backward0.lifetime", "forward storages alive right after the backward where eager freed them: op "),
        # step 0's loss, rebound by step 1 in eager, is still alive after
        # step 1's backward, and every loss after the stack returned
        (False, "backward1.lifetime", "forward storages alive right after the backward where eager freed them: op "),
    ],
)
def test_storages_a_subject_keeps_alive_are_a_lifetime_mismatch(keep_graph, where, detail):
    outcome = only("mlp_sgd", KeepsWhatEagerFrees("keeps-graph" if keep_graph else "keeps-losses", keep_graph))
    assert outcome.status is StackStatus.MISMATCH, outcome.describe()
    assert all(m.where.endswith(".lifetime") for m in outcome.mismatches), outcome.describe()  # values agree
    assert outcome.mismatches[0].where == where and outcome.mismatches[0].detail.startswith(detail), outcome.describe()
    if not keep_graph:
        assert outcome.mismatches[-1].where == "end.lifetime", outcome.describe()
        assert "cyclic collector ran" in outcome.mismatches[-1].detail


def test_lifetimes_label_the_stacks_own_storages_alike_under_eager_and_cagrad(monkeypatch):
    from harness.stacks.execute import execute

    runs = [execute(get("mlp_sgd"), s, CPU) for s in (EagerSubject(), make_subject("cagrad[eager]"))]
    eager, compiled = (run.ranks[0] for run in runs)
    # the mode is off while the backward runs: cagrad compiled every one
    assert runs[1].counts["fallbacks"] == 0 and runs[1].counts["captures"] >= 1, runs[1].counts
    assert [w for w, _ in eager.lifetimes] == ["backward0", "backward1", "backward2", "end"]
    assert eager.lifetimes == compiled.lifetimes
    # after eager's backward: the loss (a mean) alive, the activations the
    # graph saved (tanh's outputs) freed with it, and the gradients (aten.mm
    # of the backward; the forward's Linear is addmm) not noted
    after = eager.lifetimes[0][1].after_backward
    assert any("aten.mean" in label for label in after), after
    assert not any("tanh" in label or "aten.mm." in label for label in after), after
    monkeypatch.setenv("CAGRAD_FUZZ_LIFETIMES", "0")
    assert execute(get("mlp_sgd"), EagerSubject(), CPU).ranks[0].lifetimes == []


def test_planted_error_is_reported_with_type_and_message():
    outcome = only("mlp_sgd", RaisesOnEntry(RuntimeError("planted engine failure")))
    assert outcome.status is StackStatus.ERROR and outcome.eager_error is None
    assert outcome.error.type == "RuntimeError" and outcome.error.message == "planted engine failure"
    assert outcome.describe() == "RuntimeError: planted engine failure"


def test_same_exception_as_eager_is_a_match_and_another_is_an_error():
    same = only("test_raises_value_error", "cagrad[eager]")
    assert same.status is StackStatus.MATCH and same.eager_error.type == "ValueError"
    assert "both raised ValueError" in same.describe()
    other = only("test_raises_value_error", RaisesOnEntry(TypeError("not eager's")))
    assert other.status is StackStatus.ERROR and other.error.type == "TypeError"


def test_compiled_subject_that_never_enters_its_engine_is_an_error():
    from harness.stacks.stack import Stack

    forgetful = Stack("forgetful", "never enters the engine", lambda ctx: ctx.record("x", torch.ones(1)))
    (outcome,) = run_stack(forgetful, [make_subject("cagrad[eager]")], CPU)
    assert outcome.status is StackStatus.ERROR and outcome.error.type == "EngineNotEntered"


@register("test_rank1_hangs", "test-only: rank 1 hangs under any subject but eager", world_size=2)
def _rank1_hangs(ctx: StackContext) -> None:
    w = torch.ones(3, requires_grad=True)
    with ctx.engine():
        (w * (ctx.rank + 1)).sum().backward()
    ctx.record("w.grad", w.grad)
    if ctx.rank == 1 and ctx.subject.name != "eager":
        time.sleep(3600)


def test_a_rank_that_hangs_is_killed_and_reported():
    # rank 1 sleeps for an hour: returning at all shows it was killed, and
    # its run says so whatever the load (no wall-clock bound asserted; on a
    # busy machine rank 0 may miss the 10 s too and is then reported alike)
    from harness.stacks.distributed import run_distributed

    _, (run,) = run_distributed(get("test_rank1_hangs"), [make_subject("cagrad[eager]")], CPU, timeout=10)
    hung = run.ranks[1].error
    assert hung is not None and hung.type == "TimeoutError" and hung.message.startswith("did not report"), hung
    assert run.ranks[0].error is None or run.ranks[0].error.type == "TimeoutError", run.ranks[0].error


def test_ranks_are_judged_one_by_one():
    def run(*values, error=None):
        ranks = [RankRun(results={"step0.grad.w": torch.tensor([v])}) for v in values]
        if error is not None:
            ranks[1].error = error
        return StackRun(ranks=ranks, engine_entries=1, counts={"captures": 1})

    subject = make_subject("cagrad[eager]")
    reference = run(1.0, 2.0)
    assert judge("s", subject, CPU, reference, run(1.0, 2.0)).status is StackStatus.MATCH
    # each rank against its own reference: rank 1's value on rank 0 is a mismatch
    swapped = judge("s", subject, CPU, reference, run(2.0, 1.0))
    assert swapped.status is StackStatus.MISMATCH
    assert [m.where for m in swapped.mismatches] == ["rank0/step0.grad.w", "rank1/step0.grad.w"]
    failed = judge("s", subject, CPU, reference, run(1.0, 2.0, error=ErrorInfo("TimeoutError", "late", "")))
    assert failed.status is StackStatus.ERROR and failed.error.message == "rank 1: late"
    assert failed.counts == {"captures": 1}


def test_compute_dtype_judges_floats_with_the_lower_precision_tolerance():
    # a float32 grad that went through float16 matmuls, rounded elsewhere by a fusing backend
    subject = make_subject("cagrad[inductor]")
    reference = StackRun(ranks=[RankRun(results={"g": torch.tensor([1.0, 2.0])})], engine_entries=1)
    got = StackRun(ranks=[RankRun(results={"g": torch.tensor([1.0, 2.001])})], engine_entries=1)
    assert judge("s", subject, CPU, reference, got).status is StackStatus.MISMATCH
    assert judge("s", subject, CPU, reference, got, compute_dtype=torch.float16).status is StackStatus.MATCH
    assert get("amp_grad_scaler").compute_dtype is torch.float16


def test_report_json_is_strict_and_names_every_pair():
    report = run_stacks([get("mlp_sgd"), get("amp_grad_scaler")], ["eager", PerturbOneGrad((16, 16))], "cpu")
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert not data["ok"] and data["subjects"] == ["eager", "perturb_one_grad"]
    pairs = {(o["stack"], o["subject"]): o for o in data["outcomes"]}
    assert pairs["mlp_sgd", "eager"]["status"] == "match"
    assert pairs["mlp_sgd", "perturb_one_grad"]["first_differing"] == "step0.grad.2.weight"
    assert pairs["amp_grad_scaler", "eager"]["status"] == "skipped"


# ---------------------------------------------------------------- CLI


def test_cli_list_names_every_stack():
    result = CliRunner().invoke(stacks_command, ["--list"])
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.output.splitlines()]
    for name in LOCAL + ["amp_grad_scaler", *DISTRIBUTED]:
        assert name in names


def test_cli_exit_status_and_json(tmp_path):
    out = tmp_path / "report.json"
    ok = CliRunner().invoke(stacks_command, ["--stacks", "mlp_sgd", "--subjects", "eager", "--json", str(out)])
    assert ok.exit_code == 0, ok.output
    assert json.loads(out.read_text())["ok"] is True
    # a backend cagrad does not know makes cagrad.enable raise: an error, exit 1
    bad = CliRunner().invoke(stacks_command, ["--stacks", "mlp_sgd", "--subjects", "cagrad[no_such_backend]"])
    assert bad.exit_code == 1, bad.output
    assert "error" in bad.output
    usage = CliRunner().invoke(stacks_command, ["--stacks", "no_such_stack"])
    assert usage.exit_code == 2 and "unknown stack" in usage.output


def test_a_fallback_on_a_stack_that_must_compile_is_a_failure():
    subject = make_subject("cagrad[eager]")
    reference = StackRun(ranks=[RankRun(results={"g": torch.tensor([1.0])})], engine_entries=1)
    got = StackRun(
        ranks=[RankRun(results={"g": torch.tensor([1.0])})],
        engine_entries=1,
        counts={"captures": 0, "fallbacks": 1},
        fallback_reasons={"invisible_hooks": 1},
    )
    fell_back = judge("s", subject, CPU, reference, got)
    assert fell_back.status is StackStatus.FELL_BACK and not fell_back.ok
    assert "invisible_hooks x1" in fell_back.describe()
    assert judge("s", subject, CPU, reference, got, expect_compiled=False).status is StackStatus.MATCH


def test_a_peer_failure_is_reported_and_does_not_fail_the_suite():
    peer = make_subject("torch_ca[eager]")
    assert peer.peer and not make_subject("cagrad[eager]").peer
    reference = StackRun(ranks=[RankRun(results={"g": torch.tensor([1.0])})], engine_entries=1)
    got = StackRun(ranks=[RankRun(results={"g": torch.tensor([2.0])})], engine_entries=1)
    outcome = judge("s", peer, CPU, reference, got)
    assert outcome.status is StackStatus.MISMATCH and outcome.peer and outcome.ok
    cagrad_outcome = judge("s", make_subject("cagrad[eager]"), CPU, reference, got)
    assert not cagrad_outcome.ok
