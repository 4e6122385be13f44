"""harness.power.equivalents: the reviewed equivalents file and its errors."""

from __future__ import annotations

import pytest

from harness.power.equivalents import DEFAULT_PATH, EquivalentsError, load, parse
from harness.power.mutants import MutantId

GOOD = """
[[equivalent]]
module = "cagrad/keys/cache.py"
line = 12
operator = "core/NumberReplacer"
occurrence = 3
reason = "a size hint"
"""


def test_equivalents_parse_and_shipped_file():
    assert parse(GOOD, "f.toml") == {MutantId("cagrad/keys/cache.py", 12, "core/NumberReplacer", 3): "a size hint"}
    assert isinstance(load(DEFAULT_PATH), dict)  # the shipped file is well formed
    assert parse("", "f.toml") == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[equivalent]\n", r"f\.toml: not valid TOML"),
        ("x = 1\n", r"f\.toml: unknown top-level key\(s\) \['x'\]"),
        ("equivalent = 3\n", r"f\.toml: 'equivalent' must be an array of tables"),
        (GOOD.replace('reason = "a size hint"', ""), r"f\.toml: entry 1: missing reason"),
        (GOOD + "colour = 'red'\n", r"f\.toml: entry 1: unknown colour"),
        (GOOD.replace("line = 12", 'line = "12"'), r"f\.toml: entry 1: line must be int, got '12'"),
        (GOOD.replace("line = 12", "line = true"), r"f\.toml: entry 1: line must be int, got True"),
        (GOOD.replace("line = 12", "line = 0"), r"entry 1 \(cagrad/keys/cache\.py:0:core/NumberReplacer:3\): line must be >= 1"),
        (GOOD.replace("a size hint", "  "), r"entry 1 \(cagrad/keys/cache\.py:12:core/NumberReplacer:3\): reason is empty"),
        (GOOD.replace("core/NumberReplacer", "NumberReplacer"), r"entry 1 .*is not a cosmic-ray name"),
        (GOOD + GOOD, r"f\.toml: entry 2 \(cagrad/keys/cache\.py:12:core/NumberReplacer:3\): the same mutant is listed twice"),
    ],
)
def test_equivalents_errors_name_file_and_entry(text, message):
    with pytest.raises(EquivalentsError, match=message):
        parse(text, "f.toml")


def test_equivalents_missing_file(tmp_path):
    with pytest.raises(EquivalentsError, match="nope.toml: cannot read"):
        load(tmp_path / "nope.toml")
