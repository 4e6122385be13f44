"""Process-wide counters of what cagrad did, readable as ``cagrad.counters``."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("cagrad")

_INT_KEYS = (
    "backwards",  # backward passes that entered cagrad
    "captures",  # backward passes that were traced into a new graph
    "cache_hits",  # backward passes that reused a compiled graph
    "guard_hits",  # of those, the ones a generated hit guard accepted (cagrad.keys.hit_path)
    "fallbacks",  # backward passes run by eager autograd instead
    "recompiles_shape",  # captures caused by sizes that differ from a cached graph
    "recompiles_new_node",  # captures caused by a node or attribute never seen there
    "recompiles_global_state",  # captures caused by a global state (grad mode, deterministic
    # algorithms, thread count, ...) no compiled variant of that graph was compiled in
    "deopts",  # compiled backwards finished by the interpreter (a hook or opaque
    # node returned None where the graph assumed a gradient)
    "retraces",  # graphs traced again at the end of a deopted first run, assuming what
    # it saw, so that the next backward hits (not captures: no backward was added)
    "segment_compile_failures",  # graph segments run uncompiled after a backend error
    "backend_compiles",  # graphs (whole or segments) a named backend compiled directly
    "graph_segments",  # compiled graphs per capture or retrace, summed: 1 for a whole
    # graph, else the segments between its opaque calls (cagrad.capture.segments)
    "dynamo_compiles",  # of those, ones handed to torch.compile instead (Dynamo
    # compiles them on their first call and guards them)
    "nodes_forced_opaque",  # nodes that failed to trace and run as they are in
    # their compiled backward (the rest of the graph stays compiled)
    "cudagraph_records",  # CUDA graphs recorded (mode="reduce-overhead", cagrad.compile.cuda_graphs)
    "cudagraph_replays",  # compiled backwards replayed as a CUDA graph
    "cudagraph_skips",  # compiled backwards of that mode run without a graph
    "cudagraph_early_replays",  # of the replays, ones started before the hit guard ran
    "cudagraph_wasted_replays",  # early replays the backward did not use (another graph, a miss)
    "cudagraph_evictions",  # graphs dropped for one that reads a new allocator layout in place
    "disk_hits",  # captures loaded from the disk cache instead of traced (cagrad.compile.disk_cache)
    "disk_stores",  # captures written to the disk cache
    "disk_skips",  # captures with a disk cache that were not written (reason logged at DEBUG)
    "specializations",  # static compiles of a symbolic graph for sizes it runs at (cagrad.compile.specialize)
    "hooks_traced",  # tensor and node hook dicts traced into a captured graph (cagrad.hooks.hook_tracing)
    "hooks_opaque",  # of the dicts chosen for tracing, ones that did not trace and run opaque
    "custom_functions_traced",  # custom Function backwards traced into a captured graph
    # (cagrad.hooks.backward_tracing; one that fails to trace counts in nodes_forced_opaque)
)


class Counters(Mapping[str, Any]):
    """A live, read-only view of cagrad's counters.

    Keys: the integer counters ``backwards``, ``captures``, ``cache_hits``,
    ``guard_hits``, ``fallbacks``, ``recompiles_shape``,
    ``recompiles_new_node``, ``recompiles_global_state``, ``deopts``, ``retraces``, ``segment_compile_failures``,
    ``backend_compiles``, ``graph_segments``, ``dynamo_compiles``, ``nodes_forced_opaque``,
    ``cudagraph_records``, ``cudagraph_replays``, ``cudagraph_skips``,
    ``cudagraph_early_replays``, ``cudagraph_wasted_replays``, ``cudagraph_evictions``,
    ``disk_hits``, ``disk_stores``, ``disk_skips`` (:mod:`cagrad.compile.disk_cache`;
    a disk hit is a capture too: ``captures`` counts it),
    ``specializations`` (:mod:`cagrad.compile.specialize`);
    ``fallback_reasons``, a ``collections.Counter`` from reason slug (see
    :class:`cagrad.errors.Unsupported`) to the number of backward passes that
    fell back for it; ``opaque_reasons``, the same for nodes forced to
    run as they are; and ``cudagraph_skip_reasons``, the same for compiled
    backwards run without a CUDA graph (:mod:`cagrad.compile.cuda_graphs`). ``cagrad.reset()`` sets them all to zero in place, so a
    reference to this object stays valid. ``disabled_features``, a
    ``collections.Counter`` from feature (:data:`cagrad.internals.FEATURES`)
    to the number of torch internals that failed their check and turned it
    off, describes the installed torch rather than events, so
    ``cagrad.reset()`` keeps it (:func:`cagrad.internals.recheck` clears it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ints: dict[str, int] = dict.fromkeys(_INT_KEYS, 0)
        self._reasons: collections.Counter[str] = collections.Counter()
        self._opaque: collections.Counter[str] = collections.Counter()
        self._cudagraph: collections.Counter[str] = collections.Counter()
        self._disabled: collections.Counter[str] = collections.Counter()

    def __getitem__(self, key: str) -> Any:
        if key == "fallback_reasons":
            return self._reasons
        if key == "opaque_reasons":
            return self._opaque
        if key == "cudagraph_skip_reasons":
            return self._cudagraph
        if key == "disabled_features":
            return self._disabled
        return self._ints[key]

    def __iter__(self) -> Iterator[str]:
        yield from self._ints
        yield "fallback_reasons"
        yield "opaque_reasons"
        yield "cudagraph_skip_reasons"
        yield "disabled_features"

    def __len__(self) -> int:
        return len(self._ints) + 4

    def __repr__(self) -> str:
        return (
            f"Counters({dict(self._ints)}, fallback_reasons={dict(self._reasons)}, "
            f"opaque_reasons={dict(self._opaque)}, cudagraph_skip_reasons={dict(self._cudagraph)}, "
            f"disabled_features={dict(self._disabled)})"
        )

    def bump(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._ints[key] += n

    def record_fallback(self, reason: str, detail: str) -> None:
        """Counts one backward that eager ran, and logs why."""
        with self._lock:
            self._ints["fallbacks"] += 1
            self._reasons[reason] += 1
        log.info("cagrad falls back to eager autograd (%s): %s", reason, detail)

    def record_forced_opaque(self, reason: str, detail: str) -> None:
        """Counts one node that failed to trace and runs as it is, and logs why."""
        with self._lock:
            self._ints["nodes_forced_opaque"] += 1
            self._opaque[reason] += 1
        log.info("cagrad runs a node as it is (%s): %s", reason, detail)

    def record_cudagraph_skip(self, reason: str) -> None:
        """Counts one compiled backward run without its CUDA graph."""
        with self._lock:
            self._ints["cudagraph_skips"] += 1
            self._cudagraph[reason] += 1

    def record_disabled(self, feature: str) -> None:
        """Counts one torch internal that failed its check and turned
        ``feature`` off (:mod:`cagrad.internals`)."""
        with self._lock:
            self._disabled[feature] += 1

    def clear_disabled(self) -> None:
        with self._lock:
            self._disabled.clear()

    def clear(self) -> None:
        with self._lock:
            for key in self._ints:
                self._ints[key] = 0
            self._reasons.clear()
            self._opaque.clear()
            self._cudagraph.clear()

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy, e.g. for deltas around a run."""
        with self._lock:
            out: dict[str, Any] = dict(self._ints)
            out["fallback_reasons"] = dict(self._reasons)
            out["opaque_reasons"] = dict(self._opaque)
            out["cudagraph_skip_reasons"] = dict(self._cudagraph)
            out["disabled_features"] = dict(self._disabled)
            return out


counters = Counters()
