"""Command line: ``python -m fuzz`` or the ``cagrad-fuzz`` console script.

::

    python -m fuzz campaign --budget 600 --seed 1 --out fuzz-out
    python -m fuzz replay fuzz-out/failures/F001-.../reproducer.py
    python -m fuzz replay program.json --subjects 'cagrad[eager],torch_ca[eager]'
    python -m fuzz replay program.json --show      # as plain torch code
    python -m fuzz ops                             # the op catalog
    python -m fuzz coverage --seed 1 --programs 500   # what a campaign would cover (generated, not run)
    python -m fuzz campaign --budget 60 --out o --ops 'fn_sin_scale,slice_mul_,sin' --no-hooks
    python -m fuzz campaign --budget 60 --out o --no-shapes   # no size sequences
    python -m fuzz campaign --budget 3600 --seed 7 --shard 2/4 --out shard2   # one of 4 machines
    python -m fuzz merge shard1 shard2 shard3 shard4 --out merged

Every command runs cagrad with ``CAGRAD_VERIFY_GUARDS=1`` unless the
environment sets it (``0`` turns it off): each backward a generated hit guard
accepts is collected again by the full path, and one the full path sees as
another graph raises cagrad's internal error, so a wrong guarded hit is a
failure of the campaign even where its gradients happen to agree with
eager's (:mod:`cagrad.keys.hit_path`).
It also sets ``CAGRAD_STRICT=1`` unless the environment sets it: an
internal error of cagrad raises (a finding: an exception eager does not
raise) instead of falling back to eager (:mod:`cagrad.internal_errors`).

Exit status: 0 clean, 1 divergence found (campaign) or reproduced (replay),
2 usage or I/O error, 3 internal error of the fuzzer, 130 campaign
interrupted.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import click

EXIT_CLEAN, EXIT_DIVERGENCE, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    from harness.subjects import split_names

    return split_names(text)


def _quiet_warnings() -> None:
    # torch without numpy warns on import; nothing the user can act on here.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """cagrad-fuzz: random autograd programs, eager vs compiled autograd."""
    _quiet_warnings()
    # set before any worker starts: workers inherit it (see the module docstring)
    os.environ.setdefault("CAGRAD_VERIFY_GUARDS", "1")
    # an internal error is a finding (an exception eager does not raise),
    # not a fallback (cagrad.internal_errors)
    os.environ.setdefault("CAGRAD_STRICT", "1")


@main.command()
@click.option("--budget", "budget", type=click.FloatRange(min=0), required=True, help="Seconds of generation.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Campaign seed.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Output directory (state, report.json, failures); an existing one is resumed.",
)
@click.option(
    "--subjects",
    help="Comma-separated harness subjects, e.g. 'cagrad[eager],torch_ca[eager]' "
    "(default: the harness defaults; none when only --plugin is given).",
)
@click.option(
    "--plugin",
    "plugins",
    multiple=True,
    help="Extra subjects from 'file.py:NAME' or 'module:NAME' (a harness.Subject, a subclass or a factory).",
)
@click.option("--device", "devices", multiple=True, help="Device to run on (repeatable; default: all available).")
@click.option("--max-ops", type=click.IntRange(min=1), default=12, show_default=True, help="Ops per program, at most.")
@click.option("--max-leaves", type=click.IntRange(min=1), default=5, show_default=True, help="Leaves per program, at most.")
@click.option("--ops", "ops", help="Comma-separated op names to draw from (default: the whole catalog).")
@click.option("--dtypes", default="float32,float64", show_default=True, help="Leaf dtypes to draw from.")
@click.option("--modes", default="backward,grad", show_default=True, help="Backward entry points to use.")
@click.option(
    "--repeat/--no-repeat", default=True, show_default=True, help="Now and then run backward twice with retain_graph."
)
@click.option(
    "--hooks/--no-hooks",
    default=True,
    show_default=True,
    help="Register hooks (tensor, retain_grad, node pre/post, post-accumulate-grad) on most programs.",
)
@click.option("--max-hooks", type=click.IntRange(min=1), default=4, show_default=True, help="Hooks per program, at most.")
@click.option(
    "--hook-actions",
    default=None,
    metavar="KIND.ACTION,...",
    help="Draw hooks only of these kinds and actions (e.g. 'tensor.pure_scale,tensor.pure_shift': hooks "
    "cagrad traces into its graph); default: every one but the opt-in 'pre.pure_scale' and 'post.pure_scale' "
    "(pure node hooks) and 'tensor.warn' (a hook that warns), drawn only when named.",
)
@click.option(
    "--shapes/--no-shapes",
    default=True,
    show_default=True,
    help="Make some programs (about one in nine with default options) a size sequence: re-run at new leaf sizes, grads checked at every "
    "size, cagrad's captures checked against its rule (at most one recapture per new set of dynamic sizes); "
    "the report lists every subject's captures per size variant.",
)
@click.option(
    "--training/--no-training",
    default=True,
    show_default=True,
    help="Make about one program in eight train (1-3 SGD or Adam steps, every loss, .grad and parameter "
    "compared after each step) and about one in eight checkpoint a region of its ops (docs/fuzzing.md, "
    "'Program features').",
)
@click.option(
    "--shrink-seconds",
    type=click.FloatRange(min=0),
    default=120.0,
    show_default=True,
    help="Time to shrink one new divergence (may run past the budget).",
)
@click.option(
    "--round-size",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Programs per round (one Hypothesis run; the unit of parallelism and shards).",
)
@click.option("--max-programs", type=click.IntRange(min=1), help="Stop after this many programs, budget or not.")
@click.option(
    "--steer/--no-steer",
    default=True,
    show_default=True,
    help="Weight each round's ops toward what earlier rounds covered least (fuzz/campaign/steer.py).",
)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a live progress bar.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=os.cpu_count() or 1,
    show_default="the machine's cores",
    help="Worker processes; a worker that crashes or hangs is recorded and replaced.",
)
@click.option(
    "--timeout",
    "timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="Seconds (wall clock) one program may run before it is recorded as a timeout.",
)
@click.option(
    "--cpu-timeout",
    "cpu_timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="CPU seconds one program may use before it is recorded as a timeout (Linux): unlike --timeout, "
    "not sooner on a busy machine; a hang that sleeps is caught by --timeout only.",
)
@click.option("--shard", help="K/N: run the K-th of N disjoint shares of the campaign's rounds (merge them with 'merge').")
@click.option("--rounds", type=click.IntRange(min=1), help="Run only the campaign's rounds 0..ROUNDS-1 (before sharding).")
@click.option(
    "--known",
    default="default",
    show_default="the shipped fuzz/known_issues.toml",
    help="Known-issues file (TOML or JSON): matching divergences are counted, not failures; 'none' for none.",
)
@click.option(
    "--neighbours",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Neighbour programs run in the same cagrad state after an agreeing one (wrong cache hits).",
)
@click.option(
    "--peer-every",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Run the peer subjects (torch's compiled autograd, torch_ca[...]) on one program in N of each round "
    "(cagrad's subjects run on every program); 1: on every program.",
)
def campaign(
    budget: float,
    seed: int,
    out: Path,
    subjects: str | None,
    plugins: tuple[str, ...],
    devices: tuple[str, ...],
    max_ops: int,
    max_leaves: int,
    ops: str | None,
    dtypes: str,
    modes: str,
    repeat: bool,
    hooks: bool,
    max_hooks: int,
    hook_actions: str | None,
    shapes: bool,
    training: bool,
    shrink_seconds: float,
    round_size: int,
    max_programs: int | None,
    steer: bool,
    progress: bool,
    workers: int,
    timeout: float,
    cpu_timeout: float | None,
    shard: str | None,
    rounds: int | None,
    known: str,
    neighbours: int,
    peer_every: int,
) -> None:
    """Fuzz until the budget ends; write report.json and reproducers under OUT.

    Exit status: 0 no divergence, 1 divergence(s) found (see OUT/report.json),
    2 usage or I/O error, 3 internal error, 130 interrupted (run the same
    command to resume).
    """
    from fuzz.campaign import Campaign, CampaignConfig, CampaignError, parse_shard
    from fuzz.ir import DTYPES, MODES
    from fuzz.strategies import GenConfig, programs

    dtype_list = tuple(_split(dtypes) or ())
    mode_list = tuple(_split(modes) or ())
    bad = [d for d in dtype_list if d not in DTYPES] + [m for m in mode_list if m not in MODES]
    if bad or not dtype_list or not mode_list:
        raise click.BadParameter(f"unknown or missing value(s) {bad}; dtypes: {list(DTYPES)}, modes: {list(MODES)}")
    try:
        gen = GenConfig(
            max_ops=max_ops,
            max_leaves=max_leaves,
            dtypes=dtype_list,
            modes=mode_list,
            ops=tuple(_split(ops) or ()) if ops else None,
            repeat=repeat,
            hooks=hooks,
            max_hooks=max_hooks,
            hook_actions=tuple(_split(hook_actions) or ()) if hook_actions else None,
            shapes=shapes,
            training=training,
            checkpoint=training,
        )
        programs(gen)  # checks the op names and hook actions
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--ops or --hook-actions") from None
    try:
        shard_kn = parse_shard(shard) if shard is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--shard") from None
    if cpu_timeout is not None:
        from fuzz.workers import cpu_clock_available

        if not cpu_clock_available():
            raise click.BadParameter("needs /proc/PID/stat (Linux) to read a worker's CPU time", param_hint="--cpu-timeout")
    if known != "none" and known != "default" and not Path(known).is_file():
        raise click.BadParameter(f"known-issues file {known!r} does not exist", param_hint="--known")
    config = CampaignConfig(
        budget_s=budget,
        seed=seed,
        out=out,
        subjects=_split(subjects),
        plugins=list(plugins),
        devices=list(devices) or None,
        gen=gen,
        shrink_s=shrink_seconds,
        round_size=round_size,
        progress=progress,
        max_programs=max_programs,
        workers=workers,
        timeout_s=timeout,
        cpu_timeout_s=cpu_timeout,
        shard=shard_kn,
        rounds=rounds,
        known=None if known == "none" else known,
        neighbours=neighbours,
        steer=steer,
        peer_every=peer_every,
    )
    try:
        code = Campaign(config).run()
    except CampaignError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    except Exception:  # a bug in the fuzzer: not to be read as a divergence
        click.echo(f"internal error in cagrad-fuzz (state and report were saved):\n{traceback.format_exc()}", err=True)
        sys.exit(EXIT_INTERNAL)
    sys.exit(code)


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=True, path_type=Path))
@click.option("--subjects", help="Comma-separated subjects instead of the recorded ones (or the defaults).")
@click.option("--plugin", "plugins", multiple=True, help="Extra subjects, as for campaign.")
@click.option("--device", "devices", multiple=True, help="Device(s) instead of the recorded ones.")
@click.option("--json", "as_json", is_flag=True, help="Print the differential report as JSON.")
@click.option("--show", is_flag=True, help="Print the program as plain torch code and exit.")
@click.option(
    "--neighbours",
    type=click.IntRange(min=0),
    default=None,
    help="Neighbour programs to run after it in the same cagrad state (default: the reproducer's "
    "recorded count; 0 for a program .json). A campaign's failure can come from a neighbour.",
)
def replay(
    file: Path,
    subjects: str | None,
    plugins: tuple[str, ...],
    devices: tuple[str, ...],
    as_json: bool,
    show: bool,
    neighbours: int | None,
) -> None:
    """Run FILE (a reproducer .py, a program .json, or a failure directory) again."""
    from fuzz.ir import IRError, Program
    from fuzz.render import render_source
    from fuzz.reproducer import read_reproducer
    from fuzz.reproducer import replay as run_replay

    if file.is_dir():
        candidates = [file / "reproducer.py", file / "program.json"]
        found = next((c for c in candidates if c.exists()), None)
        if found is None:
            raise click.BadParameter(f"{file} has no reproducer.py or program.json", param_hint="FILE")
        file = found
    recorded_subjects: list[str] = []
    recorded_plugins: list[str] = []
    recorded_devices: list[str] | None = None
    recorded_neighbours = 0
    try:
        if file.suffix == ".py":
            rec = read_reproducer(file)
            program = rec["program"]
            recorded_subjects, recorded_plugins, recorded_devices = rec["subjects"], rec["plugins"], rec["devices"]
            recorded_neighbours = rec["neighbours"]
        else:
            program = Program.from_json(file.read_text())
    except (IRError, ValueError, SyntaxError, OSError) as e:
        click.echo(f"error: {file}: {e}", err=True)
        sys.exit(EXIT_USAGE)
    if show:
        click.echo(render_source(program), nl=False)
        sys.exit(EXIT_CLEAN)
    if subjects is not None or plugins:
        use_subjects, use_plugins = _split(subjects), list(plugins)
    else:
        use_subjects, use_plugins = recorded_subjects or None, recorded_plugins
    code = run_replay(
        program,
        use_subjects,
        use_plugins,
        list(devices) or recorded_devices,
        echo=click.echo,
        as_json=as_json,
        neighbours=recorded_neighbours if neighbours is None else neighbours,
    )
    sys.exit(code)


@main.command()
@click.argument("outs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Directory for the merged report.")
def merge(outs: tuple[Path, ...], out: Path) -> None:
    """Merge campaign outputs OUTS (shards of one campaign, or any campaigns)
    into OUT: counts added, failures deduplicated by signature.

    Exit status: 0 no failure in any, 1 failure(s), 2 unreadable input.
    """
    from fuzz.merge import MergeError, merge_outputs

    try:
        report = merge_outputs(list(outs), out)
    except MergeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(
        f"merged {len(outs)} campaign output(s): {report['programs_run']} programs, "
        f"{len(report['failures'])} failure(s), {sum(k['count'] for k in report['known'])} known; "
        f"report: {out / 'report.json'}"
    )
    sys.exit(report["exit_status"])


@main.command("ops")
def list_ops() -> None:
    """List the op catalog (names for --ops)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from fuzz import ops as catalog

    table = Table(title=f"{len(catalog.OPS)} ops")
    for col in ("op", "category", "inputs", "attributes", "notes"):
        table.add_column(col, overflow="fold")
    for spec in catalog.OPS.values():
        attrs = ", ".join(f"{k}: {a.kind}" for k, a in spec.attrs.items())
        notes = "; ".join(n for n in (spec.doc, "several outputs" if spec.multi_output else "") if n)
        table.add_row(spec.name, spec.category, spec.arity_text(), Text(attrs), Text(notes))
    Console().print(table)


