"""SizeInput: the sizes of a backward, kept out of its cache key.

Every size-like integer a backward's graph depends on (tensor shapes,
strides and storage offsets, the shapes in nodes' input metadata, and the
``SymInt`` fields nodes save, such as ``SumBackward0.self_sym_sizes``) is a
*size slot* (torch's compiled autograd calls them ``SizeInput``). The cache
key records only how many slots there are; their values are checked per
compiled *variant* (:class:`SizeCheck`):

* a STATIC slot must have the value it had at capture;
* a DYNAMIC slot was a symbol (a ``SymInt``) during the capture; slots that
  shared a symbol (duck sizing) must still be equal, derived slots must still
  equal their expression, each symbol must stay in the range the trace
  assumed (sizes traced as symbols are assumed to be 2 or more), and every
  guard the trace recorded (a branch it took on a symbolic comparison) must
  still hold.

A slot is *dynamic-capable* unless its value is baked into the graph by a
C++ node called during the trace with no Python formula to take a SymInt
instead (see :mod:`cagrad.autograd.formulas`), or it is negative or huge (not a size).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch.utils._sympy.printers import PythonPrinter

_MAX_DYNAMIC = 1 << 62  # values beyond this (INT64_MAX slice ends) stay static


def is_nested_int(v: Any) -> bool:
    """Whether ``v`` is a nested tensor's nested int (``j1``, ``3*j1``), a
    SymInt whose node says so (``torch.nested._internal.nested_int``)."""
    if type(v) is int or not isinstance(v, torch.SymInt):
        return False
    check = getattr(v.node, "is_nested_int", None)
    return bool(check is not None and check())


class SizeInputs:
    """The size slots of one backward, in collection order.

    A nested tensor's nested int (``j1``, ``3*j1``: a jagged dimension's
    size or a stride over it, one per offsets tensor) takes a static slot
    whose value is a negative marker (:meth:`nested_marker`): the number of
    its nested int among those this backward met, in order, and its
    coefficient. Equal markers mean the same jagged structure (which nested
    tensors share offsets), whatever the nested ints' names in the process.

    Attributes:
        values: one int per slot.
        dynamic_ok: whether each slot may become a symbol.
        origins: ``(first slot, description)`` per group of slots, for logs.
        nested: nested int id -> its number in this backward.
    """

    __slots__ = ("values", "dynamic_ok", "origins", "nested")

    def __init__(self) -> None:
        self.values: list[int] = []
        self.dynamic_ok: list[bool] = []
        self.origins: list[tuple[int, str]] = []
        self.nested: dict[int, int] = {}

    def nested_marker(self, v: Any) -> int:
        """The slot value of nested int ``v`` (a SymInt whose node is a
        ``NestedIntNode``): ``-1 - (number << 32 | coefficient)``, below
        every size, stride and offset."""
        node = v.node
        n = self.nested.setdefault(node.nested_int(), len(self.nested))
        return -1 - (n << 32 | node.nested_int_coeff())

    def add_static(self, values: Sequence[Any], origin: str) -> int:
        """:meth:`add` of static slots whose values may hold nested ints (a
        subclass's outer geometry, a jagged input's shape): each becomes
        its :meth:`nested_marker`."""
        return self.add([self.nested_marker(v) if is_nested_int(v) else v for v in values], False, origin)

    def add(self, values: Sequence[int], dynamic_ok: bool, origin: str) -> int:
        """Appends slots; returns the index of the first."""
        start = len(self.values)
        self.origins.append((start, origin))
        self.values.extend(values)
        if dynamic_ok:
            self.dynamic_ok.extend(0 <= v < _MAX_DYNAMIC for v in values)
        else:
            self.dynamic_ok.extend([False] * len(values))
        return start

    def origin(self, slot: int) -> str:
        """``"<description>[i]"`` for a slot, for logs."""
        best = None
        for start, what in self.origins:
            if start > slot:
                break
            best = (start, what)
        if best is None:
            return f"size slot {slot}"
        return f"{best[1]}[{slot - best[0]}]"


@dataclasses.dataclass
class SizeCheck:
    """Which slot values a compiled variant accepts, and the symbols they bind.

    Attributes:
        expected: the slot values at capture (for logs and for deciding which
            slots changed).
        static: slots that must keep their value.
        symbols: per graph size input ``sizes[j]``, the slots that bind it
            (all must be equal).
        derived: ``(slot, fn)``: a slot whose value must equal
            ``fn(symbol values)``.
        ranges: per graph size input, ``(lower, upper)`` bounds.
        guards: ``fn(symbol values) -> bool`` for every recorded guard.
        guard_exprs: the guards as sympy expressions (for logs).
        symbol_names: the bound symbols' names (for logs).
        bound_symbols: the bound symbols (sympy), in ``sizes`` order.
        hints: their values at capture.
        derived_exprs: per ``derived`` entry, its expression (sympy), for
            :mod:`cagrad.compile.disk_cache`.
    """

    expected: list[int]
    static: list[int]
    symbols: list[list[int]] = dataclasses.field(default_factory=list)
    derived: list[tuple[int, Callable[..., Any]]] = dataclasses.field(default_factory=list)
    ranges: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    guards: list[Callable[..., Any]] = dataclasses.field(default_factory=list)
    guard_exprs: list[Any] = dataclasses.field(default_factory=list)
    symbol_names: list[str] = dataclasses.field(default_factory=list)
    bound_symbols: list[Any] = dataclasses.field(default_factory=list)
    hints: list[int] = dataclasses.field(default_factory=list)
    derived_exprs: list[Any] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.static:
            getter = operator.itemgetter(*self.static)
            want = getter(self.expected)
            self._static_ok = lambda values: getter(values) == want
        else:
            self._static_ok = lambda values: True
        # match's per-call work, read in C where it can be: each symbol's
        # other slots in one tuple, and each distinct derived function
        # (strides repeat a few products of the symbols) computed once and
        # compared with all its slots in one tuple. symbols and derived are
        # not changed after construction (tighten adds guards and ranges)
        self._bind = [(slots[0], _tuple_getter(slots[1:]), len(slots) - 1) for slots in self.symbols]
        by_fn: dict[int, tuple[Callable[..., Any], list[int]]] = {}
        for slot, fn in self.derived:
            by_fn.setdefault(id(fn), (fn, []))[1].append(slot)
        self._derive = [(fn, _tuple_getter(slots), len(slots)) for fn, slots in by_fn.values()]

    @property
    def is_static(self) -> bool:
        return not self.symbols

    def match(self, values: Sequence[int]) -> list[int] | None:
        """The graph's ``sizes`` list for these slot values, or None."""
        if len(values) != len(self.expected):
            return None
        if self.is_static:
            return [] if list(values) == self.expected else None
        if not self._static_ok(values):
            return None
        sym_values = []
        for (first, others, n), (lower, upper) in zip(self._bind, self.ranges):
            v = values[first]
            if n and others(values) != (v,) * n:
                return None
            if not lower <= v <= upper:
                return None
            sym_values.append(v)
        for fn, slots, n in self._derive:
            if slots(values) != (fn(*sym_values),) * n:
                return None
        for guard in self.guards:
            if not guard(*sym_values):
                return None
        return sym_values

    def function(self, expr: Any) -> Callable[..., Any]:
        """A function of the symbol values computing ``expr`` (static: none)."""
        raise ValueError(f"a static check has no symbols to compute {expr} from")

    def changed(self, values: Sequence[int]) -> set[int]:
        """Slots whose value differs from the captured one."""
        return {i for i, (a, b) in enumerate(zip(values, self.expected)) if a != b}


