"""What makes a campaign's programs cheaper, pinned by counts (never by time).

* The neighbours of a cagrad subject run in the state its own run of the
  program left (``run_differential``'s ``after_subject``), so the oracle
  never runs the program again to rebuild that state: each cagrad subject
  runs a program once, plus its neighbours (plus a fresh run of a
  neighbour that differed).
* Dynamo's compiles (one per new graph of torch's compiled autograd) skip
  timing their guards (:mod:`harness.compile_overheads`): one skipped
  profile per frame compiled, the same frames compiled per program.
* The state oracle's config reads see a value set, patched or changed in
  place, as before.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import harness
from fuzz.ir import Leaf, Op, Program
from fuzz.oracle import Oracle
from harness import global_state
from tests.fuzz.test_fuzz_neighbours import SOFTMAX, softmax_dim_left_out  # noqa: F401 - fixture

SUBJECTS = ["cagrad[eager]", "cagrad[aot_eager]", "eager"]

SEQUENCE = Program(
    leaves=(Leaf("x0", (3, 4), "float64"),),
    ops=(Op("v0", "softmax", ("x0",), {"dim": 0}), Op("v1", "mul", ("v0", "v0"))),
    roots=("v1",),
    seed=3,
    resizes=(((3, 5),),),
)


def _counting(oracle: Oracle) -> collections.Counter[str]:
    """Counts each subject's backward runs (as the campaign's workers wrap them)."""
    runs: collections.Counter[str] = collections.Counter()
    for subject in oracle.subjects:
        inner = subject.run

        def run(run: Any, _inner: Any = inner, _name: str = subject.name) -> Any:
            runs[_name] += 1
            return _inner(run)

        subject.run = run  # type: ignore[method-assign]
    return runs


def test_neighbours_run_after_each_subject_without_a_replay() -> None:
    """Two cagrad subjects before a third one: each runs the program once and
    its 4 neighbours once (the oracle used to run the program again under
    every cagrad subject but the last, to rebuild its cache)."""
    oracle = Oracle(SUBJECTS, devices=["cpu"], neighbours=4)
    runs = _counting(oracle)
    verdict = oracle.run(SOFTMAX)
    assert verdict.ok, verdict.report.summary()
    assert runs == {"cagrad[eager]": 5, "cagrad[aot_eager]": 5, "eager": 1}
    assert [(c.subject, c.index, c.status) for c in verdict.neighbours] == [
        (s, k, "equal") for s in ("cagrad[eager]", "cagrad[aot_eager]") for k in (1, 2, 3, 4)
    ]
    # the neighbours met the graphs the program left: a dim change misses,
    # a seed or size change of the same graph hits
    assert any(c.hit for c in verdict.neighbours if c.subject == "cagrad[eager]")
    assert any(c.hit for c in verdict.neighbours if c.subject == "cagrad[aot_eager]")


def test_every_cagrad_subject_finds_the_planted_wrong_hit(softmax_dim_left_out: None) -> None:  # noqa: F811
    """The wrong cache hit is found under both cagrad subjects, the first of
    them included (its neighbours run before the second subject resets):
    per subject, the program, the neighbour, and the neighbour's fresh run."""
    oracle = Oracle(SUBJECTS, devices=["cpu"], neighbours=1)
    runs = _counting(oracle)
    verdict = oracle.run(SOFTMAX)
    assert sorted((k.subject, k.kind) for k in verdict.keys) == [("cagrad[aot_eager]", "cache"), ("cagrad[eager]", "cache")]
    assert runs == {"cagrad[eager]": 3, "cagrad[aot_eager]": 3, "eager": 1}
    notes = [n for n in verdict.report.notes if "neighbour 1" in n]
    assert [n.split(":")[0] for n in notes] == ["cagrad[eager]@cpu", "cagrad[aot_eager]@cpu"]
    assert [o.subject for o in verdict.report.outcomes] == SUBJECTS


def test_a_size_sequence_neighbours_start_from_its_last_variant() -> None:
    """A size sequence runs its variants, then its neighbours in the state
    the last variant left (the size change hits its graph, the dim change
    cannot): one run per variant and neighbour, no replay of the variants."""
    oracle = Oracle(SUBJECTS, devices=["cpu"], neighbours=2)
    runs = _counting(oracle)
    verdict = oracle.run(SEQUENCE)
    assert verdict.ok, verdict.report.summary()
    assert runs == {"cagrad[eager]": 4, "cagrad[aot_eager]": 4, "eager": 2}
    assert [(c.subject, c.label, c.status, c.hit) for c in verdict.neighbours] == [
        (s, label, "equal", hit)
        for s in ("cagrad[eager]", "cagrad[aot_eager]")
        for label, hit in (("ops[0].attrs.dim: 0 -> -2", False), ("size 4 -> 3", True))
    ]


def test_after_subject_sees_each_outcome_in_run_order() -> None:
    seen: list[tuple[str, str, str]] = []

    def after(subject: harness.Subject, device: torch.device, outcome: harness.Outcome) -> None:
        seen.append((subject.name, str(device), outcome.status.value))

    from fuzz.interpret import IRProgram

    report = harness.run_differential(IRProgram(SOFTMAX), SUBJECTS, ["cpu"], after_subject=after)
    assert seen == [(o.subject, o.device, o.status.value) for o in report.outcomes]
    assert [s for s, _, _ in seen] == SUBJECTS


