"""``python -m golden_graphs``: see :mod:`golden_graphs.cli`."""

from .cli import main

main(prog_name="python -m golden_graphs")
