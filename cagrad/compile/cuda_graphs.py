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
  addresses settle after a few steps replays without copies; a call whose
  best graph copies inputs that are at the address they had two calls ago
  records one more that reads them in place (at most :data:`LAYOUT_GRAPHS`
  kept per tuple of sizes, the least recently replayed evicted, and
  :data:`LAYOUT_RECORDS` recorded in all), so a loop whose allocator
  alternates between two layouts (one step's ``.grad`` copies taking blocks
  the next forward would have used) gets a graph per layout, even where
  its first steps, before the allocator settled, used up the graphs; calls
  where nothing is where it was share the graph that copies every input but
  the parameters. The buffers of copied inputs come from a memory pool of
  their own, so that recording a graph does not move the next forward's
  activations. An input whose elements share memory (an ``expand``ed
  saved tensor, stride 0) cannot be copied into a buffer of its layout;
  its storage span is copied into a flat buffer, which the graph reads
  through the input's strides (a call whose such input has other strides
  runs without the graph: ``overlapping_input_layout``);
* small CPU inputs (at most :data:`MAX_HOST_VALUES` elements: the philox
  seed and offset an attention backward takes, a CPU scalar operand) are
  read on the host when a kernel is launched, so a recorded graph holds the
  values it was recorded with: their values, and the sign of each zero
  among them, are part of the graph's key (their dtype and shape are fixed
  by the cache key and the sizes; a call with other values records another
  graph, up to the bound), and they are copied into host buffers the graph owns before each
  replay, so that a copy from host memory captured in the graph reads live
  memory holding those values;
* outputs live in the graph's pool and are overwritten by the next replay.
  They are handed out as aliases (``detach()``), which the caller may keep
  as ``.grad`` like any fresh gradient: before the next replay,
  :func:`cagrad.native.reclaim_fn` checks them; a dead one costs nothing
  (a loop that sets ``.grad`` to None each step copies nothing, and uses no
  memory beyond the graph's pool), a live one (a ``.grad`` kept to
  accumulate into) is moved to memory of its own, and one that a view made
  by the user shares cannot be moved: that call runs without the graph
  (``outputs_alive``). An output that is a view of a copied input's buffer
  (``CatBackward`` slicing a root gradient) is handed out as the same view
  of the caller's input instead, as eager's ``.grad`` shares that tensor
  (:func:`~cagrad.compile.cuda_graph_layout.views_of_inputs`; the
  recording keeps such an input in the caller's list, where the caller
  still holds it). Where the extension is not built the outputs are
  *borrowed* (:class:`BorrowedOutputs`) and copied instead
  (:func:`cagrad.run.runtime.finish_whole` accumulates them without stealing
  and clones ``autograd.grad`` results).

A guarded hit (:mod:`cagrad.keys.hit_path`) may replay the graph it most
likely picks *before* its guard runs, so that the GPU runs the graph while
the host checks the graph and collects its inputs
(:meth:`CudaGraphed.speculate`, ``counters["cudagraph_early_replays"]``);
the replay is used only where the call then picks that very graph, else it
is dropped unread (``cudagraph_wasted_replays``). A graph with an integer or
boolean CUDA input (indices, masks) is never replayed early: before the guard,
its recorded addresses may hold other data, and kernels address memory
through such inputs.

