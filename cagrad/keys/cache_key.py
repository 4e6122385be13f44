"""CacheKey and the byte encoding that CompiledNodeArgs writes into it.

A node's key is ``(node type name, bytes)``. The bytes hold everything about
the node that the traced graph depends on and that is not a lifted input:
non-tensor attributes, tensor metadata, edges, hook counts, static sizes. The
encoding is deterministic across processes (no ids, addresses or hash seeds),
so keys can be snapshotted and compared byte for byte.

Encoding (all multi-byte integers little-endian):

* sizes and counts (non-negative): one byte below 0xFD; else a marker byte
  0xFD/0xFE/0xFF followed by 2/4/8 bytes. This is the 1/3/5/9-byte scheme of
  ``CompiledNodeArgs::collect_size`` in torch/csrc/dynamo/compiled_autograd.h.
* tagged values: one tag byte, then the payload:
  ``N`` None, ``T``/``F`` bools, ``i`` int (zigzag, then the size scheme),
  ``f`` float (IEEE-754 binary64), ``c`` complex (two binary64), ``s`` str
  (size + UTF-8), ``(`` sequence (size + items), ``d`` dtype (name),
  ``v`` device (type name + index + 1, 0 for none), ``l`` layout,
  ``m`` memory format, ``?`` symbolic int (the size slot it is bound to).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import torch

from ..errors import Unsupported


class CacheKey(NamedTuple):
    """One autograd node's entry in the shadow-graph cache.

    Attributes:
        node_type: the node's class name, e.g. ``"MmBackward0"``.
        key: the bytes :class:`CompiledNodeArgs` collected for it.
    """

    node_type: str
    key: bytes

    def hex(self) -> str:
        """``"<node_type> <hex bytes>"``: the line a golden snapshot stores."""
        return f"{self.node_type} {self.key.hex()}"


_pack_d = struct.Struct("<d").pack
_pack_h = struct.Struct("<H").pack
_pack_i = struct.Struct("<I").pack
_pack_q = struct.Struct("<Q").pack

_U64_MAX = (1 << 64) - 1
_DTYPE_BYTES: dict[torch.dtype, bytes] = {}
_DEVICE_BYTES: dict[torch.device, bytes] = {}
_I64_LIMIT = 1 << 63


def _dtype_name(dtype: torch.dtype) -> bytes:
    return str(dtype).removeprefix("torch.").encode()


class KeyWriter:
    """Appends tagged values to a growing key. One writer per node."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def getvalue(self) -> bytes:
        return bytes(self.buf)

    # -- raw pieces -------------------------------------------------------
    def size(self, n: int) -> None:
        """A non-negative count in the 1/3/5/9-byte encoding."""
        buf = self.buf
        if n < 0xFD:
            buf.append(n)
        elif n <= 0xFFFF:
            buf.append(0xFD)
            buf += _pack_h(n)
        elif n <= 0xFFFFFFFF:
            buf.append(0xFE)
            buf += _pack_i(n)
        elif n <= _U64_MAX:
            buf.append(0xFF)
            buf += _pack_q(n)
        else:
            raise Unsupported("key_overflow", f"integer {n} does not fit in 64 bits")

    def sizes(self, seq: Any) -> None:
        """A count, then each element as :meth:`size` writes it."""
        n = len(seq)
        if n < 0xFD and (n == 0 or (max(seq) < 0xFD and min(seq) >= 0)):
            # every element fits in one byte: the same bytes, written at once
            self.buf.append(n)
            self.buf += bytes(seq)
            return
        self.size(n)
        for s in seq:
            self.size(s)

    def tag(self, t: bytes) -> None:
        self.buf += t

    def text(self, s: str) -> None:
        data = s.encode()
        self.size(len(data))
        self.buf += data

    # -- tagged values ----------------------------------------------------
    def int(self, v: int) -> None:
        self.buf.append(0x69)  # "i"
        if v >= _I64_LIMIT:
            # some bindings hand int64 fields out as uint64 (MeanBackward1's
            # dim (-1,) reads (2**64 - 1,)): same C++ value, same key
            v -= 1 << 64
        # zigzag keeps small negative ints (dims like -1) in one byte
        self.size((v << 1) if v >= 0 else ((-v << 1) - 1))

    def value(self, v: Any) -> None:
        """Any non-tensor attribute value a backward node may save.

        Raises:
            Unsupported: for a type this encoding does not cover (a node
                holding such a value cannot be keyed, so it falls back).
        """
        writer = _WRITERS.get(type(v))
        if writer is not None:
            writer(self, v)
            return
        if isinstance(v, (tuple, list)):
            _write_seq(self, v)
        elif isinstance(v, torch.SymInt):
            raise Unsupported("symbolic_attribute", f"a saved SymInt {v} without a size slot")
        else:
            raise Unsupported("unkeyable_attribute", f"cannot key a saved {type(v).__name__}")

    def device(self, d: torch.device) -> None:
        encoded = _DEVICE_BYTES.get(d)
        if encoded is None:
            w = KeyWriter()
            w.buf.append(0x76)  # "v"
            w.text(d.type)
            w.size(0 if d.index is None else d.index + 1)
            encoded = _DEVICE_BYTES[d] = w.getvalue()
        self.buf += encoded

    def dtype(self, d: torch.dtype) -> None:
        encoded = _DTYPE_BYTES.get(d)
        if encoded is None:
            name = _dtype_name(d)
            encoded = _DTYPE_BYTES[d] = b"d" + bytes([len(name)]) + name
        self.buf += encoded


def _write_none(w: KeyWriter, v: Any) -> None:
    w.buf.append(0x4E)  # "N"


def _write_bool(w: KeyWriter, v: bool) -> None:
    w.buf.append(0x54 if v else 0x46)  # "T" / "F"


def _write_float(w: KeyWriter, v: float) -> None:
    w.buf.append(0x66)  # "f"
    w.buf += _pack_d(v)


def _write_complex(w: KeyWriter, v: complex) -> None:
    w.buf.append(0x63)  # "c"
    w.buf += _pack_d(v.real)
    w.buf += _pack_d(v.imag)


def _write_str(w: KeyWriter, v: str) -> None:
    w.buf.append(0x73)  # "s"
    w.text(v)


def _write_seq(w: KeyWriter, v: Any) -> None:
    w.buf.append(0x28)  # "("
    w.size(len(v))
    for item in v:
        w.value(item)


def _write_layout(w: KeyWriter, v: torch.layout) -> None:
    w.buf.append(0x6C)  # "l"
    w.text(str(v).removeprefix("torch."))


def _write_memory_format(w: KeyWriter, v: torch.memory_format) -> None:
    w.buf.append(0x6D)  # "m"
    w.text(str(v).removeprefix("torch."))


_WRITERS: dict[type, Any] = {
    type(None): _write_none,
    bool: _write_bool,
    int: KeyWriter.int,
    float: _write_float,
    complex: _write_complex,
    str: _write_str,
    tuple: _write_seq,
    list: _write_seq,
    torch.Size: _write_seq,
    torch.dtype: KeyWriter.dtype,
    torch.device: KeyWriter.device,
    torch.layout: _write_layout,
    torch.memory_format: _write_memory_format,
}
