"""Standalone reproducer files for divergences.

:func:`write_reproducer` writes a ``.py`` file that embeds the program's JSON,
the subjects and devices to compare, and (in its docstring) the program as
plain torch code. Run with ``python FILE`` it rebuilds the program, runs the
harness comparison, prints the outcome table and exits 0 when every subject
agrees with eager, 1 on a divergence and 2 when it cannot run (bad
arguments, a device that is not there). It imports ``fuzz`` and ``harness``
from the installed project, or, failing that, from the checkout it was
written from (``PROJECT_ROOT``).

A reproducer written with ``neighbours=N`` (a campaign run with
``--neighbours N``, a ``cache`` failure) replays the whole sequence: the
program, then its ``N`` neighbours (:mod:`fuzz.neighbours`) in the same
cagrad state, no reset in between, as :class:`fuzz.oracle.Oracle` runs them,
and prints each neighbour's result; ``--show`` prints the neighbours too.
Reproducers written before ``NEIGHBOURS`` existed replay with none.

:func:`read_reproducer` reads those fields back (``python -m fuzz replay``).
"""

from __future__ import annotations

import argparse
import ast
import json
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fuzz.ir import Program
from fuzz.render import render_source

# (__file__, not fuzz.__file__: an editable install made before fuzz/ had an
# __init__.py imports fuzz as a namespace package, without a __file__.)
PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)

_TEMPLATE = '''\
#!/usr/bin/env python3
"""cagrad-fuzz reproducer.

{header}

Run:   python {filename}             exit 0: no divergence, 1: divergence, 2: cannot run
       python {filename} --show      print the program as plain torch code
       python {filename} --subjects 'cagrad[eager],torch_ca[eager]' --device cpu

The program as plain torch code (same leaves, same backward; run() returns
what the harness compares):

{source}{neighbour_sources}
"""

import sys

PROGRAM_JSON = {program_json}
SUBJECTS = {subjects!r}
PLUGINS = {plugins!r}
DEVICES = {devices!r}
# Neighbour programs run after it under each cagrad subject, no reset (0: none).
NEIGHBOURS = {neighbours!r}
# Where the fuzz package was when this file was written; used only when
# "import fuzz" fails (the project is not installed).
PROJECT_ROOT = {project_root!r}
# Settings the campaign ran with that change what is compared; set unless
# the environment sets them.
ENVIRONMENT = {environment!r}


def main(argv=None):
    import os

    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    try:
        import fuzz.reproducer  # noqa: F401
    except ImportError:
        sys.path.insert(0, PROJECT_ROOT)
    from fuzz.reproducer import run_reproducer

    return run_reproducer(PROGRAM_JSON, SUBJECTS, PLUGINS, DEVICES, argv, neighbours=NEIGHBOURS)


if __name__ == "__main__":
    sys.exit(main())
'''


def _string_literal(text: str) -> str:
    if "'''" not in text and "\\" not in text:
        return "r'''\n" + text + "\n'''"
    return repr(text)


def render_reproducer(
    program: Program,
    *,
    subjects: Sequence[str] = (),
    plugins: Sequence[str] = (),
    devices: Sequence[str] = ("cpu",),
    header: str = "",
    filename: str = "reproducer.py",
    neighbours: int = 0,
) -> str:
    """The text of a reproducer of ``program`` (see the module doc); with
    ``neighbours`` > 0 it replays the program's neighbour sequence, and its
    docstring shows each neighbour's change and code."""
    source = _docstring_code(render_source(program))
    neighbour_sources = ""
    if neighbours > 0:
        from fuzz.neighbours import derive

        neighbour_sources = "".join(
            f"\n\nThen, in the same cagrad state (no reset), neighbour {k}: {nb.label}\n\n"
            + _docstring_code(render_source(nb.program))
            for k, nb in enumerate(derive(program, neighbours), 1)
        )
    return _TEMPLATE.format(
        header=(header or f"Program {program.name or '(unnamed)'}").replace('"""', "'''").replace("\\", "/"),
        filename=filename,
        source=source,
        neighbour_sources=neighbour_sources,
        neighbours=int(neighbours),
        program_json=_string_literal(program.to_json(indent=1)),
        subjects=list(subjects),
        plugins=[_absolute_plugin(p) for p in plugins],
        devices=list(devices),
        project_root=PROJECT_ROOT,
        environment=_comparison_environment(),
    )


def _comparison_environment() -> dict[str, str]:
    """The environment settings of this process that change what the
    harness compares (:data:`harness.compare.STRIDES_ENV`), for the
    reproducer to run with."""
    import os

    from harness.compare import STRIDES_ENV

    return {k: os.environ[k] for k in (STRIDES_ENV,) if k in os.environ}


def _docstring_code(source: str) -> str:
    """``source`` indented, safe inside the reproducer's docstring."""
    return textwrap.indent(source.rstrip("\n"), "    ").replace('"""', "'''").replace("\\", "\\\\")


