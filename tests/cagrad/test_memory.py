"""Saved tensors are freed by a backward without retain_graph, as in eager.

A saved activation is referenced only by the autograd graph; its storage
dies when the graph releases it. ``StorageWeakRef`` watches the storage
without keeping it alive.
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import cagrad


def _graph_with_saved_activation():
    x = torch.randn(64, 64, requires_grad=True)
    h = x.exp()  # ExpBackward0 saves its result
    ref = StorageWeakRef(h.untyped_storage())
    y = h.sum()
    del h
    return x, y, ref


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_saved_tensors_freed_after_backward(backend):
    x, y, ref = _graph_with_saved_activation()
    assert not ref.expired()
    with cagrad.enable(backend):
        y.backward()
    assert cagrad.counters["captures"] == 1
    assert ref.expired(), "the saved activation outlived the backward"


def test_saved_tensors_freed_on_cache_hit():
    with cagrad.enable("eager"):
        _, y, _ = _graph_with_saved_activation()
        y.backward()
        x, y, ref = _graph_with_saved_activation()
        y.backward()
    assert cagrad.counters["cache_hits"] == 1
    assert ref.expired()


def test_retain_graph_keeps_saved_tensors():
    x, y, ref = _graph_with_saved_activation()
    with cagrad.enable("eager"):
        y.backward(retain_graph=True)
        assert not ref.expired()
        y.backward()
    assert ref.expired()


def test_eager_reference_frees_too():
    """The oracle for the tests above: eager frees the same storage."""
    x, y, ref = _graph_with_saved_activation()
    y.backward()
    assert ref.expired()
