"""``python -m harness stacks``: the stacks suite from the command line.

::

    python -m harness stacks                        # every stack, default subjects, CPU
    python -m harness stacks --list                 # the stacks, one line each
    python -m harness stacks --stacks mlp_sgd,threads --subjects 'cagrad[eager]'
    python -m harness stacks --no-distributed --json out.json

Exit status: 0 when every (stack, subject) matches or is skipped, 1 when
any mismatches, errors or falls back to eager (``fell_back``), 2 on a usage
error. Outcomes of a peer (``torch_ca[...]``) are shown, marked ``(peer)``,
and never change the exit status.
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


@click.command("stacks")
@click.option("--stacks", "stack_names", metavar="NAMES", help="Comma-separated stacks (default: all).")
@click.option(
    "--subjects",
    "subject_names",
    metavar="NAMES",
    help="Comma-separated subjects (default: cagrad[eager],cagrad[aot_eager],cagrad[inductor],torch_ca[eager]).",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the report here.")
@click.option("--no-distributed", is_flag=True, help="Leave out the stacks that spawn several ranks.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=120.0,
    show_default=True,
    help="Seconds each run of a distributed stack may take before its ranks are killed.",
)
@click.option("--list", "list_only", is_flag=True, help="List the stacks and exit.")
def stacks(stack_names, subject_names, device, json_out, no_distributed, timeout, list_only) -> None:
    """Named training-step programs under eager autograd and every subject, compared."""
    from harness.stacks import registry
    from harness.stacks.runner import run_stacks
    from harness.stacks.table import render

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    if list_only:
        for s in registry.all_stacks():
            tags = [f"{s.world_size} ranks"] if s.distributed else []
            tags += ["CUDA"] if s.requires_cuda else []
            tags += [f"engine per {s.placement}"] if s.placement != "backward" else []
            suffix = f" [{', '.join(tags)}]" if tags else ""
            click.echo(f"{s.name:<26}{s.description}{suffix}")
        raise SystemExit(EXIT_OK)
    try:
        selected = registry.select(_names(stack_names))
    except KeyError as exc:
        raise click.UsageError(str(exc.args[0])) from exc
    if no_distributed:
        selected = [s for s in selected if not s.distributed]

    def progress(outcomes) -> None:
        for o in outcomes:
            console.print(Text(f"{o.stack} / {o.subject}: {o.status.value}"), highlight=False)

    try:
        report = run_stacks(selected, _names(subject_names), device, timeout=timeout, on_outcomes=progress)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    console.print(render(report))
    if json_out is not None:
        json_out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    raise SystemExit(EXIT_OK if report.ok else EXIT_FAILED)
