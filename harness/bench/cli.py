"""``python -m harness.bench``: the side-by-side tables, and their JSON."""

from __future__ import annotations

import json
import platform
import re
import shutil
import statistics
from collections.abc import Callable

import click
import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .first import FirstCell, fresh_cache_dir, growth_exponent, measure_first
from .measure import measure, measure_row
from .model_workloads import KNOWN, SIZES, build, default_size, unavailable
from .subjects import SUBJECTS
from .workloads import FAMILIES, STEADY


def _split(value: str, known: dict) -> list[str]:
    # commas inside brackets belong to a name: cagrad[inductor,reduce-overhead]
    names = [n.strip() for n in re.split(r",(?![^\[]*\])", value) if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; known: {', '.join(known)}")
    return names


FIRST_SUBJECTS = "torch_ca[eager],cagrad[eager],torch_ca[inductor],cagrad[inductor]"
FIRST_WORKLOADS = ",".join([*FAMILIES["transformer"], *FAMILIES["chain"], "mlp"])


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--mode", type=click.Choice(["steady", "first"]), default="steady", show_default=True,
              help="steady: hit-path backward; first: the first backward of a new graph (capture + compile)")
@click.option("--workloads", default=None, help=f"comma-separated; default steady: {','.join(STEADY)}; "
              f"first: {FIRST_WORKLOADS}; on request: the others of {','.join(KNOWN)}")
@click.option("--size", type=click.Choice(SIZES), default=None,
              help="the model workloads' size (gpt2, llama; needs transformers); default full on cuda, small on "
              "cpu; the other workloads size by --device alone")
@click.option("--subjects", default=None, help=f"comma-separated; default steady: all but the ,dynamic ones (the reduce-overhead ones on CUDA only); first: {FIRST_SUBJECTS}")
@click.option("--iters", default=30, show_default=True, help="steady: timed backwards per cell")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(min=1),
              help="steady: measure the whole table this many times, one round after another; each ratio is "
              "the median of its rounds' ratios, each taken against eager's cell of the same round (drift of "
              "the machine between cells cancels), shown with its range")
@click.option("--interleave/--sequential", default=True, show_default=True,
              help="steady: time the subjects of a workload in turns, one backward each per turn, and take each "
              "ratio as the median of the per-turn ratios to eager (the machine's drift falls on every subject "
              "alike); --sequential: one subject's backwards after another's, each in a fresh compile state")
@click.option("--warm/--no-warm", default=True, show_default=True,
              help="first: also run each cell again in a second process on the caches the first filled")
@click.option("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the cells here")
def main(device: str, mode: str, workloads: str | None, size: str | None, subjects: str | None, iters: int,
         rounds: int, interleave: bool, warm: bool, threads: int | None, json_path: str | None) -> None:
    """Backward timings side by side, one run: steady state (median ms per
    subject and workload, ratio to eager, cagrad's own overhead per node in
    us, peak CUDA memory in MiB, the backward's GPU kernel time in ms) or
    first backward (seconds, cagrad's split into trace and backend compile,
    inductor's compile_fx time for every subject, cold and warm start, and
    the growth exponent of time against node count per workload family).
    A workload that cannot be built here (gpt2, llama without transformers)
    is skipped with its reason, logged and written to the JSON."""
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: no CUDA device here")
    if threads:
        torch.set_num_threads(threads)
    first = mode == "first"
    wl_names = _split(workloads or (FIRST_WORKLOADS if first else ",".join(STEADY)), KNOWN)
    steady = ",".join(n for n, s in SUBJECTS.items() if s.default and (device == "cuda" or not s.cuda_only))
    sub_names = _split(subjects or (FIRST_SUBJECTS if first else steady), SUBJECTS)
    console = Console(width=200)
    meta = {"device": device, "mode": mode, "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads()}
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    skipped = {wl: reason for wl in wl_names if (reason := unavailable(wl))}
    for wl, reason in skipped.items():
        console.log(f"{wl}: skipped: {reason}", markup=False)
    wl_names = [wl for wl in wl_names if wl not in skipped]
    meta["size"] = size or default_size(device)
    if first:
        doc = _first(console, device, wl_names, sub_names, warm, threads, size)
    else:
        meta["iters"], meta["rounds"], meta["interleave"] = iters, rounds, interleave
        doc = {"cells": _steady(console, device, wl_names, sub_names, iters, rounds, size, interleave)}
    doc["skipped"] = skipped
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, **doc}, f, indent=2)


