"""The snapshot file format: render/parse round trip and parse errors."""

from __future__ import annotations

import pytest

from cagrad import CacheKey
from golden_graphs.snapshot import MAGIC, Snapshot, SnapshotError, parse, render

SNAP = Snapshot(
    scenario="demo",
    torch="2.13",
    about="a demo: two nodes",
    task_key=CacheKey("GraphTask", bytes.fromhex("4101")),
    cache_keys=(
        CacheKey("SumBackward0", bytes.fromhex("0054002802")),
        CacheKey("AccumulateGrad", b""),
    ),
    graph=(
        "placeholder inputs",
        "%in0 : f32[] = inputs[0]",
        "# SumBackward0 (NodeCall 0)",
        "%expand : f32[3] stride=(0,) = aten.expand.default(%in0, [3])",
        "return [%expand]",
    ),
)
TEXT = render(SNAP)
LINES = TEXT.splitlines()


def _line_of(text: str) -> int:
    return LINES.index(text) + 1


def _error(text: str) -> SnapshotError:
    with pytest.raises(SnapshotError) as info:
        parse(text, "snap/demo.txt")
    err = info.value
    assert str(err).startswith(f"snap/demo.txt:{err.line}: ")
    return err


def _replace(old: str, new: str | None) -> str:
    lines = [new if line == old else line for line in LINES]
    return "\n".join(line for line in lines if line is not None) + "\n"


def test_round_trip():
    assert parse(TEXT) == SNAP
    assert render(parse(TEXT)) == TEXT


def test_layout():
    assert LINES[0] == MAGIC
    assert "[task_key]" in LINES and "[cache_keys]" in LINES and "[graph]" in LINES
    assert LINES[-1] == "[end]"
    assert "SumBackward0 0054002802" in LINES
    assert "AccumulateGrad " in LINES  # empty key bytes keep the separator


def test_bad_hex_digit_names_line_and_column():
    err = _error(_replace("SumBackward0 0054002802", "SumBackward0 00540g2802"))
    assert err.line == _line_of("SumBackward0 0054002802")
    assert "'g' at column 19 is not a lowercase hex digit" in err.message


def test_odd_hex_length():
    err = _error(_replace("SumBackward0 0054002802", "SumBackward0 005400280"))
    assert err.line == _line_of("SumBackward0 0054002802")
    assert "odd number of hex digits" in err.message


def test_uppercase_hex_is_rejected():
    err = _error(_replace("SumBackward0 0054002802", "SumBackward0 0054002ABC"))
    assert "not a lowercase hex digit" in err.message


def test_key_line_without_type():
    err = _error(_replace("SumBackward0 0054002802", "0054002802"))
    assert err.line == _line_of("SumBackward0 0054002802")
    assert "expected a key line '<NodeType> <hex bytes>'" in err.message


def test_missing_cache_keys_section():
    err = _error(_replace("[cache_keys]", None))
    assert err.line == _line_of("SumBackward0 0054002802") - 1  # the header's line is gone
    assert "expected a section header after the 1 line(s) of [task_key]" in err.message


def test_missing_graph_section():
    err = _error(_replace("[graph]", None))
    assert err.line == _line_of("placeholder inputs") - 1
    assert "expected a key line" in err.message


def test_missing_task_key_section():
    err = _error(_replace("[task_key]", None))
    assert err.line == _line_of("[task_key]")
    assert "expected the section header '[task_key]', got 'GraphTask 4101'" in err.message


def test_empty_cache_keys_section():
    text = _replace("SumBackward0 0054002802", None).replace("AccumulateGrad \n", "")
    err = _error(text)
    assert err.line == _line_of("[cache_keys]")
    assert "at least one key line in [cache_keys]" in err.message


def test_truncated_before_end():
    err = _error("\n".join(LINES[:-1]) + "\n")
    assert "expected '[end]'" in err.message and "truncated" in err.message
    assert err.line == len(LINES)


@pytest.mark.parametrize("keep", [1, 4, 8, 11, 14])
def test_truncated_anywhere(keep):
    err = _error("\n".join(LINES[:keep]) + "\n")
    assert err.line <= keep + 1
    assert "expected" in err.message


def test_truncated_mid_graph_needs_return():
    cut = LINES.index("return [%expand]")
    err = _error("\n".join(LINES[:cut]) + "\n")
    assert "expected the graph's 'return ...' line" in err.message
    assert err.line == cut  # the last graph line present


def test_bad_first_line():
    err = _error(TEXT.replace(MAGIC, "# some other format", 1))
    assert err.line == 1 and "expected the first line" in err.message


def test_empty_file():
    err = _error("")
    assert err.line == 1


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("torch: 2.13", "torch: 2", "expected 'torch: <major>.<minor>'"),
        ("about: a demo: two nodes", "scenario: demo", "header field 'scenario' given twice"),
        ("about: a demo: two nodes", "colour: red", "expected a header field"),
        ("about: a demo: two nodes", None, "expected header field 'about'"),
    ],
)
def test_bad_header(old, new, expected):
    err = _error(_replace(old, new))
    assert expected in err.message


def test_text_after_end():
    err = _error(TEXT + "extra\n")
    assert err.line == len(LINES) + 1 and "nothing after '[end]'" in err.message


def test_render_refuses_what_parse_cannot_read():
    import dataclasses

    with pytest.raises(ValueError):
        render(dataclasses.replace(SNAP, about="two\nlines"))
    with pytest.raises(ValueError):
        render(dataclasses.replace(SNAP, graph=SNAP.graph[:-1]))
    with pytest.raises(ValueError):
        render(dataclasses.replace(SNAP, graph=("", *SNAP.graph)))
