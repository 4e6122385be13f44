"""validate_outputs: what the engine does to every gradient on every edge.

After each node runs, eager autograd checks and adjusts the gradient it sends
along each valid edge against the input metadata of the edge's target
(``validate_outputs`` in torch/csrc/autograd/engine.cpp):

* a gradient whose shape differs but from which the expected shape can be
  reduced by broadcasting is summed down (``at::sum_to``); any other shape is
  an error;
* a real gradient for a complex input (or the reverse, for non-floating
  types) is an error; a different dtype is cast to the expected one;
* a 0-dim gradient on another device is moved; any other device mismatch is
  an error.

cagrad applies the same steps to the fake gradients during a trace, so they
are recorded in the graph, and raises eager's errors at trace time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Edge = tuple[Any, int]


def _expandable(shape: Sequence[int], desired: Sequence[int]) -> bool:
    # at::is_expandable_to(shape, desired)
    if len(shape) > len(desired):
        return False
    if any(isinstance(x, torch.SymInt) for x in [*shape, *desired]):
        from torch.fx.experimental.symbolic_shapes import sym_and

        # one condition per dimension (see sum_to)
        return not any(sym_and(a != b, a != 1) for a, b in zip(reversed(shape), reversed(desired)))
    for a, b in zip(reversed(shape), reversed(desired)):
        if a != b and a != 1:
            return False
    return True


def sum_to(grad: torch.Tensor, shape: Sequence[Any]) -> torch.Tensor:
    """``at::sum_to(grad, shape)`` (what the engine's ``reduce_grad`` and
    ``sum_to_size`` run): the same ops, with each reduction decision taken
    on its whole condition.

    ``at::sum_to`` reduces a dimension where the target size is 1 and the
    gradient's is not, asking the two halves one after the other; with
    symbolic sizes each half is a guard of its own. Where both sizes are
    one symbol ``s`` (a gradient ``(s, d)`` summed to ``(s, 1)``) the
    condition ``s == 1 and s != 1`` is false for every ``s``, but its first
    half alone guards ``Ne(s, 1)``, which keeps a size of 1 out of the
    graph's sizes. Asked as one condition, it needs no guard, and where it
    does the guard is the condition itself. Real sizes: ``sum_to_size``.
    """
    sizes = list(grad.shape)
    target = list(shape)
    if not any(isinstance(x, torch.SymInt) for x in sizes + target):
        return grad.sum_to_size(target)
    from torch.fx.experimental.symbolic_shapes import sym_and

    if not target:
        return grad.sum()
    lead = len(sizes) - len(target)
    dims = list(range(lead))
    for i in range(lead, len(sizes)):
        if sym_and(target[i - lead] == 1, sizes[i] != 1):
            dims.append(i)
    if dims:
        grad = grad.sum(dims, keepdim=True)
    return grad.view(target) if lead > 0 else grad


def real_metadata(fn: Any, input_nr: int) -> tuple[Sequence[Any], torch.dtype, torch.device]:
    """``(shape, dtype, device)`` a node expects at an input, as it records it."""
    md = fn._input_metadata[input_nr]
    return md.shape, md.dtype, md.device


def validate_outputs(
    name: str,
    edges: Sequence[Edge],
    grads: Sequence[torch.Tensor | None],
    metadata: Callable[[Any, int], tuple[Sequence[Any], torch.dtype, torch.device]] = real_metadata,
) -> list[torch.Tensor | None]:
    """The gradients ``name`` hands along ``edges``, checked as eager checks.

    Args:
        name: the node's name, for error messages.
        edges: ``(target node or None, input_nr)`` per output.
        grads: one gradient (or None) per edge.
        metadata: ``(target, input_nr) -> (shape, dtype, device)``; during a
            trace with dynamic sizes the shape holds SymInts.

    Returns:
        the adjusted gradients.

    Raises:
        RuntimeError: eager's messages for a wrong number of gradients, an
            incompatible shape, dtype kind or device.
    """
    if len(grads) != len(edges):
        raise RuntimeError(
            f"Function {name} returned an invalid number of gradients - "
            f"expected {len(edges)}, but got {len(grads)}"
        )
    out = list(grads)
    for i, ((fn, input_nr), grad) in enumerate(zip(edges, grads)):
        if fn is None or grad is None:
            continue
        shape, dtype, device = metadata(fn, input_nr)
        shape = list(shape)
        if list(grad.shape) != shape:
            if not _expandable(shape, grad.shape):
                raise RuntimeError(
                    f"Function {name} returned an invalid gradient at index {i} - "
                    f"got {list(grad.shape)} but expected shape compatible with {shape}"
                )
            grad = sum_to(grad, shape)
        if not grad.dtype.is_floating_point and dtype.is_complex != grad.dtype.is_complex:
            raise RuntimeError(
                f"Function {name} returned an invalid gradient at index {i} - "
                f"expected dtype {dtype} but got {grad.dtype}"
            )
        if grad.dtype != dtype:
            grad = grad.to(dtype)
        if grad.device != device:
            if grad.dim() == 0:
                grad = grad.to(device)
            else:
                raise RuntimeError(
                    f"Function {name} returned an invalid gradient at index {i} - "
                    f"expected device {device} but got {grad.device}"
                )
        out[i] = grad
    return out
