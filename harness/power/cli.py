"""``python -m harness.power``: mutation testing of cagrad's core with cosmic-ray.

Commands: ``run`` (sample, run or resume, report), ``report`` (one report
from a run's folders, shards merged, reruns of its survivors applied),
``relocate`` (a report's mutants found in the current tree).
docs/mutation-testing.md is the manual.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

EXIT_USAGE = 2


def _fail(message: str) -> None:
    click.echo(f"harness.power: {message}", err=True)
    sys.exit(EXIT_USAGE)


def _summary(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mutation score per module")
    for col in ("module", "mutants", "killed", "timeout", "survived", "equivalent", "pending", "score"):
        table.add_column(col, justify="left" if col == "module" else "right")
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    for name, c in [*report["modules"].items(), ("total", report["total"])]:
        table.add_row(name, *(str(c[k]) for k in ("mutants", "killed", "timeout", "survived", "equivalent", "pending")), pct(c["score"]))
    console = Console(stderr=True)
    if not console.is_terminal:
        console.width = max(console.width, 130)  # module paths whole in logs
    console.print(table)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Mutation testing of cagrad's core: how many seeded bugs the fuzzer, the golden check and tests catch."""


@main.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Run folder (session database, report); an existing one is resumed.")
@click.option("--sample", type=click.IntRange(min=1), default=300, show_default=True,
              help="Mutants drawn from all of the modules' mutants (before sharding).")
@click.option("--all", "all_mutants", is_flag=True, help="Every mutant instead of a sample.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Sampling seed.")
@click.option("--shard", help="K/N: run the K-th of N disjoint shares of the sample (merge with 'report A B ...').")
@click.option("--module", "targets", multiple=True,
              help="Package folder or .py file to mutate, relative to the repository (repeatable; "
                   "default: cagrad/keys, autograd, capture, run, native).")
@click.option("--killers", default="tests,golden,fuzz", show_default=True,
              help="Killers in order (the first failure kills): tests, golden, fuzz, or pytest:PATH.")
@click.option("--programs", type=click.IntRange(min=1), default=30, show_default=True,
              help="Programs of the fuzz killer's campaign.")
@click.option("--timeout-factor", type=click.FloatRange(min=1), default=5.0, show_default=True,
              help="Per-mutant timeout, as a multiple of the baseline (the killers on the unmutated tree, timed at start).")
@click.option("--max-mutants", type=click.IntRange(min=1), help="Stop after this many mutants (resume the folder later).")
@click.option("--equivalents", type=click.Path(dir_okay=False, path_type=Path),
              help="Reviewed equivalents file (default: harness/power/equivalents.toml).")
@click.option("--mutant", "only", multiple=True, metavar="ID",
              help="Run this mutant (module:line:operator:occurrence, as the report names it) instead of a sample "
                   "(repeatable): e.g. a report's survivors again after a new test.")
@click.option("--scratch", type=click.Path(file_okay=False, path_type=Path),
              help="Where the tree copy goes (default: the system's temporary folder).")
def run(out, sample, all_mutants, seed, shard, targets, killers, programs, timeout_factor, max_mutants, equivalents, only, scratch):
    """Sample mutants, run the killers on each in a copy of the tree, write OUT/report.{json,md}."""
    from harness.power import report as report_mod
    from harness.power.equivalents import EquivalentsError, load
    from harness.power.mutants import CORE_PACKAGES
    from harness.power.runner import BaselineError, RunConfig, run as run_session
    from harness.power.session import SessionError

    from fuzz.campaign.config import parse_shard

    try:
        load(equivalents)  # a malformed file fails before the run, not after it
        from harness.power.mutants import MutantId

        for text in only:
            MutantId.parse(text)
        shard_kn = parse_shard(shard) if shard else (1, 1)
        from harness.power.kill import command

        for k in killers.split(","):
            command(k, programs, "")
    except (EquivalentsError, ValueError) as e:
        _fail(str(e))
    cfg = RunConfig(
        out=out, sample=None if all_mutants else sample, seed=seed, shard=shard_kn,
        targets=tuple(targets) or CORE_PACKAGES, killers=tuple(killers.split(",")), programs=programs,
        timeout_factor=timeout_factor, max_mutants=max_mutants, scratch=scratch, only=only,
    )  # fmt: skip
    try:
        run_session(cfg, log=lambda m: click.echo(m, err=True))
        rep = report_mod.build([out], equivalents)
    except KeyboardInterrupt:
        click.echo(f"harness.power: interrupted; run the same command again to resume {out}", err=True)
        sys.exit(130)
    except ImportError as e:
        _fail(f"{e}: install the power extra (pip install -e .[power])")
    except (SessionError, BaselineError, FileNotFoundError, report_mod.ReportError) as e:
        _fail(str(e))
    paths = report_mod.write(rep, out)
    _summary(rep)
    click.echo(f"report: {paths[0]}, {paths[1]}", err=True)


@main.command()
@click.argument("folders", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Where report.{json,md} go.")
@click.option("--equivalents", type=click.Path(dir_okay=False, path_type=Path),
              help="Reviewed equivalents file (default: harness/power/equivalents.toml).")
@click.option("--rerun", "reruns", multiple=True, type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Folder of a 'run --mutant ...' of the sample's survivors after new tests (repeatable; "
                   "a later one wins): its outcomes replace the sample's.")
@click.option("--relocated", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Map written by 'relocate' (sample id -> current id): rerun ids that moved since the sample.")
def report(folders, out, equivalents, reruns, relocated):
    """One report from run folders (the shards of one run), with reruns of its survivors."""
    from harness.power import report as report_mod
    from harness.power.equivalents import EquivalentsError
    from harness.power.session import SessionError

    try:
        from harness.power.relocate import load_map

        rep = report_mod.build(list(folders), equivalents, reruns, load_map(relocated) if relocated else None)
    except (report_mod.ReportError, EquivalentsError, SessionError, ValueError) as e:
        _fail(str(e))
    paths = report_mod.write(rep, out)
    _summary(rep)
    click.echo(f"report: {paths[0]}, {paths[1]}", err=True)


@main.command()
@click.argument("report_json", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--outcome", "outcomes", multiple=True, default=("survived", "pending"), show_default=True,
              help="Rows of these outcomes (repeatable).")
@click.option("--sample-tree", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="A checkout of the sample's commit: where a pending row's diff is made (it has none).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The map (JSON: sample id -> current id or null), for 'report --relocated'.")
@click.option("--ids", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the current ids, one per line (for 'run --mutant').")
def relocate(report_json, outcomes, sample_tree, out, ids):
    """Find a report's mutants in the current tree (lines and occurrences move when code is added above)."""
    import json

    from harness.power.relocate import relocate as find

    try:
        rows = [r for r in json.loads(report_json.read_text())["mutants"] if r["outcome"] in outcomes]
    except (ValueError, KeyError, TypeError) as e:
        _fail(f"{report_json}: not a harness.power report.json ({e})")
    found = find(Path.cwd(), rows, sample_tree)
    out.write_text(json.dumps(found, indent=1))
    if ids is not None:
        ids.write_text("".join(f"{v}\n" for v in found.values() if v))
    for sample_id, current in found.items():
        if current != sample_id:
            click.echo(f"{sample_id} -> {current or 'not found (judge it again)'}", err=True)
    click.echo(f"{sum(v is not None for v in found.values())} of {len(found)} found; map: {out}", err=True)
