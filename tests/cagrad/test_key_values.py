"""Cache keys, size slots and the cache trie on values common graphs do not
hold: a tuple subclass and an unkeyable attribute value, a slice end of
INT64_MAX or of 2**62, sizes beyond 32 bits, size sequences of 253 and more
items or items, device indices, and the trie's entry count. (Survivors of the mutation run,
docs/mutation-testing.md.) Expected values come from the encoding and the
documented rules, not from the code under test."""

from __future__ import annotations

import collections
import struct

import pytest
import torch

import cagrad
from cagrad import engine
from cagrad.errors import Unsupported
from cagrad.keys.cache import CacheNode, FallbackVerdict
from cagrad.keys.cache_key import CacheKey, KeyWriter

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


def _sizes(seq) -> bytes:
    w = KeyWriter()
    w.sizes(seq)
    return w.getvalue()


def _size(n: int) -> bytes:
    w = KeyWriter()
    w.size(n)
    return w.getvalue()


def test_sizes_use_the_1_3_5_9_byte_scheme_up_to_64_bits():
    """The module docstring's scheme (that of torch's
    ``CompiledNodeArgs::collect_size``): one byte below 0xFD, else the marker
    0xFD/0xFE/0xFF and 2/4/8 little-endian bytes; beyond 64 bits a fallback."""
    assert _size(0xFC) == b"\xfc"
    assert _size(0xFD) == b"\xfd\xfd\x00"
    assert _size(1 << 16) == b"\xfe\x00\x00\x01\x00"
    assert _size(1 << 40) == b"\xff" + struct.pack("<Q", 1 << 40)
    assert _size((1 << 64) - 1) == b"\xff" + b"\xff" * 8
    with pytest.raises(Unsupported) as info:
        _size(1 << 64)
    assert info.value.reason == "key_overflow"


@pytest.mark.parametrize(
    "seq, want",
    [
        ((), b"\x00"),
        ([], b"\x00"),
        ((0, 1, 0xFC), b"\x03\x00\x01\xfc"),
        ((0xFD,), b"\x01\xfd\xfd\x00"),  # one item above a byte: each item as size() writes it
        ((300, 1), b"\x02\xfd\x2c\x01\x01"),
        ((1,) * 0xFC, b"\xfc" + b"\x01" * 0xFC),
        ((1,) * 0xFE, b"\xfd\xfe\x00" + b"\x01" * 0xFE),  # 254 items: a 3-byte count
        ((2,) * 0x100, b"\xfd\x00\x01" + b"\x02" * 0x100),
    ],
)
def test_a_size_sequence_is_its_count_then_each_item_as_size_writes_it(seq, want):
    """``sizes`` writes what ``size`` writes for the count and for each item,
    whichever way it takes (expected bytes written out by hand)."""
    assert _sizes(seq) == want
    assert _sizes(seq) == _size(len(seq)) + b"".join(_size(n) for n in seq)


def test_device_indices_are_keyed_one_above_and_none_as_zero():
    """``v``, the type's length and name, then index + 1 (0 for no index):
    cuda, cuda:0 and cuda:1 are three keys (device objects only: no GPU is
    used)."""
    got = {}
    for d in (torch.device("cuda"), torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")):
        w = KeyWriter()
        w.device(d)
        got[str(d)] = w.getvalue()
    assert got == {
        "cuda": b"v\x04cuda\x00",
        "cuda:0": b"v\x04cuda\x01",
        "cuda:1": b"v\x04cuda\x02",
        "cpu": b"v\x03cpu\x00",
    }


def test_a_size_of_2_62_stays_static_and_one_below_may_be_a_symbol():
    """Slots from 0 up to 2**62 (excluded) may become symbols
    (``cagrad.keys.sizes``): a slice end of 2**62 - 1 does under
    ``dynamic=True``, one of 2**62 stays a constant of the graph."""
    x = torch.randn(5, 3, requires_grad=True)
    below = cagrad.capture((x[1 : (1 << 62) - 1] * 2).sum(), dynamic=True)
    assert (1 << 62) - 1 in below.size_values
    at = cagrad.capture((x[1 : 1 << 62] * 2).sum(), dynamic=True)
    assert 1 << 62 not in at.size_values
    assert str(1 << 62) in at.graph_module.code


def test_the_trie_counts_entries_on_inner_nodes_and_their_children():
    """A key sequence that ends where a longer one goes on: the inner node's
    variant or verdict and its children's entries are all counted (1 + 1,
    1 + 2, ...), whatever the bit patterns of the counts."""
    k1, k2, k3 = (CacheKey("SumBackward0", bytes([i])) for i in range(3))
    root = CacheNode()
    root.lookup([k1]).variants.append(object())
    root.lookup([k1, k2]).variants.append(object())
    assert root.num_entries() == 2
    root.lookup([k1, k3]).verdict = FallbackVerdict("speculation_failed", "test")
    root.lookup([k1, k3]).variants.append(object())
    assert root.num_entries() == 4
    root.lookup([k2]).variants += [object(), object(), object()]
    assert root.num_entries() == 7
