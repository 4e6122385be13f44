"""harness.power.mutants: identities, seeded sampling, shards; and the
enumeration over a small module, checked against cosmic-ray's own mutation
of each occurrence."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.power.mutants import MutantId, annotation_spans, enumerate_mutants, module_paths, sample, shard

IDS = [MutantId(f"pkg/m{m}.py", line, "core/AddNot", occ) for m in range(3) for line, occ in zip(range(1, 40, 3), range(13))]


def test_id_text_round_trips():
    for ident in IDS[:5]:
        assert MutantId.parse(str(ident)) == ident
    with pytest.raises(ValueError, match="bad mutant id 'nope'"):
        MutantId.parse("nope")


def test_sampling_is_deterministic_for_a_seed():
    first = sample(IDS, 10, seed=3)
    assert sample(list(reversed(IDS)), 10, seed=3) == first  # input order does not matter
    assert len(first) == len(set(first)) == 10 and set(first) <= set(IDS)
    assert any(sample(IDS, 10, seed=s) != first for s in range(4, 8))  # the seed does
    assert sample(IDS, None, seed=0) == sorted(IDS) == sample(IDS, 10_000, seed=5)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_shards_are_disjoint_and_cover(n):
    drawn = sample(IDS, 25, seed=1)
    shares = [shard(drawn, k, n) for k in range(1, n + 1)]
    seen = [i for share in shares for i in share]
    assert sorted(seen) == sorted(drawn) and len(seen) == len(set(seen))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError, match="bad shard 0/3"):
        shard(drawn, 0, 3)


MODULE = textwrap.dedent(
    """\
    from __future__ import annotations


    def clamp(x: int | None, lo: int, hi: int) -> int | None:
        if x < lo:
            return lo
        return hi if x > hi else x
    """
)


def test_annotations_are_spanned_only_under_future_import():
    spans = annotation_spans(MODULE)
    assert ((4, 13), (4, 23)) in spans  # "int | None" of x
    assert annotation_spans(MODULE.replace("from __future__ import annotations", "")) == []


def test_enumeration_over_a_small_module(tmp_path: Path):
    pytest.importorskip("cosmic_ray")
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(MODULE)
    assert module_paths(tmp_path, ["pkg"]) == ["pkg/m.py"]
    with pytest.raises(FileNotFoundError, match="nothing"):
        module_paths(tmp_path, ["nothing"])
    skipped: dict[str, int] = {}
    items = enumerate_mutants(tmp_path, ["pkg/m.py"], skipped)
    assert skipped["pkg/m.py"] > 0  # the "|" of the annotations, under every BinaryOperator replacement
    assert all(i.line in (5, 6, 7) for i in items)  # the body only: nothing in the signature's annotations
    lt = [i for i in items if i.operator == "core/ReplaceComparisonOperator_Lt_Gt"]
    assert [(i.line, i.occurrence) for i in lt] == [(5, 0)]
    # each identity names the mutation cosmic-ray makes: apply one and look
    mutated = mutate_code(MODULE, get_operator(lt[0].operator)(), lt[0].occurrence)
    assert "if x > lo:" in mutated
    assert items[lt[0]].job_id == "pkg/m.py:5:core/ReplaceComparisonOperator_Lt_Gt:0"
