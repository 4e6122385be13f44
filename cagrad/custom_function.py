"""Custom ``torch.autograd.Function`` backward nodes, run as eager runs them.

The engine calls a custom Function's backward through ``PyNode::apply``
(torch/csrc/autograd/python_function.cpp), which does more than the Python
``backward``:

* an undefined incoming gradient becomes zeros of the forward output's
  shape, dtype and device, unless ``ctx.set_materialize_grads(False)`` was
  called (or the output was non-differentiable and the internal
  ``_materialize_non_diff_grads`` is off); a non-tensor output's gradient
  stays None;
* the result must hold one gradient per forward input (extra trailing Nones
  are dropped); a non-tensor input must get None;
* the gradients of tensor inputs are handed along the node's edges.

Two facts it reads are not visible from Python: ``materialize_grads`` is a
write-only attribute, and the metadata of non-differentiable outputs (and
which forward inputs were tensors) lives only in C++. cagrad records them
when they are set: a ``materialize_grads`` property on ``BackwardCFunction``
keeps the value it writes, and ``Function.apply`` is wrapped to note the
forward's input kinds and output metadata on the ctx. A Function applied
before ``import cagrad`` (or one overriding ``apply``) has no record, and its
backward falls back to eager.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction, Function

from .validate import validate_outputs

_RECORD = "_cagrad_record"
_MATERIALIZE = "_cagrad_materialize_grads"

_original_apply = Function.apply.__func__  # type: ignore[attr-defined]
_base_materialize = torch._C._FunctionBase.__dict__["materialize_grads"]


@dataclasses.dataclass(frozen=True)
class OutputInfo:
    """One forward output, as ``VariableInfo`` keeps it."""

    differentiable: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclasses.dataclass(frozen=True)
class ForwardRecord:
    """What ``PyNode::apply`` needs that Python cannot read off the node.

    Attributes:
        is_variable_input: per forward input, whether it was a tensor.
        outputs: per forward output, its :class:`OutputInfo` (None for a
            non-tensor output).
    """

    is_variable_input: tuple[bool, ...]
    outputs: tuple[OutputInfo | None, ...]


def _get_materialize(self: Any) -> bool:
    return self.__dict__.get(_MATERIALIZE, True)


def _set_materialize(self: Any, value: bool) -> None:
    _base_materialize.__set__(self, value)
    self.__dict__[_MATERIALIZE] = bool(value)


def _flat_outputs(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _record(cls: type, args: tuple, out: Any) -> None:
    outputs = _flat_outputs(out)
    backward_cls = getattr(cls, "_backward_cls", None)
    ctx = None
    for o in outputs:
        if isinstance(o, torch.Tensor) and isinstance(o.grad_fn, backward_cls):
            ctx = o.grad_fn
            break
    if ctx is None:
        return  # nothing differentiable: no backward node
    infos = []
    for o in outputs:
        if isinstance(o, torch.Tensor):
            infos.append(OutputInfo(o.requires_grad, tuple(o.shape), o.dtype, o.device))
        else:
            infos.append(None)
    ctx.__dict__[_RECORD] = ForwardRecord(
        tuple(isinstance(a, torch.Tensor) for a in args), tuple(infos)
    )


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    out = _original_apply(cls, *args, **kwargs)
    if torch.is_grad_enabled() and not kwargs:
        try:
            _record(cls, args, out)
        except Exception:  # noqa: BLE001 - a missing record only means a fallback
            pass
    return out


def install() -> None:
    """Puts the recording in place (idempotent)."""
    if isinstance(BackwardCFunction.__dict__.get("materialize_grads"), property):
        return
    BackwardCFunction.materialize_grads = property(_get_materialize, _set_materialize)
    _apply.__doc__ = _original_apply.__doc__
    Function.apply = classmethod(_apply)  # type: ignore[method-assign, assignment]


def record_of(node: Any) -> ForwardRecord | None:
    """The forward record of a custom Function node, or None if unknown."""
    record = node.__dict__.get(_RECORD)
    if record is None:
        return None
    # consistent with what the node itself shows
    if sum(record.is_variable_input) != len(node.next_functions):
        return None
    if len(record.outputs) != len(node._input_metadata):
        return None
    return record


def apply(node: Any, record: ForwardRecord, edges: Sequence[Any], grads: Sequence[Any]) -> list:
    """Runs the node's backward as ``PyNode::apply`` + ``validate_outputs`` do.

    Args:
        node: the ``BackwardCFunction`` (the ctx).
        record: its :func:`record_of`.
        edges: its ``next_functions``.
        grads: one incoming gradient (or None) per forward output.

    Returns:
        one gradient (or None) per edge.

    Raises:
        RuntimeError: eager's messages for a wrong number of gradients or a
            gradient for a non-tensor input; whatever the backward raises.
    """
    name = type(node).__name__
    materialize = node.__dict__.get(_MATERIALIZE, True)
    args = []
    for g, info in zip(grads, record.outputs):
        if g is None and materialize and info is not None:
            if info.differentiable or node._materialize_non_diff_grads:
                g = torch.zeros(info.shape, dtype=info.dtype, device=info.device)
        args.append(g)
    with torch.no_grad():
        r = node.apply(*args)
    r = r if isinstance(r, tuple) else (r,)
    n_inputs = len(record.is_variable_input)
    if len(r) > n_inputs and all(x is None for x in r[n_inputs:]):
        r = r[:n_inputs]
    if len(r) != n_inputs:
        raise RuntimeError(
            f"function {name} returned an incorrect number of gradients "
            f"(expected {n_inputs}, got {len(r)})"
        )
    outs = []
    for i, (g, is_var) in enumerate(zip(r, record.is_variable_input)):
        if not is_var:
            if g is not None:
                raise RuntimeError(
                    f"function {name} returned a gradient different than None at position "
                    f"{i + 1}, but the corresponding forward input was not a Variable"
                )
            continue
        if g is not None and not isinstance(g, torch.Tensor):
            raise RuntimeError(f"expected Variable or None (got {type(g).__name__})")
        outs.append(g)
    return validate_outputs(name, edges, outs)
