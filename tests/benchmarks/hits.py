"""Timing a workload's backward, each round on a fresh forward graph."""

from __future__ import annotations

from typing import Any

import cagrad


def time_backward(benchmark: Any, workload: Any, compiled: bool, rounds: int) -> None:
    """Times ``rounds`` backwards of a bench workload (:mod:`harness.bench.workloads`),
    eager or under ``cagrad.enable("eager")``; each round's forward runs in
    the benchmark's ``setup``, untimed."""
    holder = {}

    def setup() -> None:
        holder["loss"] = workload.step(workload.model)

    def run() -> None:
        if compiled:
            with cagrad.enable("eager"):
                holder["loss"].backward()
        else:
            holder["loss"].backward()

    benchmark.pedantic(run, setup=setup, rounds=rounds, warmup_rounds=5)


def process_wide_gate(census: Any) -> bool:
    """``hit_path.census_allows`` as it was before guards read their own
    nodes' hook lists: no guard while any hook is live in the process."""
    return not (census.probe_nodes or census.tensor_hooks or census.cpp_hooks)
