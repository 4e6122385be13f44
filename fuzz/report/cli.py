"""``python -m fuzz report OUT [--html [PATH]] [--junit [PATH]]``.

Reads ``OUT/report.json`` (or a report.json path) and writes the HTML page
(default ``OUT/report.html``) and/or the JUnit XML (default
``OUT/junit.xml``); with neither flag, both. Exit status 0 when written, 2
when report.json is missing or malformed or an output cannot be written
(the message names the file and what was expected).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

EXIT_OK, EXIT_USAGE = 0, 2

#: Value an option takes when given without a path: "use the default under OUT".
_DEFAULT = "\0default"


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--html",
    "html_path",
    is_flag=False,
    flag_value=_DEFAULT,
    default=None,
    metavar="[PATH]",
    help="Write the self-contained HTML report (default path: OUT/report.html).",
)
@click.option(
    "--junit",
    "junit_path",
    is_flag=False,
    flag_value=_DEFAULT,
    default=None,
    metavar="[PATH]",
    help="Write JUnit XML, one test case per signature and subject (default path: OUT/junit.xml).",
)
def report(out: Path, html_path: str | None, junit_path: str | None) -> None:
    """Write reports people read from OUT/report.json: HTML and/or JUnit XML (both when no flag is given).

    OUT is a campaign's output directory or its report.json. Exit status: 0
    written, 2 missing or malformed report.json, or an output not writable.
    """
    from fuzz.report.html import write_html
    from fuzz.report.junit import write_junit
    from fuzz.report.load import ReportError, load_report

    try:
        rep = load_report(out)
    except ReportError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    if html_path is None and junit_path is None:
        html_path = junit_path = _DEFAULT
    jobs = []
    if html_path is not None:
        jobs.append((write_html, rep.out / "report.html" if html_path == _DEFAULT else Path(html_path)))
    if junit_path is not None:
        jobs.append((write_junit, rep.out / "junit.xml" if junit_path == _DEFAULT else Path(junit_path)))
    for write, path in jobs:
        try:
            write(rep, path)
        except OSError as e:
            click.echo(f"error: cannot write {path}: {e.strerror or e}", err=True)
            sys.exit(EXIT_USAGE)
        click.echo(f"wrote {path}")
    sys.exit(EXIT_OK)
