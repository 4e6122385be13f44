"""The benchmarks time cagrad as users run it: without the suite's guard
verification (``CAGRAD_VERIFY_GUARDS``, set for every test by
``tests/conftest.py``), which collects every guarded hit in full as well."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _unverified_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAGRAD_VERIFY_GUARDS", "0")
