"""The instruction sets of the extension's ``walk(starts, steps, count)``
and ``collect(nodes, program, values, tensors)``: a hit guard's structure
check and per-node checks as data, each run in one C++ call.

``walk``'s steps follow the capture's dependency walk: ``steps[k]`` is
``(src, edges)``, node ``src`` (an index into the nodes discovered so far,
``starts`` first) has exactly ``len(edges)`` next edges, and edge ``j`` is
``()`` (no function), ``(i, input_nr)`` (the node discovered as ``i``, by
identity) or ``(i, input_nr, type)`` (a node discovered here as ``i``, the
next index, whose Python object is exactly of ``type``). :func:`walk` is
its Python.

A hit guard (:mod:`cagrad.keys.hit_path`) compares, node by node, what the
graph's CacheKeys depend on and appends the size values and lifted tensors
in the full collection's order. Written as Python lines, that is about ten
bytecodes per attribute: on a 20-node CNN about 1,800 instructions and 17 us
of the guard's 30 (CPU, warm). As a program, the same checks are one call.

An instruction is a tuple ``(op, i, ...)``; ``i`` indexes the ``nodes``
tuple (the guard's nodes in run order) and ``name`` is an attribute read
from node ``i`` (``"_saved_self"``):

========== =============================== ===================================================
op         operands                        holds when
========== =============================== ===================================================
METADATA   ``input_nr, key``               input ``input_nr``'s InputMetadata has ``key``
                                           (``metadata_key``); its sizes go to ``values``
TENSOR     ``name, type, key``             the attribute is exactly of ``type`` with tensor
                                           key ``key`` (``tensor_key``); its sizes, strides
                                           and storage offset go to ``values``, itself to
                                           ``tensors``
NONE       ``name``                        the attribute is None
INTS       ``name, n``                     a tuple or list of ``n`` ints, appended as int64
INT        ``name``                        an int, appended as int64
IS         ``name, obj``                   the attribute is ``obj`` (None, a bool, a dtype)
EQ         ``name, value``                 exactly of ``value``'s type (int, str) and equal
INT_SEQ    ``name, seq``                   of ``seq``'s type (tuple, list), its length, every
                                           item exactly an int and equal
FLOAT      ``name, value``                 exactly a float with ``value``'s binary64 bits
LEAF       ``type, key``                   node ``i`` (an AccumulateGrad) has a variable with
                                           no grad_fn, no tensor hook and no post-accumulate
                                           hook, which TENSOR's check accepts (not appended
                                           to ``tensors``)
========== =============================== ===================================================

Each condition is the one the guard's Python line for it tests (see
:class:`cagrad.keys.hit_path._Generator`); :func:`run` is that Python, the
reference that :func:`cagrad.native.self_tests.collect` compares the C++
with. A failing instruction stops the program: ``collect`` returns False
(what it appended stays; the guard discards it). An attribute that raises
(a saved tensor freed or modified in place: RuntimeError) propagates.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

METADATA, TENSOR, NONE, INTS, INT, IS, EQ, INT_SEQ, FLOAT, LEAF = range(10)

_pack_d = struct.Struct("<d").pack


def walk(starts: tuple, steps: Sequence[tuple], count: int) -> tuple | None:
    """``walk``'s semantics in Python, through ``next_functions``: the
    ``count`` discovered nodes by index, or None where the graph differs.

    Raises:
        ValueError: malformed steps.
    """
    found: list[Any] = list(starts) + [None] * (count - len(starts))
    discovered = len(starts)
    for src, edges in steps:
        if not 0 <= src < discovered:
            raise ValueError("walk(): a step's src is not discovered yet")
        nxt = found[src].next_functions
        if len(nxt) != len(edges):
            return None
        for (fn, input_nr), spec in zip(nxt, edges):
            if not spec:
                if fn is not None:
                    return None
                continue
            if fn is None or input_nr != spec[1]:
                return None
            if len(spec) == 2:
                if fn is not found[spec[0]]:
                    return None
                continue
            if spec[0] != discovered:
                raise ValueError("walk(): a new node's index is not the next one")
            found[spec[0]] = fn
            discovered += 1
            if type(fn) is not spec[2]:
                return None
    if discovered != count:
        raise ValueError("walk(): the steps discover fewer nodes than count")
    return tuple(found)


def run(nodes: tuple, program: Sequence[tuple], values: list, tensors: list, readers: Any) -> bool:
    """``collect``'s semantics in Python, through the extension's single
    readers (``readers``: :class:`cagrad.native.MetadataReaders`).

    Raises:
        ValueError: an unknown instruction.
        RuntimeError: an attribute's (a freed saved tensor).
    """
    for op in program:
        code, node = op[0], nodes[op[1]]
        if code == METADATA:
            ok = readers.metadata(node, op[2], op[3], values)
        elif code == LEAF:
            v = node.variable
            ok = (
                v.grad_fn is None
                and not v._backward_hooks
                and not getattr(v, "_post_accumulate_grad_hooks", None)
                and readers.tensor(v, op[2], op[3], values)
            )
        else:
            a = getattr(node, op[2])
            if code == TENSOR:
                ok = a is not None and readers.tensor(a, op[3], op[4], values)
                if ok:
                    tensors.append(a)
            elif code == NONE:
                ok = a is None
            elif code == INTS:
                ok = readers.ints(a, op[3], values)
            elif code == INT:
                ok = readers.int_(a, values)
            elif code == IS:
                ok = a is op[3]
            elif code == EQ:
                ok = type(a) is type(op[3]) and a == op[3]
            elif code == INT_SEQ:
                want = op[3]
                ok = type(a) is type(want) and len(a) == len(want)
                ok = ok and all(type(x) is int and x == y for x, y in zip(a, want))
            elif code == FLOAT:
                ok = type(a) is float and _pack_d(a) == _pack_d(op[3])
            else:
                raise ValueError(f"unknown guard instruction {op!r}")
        if not ok:
            return False
    return True


def describe(op: tuple, node_names: Sequence[str]) -> str:
    """One instruction as a line of the guard's logged listing, e.g.
    ``n2._saved_mat1: Tensor key=1099545182214, lifted``."""
    code, where = op[0], node_names[op[1]]
    if code == METADATA:
        return f"{where} input {op[2]}: metadata key={op[3]}"
    if code == LEAF:
        return f"{where}.variable: a leaf without hooks, {op[2].__name__} key={op[3]}"
    what = {
        TENSOR: lambda: f"{op[3].__name__} key={op[4]}, lifted",
        NONE: lambda: "None",
        INTS: lambda: f"{op[3]} ints",
        INT: lambda: "an int",
        IS: lambda: f"is {op[3]!r}",
        EQ: lambda: f"== {op[3]!r}",
        INT_SEQ: lambda: f"== {op[3]!r}, ints",
        FLOAT: lambda: f"== {op[3]!r} (binary64)",
    }[code]()
    return f"{where}.{op[2]}: {what}"
