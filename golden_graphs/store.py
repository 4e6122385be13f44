"""Where snapshots live on disk.

Layout: ``<root>/torch-<major>.<minor>/<scenario>.txt``. Decompositions and
backward formulas change between torch releases, so each torch minor
version has its own directory; patch releases share one. The default root is
``golden_graphs/snapshots`` next to this module; the CLI's ``--root`` (or
``$CAGRAD_GOLDEN_ROOT``) points elsewhere.

Writes are atomic (a temporary file in the same directory, then
``os.replace``), so an interrupted ``accept`` never leaves half a snapshot.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch

DEFAULT_ROOT = Path(__file__).resolve().parent / "snapshots"
ROOT_ENV = "CAGRAD_GOLDEN_ROOT"
SUFFIX = ".txt"


def torch_version(version: str | None = None) -> str:
    """``"2.13"`` for torch ``2.13.0+cpu`` (default: the running torch).

    Raises:
        ValueError: a version string that does not start ``<int>.<int>``.
    """
    text = str(torch.__version__ if version is None else version)
    m = re.match(r"(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"cannot read a major.minor version from {text!r}")
    return f"{m.group(1)}.{m.group(2)}"


def available_versions(root: str | os.PathLike | None = None) -> list[str]:
    """The torch versions that have a snapshot set under ``root`` (default:
    :data:`DEFAULT_ROOT`), sorted numerically: ``["2.11", "2.13"]``."""
    base = Path(root) if root is not None else DEFAULT_ROOT
    if not base.is_dir():
        return []
    found = [m.group(1) for p in base.iterdir() if p.is_dir() and (m := _SET_DIR.fullmatch(p.name))]
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


_SET_DIR = re.compile(r"torch-(\d+\.\d+)")


class SnapshotStore:
    """The snapshot directory of one torch version under ``root``.

    Args:
        root: the directory holding ``torch-<version>/`` directories.
        version: the torch ``major.minor`` (default: the running torch's).
    """

    def __init__(self, root: str | os.PathLike | None = None, version: str | None = None) -> None:
        self.root = Path(root) if root is not None else DEFAULT_ROOT
        self.version = version or torch_version()
        self.dir = self.root / f"torch-{self.version}"

    def exists(self) -> bool:
        """Whether this version's directory exists."""
        return self.dir.is_dir()

    def path(self, name: str) -> Path:
        """The file of scenario ``name``."""
        return self.dir / f"{name}{SUFFIX}"

    def stored_names(self) -> list[str]:
        """Stems of every ``*.txt`` file in the directory, sorted."""
        if not self.exists():
            return []
        return sorted(p.stem for p in self.dir.iterdir() if p.suffix == SUFFIX and p.is_file())

    def read(self, name: str) -> str | None:
        """The text of ``name``'s snapshot, or None when there is no file."""
        try:
            return self.path(name).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    def write(self, name: str, text: str) -> None:
        """Writes ``name``'s snapshot atomically, creating the directory."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
            os.chmod(tmp, _file_mode())  # mkstemp makes 0600 files
            os.replace(tmp, self.path(name))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def remove(self, name: str) -> None:
        """Deletes ``name``'s snapshot file."""
        self.path(name).unlink()

    def display(self, name: str | None = None) -> str:
        """The path of ``name``'s snapshot (None: of the directory) as shown
        to users: relative to the current directory when it lies under it."""
        p = self.dir if name is None else self.path(name)
        try:
            return str(p.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            return str(p)


def _file_mode() -> int:
    """0666 less the process's umask: the mode ``open(path, "w")`` would give."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
