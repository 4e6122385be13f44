"""``python -m harness.bench``: the side-by-side table, and its JSON."""

from __future__ import annotations

import json
import platform

import click
import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .measure import measure
from .subjects import SUBJECTS
from .workloads import WORKLOADS


def _split(value: str, known: dict) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; known: {', '.join(known)}")
    return names


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True, help="comma-separated")
@click.option("--subjects", default=",".join(SUBJECTS), show_default=True, help="comma-separated")
@click.option("--iters", default=30, show_default=True, help="timed backwards per cell")
@click.option("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the cells here")
def main(device: str, workloads: str, subjects: str, iters: int, threads: int | None, json_path: str | None) -> None:
    """Steady-state backward: median ms per subject and workload, ratio to
    eager, cagrad's own overhead per node (us), peak CUDA memory (MiB)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: no CUDA device here")
    if threads:
        torch.set_num_threads(threads)
    wl_names = _split(workloads, WORKLOADS)
    sub_names = _split(subjects, SUBJECTS)
    console = Console(width=200)
    results: dict[str, dict[str, dict]] = {}
    for wl in wl_names:
        results[wl] = {}
        for sub in sub_names:
            torch.manual_seed(0)
            cell = measure(WORKLOADS[wl](device), SUBJECTS[sub], device, iters)
            results[wl][sub] = cell.__dict__
            console.log(f"{wl} / {sub}: {cell.ms and round(cell.ms, 3)} ms {cell.error or ''}", markup=False)
    table = Table(title=f"steady-state backward, {device}, torch {torch.__version__}")
    table.add_column("workload (nodes)")
    for sub in sub_names:
        table.add_column(Text(sub), justify="right")
    for wl in wl_names:
        row = results[wl]
        eager_ms = row.get("eager", {}).get("ms")
        nodes = next((c["nodes"] for c in row.values() if c.get("nodes")), None)
        cells = []
        for sub in sub_names:
            c = row[sub]
            if c["ms"] is None:
                cells.append(Text(c["error"], style="red"))
                continue
            text = f"{c['ms']:.3f} ms"
            if eager_ms and sub != "eager":
                text += f" ({c['ms'] / eager_ms:.2f}x)"
            if c.get("overhead_us_per_node") is not None:
                text += f"\n{c['overhead_us_per_node']:.2f} us/node"
            if c.get("peak_mib") is not None:
                text += f"\n{c['peak_mib']:.0f} MiB"
            if c["counters"].get("fallbacks"):
                text += f"\n{c['counters']['fallbacks']} fallbacks"
            cells.append(Text(text))
        table.add_row(f"{wl} ({nodes})", *cells)
    console.print(table)
    if json_path:
        meta = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
                "threads": torch.get_num_threads(), "iters": iters}
        if device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name()
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "cells": results}, f, indent=2)
