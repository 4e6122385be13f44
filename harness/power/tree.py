"""The isolated copy of the source tree that mutants are applied in.

cosmic-ray writes each mutant into the module file itself and puts the
original back afterwards; here that file is always in a temporary copy of the
tree, never in the user's checkout. The copy holds the packages and tests the
killers import, and ``pyproject.toml`` (pytest's configuration).

Bytecode: the copy is compiled with checked-hash ``.pyc`` files (PEP 552),
validated against the source's hash rather than its modification time, and the
killers run with ``PYTHONDONTWRITEBYTECODE=1`` (cosmic-ray sets it): a mutant
and the original restored within the same second, at the same size, can
never be confused, and only the mutated module is compiled again per mutant.
"""

from __future__ import annotations

import compileall
import hashlib
import py_compile
import shutil
import tempfile
from pathlib import Path

#: What the copy holds, relative to the repository root.
COPIED = ("cagrad", "harness", "fuzz", "golden_graphs", "tests", "pyproject.toml")

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", "*.egg-info", "*.orig", "*.rej")


def repo_root() -> Path:
    """The checkout this package was imported from (the folder above ``harness``)."""
    return Path(__file__).resolve().parents[2]


def make_copy(root: Path, parent: Path | None = None, names: tuple[str, ...] = COPIED) -> Path:
    """Copies ``names`` (default :data:`COPIED`) from ``root`` into a new temporary folder (under
    ``parent`` if given) and compiles it (checked-hash bytecode); returns the
    folder. The caller removes it (:func:`remove_copy`).

    Raises:
        FileNotFoundError: ``root`` lacks one of :data:`COPIED`.
    """
    dest = Path(tempfile.mkdtemp(prefix="cagrad-power-tree-", dir=parent))
    for name in names:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=_IGNORE)
        elif src.is_file():
            shutil.copy2(src, dest / name)
        else:
            shutil.rmtree(dest)
            raise FileNotFoundError(f"{root} has no {name}: not a cagrad checkout")
    compileall.compile_dir(
        dest, quiet=1, workers=1, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH
    )
    return dest


def remove_copy(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def digest(root: Path, modules: list[str]) -> str:
    """sha256 over the modules' paths and contents: whether the code a run's
    mutant identities refer to is still the same."""
    h = hashlib.sha256()
    for m in modules:
        h.update(m.encode() + b"\0" + (root / m).read_bytes() + b"\0")
    return h.hexdigest()
