"""Standalone reproducer files for divergences.

:func:`write_reproducer` writes a ``.py`` file that embeds the program's JSON,
the subjects and devices to compare, and (in its docstring) the program as
plain torch code. Run with ``python FILE`` it rebuilds the program, runs the
harness comparison, prints the outcome table and exits 0 when every subject
agrees with eager, 1 on a divergence and 2 when it cannot run (bad
arguments, a device that is not there). It imports ``fuzz`` and ``harness``
from the installed project, or, failing that, from the checkout it was
written from (``PROJECT_ROOT``).

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

{source}
"""

import sys

PROGRAM_JSON = {program_json}
SUBJECTS = {subjects!r}
PLUGINS = {plugins!r}
DEVICES = {devices!r}
# Where the fuzz package was when this file was written; used only when
# "import fuzz" fails (the project is not installed).
PROJECT_ROOT = {project_root!r}


def main(argv=None):
    try:
        import fuzz.reproducer  # noqa: F401
    except ImportError:
        sys.path.insert(0, PROJECT_ROOT)
    from fuzz.reproducer import run_reproducer

    return run_reproducer(PROGRAM_JSON, SUBJECTS, PLUGINS, DEVICES, argv)


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
) -> str:
    source = textwrap.indent(program.source().rstrip("\n"), "    ").replace('"""', "'''").replace("\\", "\\\\")
    return _TEMPLATE.format(
        header=(header or f"Program {program.name or '(unnamed)'}").replace('"""', "'''").replace("\\", "/"),
        filename=filename,
        source=source,
        program_json=_string_literal(program.to_json(indent=1)),
        subjects=list(subjects),
        plugins=[_absolute_plugin(p) for p in plugins],
        devices=list(devices),
        project_root=PROJECT_ROOT,
    )


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
    """``{"program": Program, "subjects", "plugins", "devices"}`` of a reproducer."""
    tree = ast.parse(Path(path).read_text(), filename=str(path))
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("PROGRAM_JSON", "SUBJECTS", "PLUGINS", "DEVICES"):
                found[name] = ast.literal_eval(node.value)
    if "PROGRAM_JSON" not in found:
        raise ValueError(f"{path}: not a cagrad-fuzz reproducer (no PROGRAM_JSON)")
    return {
        "program": Program.from_json(found["PROGRAM_JSON"]),
        "subjects": found.get("SUBJECTS") or [],
        "plugins": found.get("PLUGINS") or [],
        "devices": found.get("DEVICES") or None,
    }


def replay(
    program: Program,
    subjects: Sequence[str] | None,
    plugins: Sequence[str],
    devices: Sequence[str] | None,
    *,
    echo: Any = print,
    as_json: bool = False,
) -> int:
    """Runs the comparison, prints the report; 0 agree, 1 diverge, 2 cannot run."""
    from fuzz.oracle import Oracle

    try:
        oracle = Oracle(subjects or None, plugins, devices)
    except (ValueError, KeyError) as e:
        echo(f"error: {e}")
        return 2
    verdict = oracle.run(program)
    if verdict.build_error is not None:
        echo(f"error: the program does not build under eager autograd:\n{verdict.build_error}")
        return 2
    assert verdict.report is not None
    echo(json.dumps(verdict.report.to_json(), indent=1) if as_json else verdict.report.summary().rstrip())
    return 0 if verdict.ok else 1


def run_reproducer(
    program_json: str,
    subjects: Sequence[str],
    plugins: Sequence[str],
    devices: Sequence[str] | None,
    argv: Sequence[str] | None = None,
) -> int:
    """The ``main`` of a reproducer file."""
    parser = argparse.ArgumentParser(description="Replays a cagrad-fuzz divergence.")
    parser.add_argument("--show", action="store_true", help="print the program as torch code and exit")
    parser.add_argument("--subjects", help="comma-separated subject names instead of the recorded ones")
    parser.add_argument("--device", action="append", help="device to run on (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the differential report as JSON")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    program = Program.from_json(program_json)
    if args.show:
        print(program.source(), end="")
        return 0
    if args.subjects:
        from harness.subjects import split_names

        subjects, plugins = split_names(args.subjects), []
    return replay(program, list(subjects), list(plugins), args.device or devices, as_json=args.json)
