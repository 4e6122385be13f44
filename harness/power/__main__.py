"""``python -m harness.power``: see :mod:`harness.power.cli`."""

from harness.power.cli import main

if __name__ == "__main__":
    main()
