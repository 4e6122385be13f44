"""Cache keys, size slots and the cache trie on values common graphs do not
hold: a tuple subclass and an unkeyable attribute value, a slice end of
INT64_MAX, and the trie's entry count. (Survivors of the mutation run,
docs/mutation-testing.md.) Expected values come from the encoding and the
documented rules, not from the code under test."""

from __future__ import annotations

import collections

import pytest
import torch

import cagrad
from cagrad import engine
from cagrad.errors import Unsupported
from cagrad.keys.cache_key import KeyWriter

_INT64_MAX = (1 << 63) - 1


def _encoded(v) -> bytes:
    w = KeyWriter()
    w.value(v)
    return w.getvalue()


def test_a_tuple_subclass_is_keyed_as_the_sequence_it_is():
    """``(`` tag, count 2, then ``i`` and the zigzag ints 1 -> 2, 2 -> 4
    (cagrad.keys.cache_key's encoding); a named tuple has no writer of its
    own and is keyed as its items."""
    pair = collections.namedtuple("pair", "a b")
    assert _encoded(pair(1, 2)) == b"(\x02i\x02i\x04"
    assert _encoded((1, 2)) == b"(\x02i\x02i\x04"


def test_an_unkeyable_attribute_value_is_unsupported_with_its_reason():
    """A value the encoding does not cover is a fallback reason, not a crash."""
    with pytest.raises(Unsupported) as info:
        _encoded(object())
    assert info.value.reason == "unkeyable_attribute"
    assert "object" in str(info.value)


def test_an_int64_max_slice_end_stays_static():
    """``x[1:]`` saves the end INT64_MAX: far beyond any size, it stays a
    constant of the graph (``Capture.size_values`` shows None for it), also
    with ``dynamic=True``; the start, step and sizes may become symbols."""
    x = torch.randn(5, 3, requires_grad=True)
    for dynamic in (False, True):
        cap = cagrad.capture((x[1:] * 2).sum(), dynamic=dynamic)
        assert _INT64_MAX not in cap.size_values
        assert None in cap.size_values and 5 in cap.size_values
    assert str(_INT64_MAX) in cap.graph_module.code  # a constant of the graph


def test_the_trie_counts_one_entry_per_compiled_variant():
    """Two graphs of different structure, one of them at two sizes: three
    compiled variants, so three entries, whatever the trie's shape."""
    cagrad.reset()
    try:
        with cagrad.enable("eager"):
            for n, op in ((3, torch.sin), (4, torch.sin), (3, torch.cos)):
                x = torch.randn(n, requires_grad=True)
                op(x).sum().backward()
                assert torch.equal(x.grad, (x.detach().cos() if op is torch.sin else -x.detach().sin()))
            assert cagrad.counters["captures"] == 3
            cache = engine.cache_for("eager", None)
            assert cache.num_entries() == 3
    finally:
        cagrad.reset()
