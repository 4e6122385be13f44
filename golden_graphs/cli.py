"""``python -m golden_graphs`` / ``cagrad-golden``: check, accept, review, list.

::

    cagrad-golden [--root DIR] check  [NAMES...]   exit 1 on any difference
    cagrad-golden [--root DIR] accept [NAMES...] [--prune]
    cagrad-golden [--root DIR] review [NAMES...] [--against 2.11]
                               [--format text|markdown] [--output FILE]
                                                 show everything, exit 0
    cagrad-golden [--root DIR] list
    cagrad-golden [--root DIR] new-version [--against 2.13] [--output FILE]
                                                 the running torch's set, made

``--root`` (or ``$CAGRAD_GOLDEN_ROOT``) is the directory holding the
``torch-<major>.<minor>/`` snapshot directories; it defaults to
``golden_graphs/snapshots``. Without NAMES a command covers every scenario
and also reports stale files (snapshots whose scenario no longer exists).

Snapshot sets are per torch minor version (``torch-2.13/``...). ``check``
and ``review`` use the running torch's set; ``review --against 2.11``
compares the current captures with another version's set instead (what a
torch upgrade changes). A changed cache key is shown as field-level changes
(``NodeCall 3 MmBackward0: `attribute dim` 1 -> 0``) above the unified diff.

Exit status: 0 when everything matches (``check``), when everything was
written (``accept``) and always for ``review`` and ``list``; 1 for a
difference, a missing/malformed/stale snapshot or a scenario that failed to
capture; 2 when there is no snapshot set for the running torch (or for
``--against``): nothing was compared, and the message names the versions
that have one and the ``accept`` command that creates it; 2 also for usage
errors such as an unknown scenario name.
"""

from __future__ import annotations

import difflib
import os
import sys
import tempfile
from pathlib import Path
from collections.abc import Sequence

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import scenarios
from .accept import accept as accept_snapshots
from .compare import Outcome, Status, compare, summary
from .markdown import review_markdown
from .store import DEFAULT_ROOT, ROOT_ENV, SnapshotStore, available_versions, torch_version

EXIT_NO_SNAPSHOT_SET = 2  #: ``check``/``review``: no snapshot set for the version
_STATUS_STYLE = {
    Status.OK: "green",
    Status.CHANGED: "yellow",
    Status.MISSING: "magenta",
    Status.MALFORMED: "red",
    Status.STALE: "magenta",
    Status.ERROR: "red",
}


def _console() -> Console:
    # soft_wrap: long hex lines stay one line (copy-pasteable, diffable)
    return Console(file=sys.stdout, highlight=False, soft_wrap=True)


def _names_arg(names: Sequence[str]) -> list[str] | None:
    unknown = [n for n in names if n not in scenarios.REGISTRY]
    if unknown:
        raise click.BadParameter(
            f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(scenarios.names())}",
            param_hint="NAMES",
        )
    return list(names) or None


def _accept_hint(store: SnapshotStore, names: Sequence[str] = ()) -> str:
    root = "" if store.root == DEFAULT_ROOT else f" --root {store.root}"
    return f"python -m golden_graphs{root} accept{''.join(' ' + n for n in names)}"


@click.group()
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    envvar=ROOT_ENV,
    default=None,
    help=f"Directory of torch-<major>.<minor>/ snapshot dirs [env {ROOT_ENV}; "
    "default: golden_graphs/snapshots].",
)
@click.pass_context
def main(ctx: click.Context, root: str | None) -> None:
    """Golden FX graphs and cache keys of cagrad's backward captures."""
    ctx.obj = SnapshotStore(root)


@main.command("list", short_help="List scenarios and which have snapshots.")
@click.pass_obj
def list_cmd(store: SnapshotStore) -> None:
    """List the scenarios, their descriptions and whether a snapshot exists."""
    stored = set(store.stored_names())
    width = max(len(n) for n in scenarios.names())
    for name in scenarios.names():
        mark = "" if name in stored else "  [no snapshot]"
        click.echo(f"{name:<{width}}  {scenarios.get(name).description}{mark}")
    for name in sorted(stored - set(scenarios.names())):
        click.echo(f"{name:<{width}}  [stale snapshot: no such scenario]")


@main.command(short_help="Compare with the snapshots; exit 1 on any difference.")
@click.argument("names", nargs=-1)
@click.pass_obj
def check(store: SnapshotStore, names: tuple[str, ...]) -> None:
    """Compare the current captures with the snapshots; exit 1 on any change.

    Prints a unified diff per changed scenario and lists missing, malformed
    and stale snapshots and scenarios that failed to capture.
    """
    selected = _names_arg(names)
    console = _console()
    _require_set(console, store)
    outcomes = compare(store, selected)
    _report(console, outcomes)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        console.print(Text(f"golden_graphs check FAILED: {summary(outcomes)}", style="bold red"))
        to_accept = [o.name for o in bad if o.status is not Status.STALE]
        if to_accept:
            console.print(f"If the changes are intended, run: {_accept_hint(store, to_accept)}")
        if any(o.status is Status.STALE for o in bad):
            console.print(f"Delete stale snapshots with: {_accept_hint(store)} --prune")
        sys.exit(1)
    console.print(f"golden_graphs check passed: {summary(outcomes)} ({store.display()})")


