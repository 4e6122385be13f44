from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from golden_graphs.cli import main
from golden_graphs.store import DEFAULT_ROOT, SnapshotStore, torch_version


def cli(*args: str):
    """Runs the golden_graphs CLI in-process; returns the click Result."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="session")
def committed() -> SnapshotStore:
    """The checked-in snapshots of the running torch (skips when there are none:
    snapshots are per torch minor version)."""
    store = SnapshotStore(DEFAULT_ROOT)
    if not store.exists():
        pytest.skip(
            f"no golden snapshots for torch {torch_version()} ({store.dir}); "
            "create them with: python -m golden_graphs accept"
        )
    return store


@pytest.fixture(scope="session")
def accepted_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root that ``accept`` filled from the current captures (once per session)."""
    root = tmp_path_factory.mktemp("golden_accepted")
    result = cli("--root", root, "accept")
    assert result.exit_code == 0, result.output
    return root


@pytest.fixture
def root(tmp_path: Path, accepted_root: Path) -> Path:
    """A private copy of :func:`accepted_root` that a test may edit."""
    shutil.copytree(accepted_root, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.fixture
def version_dir(root: Path) -> Path:
    return root / f"torch-{torch_version()}"
