"""A host GraphTask of torch's engine around a compiled backward.

A hook added from C++ may queue a callback from C++
(``Engine::get_default_engine().queue_callback``, as DDP's reducer does for
``finalize_backward``); that needs a GraphTask of torch's engine current in
the thread, which a cagrad backward does not have. :func:`run_hosted` runs
a function as the pre-hook of the one node of a tiny graph that torch's
engine runs, so that such callbacks (and those queued from Python in the
meantime, which then go to the same GraphTask) run after the function, in
queue order, as eager runs them after the whole backward.

The host graph is ``leaf -> view``: torch runs it on the calling thread (a
CPU graph), with ``accumulate_grad=False`` so nothing is written to the leaf.
Exceptions raised by the function propagate with their own type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..autograd import run_context

T = TypeVar("T")


def run_hosted(fn: Callable[[], T], eager_engine: Any) -> T:
    """Runs ``fn()`` inside a backward of ``eager_engine`` (torch's
    ``ImperativeEngine``) and returns its result once that backward's
    callbacks have run.

    Raises:
        whatever ``fn`` or a callback raises.
    """
    result: list[Any] = []
    leaf = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        root = leaf.view(())

    def prehook(grad_outputs: tuple) -> None:
        result.append(fn())

    root.grad_fn.register_prehook(prehook)
    ctx = run_context.current()
    if ctx is not None:
        ctx.hosted = True
    try:
        eager_engine.run_backward(
            (root,), (torch.ones(()),), False, False, (leaf,), allow_unreachable=True, accumulate_grad=False
        )
    finally:
        if ctx is not None:
            ctx.hosted = False
    return result[0]
