"""``python -m harness <command>``: the harness's command line.

Commands: ``stacks`` (:mod:`harness.stacks.cli`), ``models``
(:mod:`harness.models.cli`).
"""

from __future__ import annotations

import os

import click

from harness.models.cli import models
from harness.stacks.cli import stacks


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """The differential harness of cagrad."""
    # an internal error is reported as an error, not hidden by the fallback
    # (cagrad.internal_errors); subprocesses inherit it
    os.environ.setdefault("CAGRAD_STRICT", "1")


main.add_command(stacks)
main.add_command(models)

if __name__ == "__main__":
    main()