@main.command(short_help="Rewrite snapshots from the current captures.")
@click.argument("names", nargs=-1)
@click.option("--prune", is_flag=True, help="Delete stale snapshots (only without NAMES).")
@click.pass_obj
def accept(store: SnapshotStore, names: tuple[str, ...], prune: bool) -> None:
    """Rewrite the snapshots of NAMES (default: all) from the current captures.

    Prints what changed per file. Other scenarios' files are untouched; stale
    files are reported and kept unless --prune is given.
    """
    selected = _names_arg(names)
    if prune and selected is not None:
        raise click.UsageError("--prune works only without NAMES")
    created_dir = not store.exists()
    results = accept_snapshots(store, selected, prune=prune)
    console = _console()
    if created_dir and store.exists():
        console.print(f"created {store.display()}")
    for r in results:
        counts = f" (+{r.added} -{r.removed} lines)" if r.changed else ""
        line = Text(f"{r.action.value:<14} {r.outcome.path}{counts}")
        if r.changed:
            line.stylize("yellow")
        console.print(line)
        if r.outcome.detail:
            console.print(f"    {r.outcome.detail}")
    changed = sum(r.changed for r in results)
    console.print(f"golden_graphs accept: {changed} file(s) changed, {len(results) - changed} not")
    if any(r.outcome.status is Status.ERROR for r in results):
        sys.exit(1)


@main.command(short_help="Show all diffs, missing and stale snapshots; exit 0.")
@click.argument("names", nargs=-1)
@click.option(
    "--against",
    metavar="MAJOR.MINOR",
    default=None,
    help="Compare the current captures with this torch version's snapshot set "
    "(what a torch upgrade changes) instead of the running torch's.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "markdown"]),
    default="text",
    show_default=True,
    help="markdown: a summary for a pull-request comment.",
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write the review to this file (atomically) instead of stdout.",
)
@click.pass_obj
def review(
    store: SnapshotStore, names: tuple[str, ...], against: str | None, fmt: str, output: str | None
) -> None:
    """Show every diff (key field changes first), missing and stale
    snapshot, then a table; exit 0 whatever changed (2 without a set)."""
    selected = _names_arg(names)
    console = _console()
    running = torch_version()
    if against is not None:
        try:
            version = torch_version(against)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--against") from None
        store = SnapshotStore(store.root, version)
    _require_set(console, store)
    outcomes = compare(store, selected, version=running)
    if fmt == "markdown" or output is not None:
        text = (
            review_markdown(outcomes, running, against=store.version if against else None)
            if fmt == "markdown"
            else _plain_review(outcomes)
        )
        if output is None:
            click.echo(text, nl=False)
        else:
            _write_atomic(output, text)
            console.print(f"wrote {output}: {summary(outcomes)}")
        return
    _report(console, outcomes, show_missing=True)
    table = Table(title=f"golden graphs, torch {store.version} snapshots vs torch {running}")
    table.add_column("scenario")
    table.add_column("status")
    table.add_column("+/-", justify="right")
    for o in outcomes:
        plus = sum(1 for d in o.diff if d.startswith("+") and not d.startswith("+++"))
        minus = sum(1 for d in o.diff if d.startswith("-") and not d.startswith("---"))
        table.add_row(
            o.name, Text(o.status.value, style=_STATUS_STYLE[o.status]), f"+{plus} -{minus}" if o.diff else ""
        )
    console.print(table)
    console.print(summary(outcomes))


