"""``python -m harness models``: the models suite from the command line.

::

    python -m harness models                          # every row, default subjects, CPU
    python -m harness models --list                   # the rows, one line each
    python -m harness models --rows gpt2,resnet --subjects 'cagrad[eager]'
    python -m harness models --device cuda --json out.json

Each row runs in its own spawned process unless ``--in-process``
(``--process-per-subject``: one per (row, subject)). Exit
status: 0 when every (row, subject) matches or is skipped, 1 when any
mismatches, errors or falls back to eager (``fell_back``), 2 on a usage
error. Outcomes of a peer (``torch_ca[...]``) are shown, marked
``(peer)``, and never change the exit status.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import click
from rich.console import Console
from rich.text import Text

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _names(text: str | None) -> list[str] | None:
    from harness.subjects import split_names

    return None if text is None else split_names(text)


@click.command("models")
@click.option("--rows", "row_names", metavar="NAMES", help="Comma-separated rows (default: all).")
@click.option(
    "--subjects",
    "subject_names",
    metavar="NAMES",
    help="Comma-separated subjects (default: cagrad[eager],cagrad[aot_eager],cagrad[inductor]).",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="The seed every run starts from.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the report here.")
@click.option("--in-process", is_flag=True, help="Run every row in this process instead of one spawned process each.")
@click.option(
    "--process-per-subject",
    is_flag=True,
    help="A spawned process per (row, subject), eager's reference rerun in each: every subject starts where cagrad "
    "never ran.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=1200.0,
    show_default=True,
    help="Seconds one row (eager and every subject) may take in its process before it is killed.",
)
@click.option("--list", "list_only", is_flag=True, help="List the rows and exit.")
def models(
    row_names, subject_names, device, seed, json_out, in_process, process_per_subject, timeout, list_only
) -> None:
    """Models of transformers, torchvision and timm trained under eager autograd and every subject, compared."""
    from harness.models import registry
    from harness.models.runner import run_models
    from harness.models.table import render

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    if list_only:
        rows = registry.all_rows()
        # columns as wide as their longest entry: a name never runs into its library
        name_w = max(len(r.name) for r in rows) + 2
        lib_w = max(len(r.library) for r in rows) + 2
        for r in rows:
            click.echo(f"{r.name:<{name_w}}{r.library:<{lib_w}}{r.description}")
        raise SystemExit(EXIT_OK)
    if in_process and process_per_subject:
        raise click.UsageError("--in-process and --process-per-subject exclude each other")
    try:
        selected = registry.select(_names(row_names))
    except KeyError as exc:
        raise click.UsageError(str(exc.args[0])) from exc

    def progress(outcomes) -> None:
        for o in outcomes:
            console.print(Text(f"{o.row} / {o.subject}: {o.status.value} ({o.seconds:.1f} s)"), highlight=False)

    try:
        report = run_models(
            selected,
            _names(subject_names),
            device,
            seed=seed,
            isolate=not in_process,
            per_subject=process_per_subject,
            timeout=timeout,
            on_outcomes=progress,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    console.print(render(report))
    versions = ", ".join(f"{k} {v or 'not installed'}" for k, v in report.versions.items())
    console.print(Text(versions), highlight=False)
    for note in report.notes:
        console.print(Text("note: " + note), highlight=False)
    if json_out is not None:
        json_out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    raise SystemExit(EXIT_OK if report.ok else EXIT_FAILED)