def _tuple_getter(slots: Sequence[int]) -> Callable[[Sequence[int]], tuple]:
    """``values -> tuple(values[i] for i in slots)``, in C (an itemgetter of
    one index returns the item itself, not a 1-tuple)."""
    if len(slots) == 1:
        (i,) = slots
        return lambda values: (values[i],)
    if not slots:
        return lambda values: ()
    return operator.itemgetter(*slots)


def _always_true(e: Any) -> bool:
    """A guard the ShapeEnv simplified to true (it checks nothing)."""
    return e is sympy.true or e is True


def static_check(values: Sequence[int]) -> SizeCheck:
    """The check of a variant traced with every slot static."""
    return SizeCheck(list(values), list(range(len(values))))


def symbolic_check(values: Sequence[int], slot_exprs: Sequence[Any], shape_env: Any) -> SizeCheck:
    """Builds the check of a variant traced with symbols.

    Args:
        values: slot values at capture.
        slot_exprs: per slot, its value in the trace: an int (static) or a
            sympy expression over the trace's symbols.
        shape_env: the trace's ShapeEnv (replacements, ranges, guards).

    Returns:
        the check; its ``function(expr)`` turns any expression of the trace
        into a function of the symbol values ``match`` returns.

    Raises:
        ValueError: an expression depends on a symbol no slot binds (the
            caller falls back).
    """
    replace = shape_env.replace
    static: list[int] = []
    groups: dict[Any, list[int]] = {}
    derived_exprs: list[tuple[int, Any]] = []
    for slot, expr in enumerate(slot_exprs):
        if isinstance(expr, int):
            static.append(slot)
            continue
        e = replace(expr)
        if e.is_number:
            static.append(slot)
        elif isinstance(e, sympy.Symbol):
            groups.setdefault(e, []).append(slot)
        else:
            derived_exprs.append((slot, e))
    bound = list(groups)
    ranges = []
    for sym in bound:
        vr = shape_env.var_to_range.get(sym)
        lower = -float("inf") if vr is None else float(vr.lower)
        upper = float("inf") if vr is None else float(vr.upper)
        ranges.append((lower, upper))
    guard_exprs = []
    for g in shape_env.guards:
        e = replace(g.expr)
        if not e.is_number and not _always_true(e):
            guard_exprs.append(e)
    return rebuilt_check(
        values,
        static,
        [groups[sym] for sym in bound],
        derived_exprs,
        ranges,
        guard_exprs,
        bound,
        [values[groups[sym][0]] for sym in bound],
        replace,
    )