@main.command("new-version", short_help="Make the running torch's snapshot set and review it against the last one.")
@click.argument("names", nargs=-1)
@click.option(
    "--against",
    metavar="MAJOR.MINOR",
    default=None,
    help="The set to review the new one against (default: the newest set of an older torch).",
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write the review (markdown) to this file instead of printing it.",
)
@click.pass_obj
def new_version(store: SnapshotStore, names: tuple[str, ...], against: str | None, output: str | None) -> None:
    """Make the snapshot set of the running torch (``torch-<major>.<minor>/``,
    every scenario, or NAMES) and review it against the set of the newest older torch
    (or ``--against``): what the new torch changes in cagrad's graphs and
    keys, as markdown. Exit 1 when the set exists already (use ``accept``)
    or a scenario fails to capture; 2 on a bad ``--against``. The steps for
    a new torch are in docs/torch-versions.md."""
    selected = _names_arg(names)
    console = _console()
    if store.exists():
        console.print(f"golden_graphs: {store.display()} exists already; re-accept it with: {_accept_hint(store)}")
        sys.exit(1)
    older = [v for v in available_versions(store.root) if _key(v) < _key(store.version)]
    base = against if against is not None else (older[-1] if older else None)
    if base is not None:
        try:
            base = torch_version(base)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--against") from None
        if not SnapshotStore(store.root, base).exists():
            raise click.BadParameter(f"no snapshot set for torch {base}", param_hint="--against")
    results = accept_snapshots(store, selected)
    failed = [r.outcome.name for r in results if r.outcome.status is Status.ERROR]
    console.print(f"created {store.display()}: {len(results) - len(failed)} snapshot(s)")
    if base is None:
        console.print("no older snapshot set to review against")
    else:
        outcomes = compare(SnapshotStore(store.root, base), selected, version=store.version)
        text = review_markdown(outcomes, store.version, against=base)
        if output is None:
            click.echo(text, nl=False)
        else:
            _write_atomic(output, text)
            console.print(f"wrote {output}: against torch {base}, {summary(outcomes)}")
    if failed:
        console.print(Text(f"failed to capture: {', '.join(failed)}", style="bold red"))
        sys.exit(1)


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def _require_set(console: Console, store: SnapshotStore) -> None:
    """Exits with :data:`EXIT_NO_SNAPSHOT_SET` when ``store``'s version has
    no snapshot set, naming the versions that have one."""
    if store.exists():
        return
    have = available_versions(store.root)
    listed = ", ".join(have) if have else "none"
    console.print(
        f"golden_graphs: no snapshot set for torch {store.version} ({store.display()} does not "
        f"exist); snapshot sets exist for torch: {listed}.\n"
        f"Nothing was compared. Create this set on a machine with torch {store.version}: "
        f"{_accept_hint(store)}"
    )
    sys.exit(EXIT_NO_SNAPSHOT_SET)


def _plain_review(outcomes: list[Outcome]) -> str:
    """The text review without colours (for ``--output`` in text format)."""
    console = Console(record=True, file=open(os.devnull, "w"), width=200, soft_wrap=True)  # noqa: SIM115
    _report(console, outcomes, show_missing=True)
    console.print(summary(outcomes))
    return console.export_text()


def _write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and ``os.replace``."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _report(console: Console, outcomes: list[Outcome], show_missing: bool = False) -> None:
    """Prints each non-OK outcome: a headline, its detail, its diff."""
    for o in outcomes:
        if o.ok:
            continue
        style = _STATUS_STYLE[o.status]
        head = Text(f"{o.status.value.upper()} {o.name}: ", style=f"bold {style}")
        head.append(_headline(o))
        console.print(head)
        if o.detail:
            console.print(Text(f"    {o.detail}"))
        if o.fields:
            console.print(Text("  key field changes:", style="bold"))
            for line in o.fields:
                console.print(Text(f"    {line}", style=style))
        if o.status in (Status.CHANGED, Status.MALFORMED) or (show_missing and o.diff):
            _print_diff(console, o.diff)


def _headline(o: Outcome) -> str:
    if o.status is Status.CHANGED:
        return f"{o.path} differs from the current capture"
    if o.status is Status.MISSING:
        n = len((o.current or "").splitlines())
        return f"no snapshot {o.path} (accept would write {n} lines)"
    if o.status is Status.MALFORMED:
        return f"{o.path} does not parse"
    if o.status is Status.STALE:
        return f"{o.path} has no scenario (removed or renamed?)"
    return "the scenario failed to capture; its snapshot was not compared"


def _print_diff(console: Console, diff: list[str]) -> None:
    """Prints a unified diff, coloured on a terminal; in a block of ``-``
    lines followed by as many ``+`` lines, each pair's differing characters
    are also underlined (long hex keys differ in a byte or two)."""
    texts = [_diff_line(line) for line in diff]
    i = 0
    while i < len(diff):
        j = i
        while j < len(diff) and diff[j].startswith("-") and not diff[j].startswith("---"):
            j += 1
        k = j
        while k < len(diff) and diff[k].startswith("+") and not diff[k].startswith("+++"):
            k += 1
        if j > i and k - j == j - i:
            for a, b in zip(range(i, j), range(j, k)):
                _mark_changes(texts[a], texts[b], diff[a], diff[b])
        i = max(k, i + 1)
    for text in texts:
        console.print(text)


def _diff_line(line: str) -> Text:
    if line.startswith(("+++", "---")):
        style = "bold"
    elif line.startswith("@@"):
        style = "cyan"
    elif line.startswith("+"):
        style = "green"
    elif line.startswith("-"):
        style = "red"
    else:
        style = ""
    return Text(line, style=style)


def _mark_changes(old: Text, new: Text, a: str, b: str) -> None:
    matcher = difflib.SequenceMatcher(None, a[1:], b[1:], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            old.stylize("bold underline", i1 + 1, i2 + 1)
            new.stylize("bold underline", j1 + 1, j2 + 1)
