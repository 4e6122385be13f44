"""``python -m fuzz ...``: see :mod:`fuzz.cli`."""

from fuzz.cli import main

if __name__ == "__main__":
    main()
