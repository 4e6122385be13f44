"""Planted subjects shared by the suites' lifetime tests: eager autograd
with a fault that changes no value, only which tensors stay alive."""

from __future__ import annotations

import contextlib

import torch

from harness.subjects import EagerSubject


class KeepsWhatEagerFrees(EagerSubject):
    """Eager autograd with ``torch.autograd.backward`` wrapped while active:
    with ``keep_graph``, ``retain_graph=True`` forced (the graph's saved
    tensors outlive the backward while the program holds its loss, as a
    runtime holding its own references to them would keep them); without,
    each root kept in :attr:`kept` (a cache that outlives the program).

    Example::

        subject = KeepsWhatEagerFrees("leaks-loss", keep_graph=False)
        with subject.active():
            loss.backward()
        subject.kept  # [loss]
    """

    def __init__(self, name: str, keep_graph: bool) -> None:
        super().__init__(name)
        self.keep_graph = keep_graph
        self.kept: list = []

    @contextlib.contextmanager
    def active(self):
        real = torch.autograd.backward

        def backward(tensors, grad_tensors=None, retain_graph=None, *args, **kwargs):
            if self.keep_graph:
                retain_graph = True
            else:
                self.kept.append(tensors)
            return real(tensors, grad_tensors, retain_graph, *args, **kwargs)

        torch.autograd.backward = backward
        try:
            yield
        finally:
            torch.autograd.backward = real