def _steady(console: Console, device: str, wl_names: list[str], sub_names: list[str], iters: int,
            rounds: int, size: str | None, interleave: bool) -> dict:
    measured: dict[str, dict[str, list[dict]]] = {wl: {sub: [] for sub in sub_names} for wl in wl_names}
    for r in range(rounds):
        at = f" (round {r + 1}/{rounds})" if rounds > 1 else ""
        for wl in wl_names:
            if interleave:
                torch.manual_seed(0)
                cells = measure_row(build(wl, device, size), {sub: SUBJECTS[sub] for sub in sub_names}, device, iters)
            else:
                cells = {}
                for sub in sub_names:
                    torch.manual_seed(0)
                    cells[sub] = measure(build(wl, device, size), SUBJECTS[sub], device, iters)
            for sub, cell in cells.items():
                measured[wl][sub].append(cell.__dict__)
                console.log(f"{wl} / {sub}{at}: {cell.ms and round(cell.ms, 3)} ms {cell.error or ''}", markup=False)
    results = {wl: {sub: combine_rounds(row[sub], row.get("eager")) for sub in sub_names}
               for wl, row in measured.items()}

    def steady_text(row: dict, sub: str) -> str:
        c, eager_ms = row[sub], row.get("eager", {}).get("ms")
        text = f"{c['ms']:.3f} ms"
        if c.get("ratio") is not None and sub != "eager":
            low, high = c["ratio_range"]
            text += f" ({c['ratio']:.2f}x)" if low == high else f" ({c['ratio']:.2f}x, {low:.2f}-{high:.2f})"
        elif eager_ms and sub != "eager":
            text += f" ({c['ms'] / eager_ms:.2f}x)"
        if c.get("overhead_us_per_node") is not None:
            text += f"\n{c['overhead_us_per_node']:.2f} us/node"
        if c.get("peak_mib") is not None:
            text += f"\n{c['peak_mib']:.0f} MiB"
            if c.get("records_timed") and c.get("peak_steady_mib") is not None:
                text += f" ({c['peak_steady_mib']:.0f} steady)"
        if c.get("gpu_ms") is not None:
            text += f"\nGPU {c['gpu_ms']:.3f} ms"
        return text

    table = _grid(f"steady-state backward, {device}, torch {torch.__version__}: median ms (ratio to eager)"
                  + ("; cagrad's own overhead per node" if device == "cpu" else
                     "; cagrad's own overhead per node, peak MiB above the forward's, GPU: the backward's "
                     "kernel time (the floor with no host overhead)"), results, wl_names, sub_names,
                  lambda c: c, "ms", steady_text)
    console.print(table)
    return results


def combine_rounds(cells: list[dict], eager: list[dict] | None) -> dict:
    """One subject's cells of every round as one cell.

    Args:
        cells: its :class:`~harness.bench.measure.Cell` dicts, one per round.
        eager: eager's cells of the same workload, round for round (None
            where eager was not measured).

    Returns:
        the last round's cell, with ``ms``, ``overhead_us_per_node`` and
        ``gpu_ms`` the medians of the rounds that measured them,
        ``peak_mib`` and ``peak_steady_mib`` their largest,
        ``records_timed`` their sum, ``round_ms`` each round's ms (None
        where it failed), ``round_turn_ms`` each round's ``turn_ms``, and where eager was measured ``ratio``: the
        median over rounds of each round's ratio (the cell's own ``ratio``,
        taken turn by turn beside eager, where it has one; else its ms /
        eager's ms of that round), and ``ratio_range``: [lowest, highest]
        of them. ``error`` stays set only
        where no round measured the cell.
    """
    out = dict(cells[-1])
    good = [c for c in cells if c["ms"] is not None]
    out["round_ms"] = [c["ms"] for c in cells]
    out["round_turn_ms"] = [c.get("turn_ms") for c in cells]
    if not good:
        return out
    out["error"] = None
    for key in ("ms", "overhead_us_per_node", "gpu_ms"):
        values = [c[key] for c in good if c[key] is not None]
        out[key] = statistics.median(values) if values else None
    for key in ("peak_mib", "peak_steady_mib"):
        peaks = [c[key] for c in good if c.get(key) is not None]
        out[key] = max(peaks) if peaks else None
    records = [c["records_timed"] for c in good if c.get("records_timed") is not None]
    out["records_timed"] = sum(records) if records else None
    out["nodes"] = next((c["nodes"] for c in good if c["nodes"]), None)
    if eager is not None:
        ratios = [c["ratio"] if c.get("ratio") is not None else c["ms"] / e["ms"]
                  for c, e in zip(cells, eager) if c["ms"] is not None and e["ms"]]
        if ratios:
            out["ratio"] = statistics.median(ratios)
            out["ratio_range"] = [min(ratios), max(ratios)]
    return out


