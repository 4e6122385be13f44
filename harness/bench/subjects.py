"""The benchmark subjects: how a backward is run.

A subject is ``(wrap_model, backward_context)``: ``wrap_model`` turns the
workload's module into what the forward calls (``torch.compile`` for the
compiled-forward subjects), ``backward_context()`` is entered around each
backward (None: plain eager autograd).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

import cagrad


@dataclasses.dataclass
class Subject:
    """One way of running the backward.

    Attributes:
        wrap: model -> the callable the forward uses.
        context: () -> context manager around each backward, or None.
        is_cagrad: cagrad's counters and overhead apply.
        cuda_only: CUDA graphs (``mode="reduce-overhead"``): left out of the
            default subjects on CPU.
        default: in the steady-state table's default subjects (the
            ``dynamic=True`` ones are for first-backward comparisons: at
            fixed sizes their hits are the default's).
    """

    wrap: Callable[[Any], Any]
    context: Callable[[], Any] | None
    is_cagrad: bool = False
    cuda_only: bool = False
    default: bool = True


def _same(model: Any) -> Any:
    return model


def _torch_ca(backend: str, mode: str | None = None) -> Callable[[], Any]:
    from torch._dynamo import compiled_autograd

    compiler_fn = functools.partial(torch.compile, backend=backend, fullgraph=True, mode=mode)
    return lambda: compiled_autograd._enable(compiler_fn)


def _cagrad(backend: str, mode: str | None = None, dynamic: bool | None = None) -> Callable[[], Any]:
    return lambda: cagrad.enable(backend, mode=mode, dynamic=dynamic)


SUBJECTS: dict[str, Subject] = {
    "eager": Subject(_same, None),
    "torch.compile": Subject(torch.compile, None),
    "torch_ca[eager]": Subject(_same, _torch_ca("eager")),
    "torch_ca[inductor]": Subject(_same, _torch_ca("inductor")),
    "cagrad[eager]": Subject(_same, _cagrad("eager"), True),
    "cagrad[inductor]": Subject(_same, _cagrad("inductor"), True),
    # sizes symbolic from the first capture (the default captures static first)
    "cagrad[eager,dynamic]": Subject(_same, _cagrad("eager", dynamic=True), True, default=False),
    "cagrad[inductor,dynamic]": Subject(_same, _cagrad("inductor", dynamic=True), True, default=False),
    "torch_ca[inductor,reduce-overhead]": Subject(_same, _torch_ca("inductor", "reduce-overhead"), cuda_only=True),
    "cagrad[inductor,reduce-overhead]": Subject(_same, _cagrad("inductor", "reduce-overhead"), True, True),
}


def backward_in(subject: Subject, loss: Any) -> None:
    """Runs ``loss.backward()`` under the subject's context."""
    with subject.context() if subject.context is not None else contextlib.nullcontext():
        loss.backward()