Where a graph would not be safe the call runs ``fn`` directly, and the
reason is logged once per entry and counted in
``cagrad.counters["cudagraph_skips"]`` and ``["cudagraph_skip_reasons"]``: an input on the host that is
not a small CPU tensor, or only host inputs (``cpu_input``), more than :data:`MAX_GRAPHS` graphs for one entry (sizes
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

import contextlib
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import logs, native
from ..counters import counters
from .cuda_graph_host import MAX_HOST_VALUES, _HostInputs, unread_host_inputs
from .cuda_graph_layout import (
    _data_ptr,
    _fits,
    _in_place,
    _key,
    _Mask,
    _overlaps,
    _params,
    _Recorded,
    _span,
    _storage_address,
    views_of_inputs,
)

log = logging.getLogger("cagrad.cuda_graphs")

MAX_GRAPHS = 8
"""Most CUDA graphs one compiled backward records (per tuple of sizes and
parameter addresses); beyond it, calls run without a graph."""

MODES = (None, "default", "reduce-overhead")

EARLY_REPLAY = os.environ.get("CAGRAD_EARLY_REPLAY", "1") != "0"
"""Whether a guarded hit may replay its CUDA graph before its guard has run
(:meth:`CudaGraphed.speculate`); ``CAGRAD_EARLY_REPLAY=0`` turns it off."""


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
        traced: the capture (:class:`cagrad.capture.traced.Traced`).
        create_graph: the backward builds a graph of its own (its outputs
            require grad; a replay records no autograd history).
    """
    if create_graph:
        return "create_graph"
    if traced.has_opaque_calls:
        return "opaque_segments"
    if traced.output_specs is not None:
        return "tensor_subclass"  # outputs rebuilt into a subclass are never borrowed
    return None


LAYOUT_GRAPHS = 3
"""Graphs kept per tuple of sizes (the copying graph and one per layout of
an allocator that alternates between two): a graph recorded for a layout
beyond it evicts the least recently replayed one."""

LAYOUT_RECORDS = 6
"""Graphs recorded per tuple of sizes, in all, after which a call whose
graph copies inputs does not record one that reads them in place (an
allocator that never settles would otherwise record on every call)."""

_capture_streams: dict[int, Any] = {}


@contextlib.contextmanager
def _capturing(graph: Any) -> Any:
    """Captures the block's CUDA work into ``graph`` on a side stream of the
    current device (one per device, kept), as ``torch.cuda.graph`` does,
    but without its ``torch.cuda.empty_cache()`` first: that gives every
    cached block back to the driver, so the next forward's activations get
    new addresses and match no graph that reads them in place (each
    recording moved the H100 transformer layer's 32 MiB activations again).
    The graph's pool then draws on memory the cache does not hold; where
    there is none left, the capture fails and the backward runs without a
    graph (``capture_failed``)."""
    device = torch.cuda.current_device()
    stream = _capture_streams.get(device)
    if stream is None:
        stream = _capture_streams[device] = torch.cuda.Stream(device)
    torch.cuda.synchronize()  # the work queued before, on any stream, is not the graph's
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            yield
        finally:
            # torch's notice on the graph itself ("The CUDA Graph is empty",
            # a backward whose graph launches no kernel): eager records no
            # graph and emits none (the H200 campaign's warnings oracle)
            with logs.torch_warnings_held("cuda graph"):
                graph.capture_end()


class CudaGraphed:
    """``fn`` replayed as CUDA graphs, one per tuple of sizes and parameter
    addresses (see the module docstring).

    Called like ``fn``: ``(inputs, sizes, scalars, hooks, packed_inputs)``,
    lists; ``inputs`` are tensors (CUDA for a replay), ``sizes`` ints. Returns
    ``fn``'s outputs: a :class:`BorrowedOutputs` after a replay, a plain
    list otherwise. Exceptions of ``fn`` itself pass through.
    """

    __slots__ = (
        "fn", "graphs", "seen", "masks", "disabled", "warmup_calls", "unread", "host", "per_size",
        "last", "confident", "pending", "early", "early_off", "buffer_pools", "replays",
    )

    def __init__(self, fn: Callable[..., Any], warmup_calls: int = 1, unread: frozenset[int] = frozenset()) -> None:
        self.fn = fn
        self.unread = unread  # inputs whose values no kernel reads (unread_host_inputs)
        self.host: _HostInputs | None = None  # the inputs on the host, from the first call
        self.graphs: dict[tuple, _Recorded] = {}
        self.per_size: dict[tuple, int] = {}  # graphs recorded, in all, per tuple of sizes (and host values)
        # per tuple of sizes: calls so far and the input addresses of the
        # last call and of the one before it
        self.seen: dict[tuple, tuple[int, Any, Any]] = {}
        # per tuple of sizes and host values: which inputs each of its graphs reads in place
        self.masks: dict[tuple, list[_Mask]] = {}
        self.disabled: str | None = None
        self.warmup_calls = warmup_calls
        # early replays (speculate): the graph replayed last, whether the
        # prediction of the last replay was right, the graph replayed early
        # in this backward and whether the backward used it
        self.last: _Recorded | None = None
        self.confident = False
        self.pending: _Recorded | None = None
        self.early = False
        self.early_off: str | None = None
        self.buffer_pools: dict[torch.device, Any] = {}  # see _buffer_memory
        self.replays = 0  # replays so far (a graph's `used` stamp)

    def _disable(self, reason: str) -> None:
        if self.disabled is None:
            log.info("cagrad: compiled backward runs without CUDA graphs: %s", reason)
        self.disabled = reason

    def __call__(self, inputs: list, sizes: list, scalars: list, hooks: list, packed: list) -> list:
        pending = self.pending
        if pending is not None:
            self.pending = None  # used below, or wasted (settle counts which)
        if self.disabled is not None:
            counters.record_cudagraph_skip(self.disabled.split(":")[0])
            return list(self.fn(inputs, sizes, scalars, hooks, packed))
        if scalars or hooks or packed:
            self._disable("inputs_beyond_tensors_and_sizes")
            return self(inputs, sizes, scalars, hooks, packed)
        host = self.host
        if host is None:
            host = self.host = _HostInputs(inputs, self.unread)
        size_key = tuple(sizes)
        if host.positions and not host.ok(inputs, size_key):
            self._disable("cpu_input")
            return self(inputs, sizes, scalars, hooks, packed)
        addresses = list(map(_data_ptr, inputs))
        calls, last, before_last = self.seen.get(size_key, (0, None, None))
        self.seen[size_key] = (calls + 1, addresses, last)
        # small host tensors (a CPU scalar operand) are part of the key by
        # value: a replay uses the values recorded (the warm-up, for the
        # backend's lazy compile, is per tuple of sizes)
        if host.positions:
            size_key = (size_key, host.key(inputs))
        # a graph's key holds exactly the addresses its mask reads in place,
        # so trying each mask recorded at these sizes (most inputs read in
        # place first) finds the best graph that fits
        recorded = None
        for mask in self.masks.get(size_key, ()):
            recorded = self.graphs.get(_key(size_key, addresses, mask))
            if recorded is not None:
                break
        if recorded is None:
            if calls < self.warmup_calls:
                return list(self.fn(inputs, sizes, scalars, hooks, packed))
            if len(self.graphs) >= MAX_GRAPHS:
                counters.record_cudagraph_skip("too_many_graphs")
                return list(self.fn(inputs, sizes, scalars, hooks, packed))
            params = _params(inputs)
            # read in place: parameters, and inputs at the address they had
            # in the previous call (else the graph copies them); host inputs
            # are always copied into buffers the graph owns, so that what it
            # reads on replay (a captured copy from host memory) stays alive
            # and holds the keyed values
            static = _in_place(inputs, params, addresses, last)
            return self._record_and_replay(inputs, sizes, scalars, hooks, packed, size_key, addresses, static, params)
        if recorded.copies_device and before_last is not None and self.per_size.get(size_key, 0) < LAYOUT_RECORDS:
            # the graph that fits copies inputs; where they are at the address
            # they had two calls ago (the caching allocator alternating between
            # two layouts, step after step, or settled on one), a graph of its
            # own reads them in place from the next call of this layout on
            params = _params(inputs)
            better = _in_place(inputs, params, addresses, before_last)
            better = [s or b for s, b in zip(recorded.static, better)]
            if sum(better) > sum(recorded.static) and self._room(size_key, recorded):
                return self._record_and_replay(
                    inputs, sizes, scalars, hooks, packed, size_key, addresses, better, params
                )
        if not recorded.fill(inputs):
            counters.record_cudagraph_skip("overlapping_input_layout")
            return list(self.fn(inputs, sizes, scalars, hooks, packed))
        if recorded is pending:
            # replayed early (speculate): the graph this call picks by its
            # sizes, host values and the addresses it reads, with no CUDA
            # input to copy in, so the replay read exactly these inputs
            self.early = True
            return self._hand_out(recorded, inputs)
        return self._replay(recorded, inputs, sizes)

    def _room(self, size_key: tuple, keep: _Recorded) -> bool:
        """Whether one more graph may be recorded at ``size_key`` for a
        layout, evicting one if needed: the least recently replayed graph of
        these sizes, but never ``keep`` (the graph that fits this call) nor
        the one that reads fewest inputs in place (it fits any call)."""
        at_size = [k for k in self.graphs if k[0] == size_key]
        if len(at_size) < LAYOUT_GRAPHS and len(self.graphs) < MAX_GRAPHS:
            return True
        if not at_size:
            return False
        fallback = min(at_size, key=lambda k: sum(k[1]))
        candidates = [k for k in at_size if k != fallback and self.graphs[k] is not keep]
        if not candidates:
            return False
        self._evict(min(candidates, key=lambda k: self.graphs[k].used))
        return True

    def _evict(self, key: tuple) -> None:
        """Drops one graph (its memory pool goes once no output of it is
        held) and every reference to it."""
        gone = self.graphs.pop(key)
        counters.bump("cudagraph_evictions")
        for g in self.graphs.values():
            if g.next is gone:
                g.next = None
        if self.last is gone:
            self.last = None
        size_key, static = key[0], key[1]
        if all(k[0] != size_key or k[1] != static for k in self.graphs):
            masks = self.masks.get(size_key, [])
            masks[:] = [m for m in masks if m.static != static]

    def _record_and_replay(
        self, inputs: list, sizes: list, scalars: list, hooks: list, packed: list, size_key: tuple,
        addresses: list[int], static: list[bool], params: list[bool],
    ) -> list:
        try:
            recorded = self._record(inputs, sizes, static, params)
        except Exception as e:  # noqa: BLE001 - the graph is optional; fn itself still runs
            self._disable(f"capture_failed: {type(e).__name__}: {e}")
            return self(inputs, sizes, scalars, hooks, packed)
        mask = _Mask(recorded.static)
        self.graphs[_key(size_key, addresses, mask)] = recorded
        self.per_size[size_key] = self.per_size.get(size_key, 0) + 1
        masks = self.masks.setdefault(size_key, [])
        if all(m.static != mask.static for m in masks):
            masks.append(mask)
            masks.sort(key=lambda m: m.count, reverse=True)
        return self._replay(recorded, inputs, sizes)

    def _replay(self, recorded: _Recorded, inputs: list, sizes: list) -> list:
        """Replays ``recorded``; its outputs are handed out as aliases that
        the next replay reclaims (:func:`cagrad.native.reclaim_fn`): a caller
        may keep them (as ``.grad``) like any fresh outputs. Where the
        extension is not built they are :class:`BorrowedOutputs` instead; and
        where an earlier alias cannot be reclaimed (a view of it lives), this
        call runs ``fn`` without the graph (counted as ``outputs_alive``)."""
        reclaim = native.reclaim_fn()
        if reclaim is None:
            recorded.graph.replay()
            counters.bump("cudagraph_replays")
            return BorrowedOutputs(recorded.outputs)
        if recorded.handed is not None and not reclaim(recorded.handed, recorded.outputs):
            counters.record_cudagraph_skip("outputs_alive")
            return list(self.fn(inputs, list(sizes), [], [], []))
        recorded.graph.replay()
        return self._hand_out(recorded, inputs)

    def _hand_out(self, recorded: _Recorded, inputs: list) -> list:
        """The outputs of ``recorded``, replayed just now or early, as
        aliases; one that is a view of a copied input as that view of the
        caller's input (:func:`views_of_inputs`)."""
        counters.bump("cudagraph_replays")
        self.replays += 1
        recorded.used = self.replays
        self._observe(recorded)
        recorded.handed = [o.detach() if isinstance(o, torch.Tensor) else o for o in recorded.outputs]
        return views_of_inputs(recorded, recorded.handed, inputs)

    def _observe(self, recorded: _Recorded) -> None:
        """Learns the order of replays: which graph followed the last one
        (a loop whose allocator alternates between two layouts alternates
        between two graphs), whether that was the graph predicted, and the
        allocator's count of memory given back now that ``recorded``'s
        in-place addresses are known to hold its inputs."""
        last = self.last
        if last is not None:
            self.confident = recorded is (last.next or last)
            last.next = recorded
        self.last = recorded
        frees = native.device_frees_fn() if EARLY_REPLAY else None
        recorded.frees = frees(recorded.device) if frees is not None else None

    def speculate(self, known: dict[int, torch.Tensor]) -> bool:
        """Replays, before the hit guard has run, the graph the next call
        will most likely pick; returns whether it did (the caller must then
        :meth:`settle` once the backward is done with this object).

        A guarded hit spends its host time (the guard, then the call) while
        the GPU waits; replaying first lets the GPU run the graph meanwhile.
        The replay is a guess that is used only where the call that follows
        in the same backward picks this very graph by its usual lookup (the
        same sizes, every in-place input at the address the graph reads, see
        :meth:`__call__`): then the replay read exactly that call's inputs.
        Else its outputs are dropped unread (a replay writes only the graph's
        own pool) and the call runs as usual.

        The guess is made only where it is safe to read the recorded
        addresses before knowing what is there now, and likely right:

        * every CUDA input the graph copies in is in ``known`` (graph input
          position -> tensor: the root gradients, known before the guard,
          which the caller maps to the positions where the graph reads
          them), with the buffer's sizes, strides, dtype and device; those
          are copied now, and the call copies them again after the replay
          (the same data). Another input to copy is known only once the
          guard has collected it: no guess then. Host inputs are fine: the
          graph is keyed on their values, so its host buffers hold them
          already from its last replay;
        * the allocator has given no memory back to the driver since the
          graph's addresses last held its inputs (:func:`cagrad.native.
          device_frees_fn`, native allocator only): every address it reads is
          still mapped, whatever tensor holds it now;
        * no CUDA input of the graph holds integers or booleans. Whatever an
          address holds now is read as the input's dtype; floating-point
          garbage only makes garbage outputs, which are dropped, but kernels
          turn index tensors and masks into addresses (``index_select``'s
          backward, ``max_pool2d``'s indices, ``masked_scatter``): garbage
          there writes or reads out of bounds, a device-side assert at best
          and another tensor's memory overwritten at worst. (A fuzz campaign
          of CUDA-graph subjects found it: a device-side assert after a
          backward through ``index_select``.) This assumes that kernels
          address memory only through integer and boolean tensors, as
          ATen's and inductor's do; a float turned into an index inside the
          graph (``grid_sample``'s grid) is bounds-checked by its kernel;
        * the last replay was the one predicted (the graph that followed the
          previous one the time before), so a miss costs at most one extra
          replay before the prediction is trusted again;
        * the outputs handed out after its last replay are dead or moved
          (:func:`cagrad.native.reclaim_fn`), as before any replay.
        """
        if not (EARLY_REPLAY and self.confident) or self.early_off or self.disabled is not None:
            return False
        last = self.last
        if last is None:
            return False
        predicted = last.next or last
        if predicted.frees is None or predicted.addresses_by_data or predicted.spans:
            return False
        early_copies = []
        if predicted.copies_device:
            for bufs, at in predicted.copies:
                if bufs[0].device.type != "cuda":
                    continue
                sources = [known.get(i) for i in at]
                if not all(t is not None and _fits(t, buf) for t, buf in zip(sources, bufs)):
                    return False
                early_copies.append((bufs, sources))
        frees = native.device_frees_fn()
        reclaim = native.reclaim_fn()
        if frees is None or reclaim is None:
            return False
        try:
            if frees(predicted.device) != predicted.frees:
                return False  # memory given back since: an address may be unmapped
            if predicted.handed is not None:
                if not reclaim(predicted.handed, predicted.outputs):
                    return False  # a view of an output lives: the call says so
                predicted.handed = None
            with torch.no_grad():  # a root gradient may require grad; the buffer must not
                for bufs, sources in early_copies:
                    torch._foreach_copy_(bufs, sources)
            predicted.graph.replay()
        except Exception as e:  # noqa: BLE001 - the call that follows replays as usual
            self.early_off = f"{type(e).__name__}: {e}"
            log.info("cagrad: no early replays for this compiled backward: %s", self.early_off)
            return False
        self.pending = predicted
        self.early = False
        return True

    def settle(self) -> None:
        """Ends a backward that replayed early: counts the replay as used
        (``cudagraph_early_replays``) or wasted (``cudagraph_wasted_replays``,
        after which no guess is made until a prediction is right again)."""
        if self.early:
            counters.bump("cudagraph_early_replays")
        else:
            counters.bump("cudagraph_wasted_replays")
            self.confident = False
        self.pending = None
        self.early = False

    def _buffer_memory(self, device: torch.device) -> Any:
        """Where the buffers of copied CUDA inputs are allocated: a memory
        pool of their own (``torch.cuda.MemPool``), one per device and
        compiled backward. Taken from the caching allocator's main pool they
        would take blocks the next forward would have reused, so its
        activations land at new addresses and the next call matches no graph
        that reads them in place (the H100 transformer layer kept copying two
        32 MiB activations on every replay)."""
        if device.type != "cuda" or not hasattr(torch.cuda, "use_mem_pool"):
            return contextlib.nullcontext()
        pool = self.buffer_pools.get(device)
        if pool is None:
            pool = self.buffer_pools[device] = torch.cuda.MemPool()
        return torch.cuda.use_mem_pool(pool, device)

    def _record(self, inputs: list, sizes: list, static: list[bool], params: list[bool]) -> _Recorded:
        """Records ``fn`` reading the ``static`` inputs in place and the rest
        from buffers of its own (filled here). The capture runs no kernel;
        the caller replays. An output that is an input read in place (a
        gradient handed through unchanged) would be the recording call's
        tensor at every replay, so such a graph is recorded again with only
        the ``params`` read in place."""
        args = []
        buffers: list[torch.Tensor | None] = []
        spans: dict[int, torch.Tensor] = {}
        moved: dict[int, weakref.ref] = {}  # the copied inputs, while someone else holds them
        for i, s in enumerate(static):
            t = inputs[i]
            if s:
                args.append(t)
                buffers.append(None)  # no reference kept: the input may die
            elif _overlaps(t):
                # a buffer of t's layout would overlap too, and no copy can
                # write it: the graph reads t's layout over a copy of its span
                source = _span(t)
                with self._buffer_memory(t.device):
                    flat = torch.empty_like(source, memory_format=torch.contiguous_format)
                flat.copy_(source)
                del source
                spans[len(args)] = flat
                buf = flat.as_strided(t.size(), t.stride(), 0)
                args.append(buf)
                buffers.append(buf)
            else:
                with self._buffer_memory(t.device):
                    buf = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
                buf.copy_(t)
                args.append(buf)
                buffers.append(buf)
            if not s:
                # the copy stands in for the input from here on (same values,
                # sizes and strides): where the caller handed its list over,
                # the input is freed now, as eager frees a saved tensor, and
                # the recording's peak holds one of the two
                moved[i] = weakref.ref(t)
                del t
                inputs[i] = buffers[-1]
        graph = torch.cuda.CUDAGraph()
        with _capturing(graph):  # it waits for the copies above first
            outputs = list(self.fn(args, list(sizes), [], [], []))
        del args
        in_place = {_storage_address(t) for t, s, p in zip(inputs, static, params) if s and not p}
        if in_place and any(isinstance(o, torch.Tensor) and _storage_address(o) in in_place for o in outputs):
            del outputs, graph
            for i, ref in moved.items():
                original = ref()  # copied from the caller's tensor again, where it lives
                if original is not None:
                    inputs[i] = original
            return self._record(inputs, sizes, params, params)
        counters.bump("cudagraph_records")
        by_data = any(t.device.type == "cuda" and not (t.is_floating_point() or t.is_complex()) for t in inputs)
        recorded = _Recorded(graph, buffers, static, outputs, torch.cuda.current_device(), by_data, spans)
        for _, i, _ in recorded.views:
            # an output views this input: the first replay hands out that view
            # of the caller's tensor, where the caller still holds it
            original = moved[i]()
            if original is not None:
                inputs[i] = original
        return recorded


__all__ = ["EARLY_REPLAY", "LAYOUT_GRAPHS", "LAYOUT_RECORDS", "MAX_GRAPHS", "MAX_HOST_VALUES", "BorrowedOutputs", "CudaGraphed", "check_mode", "unread_host_inputs", "unsafe_reason"]
