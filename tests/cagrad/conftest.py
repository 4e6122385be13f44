from __future__ import annotations

import pytest
import torch

import cagrad


@pytest.fixture(autouse=True)
def fresh_cagrad():
    """Every core test starts with an empty cache and zero counters."""
    cagrad.reset()
    torch.manual_seed(0)
    yield
    cagrad.reset()


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    """Bitwise equality, None included: eager and the eager/aot_eager
    backends run the same aten kernels in the same order."""
    assert (a is None) == (b is None), (a, b)
    if a is not None:
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def run_both(build, backend: str = "eager"):
    """Builds twice from the same seed; runs ``build``'s backward in eager and
    under cagrad. Returns (eager_result, cagrad_result)."""
    torch.manual_seed(0)
    expected = build()
    torch.manual_seed(0)
    with cagrad.enable(backend):
        actual = build()
    return expected, actual