def rebuilt_check(
    expected: Sequence[int],
    static: Sequence[int],
    symbols: Sequence[Sequence[int]],
    derived: Sequence[tuple[int, Any]],
    ranges: Sequence[tuple[float, float]],
    guard_exprs: Sequence[Any],
    bound: Sequence[Any],
    hints: Sequence[int],
    replace: Callable[[Any], Any],
) -> SizeCheck:
    """A symbolic check from its data: ``derived`` as ``(slot, expression)``
    and the guards as expressions over ``bound`` (what :func:`symbolic_check`
    reads from a trace, and :mod:`cagrad.compile.disk_cache` from a file).

    ``replace``: the ShapeEnv's ``replace`` that :meth:`SizeCheck.function`
    applies first, as :func:`symbolic_check`'s does.

    Raises:
        ValueError: an expression uses a symbol that is not in ``bound``.
    """
    bound, hints = list(bound), list(hints)
    compile_once = _compiler(bound, hints)
    check = SizeCheck(
        list(expected),
        list(static),
        [list(s) for s in symbols],
        [(slot, compile_once(e)) for slot, e in derived],
        [tuple(r) for r in ranges],
        [compile_once(e) for e in guard_exprs],
        list(guard_exprs),
        [str(sym) for sym in bound],
        bound,
        hints,
        [e for _, e in derived],
    )
    check.function = lambda expr: _compile(bound, replace(expr), hints)  # type: ignore[method-assign]
    return check


