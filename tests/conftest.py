"""Hypothesis settings profiles for the whole suite.

``CAGRAD_HYPOTHESIS_PROFILE`` picks one (default ``ci``):

* ``ci``: derandomized (every run draws the same examples), no example
  database, no deadline, slow-data health checks off: a clean clone's
  ``python -m pytest -q`` gives the same result every time;
* ``dev``: random examples on every run, failures saved to the local
  database (``.hypothesis/``) and replayed first next time;
* ``nightly``: random, :data:`NIGHTLY_FACTOR` times the examples.

Hypothesis's pool of local constants (literals of the imported modules) is
emptied (:func:`_without_local_constants`), so that what a test draws does
not depend on what the process imported before it.

Tests that set ``max_examples`` themselves wrap the number in
:func:`examples` so that it scales with the profile.

Every test runs with ``CAGRAD_VERIFY_GUARDS=1``: each backward a generated
hit guard accepts is also collected in full and compared with it
(:mod:`cagrad.keys.hit_path`); worker processes the tests spawn inherit it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

import cagrad
from cagrad import engine

os.environ.setdefault("CAGRAD_VERIFY_GUARDS", "1")
# an internal error raises instead of falling back (cagrad.internal_errors):
# the suite reports it as the fault it is
os.environ.setdefault("CAGRAD_STRICT", "1")

PROFILE_ENV = "CAGRAD_HYPOTHESIS_PROFILE"
PROFILES = ("ci", "dev", "nightly")
NIGHTLY_FACTOR = 10

# Drawing a program and running it under autograd is slow next to what
# Hypothesis expects of a data generator; these checks only say so.
_SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]

settings.register_profile("ci", derandomize=True, database=None, deadline=None, suppress_health_check=_SLOW_DATA)
settings.register_profile(
    "dev",
    derandomize=False,
    database=DirectoryBasedExampleDatabase(".hypothesis/examples"),
    deadline=None,
    suppress_health_check=_SLOW_DATA,
)
settings.register_profile(
    "nightly",
    derandomize=False,
    database=None,
    deadline=None,
    max_examples=NIGHTLY_FACTOR * settings.get_profile("default").max_examples,
    suppress_health_check=_SLOW_DATA,
)


def profile_name() -> str:
    """The profile ``CAGRAD_HYPOTHESIS_PROFILE`` names (``ci`` when unset).

    Raises:
        ValueError: the variable names no profile; the message lists them.
    """
    name = os.environ.get(PROFILE_ENV, "").strip() or "ci"
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_ENV}={name!r} is not a Hypothesis profile; expected one of {list(PROFILES)}")
    return name


def examples(n: int) -> int:
    """``max_examples`` for a test that draws ``n`` under ``ci`` and ``dev``:
    ``n`` times :data:`NIGHTLY_FACTOR` under ``nightly``."""
    return n * NIGHTLY_FACTOR if profile_name() == "nightly" else n


settings.load_profile(profile_name())


def _without_local_constants() -> bool:
    """Empties Hypothesis's pool of *local* constants for this process.

    Hypothesis draws about one choice in twenty from constants, among them
    every literal in the source of the local modules the process has
    imported by the time it first draws (``hypothesis.internal.conjecture.
    providers._get_local_constants``): what a derandomized ``@given`` test
    drew depended on which test files and modules ran before it (``pytest
    tests/cagrad/test_x.py`` alone or the whole suite). Global constants
    (0, -1, nan, boundary values, ...) stay. The campaign's rounds draw no
    constants at all (``fuzz.campaign.steer._without_constants``). This
    reaches into Hypothesis's internals; where they differ (another
    version), nothing changes and it returns False."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # pragma: no cover
        return False
    if not callable(getattr(providers, "_get_local_constants", None)):  # pragma: no cover
        return False
    providers._get_local_constants = Constants  # an empty pool, whatever was imported
    return True


LOCAL_CONSTANTS_OFF = _without_local_constants()


#: Wall-clock seconds after which a test stops waiting for a child process
#: (a campaign, a reproducer, a rank). Only a hang guard: an hour, far above
#: any run on a loaded machine (a 40-program campaign took over 900 s with the
#: load average at 13 on 2 cores); no test bounds speed by it. Campaigns in
#: tests also pass CAMPAIGN_TIMEOUTS, so that a program is timed out by the
#: CPU it used, not by the wall clock a busy machine stretches.
HANG_GUARD_S = 3600
CAMPAIGN_TIMEOUTS = ("--timeout", str(HANG_GUARD_S), "--cpu-timeout", "120")


@pytest.fixture
def cuda_ready_for_torch_ca() -> None:
    """Initializes CUDA first where a GPU is present. torch's compiled
    autograd creates a CUDA context in a CPU program's first backward of a
    process (Dynamo's ``preserve_rng_state``), a state difference from eager
    listed as ``torch-ca-cuda-init`` in fuzz/known_issues.toml; tests that
    compare gradients with torch's compiled autograd start with CUDA
    initialized so that this known difference does not hide what they check.
    A no-op without a GPU (CI)."""
    if torch.cuda.is_available():
        torch.cuda.init()


@pytest.fixture(autouse=True)
def isolated_cagrad(monkeypatch):
    """Every test starts with empty caches, zero counters, seed 0 and no disk
    cache unless it asks for one (a ``CAGRAD_CACHE_DIR`` in the environment
    would turn captures into disk hits across tests), and ends with no
    cagrad context open.

    It lives here, for the whole suite, rather than in a sub-folder's
    conftest: some pytest versions (the H100 machine's) leave a sub-folder
    conftest's autouse fixtures off when the command line names that
    folder's files, then another folder's, then the first folder's again.

    A test that leaves a context open fails at teardown (the contexts it
    left in this thread are shut, so that the next test runs eager).
    """
    monkeypatch.delenv("CAGRAD_CACHE_DIR", raising=False)
    cagrad.reset()
    torch.manual_seed(0)
    yield
    cagrad.reset()
    left = 0
    while engine.active():
        engine.pop(engine._stack()[-1])
        left += 1
    if left:
        pytest.fail(f"the test left {left} cagrad.enable context(s) open in this thread (shut now)")
    if torch.autograd.Variable._execution_engine is not engine.eager_engine():
        pytest.fail("the test left a cagrad.enable context open in another thread: later backwards run under cagrad")


#: the most pytest-xdist workers ``-n auto`` (pyproject's addopts) starts.
#: Each worker imports torch, transformers and timm and builds their models
#: (about 1.5 GB at its peak), so a many-core machine gets eight, not one per
#: core; ``-n N`` on the command line sets any number, ``-n 0`` none.
MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``'s worker count: the cores this process may use, at most
    :data:`MAX_WORKERS` (pytest-xdist's hook; its default counts every core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def pytest_report_header(config) -> str:
    """One header line: which profile the run uses."""
    return f"hypothesis profile: {profile_name()} (set {PROFILE_ENV}=ci|dev|nightly)"


def pytest_collection_modifyitems(config, items) -> None:
    """A test marked ``cuda`` is skipped, with the reason, where torch sees no
    CUDA device (CI's machines have none; the GPU device runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def run_rendered_alone(tmp_path: Path, source: str, describe: str) -> Any:
    """Runs a rendered fuzz program (``source``, with its ``run()``) in a
    fresh Python process and returns ``describe`` (an expression over
    ``gs``, the gradients ``run()`` returns) as JSON gives it back; asserts
    the process exits 0."""
    script = tmp_path / "plain.py"
    script.write_text(source + "\n\nimport json\ngs = run()\nprint(json.dumps(" + describe + "))\n")
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