# ------------------------------------------------------------- Dynamo
def test_torch_ca_compiles_skip_the_guard_latency_profile() -> None:
    """Three runs of one program under torch's compiled autograd: the same
    Dynamo frames compiled for each (a reset between runs), and every one
    of them skipped its guard-latency profile."""
    from torch._dynamo.utils import counters

    from harness import compile_overheads

    oracle = Oracle(["torch_ca[eager]"], devices=["cpu"])
    guards = __import__("torch._dynamo.guards", fromlist=["profile_guard_manager"])
    assert guards.profile_guard_manager is compile_overheads._no_profile
    compiled = []
    for _ in range(3):
        frames = counters["frames"]["ok"]
        skipped = compile_overheads.SKIPPED["profile_guard_manager"]
        verdict = oracle.run(SOFTMAX)
        assert verdict.ok, verdict.report.summary()
        compiled.append(counters["frames"]["ok"] - frames)
        assert compile_overheads.SKIPPED["profile_guard_manager"] - skipped == compiled[-1]
    assert compiled[0] >= 1 and compiled == [compiled[0]] * 3


def test_skip_guard_latency_profile_is_idempotent() -> None:
    from harness import compile_overheads

    assert compile_overheads.skip_guard_latency_profile()
    assert compile_overheads.skip_guard_latency_profile()
    import torch._dynamo.guards as guards

    assert guards.profile_guard_manager(None, {}, 1) == 0.0


# ------------------------------------------------------- state oracle
@pytest.mark.parametrize("how", ["setattr", "patch", "in_place"])
def test_config_reads_see_every_kind_of_change(how: str) -> None:
    """The config fields read live values through torch's cached export:
    a value set, patched, or a list changed in place all show, and reads
    agree again once it is put back."""
    import torch._dynamo.config as cfg

    before = global_state.capture()
    assert before.diff(global_state.capture()) == []
    if how == "setattr":
        old = cfg.recompile_limit
        cfg.recompile_limit = old + 3
        try:
            changed = global_state.capture()
        finally:
            cfg.recompile_limit = old
    elif how == "patch":
        with cfg.patch(recompile_limit=cfg.recompile_limit + 3):
            changed = global_state.capture()
    else:
        names = cfg.reorderable_logging_functions
        names.add(print_function_for_test)
        try:
            changed = global_state.capture()
        finally:
            names.discard(print_function_for_test)
    assert [d.field for d in before.diff(changed)] == ["dynamo_config"]
    assert before.diff(global_state.capture()) == []


def print_function_for_test() -> None:  # pragma: no cover - only its name is read
    pass


def test_config_reads_reuse_the_last_text_only_for_the_same_objects() -> None:
    """Two reads with nothing changed between them give the same text object
    (no second repr and sort of the keys, where torch caches its export); a
    value set to an equal one of another type (8 -> 8.0: ``==``, another
    text) is still a difference."""
    import torch._dynamo.config as cfg

    from harness.global_state import FIELDS

    read = FIELDS["dynamo_config"]
    first = read()
    if hasattr(cfg, "_get_dict") and "readonly_values" in cfg._get_dict.__code__.co_varnames:
        assert read() is first
    before = global_state.capture()
    old = cfg.recompile_limit
    cfg.recompile_limit = float(old)
    try:
        assert old == cfg.recompile_limit
        assert [d.field for d in before.diff(global_state.capture())] == ["dynamo_config"]
    finally:
        cfg.recompile_limit = old
    assert before.diff(global_state.capture()) == []


def test_a_round_runs_the_peers_on_one_program_in_peer_every(tmp_path: Any) -> None:
    """``peer_every=3``: torch's compiled autograd runs on programs 0, 3 and 6
    of a 7-program round, cagrad on all 7; ``peer_every=1``: both on all."""
    from fuzz.campaign.config import CampaignConfig
    from fuzz.campaign.rounds import RoundRunner
    from fuzz.strategies import GenConfig

    gen = GenConfig(max_ops=3, hooks=False, shapes=False, training=False, checkpoint=False)
    ran: dict[int, collections.Counter[str]] = {}
    for every in (3, 1):
        counts: collections.Counter[str] = collections.Counter()

        def emit(event: str, payload: dict[str, Any], _counts: collections.Counter[str] = counts) -> None:
            if event == "ran":
                for o in payload["outcomes"]:
                    _counts[o["where"]] += 1

        cfg = CampaignConfig(budget_s=1e9, seed=2, out=tmp_path, gen=gen, round_size=7, devices=["cpu"],
                             subjects=["cagrad[eager]", "torch_ca[eager]"], peer_every=every)  # fmt: skip
        RoundRunner(cfg, emit, lambda: None, lambda: None).run_round(0, 0, float("inf"))
        ran[every] = counts
    assert ran[3] == {"cagrad[eager]@cpu": 7, "torch_ca[eager]@cpu": 3}
    assert ran[1] == {"cagrad[eager]@cpu": 7, "torch_ca[eager]@cpu": 7}


def test_an_oracle_without_its_peers_still_runs_a_peer_named_alone() -> None:
    """``peers=False`` leaves torch's compiled autograd out beside cagrad, and
    runs it where it is the only subject (nothing else would run)."""
    program = Program(leaves=(Leaf("x0", (3,), "float64"),), ops=(Op("v0", "sin", ("x0",)),), roots=("v0",), seed=1)
    both = Oracle(["cagrad[eager]", "torch_ca[eager]"], devices=["cpu"])
    assert [s.name for s in both.peers] == ["torch_ca[eager]"]
    verdict = both.run(program, peers=False)
    assert [o.subject for o in verdict.report.outcomes] == ["cagrad[eager]"]
    alone = Oracle(["torch_ca[eager]"], devices=["cpu"])
    assert [o.subject for o in alone.run(program, peers=False).report.outcomes] == ["torch_ca[eager]"]
