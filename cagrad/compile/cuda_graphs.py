"""CUDA graphs for whole-graph compiled backwards (``mode="reduce-overhead"``).

A compiled backward launches one kernel per fused op; replaying it as a
CUDA graph launches them all with one call, which is where a backward of many
small kernels spends its time. :class:`CudaGraphed` wraps a compiled
whole-graph backward (``fn(inputs, sizes, scalars, hooks, packed_inputs)``):

* the first call at a new tuple of ``sizes`` runs ``fn`` as it is (a warm-up:
  the backend compiles or autotunes lazily on a first call, which a capture
  cannot contain; graphs that get a static specialization on their second
  call, :mod:`cagrad.compile.specialize`, warm up twice); the next records it into a
  ``torch.cuda.CUDAGraph`` (its own memory pool) and replays it; later calls
  at those sizes replay;
* inputs are read in place where their addresses are stable: leaves that
  require grad (parameters) always, and any other input (saved activations,
  the root gradients) at the address it had in the previous call (a
  training loop that repeats its forward gets the same blocks from the
  caching allocator step after step); the others are copied into buffers
  the graph owns before each replay. A graph is keyed on the addresses it
  reads in place and replayed only while every one of them holds (a tensor
  alive at that address is the input itself, so the graph reads the right
  data). A call that matches no graph records one, so a loop whose
  addresses settle after a few steps, or alternate between two patterns,
  replays without copies; calls where nothing is where it was share the
  graph that copies every input but the parameters;
* outputs live in the graph's pool and are overwritten by the next replay,
  so they are *borrowed* (:class:`BorrowedOutputs`): the caller copies each
  before the next backward (:func:`cagrad.run.runtime.finish_whole` accumulates
  them without stealing and clones ``autograd.grad`` results).

Where a graph would not be safe the call runs ``fn`` directly, and the
reason is logged once per entry and counted in
``cagrad.counters["cudagraph_skips"]`` and ``["cudagraph_skip_reasons"]``: an input not on CUDA (a graph cannot read host
memory on replay), more than :data:`MAX_GRAPHS` graphs for one entry (sizes
that keep changing; one graph per tuple of sizes and parameter addresses),
or a capture that raised (an op that synchronizes with the host, say).
Backwards that are cut into segments by opaque calls, and ``create_graph``
backwards, are never wrapped (:func:`unsafe_reason`).

This follows the recipe of PyTorch's CUDA graph documentation ("CUDA
Graphs" in the CUDA semantics notes: warm up, capture with static inputs,
copy new data into them, replay) with the static-input split that
``torch.compile(mode="reduce-overhead")`` makes for parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..counters import counters

log = logging.getLogger("cagrad.cuda_graphs")

MAX_GRAPHS = 8
"""Most CUDA graphs one compiled backward records (per tuple of sizes and
parameter addresses); beyond it, calls run without a graph."""

MODES = (None, "default", "reduce-overhead")


def check_mode(mode: str | None) -> bool:
    """True when ``mode`` asks for CUDA graphs.

    Raises:
        ValueError: for a mode other than None, ``"default"`` and
            ``"reduce-overhead"``.
    """
    if mode not in MODES:
        raise ValueError(f"cagrad: unknown mode {mode!r}; expected one of {MODES}")
    return mode == "reduce-overhead"


class BorrowedOutputs(list):
    """The outputs of a CUDA graph replay: valid until the next replay of the
    same graph, so the caller copies what it keeps."""


def unsafe_reason(traced: Any, create_graph: bool) -> str | None:
    """Why a captured backward must not be wrapped at all, or None.

    Args:
        traced: the capture (:class:`cagrad.capture.compiler.Traced`).
        create_graph: the backward builds a graph of its own (its outputs
            require grad; a replay records no autograd history).
    """
    if create_graph:
        return "create_graph"
    if traced.has_opaque_calls:
        return "opaque_segments"
    return None


class _Recorded:
    __slots__ = ("graph", "buffers", "static", "outputs")

    def __init__(self, graph: Any, buffers: list, static: list[bool], outputs: list) -> None:
        self.graph = graph
        self.buffers = buffers  # per input: the buffer the graph reads, None if in place
        self.static = static  # per input: read in place
        self.outputs = outputs


def _key(size_key: tuple, addresses: list[int], mask: list[bool]) -> tuple:
    """A graph's key: the sizes, and the addresses it reads in place."""
    return size_key, tuple(a if s else None for a, s in zip(addresses, mask))


