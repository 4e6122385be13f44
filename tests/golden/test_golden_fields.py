"""Readable keys: decoded fields, field-level diffs, per-version review, Markdown."""

from __future__ import annotations

import re
import shutil

import pytest

from cagrad import CacheKey
from cagrad.keys import compiled_node_args
from golden_graphs import key_fields, scenarios
from golden_graphs.key_fields import Field, field_diff
from golden_graphs.snapshot import SnapshotError, parse, render
from golden_graphs.store import DEFAULT_ROOT
from golden_graphs.take import take

from .conftest import cli


def test_fields_add_up_to_the_key_and_name_every_write():
    """Every field of every key of a few scenarios is named from the label
    table (no ``?`` fallback) and the fields concatenate to the key bytes."""
    for name in ("hooks_of_every_kind", "compiled_forward_aot", "custom_function_once_differentiable"):
        snap = take(name)
        for key, fields in ((snap.task_key, snap.task_fields), *zip(snap.cache_keys, snap.key_fields)):
            assert b"".join(f.data for f in fields) == key.key
            unnamed = [f.line() for f in fields if f.name.startswith(key_fields.UNNAMED)]
            assert not unnamed, (name, key.node_type, unnamed)


def test_committed_snapshots_name_every_field(committed):
    for path in committed.dir.glob("*.txt"):
        bad = [line for line in path.read_text().splitlines() if line.startswith("    [") and "] ?" in line]
        assert not bad, (path.name, bad[:3])


def test_decoded_values_match_the_writes():
    """Values are the ones written: AddBackward0's alpha, the leaf's ndim."""
    snap = take("broadcast")
    add = snap.key_fields[[k.node_type for k in snap.cache_keys].index("AddBackward0")]
    assert Field("attribute alpha", "1", bytes.fromhex("6902")) in add
    assert [f.value for f in add if f.name == "runs as"] == ["traced (t)"]
    big = take("key_negative_and_large_ints")
    diag = big.key_fields[[k.node_type for k in big.cache_keys].index("DiagonalBackward0")]
    # offset 150: zigzag 300 needs the 3-byte size (0xfd + little-endian 300)
    assert Field("attribute offset", "150", bytes([0x69, 0xFD]) + (300).to_bytes(2, "little")) in diag


def test_field_diff_lines():
    a = CacheKey("MmBackward0", b"\x01\x02")
    b = CacheKey("MmBackward0", b"\x01\x01")
    fa = (Field("node id", "1", b"\x01"), Field("attribute mat2_sym_strides", "2", b"\x02"))
    fb = (Field("node id", "1", b"\x01"), Field("attribute mat2_sym_strides", "1", b"\x01"))
    assert field_diff([a], [fa], [b], [fb]) == ["NodeCall 0 MmBackward0: `attribute mat2_sym_strides` 2 -> 1"]
    c = CacheKey("AccumulateGrad", b"")
    assert field_diff([a], [fa], [a, c], [fa, ()]) == ["NodeCall 1 AccumulateGrad: added node"]
    assert field_diff([a], [()], [b], [()]) == ["NodeCall 0 MmBackward0: key bytes 0102 -> 0101"]


def test_parser_rejects_fields_that_disagree_with_the_hex():
    text = render(take("broadcast"))
    lines = text.splitlines()
    i = lines.index("    [6902] attribute alpha = 1")
    lines[i] = "    [6904] attribute alpha = 2"
    with pytest.raises(SnapshotError) as info:
        parse("\n".join(lines) + "\n", "snap/broadcast.txt")
    assert "do not add up to its key bytes" in str(info.value)
    key_line = next(j for j in range(i, -1, -1) if not lines[j].startswith(" "))
    assert info.value.line == key_line + 1  # the key's line, 1-based
    lines[i] = "    [6902 attribute alpha = 1"
    with pytest.raises(SnapshotError) as info:
        parse("\n".join(lines) + "\n", "snap/broadcast.txt")
    assert info.value.line == i + 1 and "expected a decoded field" in str(info.value)


