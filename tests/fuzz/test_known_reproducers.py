"""The plain-torch reproducers of the shipped known-issues file
(fuzz/known_reproducers/, named by each entry's ``reproducer``): each runs
on the installed torch and must reproduce (exit 1) exactly where its
entry's ``torch`` specifier admits that torch, and agree with eager (exit 0)
elsewhere. On a new torch this says which entries to widen or close
(docs/torch-versions.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fuzz.known import KnownIssues

KNOWN = KnownIssues.default()
WITH_REPRODUCER = [i for i in KNOWN.issues if i.reproducer]


def test_reproducers_are_named_by_entries_and_exist() -> None:
    base = Path(KNOWN.path).parent
    assert len(WITH_REPRODUCER) >= 4
    for issue in WITH_REPRODUCER:
        assert (base / issue.reproducer).is_file(), (issue.id, issue.reproducer)
    named = {(base / i.reproducer).resolve() for i in WITH_REPRODUCER}
    on_disk = {p.resolve() for p in (base / "known_reproducers").glob("*.py")}
    assert on_disk == named, on_disk ^ named  # no reproducer without its entry


@pytest.mark.parametrize("issue", WITH_REPRODUCER, ids=lambda i: i.id)
def test_a_reproducer_reproduces_exactly_where_its_entry_admits_the_installed_torch(issue) -> None:
    script = Path(KNOWN.path).parent / issue.reproducer
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    listed = issue.applies_to("torch_ca[eager]", torch.__version__)
    reproduces = proc.returncode == 1
    assert reproduces == listed, (
        f"{issue.id} {'reproduces' if reproduces else 'does not reproduce'} on torch {torch.__version__}, "
        f"but its entry says torch = {issue.torch!r}: widen or close the range\n{proc.stdout}"
    )