def _absolute_plugin(spec: str) -> str:
    target, sep, attr = spec.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{Path(target).resolve()}:{attr}"
    return spec


def write_reproducer(path: Path | str, program: Program, **kwargs: Any) -> Path:
    path = Path(path)
    path.write_text(render_reproducer(program, filename=path.name, **kwargs))
    path.chmod(0o755)
    return path


def read_reproducer(path: Path | str) -> dict[str, Any]:
    """``{"program": Program, "subjects", "plugins", "devices", "neighbours"}``
    of a reproducer (``neighbours`` is 0 for one written without it).

    Raises:
        ValueError: not a reproducer, or ``NEIGHBOURS`` is not an int >= 0.
        fuzz.ir.IRError: its program is malformed.
    """
    tree = ast.parse(Path(path).read_text(), filename=str(path))
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("PROGRAM_JSON", "SUBJECTS", "PLUGINS", "DEVICES", "NEIGHBOURS"):
                found[name] = ast.literal_eval(node.value)
    if "PROGRAM_JSON" not in found:
        raise ValueError(f"{path}: not a cagrad-fuzz reproducer (no PROGRAM_JSON)")
    neighbours = found.get("NEIGHBOURS", 0)
    if not isinstance(neighbours, int) or isinstance(neighbours, bool) or neighbours < 0:
        raise ValueError(f"{path}: NEIGHBOURS must be an int >= 0, got {neighbours!r}")
    return {
        "program": Program.from_json(found["PROGRAM_JSON"]),
        "subjects": found.get("SUBJECTS") or [],
        "plugins": found.get("PLUGINS") or [],
        "devices": found.get("DEVICES") or None,
        "neighbours": neighbours,
    }


def replay(
    program: Program,
    subjects: Sequence[str] | None,
    plugins: Sequence[str],
    devices: Sequence[str] | None,
    *,
    echo: Any = print,
    as_json: bool = False,
    neighbours: int = 0,
) -> int:
    """Runs the comparison, prints the report; 0 agree, 1 diverge, 2 cannot run.

    With ``neighbours`` > 0 the program's neighbour sequence runs too (see
    :class:`fuzz.oracle.Oracle`): the report's notes list each neighbour's
    change and result, a wrong cache hit is a ``cache`` mismatch, and the
    JSON form gets a ``neighbours`` list."""
    import os

    from fuzz.oracle import Oracle

    # as the campaign that found it ran (fuzz.cli): a wrong guarded hit and
    # an internal error raise
    os.environ.setdefault("CAGRAD_VERIFY_GUARDS", "1")
    os.environ.setdefault("CAGRAD_STRICT", "1")
    try:
        oracle = Oracle(subjects or None, plugins, devices, neighbours=neighbours)
    except (ValueError, KeyError) as e:
        echo(f"error: {e}")
        return 2
    verdict = oracle.run(program)
    if verdict.build_error is not None:
        echo(f"error: the program does not build under eager autograd:\n{verdict.build_error}")
        return 2
    assert verdict.report is not None
    if as_json:
        data = verdict.report.to_json()
        if neighbours:
            data["neighbours"] = [c.to_json() for c in verdict.neighbours]
        echo(json.dumps(data, indent=1))
    else:
        echo(verdict.report.summary().rstrip())
    return 0 if verdict.ok else 1


def run_reproducer(
    program_json: str,
    subjects: Sequence[str],
    plugins: Sequence[str],
    devices: Sequence[str] | None,
    argv: Sequence[str] | None = None,
    *,
    neighbours: int = 0,
) -> int:
    """The ``main`` of a reproducer file (``neighbours``: its ``NEIGHBOURS``)."""
    parser = argparse.ArgumentParser(description="Replays a cagrad-fuzz divergence.")
    parser.add_argument("--show", action="store_true", help="print the program as torch code and exit")
    parser.add_argument("--subjects", help="comma-separated subject names instead of the recorded ones")
    parser.add_argument("--device", action="append", help="device to run on (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the differential report as JSON")
    parser.add_argument(
        "--neighbours",
        type=int,
        default=None,
        metavar="N",
        help=f"neighbour programs to run after it, no reset (recorded: {neighbours})",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    if args.neighbours is not None:
        if args.neighbours < 0:
            print(f"error: --neighbours must be >= 0, got {args.neighbours}")
            return 2
        neighbours = args.neighbours
    program = Program.from_json(program_json)
    if args.show:
        print(render_source(program), end="")
        if neighbours > 0:
            from fuzz.neighbours import derive

            for k, nb in enumerate(derive(program, neighbours), 1):
                print(f"\n# neighbour {k} (same cagrad state, no reset): {nb.label}")
                print(render_source(nb.program), end="")
        return 0
    if args.subjects:
        from harness.subjects import split_names

        subjects, plugins = split_names(args.subjects), []
    return replay(
        program, list(subjects), list(plugins), args.device or devices, as_json=args.json, neighbours=neighbours
    )