def tighten(check: SizeCheck, shape_env: Any, since: int) -> int:
    """Adds to ``check`` what a backend assumed about the symbols.

    A backend compiling a graph traced with symbols may guard on them in the
    trace's ShapeEnv (inductor's CPU code generation guards ``s0 <= 4096``;
    a backend may also decide that two symbols are equal, a replacement, or
    narrow a symbol's range). Dynamo would check those guards before every
    call; cagrad calls the backend's code directly, so they join the check:
    every guard recorded after the first ``since``, an equality per bound
    symbol the ShapeEnv now replaces, and the ShapeEnv's current ranges. The
    check only gets stricter, so the functions computed from it before stay
    right for the values it accepts.

    Returns:
        how many guards were added.

    Raises:
        ValueError: a guard uses a symbol no size input binds (the caller
            falls back).
    """
    if check.is_static:
        return 0
    bound, hints = check.bound_symbols, check.hints
    new = []
    for sym in bound:
        target = shape_env.replace(sym)
        if target != sym:
            new.append(sympy.Eq(sym, target))
    for g in shape_env.guards[since:]:
        e = shape_env.replace(g.expr)
        if _always_true(e):
            continue
        if not e.is_number:
            new.append(e)
        elif not bool(e):
            raise ValueError(f"the backend recorded a guard that is always false: {g.expr}")
    for e in new:
        check.guards.append(_compile(bound, e, hints))
        check.guard_exprs.append(e)
    for j, sym in enumerate(bound):
        vr = shape_env.var_to_range.get(sym)
        if vr is not None:
            lower, upper = check.ranges[j]
            check.ranges[j] = (max(lower, float(vr.lower)), min(upper, float(vr.upper)))
    return len(new)


def _compiler(bound: Sequence[sympy.Symbol], hints: Sequence[int]) -> Callable[[Any], Callable[..., Any]]:
    """:func:`_compile` over ``bound``, once per distinct expression (the
    derived slots of a graph repeat a few: strides are products of sizes),
    so that equal expressions share one function (``SizeCheck.match``
    computes each function once)."""
    compiled: dict[Any, Callable[..., Any]] = {}

    def compile_once(e: Any) -> Callable[..., Any]:
        fn = compiled.get(e)
        if fn is None:
            fn = compiled[e] = _compile(bound, e, hints)
        return fn

    return compile_once


def _compile(symbols: Sequence[sympy.Symbol], expr: Any, hints: Sequence[int]) -> Callable[..., Any]:
    """A fast Python function of the symbol values computing ``expr``.

    Printed by torch's ``PythonPrinter`` (the printer Dynamo compiles its
    shape guards with, which knows torch's ``FloorDiv``, ``Mod``, ...), then
    checked against substitution at the capture's values and at a few other
    points; where the two disagree or printing fails, substitution is used.

    Raises:
        ValueError: if ``expr`` uses a symbol no size input binds.
    """
    unknown = expr.free_symbols - set(symbols)
    if unknown:
        raise ValueError(f"{expr} depends on symbols {unknown} that no size input binds")

    def substitute(*vals: int) -> Any:
        out = expr.xreplace(dict(zip(symbols, map(sympy.Integer, vals))))
        if out.is_Boolean:
            return bool(out)
        return int(out)

    try:
        names = [str(sym) for sym in symbols]
        code = PythonPrinter().doprint(expr)
        fn = eval(f"lambda {', '.join(names)}: {code}", {"math": math, "max": max, "min": min})  # noqa: S307
        for point in _sample_points(hints):
            if fn(*point) != substitute(*point):
                return substitute
        return fn
    except Exception:  # noqa: BLE001 - any printing problem means substitution
        return substitute


def _sample_points(hints: Sequence[int]) -> list[list[int]]:
    points = [list(hints)]
    for k in (2, 3, 7):
        points.append([h * k + k for h in hints])
        points.append([h + k for h in hints])
    return points
