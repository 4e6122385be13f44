"""harness.power relocate: a sampled mutant found again after lines and
mutation sites were added above it (cosmic-ray enumerates both trees)."""

from __future__ import annotations

import json

import pytest

from harness.power import relocate
from harness.power.mutants import MutantId

pytest.importorskip("cosmic_ray")

BEFORE = "def f(x, y):\n    return x == y\n"
AFTER = "def g(a, b):\n    c = a == b\n    return c\n\n\ndef f(x, y):\n    return x == y\n"


def _only(root, module, operator):
    ids = [i for i in relocate.enumerate_mutants(root, [module]) if i.operator == operator]
    assert ids, "the toy module has no such mutant"
    return ids


def test_a_mutant_is_found_at_its_new_line_and_occurrence(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    for root, text in ((old, BEFORE), (new, AFTER)):
        (root / "pkg").mkdir(parents=True)
        (root / "pkg" / "m.py").write_text(text)
    op = "core/ReplaceComparisonOperator_Eq_Is"
    (sample_id,) = _only(old, "pkg/m.py", op)
    row = {"id": str(sample_id), "diff": relocate.mutant_diff(old, sample_id)}
    assert "-    return x == y" in row["diff"] and "+    return x is y" in row["diff"]
    found = relocate.relocate(new, [row])[str(sample_id)]
    now = MutantId.parse(found)
    # g's comparison came first: the same change is occurrence 1 on line 7 now
    assert (now.line, now.occurrence) == (7, 1) and (sample_id.line, sample_id.occurrence) == (2, 0)
    assert relocate.change(relocate.mutant_diff(new, now)) == relocate.change(row["diff"])
    # a pending row (no diff) is found through the sample's tree, and not without it
    pending = {"id": str(sample_id), "diff": ""}
    assert relocate.relocate(new, [pending]) == {str(sample_id): None}
    assert relocate.relocate(new, [pending], old) == {str(sample_id): found}
    # the code itself changed: not found
    (new / "pkg" / "m.py").write_text(AFTER.replace("return x == y", "return x == y + 1"))
    assert relocate.relocate(new, [row]) == {str(sample_id): None}


def test_a_relocation_map_that_is_not_one_is_refused(tmp_path):
    bad = tmp_path / "map.json"
    for text, what in [("[1]", "JSON object"), ('{"a.py:1:core/AddNot:0": 3}', "JSON object"), ("{", "not a relocation map")]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=what):
            relocate.load_map(bad)
    bad.write_text(json.dumps({"a.py:1:core/AddNot:0": "a.py:5:core/AddNot:2", "b.py:1:core/AddNot:0": None}))
    assert relocate.load_map(bad) == {"a.py:5:core/AddNot:2": "a.py:1:core/AddNot:0"}