@main.command("coverage")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Campaign seed.")
@click.option("--programs", "count", type=click.IntRange(min=1), default=500, show_default=True, help="Programs to generate.")
@click.option("--round-size", type=click.IntRange(min=1), default=100, show_default=True, help="Programs per round.")
@click.option("--steer/--no-steer", default=True, show_default=True, help="Steer rounds as a campaign does.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write the counts here.")
def coverage_preview(seed: int, count: int, round_size: int, steer: bool, json_path: Path | None) -> None:
    """What the first PROGRAMS programs of a campaign with default generation
    options would exercise (generated, not run; see docs/fuzzing.md#coverage)."""
    from fuzz.campaign.steer import preview
    from fuzz.ops import OPS
    from fuzz.strategies import GenConfig

    got = preview(GenConfig(), seed, count, round_size, steer)
    ops = got["op_counts"]
    uses = sum(ops.values())
    mean = uses / len(OPS)
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:5]
    click.echo(f"{got['programs']} programs, {uses} op uses, {len(ops)} of {len(OPS)} ops used; mean {mean:.1f} uses per op")
    click.echo("most used: " + ", ".join(f"{n} {c} ({c / uses:.1%}, {c / mean:.2f}x mean)" for n, c in top))
    click.echo("least used: " + ", ".join(f"{n} {ops.get(n, 0)}" for n in sorted(OPS, key=lambda n: ops.get(n, 0))[:5]))
    for kind in ("feature_groups", "pair_groups"):
        for group, g in got["coverage"][kind].items():
            missing = f": uncovered {', '.join(g['uncovered'])}" if g["uncovered"] else ""
            click.echo(f"{group}: {g['covered']}/{g['total']}{missing}")
    if json_path is not None:
        json_path.write_text(json.dumps(got, indent=1))


from fuzz.report.cli import report  # noqa: E402  (the command lives in its own sub-package)

main.add_command(report)

if __name__ == "__main__":  # pragma: no cover
    main()

