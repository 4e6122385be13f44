"""Subject selection by name, counter deltas, and isolation between runs."""

from __future__ import annotations

import pytest
import torch

import harness
from harness import CagradSubject, EagerSubject, Status, TorchCompiledAutogradSubject, examples
from harness.devices import available_devices, resolve_devices
from harness.subjects import all_subject_names, counter_deltas, make_subject, resolve_subjects


def test_make_subject_parses_names():
    s = make_subject("cagrad[aot_eager]")
    assert isinstance(s, CagradSubject) and s.backend == "aot_eager" and s.dynamic is None
    assert s.name == "cagrad[aot_eager]"
    t = make_subject("torch_ca[inductor,static]")
    assert isinstance(t, TorchCompiledAutogradSubject) and t.backend == "inductor" and t.dynamic is False
    assert t.name == "torch_ca[inductor,static]"
    assert make_subject("cagrad[eager,dynamic]").dynamic is True
    e = make_subject("eager")
    assert isinstance(e, EagerSubject) and e.backend is None
    graphed = make_subject("cagrad[inductor,dynamic,reduce-overhead]")
    assert (graphed.backend, graphed.dynamic, graphed.mode) == ("inductor", True, "reduce-overhead")
    assert graphed.name == "cagrad[inductor,dynamic,reduce-overhead]" and graphed.steps == 4
    assert make_subject("cagrad[inductor,reduce-overhead]").dynamic is None
    assert s.steps == 1 and t.steps == 1
    for bad in (
        "cagrad", "eager[eager]", "nope[eager]", "cagrad[eager,fast]", "",
        "torch_ca[inductor,reduce-overhead]", "cagrad[inductor,reduce-overhead,dynamic]",
    ):
        with pytest.raises(ValueError):
            make_subject(bad)


def test_default_and_all_subjects():
    assert [s.name for s in harness.default_subjects()] == ["cagrad[eager]", "cagrad[aot_eager]", "torch_ca[eager]"]
    assert [s.name for s in harness.default_subjects(inductor=True)][-2:] == ["cagrad[inductor]", "torch_ca[inductor]"]
    assert [s.name for s in resolve_subjects(None)] == [s.name for s in harness.default_subjects()]
    names = all_subject_names()
    assert names[0] == "eager" and "torch_ca[aot_eager]" in names and "cagrad[inductor]" in names
    mixed = resolve_subjects(["eager", TorchCompiledAutogradSubject("eager")])
    assert [s.name for s in mixed] == ["eager", "torch_ca[eager]"]
    assert [s.name for s in resolve_subjects("torch_ca[eager]")] == ["torch_ca[eager]"]


def test_counter_deltas():
    before = {"captures": 2, "recompiles_shape": 1, "recompiles_new_node": 0, "fallbacks": 1, "fallback_reasons": {"a": 1}}
    after = {"captures": 4, "recompiles_shape": 2, "recompiles_new_node": 1, "fallbacks": 2, "fallback_reasons": {"a": 1, "b": 1}}
    counts, reasons = counter_deltas(before, after)
    assert counts == {"captures": 2, "recompiles_shape": 1, "recompiles_new_node": 1, "fallbacks": 1, "recompiles": 2}
    assert reasons == {"b": 1}
    counts, _ = counter_deltas({"captures": 0}, {"captures": 3})
    assert counts["recompiles"] == 2  # torch CA style: captures after the first


def test_devices():
    assert available_devices()[0] == torch.device("cpu")
    assert resolve_devices("cpu") == [torch.device("cpu")]
    assert resolve_devices(["cpu", "cpu"]) == [torch.device("cpu")]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError):
            resolve_devices("cuda")
    with pytest.raises(ValueError):
        resolve_devices([])


def test_torch_ca_counts_are_per_run_not_cumulative():
    prog = examples.mlp_program("backward")
    first = harness.run_differential(prog, ["torch_ca[eager]"], devices="cpu").outcomes[0]
    second = harness.run_differential(prog, ["torch_ca[eager]", "torch_ca[eager]"], devices="cpu").outcomes
    # the cache is reset before each run, so every run captures exactly once
    assert first.captures == 1
    assert [o.captures for o in second] == [1, 1]
    assert all(o.status is Status.EQUAL for o in second)


def test_torch_ca_is_disabled_after_a_raising_run():
    from torch._dynamo import compiled_autograd

    report = harness.run_differential(examples.backward_twice_program(None), ["torch_ca[eager]"], devices="cpu")
    assert report.outcomes[0].status is Status.EQUAL
    assert not compiled_autograd.compiled_autograd_enabled
    assert not compiled_autograd.in_compiled_autograd_region


def test_cagrad_counts_are_per_run_and_cagrad_is_inactive_afterwards():
    import cagrad

    prog = examples.mlp_program("backward")
    outcomes = harness.run_differential(prog, ["cagrad[eager]", "cagrad[eager]"], devices="cpu").outcomes
    for o in outcomes:
        assert o.status is Status.EQUAL, o.describe()
        assert o.captures == 1 and o.counts.get("cache_hits", 0) == 0 and o.fallbacks == 0
    # outside the harness, a backward does not go through cagrad
    before = dict(cagrad.counters)
    w = torch.ones(3, requires_grad=True)
    (w * 2).sum().backward()
    assert cagrad.counters["captures"] == before["captures"]
    assert cagrad.counters["backwards"] == before["backwards"]


def test_a_cuda_graph_subject_runs_each_program_four_times_on_one_cache():
    """On the CPU no graph is recorded (each compiled backward is counted as
    run without one), but the steps still share one cache: one capture, three
    hits, every step equal to eager."""
    outcome = harness.run_differential(
        examples.mlp_program("backward"), ["cagrad[aot_eager,reduce-overhead]"], devices="cpu"
    ).outcomes[0]
    assert outcome.status is Status.EQUAL, outcome.describe()
    assert (outcome.counts["backwards"], outcome.captures, outcome.counts["cache_hits"]) == (4, 1, 3)
    assert outcome.counts["cudagraph_records"] == 0 and outcome.counts["cudagraph_skips"] == 4