class CudaGraphed:
    """``fn`` replayed as CUDA graphs, one per tuple of sizes and parameter
    addresses (see the module docstring).

    Called like ``fn``: ``(inputs, sizes, scalars, hooks, packed_inputs)``,
    lists; ``inputs`` are tensors (CUDA for a replay), ``sizes`` ints. Returns
    ``fn``'s outputs: a :class:`BorrowedOutputs` after a replay, a plain
    list otherwise. Exceptions of ``fn`` itself pass through.
    """

    __slots__ = ("fn", "graphs", "seen", "masks", "disabled", "warmup_calls")

    def __init__(self, fn: Callable[..., Any], warmup_calls: int = 1) -> None:
        self.fn = fn
        self.graphs: dict[tuple, _Recorded] = {}
        # per tuple of sizes: calls so far and the input addresses of the last
        self.seen: dict[tuple, tuple[int, list[int]]] = {}
        # per tuple of sizes: which inputs each of its graphs reads in place
        self.masks: dict[tuple, list[list[bool]]] = {}
        self.disabled: str | None = None
        self.warmup_calls = warmup_calls

    def _disable(self, reason: str) -> None:
        if self.disabled is None:
            log.info("cagrad: compiled backward runs without CUDA graphs: %s", reason)
        self.disabled = reason

    def __call__(self, inputs: list, sizes: list, scalars: list, hooks: list, packed: list) -> list:
        if self.disabled is not None:
            counters.record_cudagraph_skip(self.disabled.split(":")[0])
            return list(self.fn(inputs, sizes, scalars, hooks, packed))
        if scalars or hooks or packed:
            self._disable("inputs_beyond_tensors_and_sizes")
            return self(inputs, sizes, scalars, hooks, packed)
        if any(not t.is_cuda for t in inputs):
            self._disable("cpu_input")
            return self(inputs, sizes, scalars, hooks, packed)
        size_key = tuple(sizes)
        addresses = [t.data_ptr() for t in inputs]
        calls, last = self.seen.get(size_key, (0, None))
        self.seen[size_key] = (calls + 1, addresses)
        # a graph's key holds exactly the addresses its mask reads in place,
        # so trying each mask recorded at these sizes finds any graph that fits
        masks = self.masks.setdefault(size_key, [])
        for mask in masks:
            recorded = self.graphs.get(_key(size_key, addresses, mask))
            if recorded is not None:
                break
        else:
            if calls < self.warmup_calls:
                return list(self.fn(inputs, sizes, scalars, hooks, packed))
            if len(self.graphs) >= MAX_GRAPHS:
                counters.record_cudagraph_skip("too_many_graphs")
                return list(self.fn(inputs, sizes, scalars, hooks, packed))
            params = [t.is_leaf and t.requires_grad for t in inputs]
            # read in place: parameters, and inputs at the address they had
            # in the previous call (else the graph copies them)
            static = [p or a == b for p, a, b in zip(params, addresses, last or [None] * len(inputs))]
            try:
                recorded = self._record(inputs, sizes, static, params)
            except Exception as e:  # noqa: BLE001 - the graph is optional; fn itself still runs
                self._disable(f"capture_failed: {type(e).__name__}: {e}")
                return self(inputs, sizes, scalars, hooks, packed)
            self.graphs[_key(size_key, addresses, recorded.static)] = recorded
            if recorded.static not in masks:
                masks.append(recorded.static)
            return self._replay(recorded)
        for t, buf, s in zip(inputs, recorded.buffers, recorded.static):
            if not s:
                buf.copy_(t)
        return self._replay(recorded)

    def _replay(self, recorded: _Recorded) -> BorrowedOutputs:
        recorded.graph.replay()
        counters.bump("cudagraph_replays")
        return BorrowedOutputs(recorded.outputs)

    def _record(
        self, inputs: Sequence[torch.Tensor], sizes: list, static: list[bool], params: list[bool]
    ) -> _Recorded:
        """Records ``fn`` reading the ``static`` inputs in place and the rest
        from buffers of its own (filled here). The capture runs no kernel;
        the caller replays. An output that is an input read in place (a
        gradient handed through unchanged) would be the recording call's
        tensor at every replay, so such a graph is recorded again with only
        the ``params`` read in place."""
        args = []
        buffers: list[torch.Tensor | None] = []
        for t, s in zip(inputs, static):
            if s:
                args.append(t)
                buffers.append(None)  # no reference kept: the input may die
            else:
                buf = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
                buf.copy_(t)
                args.append(buf)
                buffers.append(buf)
        graph = torch.cuda.CUDAGraph()
        # the capture runs on a side stream; wait for the copies above
        torch.cuda.current_stream().synchronize()
        with torch.cuda.graph(graph):
            outputs = list(self.fn(args, list(sizes), [], [], []))
        del args
        in_place = {
            t.untyped_storage().data_ptr() for t, s, p in zip(inputs, static, params) if s and not p
        }
        if in_place and any(
            isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in in_place for o in outputs
        ):
            del outputs, graph
            return self._record(inputs, sizes, params, params)
        counters.bump("cudagraph_records")
        return _Recorded(graph, buffers, static, outputs)


__all__ = ["MAX_GRAPHS", "BorrowedOutputs", "CudaGraphed", "check_mode", "unsafe_reason"]