def _grid(title: str, results: dict, wl_names: list[str], sub_names: list[str],
          measured: Callable[[dict], dict], value: str, text: Callable[[dict, str], str]) -> Table:
    """A workload x subject table: ``text(row, subject)`` for each measured
    cell (``measured(cell)[value]`` set), the error in red otherwise, and the
    count of cagrad fallbacks under it."""
    table = Table(title=title)
    table.add_column("workload (nodes)")
    for sub in sub_names:
        table.add_column(Text(sub), justify="right")
    for wl in wl_names:
        row = results[wl]
        nodes = next((measured(c)["nodes"] for c in row.values() if measured(c).get("nodes")), None)
        cells = []
        for sub in sub_names:
            c = measured(row[sub])
            if c[value] is None:
                cells.append(Text(c["error"] or "", style="red"))
                continue
            out = text(row, sub)
            if c["counters"].get("fallbacks"):
                out += f"\n{c['counters']['fallbacks']} fallbacks"
            cells.append(Text(out))
        table.add_row(f"{wl} ({nodes})", *cells)
    return table


def _peer(sub: str) -> str | None:
    """cagrad[x] -> torch_ca[x]: the ratio column's reference."""
    return "torch_ca" + sub[len("cagrad"):] if sub.startswith("cagrad[") else None


def _first(console: Console, device: str, wl_names: list[str], sub_names: list[str], warm: bool,
           threads: int | None, size: str | None) -> dict:
    results: dict[str, dict[str, dict]] = {}
    for wl in wl_names:
        results[wl] = {}
        for sub in sub_names:
            cache = fresh_cache_dir()
            try:
                cold = measure_first(wl, sub, device, cache, threads, size)
                hot = measure_first(wl, sub, device, cache, threads, size) if warm else FirstCell()
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            results[wl][sub] = {"cold": cold.__dict__, "warm": hot.__dict__}
            console.log(f"{wl} / {sub}: cold {cold.seconds and round(cold.seconds, 2)} s, warm "
                        f"{hot.seconds and round(hot.seconds, 2)} s {cold.error or hot.error or ''}", markup=False)

    def first_text(row: dict, sub: str) -> str:
        cold, hot = row[sub]["cold"], row[sub]["warm"]
        text = f"{cold['seconds']:.2f}" + (f" / {hot['seconds']:.2f}" if hot.get("seconds") else "")
        peer = row.get(_peer(sub) or "", {}).get("cold", {}).get("seconds")
        if peer:
            text += f" ({cold['seconds'] / peer:.2f}x)"
        if cold.get("trace_s") is not None:
            text += f"\n{cold['trace_s']:.2f} + {cold['compile_s']:.2f}"
        elif cold.get("backend_s") is not None:
            text += f"\n{cold['seconds'] - cold['backend_s']:.2f} + {cold['backend_s']:.2f}"
        if peer and cold.get("backend_s") is not None:
            text += f"\nfloor {cold['backend_s'] / peer:.2f}x"
        return text

    table = _grid(f"first backward (s), {device}, torch {torch.__version__}: cold / warm (ratio to torch_ca with "
                  "the same backend); cagrad: trace + backend compile; torch_ca: the rest + inductor's compile_fx; "
                  "floor: cagrad's compile_fx time / torch_ca's first backward (the lowest ratio a faster capture "
                  "could reach)", results, wl_names, sub_names,
                  lambda c: c["cold"], "seconds", first_text)
    console.print(table)
    exponents: dict[str, dict[str, float | None]] = {}
    for family, members in FAMILIES.items():
        present = [m for m in members if m in results]
        if len(present) < 2:
            continue
        exponents[family] = {}
        for sub in sub_names:
            pts = [(results[m][sub]["cold"]["nodes"], results[m][sub]["cold"]["seconds"]) for m in present]
            exponents[family][sub] = growth_exponent([(n, s) for n, s in pts if n and s])
    if exponents:
        growth = Table(title="growth exponent b of first-backward time ~ nodes^b (cold; 1.0 is linear)")
        growth.add_column("family")
        for sub in sub_names:
            growth.add_column(Text(sub), justify="right")
        for family, row in exponents.items():
            growth.add_row(family, *[f"{row[s]:.2f}" if row[s] is not None else "-" for s in sub_names])
        console.print(growth)
    return {"cells": results, "growth_exponents": exponents}
