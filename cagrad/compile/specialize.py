"""Static specializations of a symbolic graph for the sizes it runs at.

A symbolic graph (``enable(dynamic=True)``, or the default's second capture,
at the first other sizes) serves every size with one capture. Inductor's
code for symbols is much slower than for numbers where index arithmetic cannot be folded: on the
CPU transformer layer (128 wide, batch 8, sequence 32) one fused kernel of
the attention input projection's backward took 4.3 ms with symbols and
69 us with numbers (``torch._inductor.config.cpp.enable_kernel_profile``),
the whole backward 6.3 ms against 1.7 ms.

So a whole-graph backward compiled by a backend in
:data:`SPECIALIZE_BACKENDS` is compiled at capture for the capture's sizes
only (*static first*: a static compile is also quicker, 6 s less for the CPU
transformer layer); its symbolic code is compiled at the first backward at
other sizes, before anything of that backward ran, so that the size guards
the backend adds can still send it to eager
(:func:`cagrad.compile.variants.prepare_symbolic`). Once the graph has
been called :data:`HOT_CALLS` times at another tuple of sizes, it is
compiled again with those sizes as numbers, and calls at exactly those sizes
run that code (at most :data:`MAX_SPECIALIZATIONS` tuples per graph, the
capture's included; ``counters["specializations"]`` counts every static
compile). Graphs cut into segments compile their symbolic code at capture
and specialize the same way. This is the tiering torch's own compiled
autograd reaches by compiling static first and dynamic after a change; the
default ``dynamic=None`` also captures static first, so the symbolic graph
is compiled static first for the sizes of the backward that made it.

Why it is safe: the sizes list a compiled graph is called with holds every
size input and every free symbol of its inputs (:func:`cagrad.compile.direct_compile.
lift_free_symbols`), and the cache's SizeCheck has already matched each
lifted tensor's sizes, strides and offset against expressions of those
symbols, so a tuple of sizes determines every input's geometry. A
specialization is looked up by that whole tuple and is called for nothing
else. It cannot add guards (its examples have no symbols). Any failure while
specializing is logged and the symbolic code keeps running.

``CAGRAD_SPECIALIZE=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from ..counters import counters

log = logging.getLogger("cagrad")

SPECIALIZE_BACKENDS = ("inductor",)
"""Backends whose symbolic code is worth a second compile."""

HOT_CALLS = 2
"""Calls at one tuple of sizes before it gets its own compile (the first
backward compiles the symbolic graph; the second at the same sizes
specializes, so a training loop runs numeric code from its second step)."""

MAX_SPECIALIZATIONS = 4
"""Most size tuples one graph is specialized for."""


def wanted(name: str | None) -> bool:
    """Whether graphs of backend ``name`` get specializations."""
    return name in SPECIALIZE_BACKENDS and os.environ.get("CAGRAD_SPECIALIZE", "1") != "0"


class Specializer:
    """The per-size static compiles of one symbolic graph.

    Args:
        compile_static: ``compile_static(binding) -> callable`` compiles the
            graph with ``binding`` (symbol -> int) substituted, returning a
            callable with the symbolic one's list signature, or raises.
        symbols_of: ``symbols_of(lists) -> binding`` reads the value of each
            symbol from a call's lists.
        capture_binding: each symbol's value at capture (its hint), or None
            if one has none: what a static-first compile is compiled for.
    """

    __slots__ = ("compile_static", "symbols_of", "capture_binding", "static", "calls", "failed", "pending")

    def __init__(
        self,
        compile_static: Callable[[dict], Callable[..., Any]],
        symbols_of: Callable[[Sequence[Any]], dict],
        capture_binding: dict | None = None,
    ) -> None:
        self.compile_static = compile_static
        self.symbols_of = symbols_of
        self.capture_binding = capture_binding
        self.static: dict[tuple, Callable[..., Any]] = {}
        self.calls: dict[tuple, int] = {}
        self.failed = False
        # (binding, fn): compiled at capture for the capture's sizes, before
        # the tuple of sizes it will be called with is known
        self.pending: tuple[dict, Callable[..., Any]] | None = None

    def find(self, lists: Sequence[Any]) -> Callable[..., Any] | None:
        """The specialization compiled for this call's sizes, if any (the
        one compiled at capture is claimed by the first call whose symbol
        values are the ones it was compiled for)."""
        key = tuple(lists[1])
        fn = self.static.get(key)
        if fn is None and self.pending is not None:
            binding, candidate = self.pending
            if self.symbols_of(lists) == binding:
                self.pending = None
                self.static[key] = fn = candidate
        return fn

    def lookup(self, lists: Sequence[Any]) -> Callable[..., Any] | None:
        """The specialization for this call's sizes (compiling it if this is
        its :data:`HOT_CALLS`-th call), or None to run the symbolic code."""
        fn = self.find(lists)
        if fn is not None or self.failed or len(self.static) >= MAX_SPECIALIZATIONS:
            return fn
        key = tuple(lists[1])
        n = self.calls.get(key, 0) + 1
        if n == 1 and len(self.calls) >= _MAX_COUNTED:
            self.calls.clear()  # sizes that keep changing: count afresh
        self.calls[key] = n
        if n < HOT_CALLS or _capturing():
            return None
        try:
            fn = self.compile_static(self.symbols_of(lists))
        except Exception as e:  # noqa: BLE001 - the symbolic code still runs
            self.failed = True
            log.info("cagrad: no static specialization (%s: %s); the symbolic code runs", type(e).__name__, e)
            return None
        self.static[key] = fn
        del self.calls[key]
        counters.bump("specializations")
        return fn


_MAX_COUNTED = 64  # size tuples whose calls are counted at once, per graph


def _capturing() -> bool:
    # a compile cannot run inside a CUDA graph capture (cagrad.compile.cuda_graphs)
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def concrete(value: Any, binding: dict) -> int:
    """``value`` (an int or a SymInt) with ``binding`` substituted.

    Raises:
        ValueError: a symbol is not bound.
    """
    if not isinstance(value, torch.SymInt):
        return int(value)
    expr = sympy.sympify(sympy.sympify(value.node.expr).xreplace(binding))
    if not expr.is_number:
        raise ValueError(f"size {value.node.expr} has unbound symbols {sorted(map(str, expr.free_symbols))}")
    return int(expr)


def static_examples(examples: Sequence[Any], binding: dict, fake_mode: Any) -> list[Any]:
    """The graph's example inputs with numbers for symbols: each fake
    tensor rebuilt in ``fake_mode`` with the same dtype, device and
    ``requires_grad`` and the sizes, strides and storage offset the binding
    gives; each SymInt its value.

    Raises:
        ValueError: a size uses a symbol the binding lacks.
    """
    out: list[Any] = []
    for e in examples:
        if not isinstance(e, torch.Tensor):
            out.append(concrete(e, binding))
            continue
        shape = [concrete(s, binding) for s in e.shape]
        stride = [concrete(s, binding) for s in e.stride()]
        offset = concrete(e.storage_offset(), binding)
        extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0)
        with fake_mode:
            if offset:
                base = torch.empty(extent, dtype=e.dtype, device=e.device)
                t = base.as_strided(shape, stride, offset)
            else:
                t = torch.empty_strided(shape, stride, dtype=e.dtype, device=e.device)
        if e.requires_grad:
            t = t.detach().requires_grad_(True)
        out.append(t)
    return out


__all__ = ["HOT_CALLS", "MAX_SPECIALIZATIONS", "SPECIALIZE_BACKENDS", "Specializer", "static_examples", "wanted"]
