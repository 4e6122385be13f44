"""The one inductor test of the default suite (inductor compiles take seconds on CPU)."""

from __future__ import annotations

import pytest

import harness
from harness import Status, examples


@pytest.mark.inductor
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit deprecation inside inductor
def test_mlp_agrees_under_inductor(cuda_ready_for_torch_ca):
    report = harness.run_differential(
        examples.mlp_program("backward"), ["torch_ca[inductor]", "cagrad[inductor]"], devices="cpu"
    )
    for o in report.outcomes:
        assert o.status is Status.EQUAL, f"{o.subject}: {o.describe()}\n{report.summary()}"
        assert o.captures == 1
