"""SizeCheck.match (cagrad.keys.sizes) against a plain statement of its
rule, written here: a variant accepts slot values when every static slot
keeps its captured value, all slots of a symbol are equal and within its
range, every derived slot equals its function of the symbols, and every
guard holds; it returns the symbol values."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from cagrad.keys.sizes import SizeCheck


def _product(a: int, b: int) -> int:
    return a * b


def _rule(check: SizeCheck, values: list[int]) -> list[int] | None:
    if len(values) != len(check.expected):
        return None
    if any(values[i] != check.expected[i] for i in check.static):
        return None
    syms = []
    for slots, (lower, upper) in zip(check.symbols, check.ranges):
        if len({values[i] for i in slots}) != 1 or not lower <= values[slots[0]] <= upper:
            return None
        syms.append(values[slots[0]])
    if any(fn(*syms) != values[slot] for slot, fn in check.derived):
        return None
    if not all(g(*syms) for g in check.guards):
        return None
    return syms


def _check(shared_fn: bool) -> SizeCheck:
    # slots: a, b, a, a*b, a*b, 7 (static), b (alone), a*b*b
    second = _product if shared_fn else (lambda a, b: a * b)
    return SizeCheck(
        expected=[4, 3, 4, 12, 12, 7, 3, 36],
        static=[5],
        symbols=[[0, 2], [1, 6]],
        derived=[(3, _product), (4, second), (7, lambda a, b: a * b * b)],
        ranges=[(2, math.inf), (2, 64)],
        guards=[lambda a, b: a != b + 10],
    )


def test_examples_of_each_way_to_reject():
    for shared in (True, False):
        check = _check(shared)
        assert check.match([4, 3, 4, 12, 12, 7, 3, 36]) == [4, 3]
        assert check.match([5, 3, 5, 15, 15, 7, 3, 45]) == [5, 3]
        assert check.match([5, 3, 4, 15, 15, 7, 3, 45]) is None  # a's slots differ
        assert check.match([5, 3, 5, 15, 16, 7, 3, 45]) is None  # the second a*b slot
        assert check.match([5, 3, 5, 15, 15, 8, 3, 45]) is None  # the static slot
        assert check.match([1, 3, 1, 3, 3, 7, 3, 9]) is None  # a below its range
        assert check.match([5, 65, 5, 325, 325, 7, 65, 5 * 65 * 65]) is None  # b above its range
        assert check.match([13, 3, 13, 39, 39, 7, 3, 117]) is None  # the guard a != b + 10
        assert check.match([4, 3, 4, 12, 12, 7, 3]) is None  # another slot count


@given(
    a=st.integers(0, 20),
    b=st.integers(0, 70),
    noise=st.lists(st.integers(-1, 1), min_size=8, max_size=8),
    shared=st.booleans(),
)
def test_match_follows_the_rule(a, b, noise, shared):
    check = _check(shared)
    values = [a, b, a, a * b, a * b, 7, b, a * b * b]
    values = [v + d for v, d in zip(values, noise)]
    assert check.match(values) == _rule(check, values)
