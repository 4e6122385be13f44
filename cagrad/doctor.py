"""``python -m cagrad.doctor``: what of cagrad works on the installed torch.

Runs every check of :mod:`cagrad.internals` (the torch internals cagrad
relies on), builds and self-tests the C++ extension (:mod:`cagrad.native`),
and prints, per feature, ``works`` or ``turned off`` with the failed
internals and why (a rich table; ``--json`` for machines).

Exit status: 0 when every feature and every C++ fast path works; 1 when
something is turned off (cagrad still runs: what is off falls back to eager
autograd or to Python, see docs/torch-internals.md); 2 for a usage error
(click's). The doctor leaves global state as it found it: it draws no random
numbers (the extension's self-tests run inside ``torch.random.fork_rng``,
which restores the CPU generator), and changes no grad mode or flag.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import torch

from . import internals, native
from .autograd import node_schema

# the extension's functions that are self-tested one by one when it loads;
# each one that fails is not used (Python does the work instead)
_NATIVE_FUNCTIONS = {
    "metadata": "hit guards read node and tensor metadata in C++",
    "hookless": "hit guards check every node's hook lists in one call",
    "collect": "hit guards check every node's attributes as one program",
    "walk": "hit guards walk the captured graph in one call",
    "sole": "a gradient becomes .grad uncopied in segmented runs",
    "reclaim": "CUDA-graph outputs are handed out uncopied",
}


def diagnose() -> dict[str, Any]:
    """Runs every check and returns the report as plain data.

    Returns:
        ``{"torch": version, "ok": bool, "features": {feature: {"works":
        bool, "off_by": [internal names]}}, "internals": {name:
        {"torch_object", "used_by", "feature", "works", "why"}},
        "native_functions": {name: {"works", "what"}}}``; ``ok`` is False
        when any feature or native function is turned off.
    """
    internals.run_checks()
    node_schema._header_fields()  # reports "functions_header"
    with torch.random.fork_rng(devices=[]):
        loaded = native.load()  # reports "native_extension"
    rows = {}
    for name, internal in internals.REGISTRY.items():
        reason = internals.why(name)
        rows[name] = {
            "torch_object": internal.torch_object,
            "used_by": internal.used_by,
            "feature": internal.feature,
            "works": reason is None,
            "why": reason,
        }
    features = {}
    for feature in internals.FEATURES:
        off_by = [n for n, r in rows.items() if r["feature"] == feature and not r["works"]]
        features[feature] = {"works": not off_by, "off_by": off_by}
    functions = {
        name: {"works": loaded is not None and getattr(loaded, name) is not None, "what": what}
        for name, what in _NATIVE_FUNCTIONS.items()
    }
    ok = all(f["works"] for f in features.values()) and all(f["works"] for f in functions.values())
    return {
        "torch": torch.__version__,
        "ok": ok,
        "features": features,
        "internals": rows,
        "native_functions": functions,
    }


def _print_rich(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"cagrad on torch {report['torch']}")
    table.add_column("feature")
    table.add_column("status")
    table.add_column("why")
    for feature, state in report["features"].items():
        if state["works"]:
            table.add_row(feature, "[green]works[/green]", "")
        else:
            why = "; ".join(f"{n}: {report['internals'][n]['why']}" for n in state["off_by"])
            table.add_row(feature, "[red]turned off[/red]", why)
    for name, state in report["native_functions"].items():
        label = f"native.{name}"
        if state["works"]:
            table.add_row(label, "[green]works[/green]", "")
        else:
            table.add_row(label, "[yellow]turned off[/yellow]", f"Python instead: {state['what']} in C++ no more")
    console.print(table)
    console.print("all features work" if report["ok"] else "something is turned off (exit status 1)")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def main(as_json: bool) -> None:
    """Check which features of cagrad work on the installed torch.

    Exit status 0 when all work, 1 when something is turned off.
    """
    report = diagnose()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print_rich(report)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