@pytest.fixture
def planted(monkeypatch):
    """One attribute added to every MulBackward0's key (a planted change),
    written as ``Collector._write_traced`` writes a saved attribute."""
    original = compiled_node_args.Collector._write_traced

    def _write_traced(self, w, call, schema):
        original(self, w, call, schema)
        if schema.name == "MulBackward0":
            node, attr = _Planted(), "planted"
            w.value(getattr(node, "_saved_" + attr))

    monkeypatch.setattr(compiled_node_args.Collector, "_write_traced", _write_traced)


class _Planted:
    _saved_planted = 7


def test_planted_attribute_gives_a_field_level_diff_in_check_and_markdown(root, planted):
    result = cli("--root", root, "check", "broadcast", "views")
    assert result.exit_code == 1
    out = result.output
    assert "CHANGED broadcast" in out
    assert "NodeCall 3 MulBackward0: added `attribute planted` = 7" in out  # broadcast's
    assert "+    [690e] attribute planted = 7" in out  # the byte record is kept
    result = cli("--root", root, "review", "--format", "markdown", "broadcast", "views")
    assert result.exit_code == 0
    md = result.output
    assert "| `broadcast` | changed |" in md
    assert "- NodeCall 3 MulBackward0: added `attribute planted` = 7" in md
    assert "```diff" in md and "</details>" in md


def test_review_against_another_version(root, version_dir, tmp_path):
    """review --against 2.10 compares the current captures with the 2.10 set (a
    version outside the supported 2.11-2.13, so never the current one)."""
    old = root / "torch-2.10"
    shutil.copytree(version_dir, old)
    for snap in old.glob("*.txt"):  # "taken on 2.10": only the torch line differs
        snap.write_text(re.sub(r"(?m)^torch: .*$", "torch: 2.10", snap.read_text(), count=1))
    path = old / "broadcast.txt"
    path.write_text(path.read_text().replace("    [6902] attribute alpha = 1", "    [6904] attribute alpha = 2").replace(
        "015400742d6902", "015400742d6904"
    ))
    result = cli("--root", root, "review", "--against", "2.10", "broadcast", "views")
    assert result.exit_code == 0, result.output
    assert "NodeCall 1 AddBackward0: `attribute alpha` 2 -> 1" in result.output
    out = tmp_path / "review.md"
    result = cli(
        "--root", root, "review", "--against", "2.10", "--format", "markdown", "--output", out, "broadcast", "views"
    )  # fmt: skip
    assert result.exit_code == 0
    md = out.read_text()
    assert "torch 2.10 snapshots vs the current capture" in md
    # the torch line alone is no change: views is ok, broadcast changed
    assert "**1 ok, 1 changed**" in md and "`views`" not in md
    result = cli("--root", root, "review", "--against", "2.9")
    assert result.exit_code == 2
    assert "no snapshot set for torch 2.9" in result.output and "2.10" in result.output


def test_at_least_forty_scenarios_each_described():
    assert len(scenarios.names()) >= 40
    for name in scenarios.names():
        assert scenarios.get(name).description, name


def test_every_committed_set_holds_each_scenario_once_for_its_own_torch():
    """Each ``torch-<minor>`` set (2.11 to 2.14) has one parseable file per
    registered scenario, and each file names the set's own torch minor."""
    sets = sorted(p for p in DEFAULT_ROOT.iterdir() if p.is_dir())
    assert [p.name for p in sets][:4] == ["torch-2.11", "torch-2.12", "torch-2.13", "torch-2.14"]
    for folder in sets:
        assert sorted(f.stem for f in folder.glob("*.txt")) == sorted(scenarios.names()), folder.name
        for f in folder.glob("*.txt"):
            snap = parse(f.read_text(), str(f))
            assert f"torch-{snap.torch}" == folder.name, f
