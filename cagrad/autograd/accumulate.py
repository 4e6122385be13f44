"""AccumulateGrad: how a leaf's gradient lands in ``.grad``.

Follows ``AccumulateGrad::accumulateGrad`` (torch/csrc/autograd/functions/
accumulate_grad.h), dense (strided) and sparse COO gradients alike. With
grad mode off (a backward without ``create_graph``):

* ``.grad`` unset, dense gradient: the gradient becomes ``.grad`` itself
  when nothing else refers to it and it obeys the gradient layout contract;
  otherwise a copy laid out by the contract does (``clone_obey_contract``).
* ``.grad`` unset, sparse gradient: never the gradient itself. Eager makes
  a new sparse tensor over the same indices and values when nothing else
  refers to them (its coalesced flag then reads False), else a ``clone()``.
  cagrad cannot see C++ use counts, so it takes the first form with copied
  indices and values whenever both are contiguous (the same values and
  flag, no alias anyone could observe), else ``clone()``.
* ``.grad`` set and sparse, dense gradient: the sum is dense, so ``.grad``
  is replaced by ``grad + .grad`` (a new tensor).
* ``.grad`` set otherwise (dense or sparse, gradient dense or sparse): the
  gradient is added into it in place, so ``.grad`` stays the same object and
  a reference to it held elsewhere (an optimizer's) sees the sum.

With ``create_graph=True`` (grad mode on) ``.grad`` is replaced, never
updated in place: a copy (laid out by the contract if dense, ``clone()`` if
sparse), or the out-of-place sum (``grad + .grad`` when only ``.grad`` is
sparse, since sparse + dense is not defined), both recorded by autograd so
that ``.grad`` can be differentiated.

The layout contract (``obeys_layout_contract`` in
torch/csrc/autograd/utils/grad_layout_contract.h): for a leaf whose strides
are non-overlapping and dense, ``.grad`` has the leaf's strides (dims of size
1 excepted, but never stride 0); otherwise ``.grad`` is contiguous.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from .. import native
from ..preserve import preserved
from . import run_context

log = logging.getLogger("cagrad")


def dense_strides(shape: tuple[int, ...] | torch.Size, strides: tuple[int, ...]) -> bool:
    """Whether a layout's elements fill its storage span exactly once.

    Same rule as ``TensorImpl::compute_non_overlapping_and_dense`` (with
    ``is_contiguous`` first, as ``refresh_contiguous`` does): sorted by
    stride, each dimension of size 2 or more must have the stride of the
    product of the sizes before it; dimensions of size 0 or 1 do not count,
    and a tensor with no elements qualifies.
    """
    if any(s == 0 for s in shape):
        return True
    dims = sorted((d for d in range(len(shape)) if shape[d] >= 2), key=lambda d: strides[d])
    expected = 1
    for d in dims:
        if strides[d] != expected:
            return False
        expected *= shape[d]
    return True


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """:func:`dense_strides` of a tensor's layout."""
    return dense_strides(t.shape, t.stride())


def _plain(t: torch.Tensor) -> bool:
    """Contiguous with no dim of size 0 or 1, so its strides are exactly the
    contiguous ones (a size-1 dim's stride, or any stride of an empty
    tensor, may be anything while ``is_contiguous()`` holds)."""
    shape = t.shape
    return 1 not in shape and 0 not in shape and t.is_contiguous()


def obeys_layout_contract(grad: torch.Tensor, variable: torch.Tensor) -> bool:
    if variable.is_nested or grad.is_sparse or variable.is_sparse:
        return False
    if _plain(variable) and grad.is_contiguous():
        # the common case, decided in C: equal shapes (validate_outputs) and
        # no size-1 dim, so both have the contiguous strides
        return True
    if is_non_overlapping_and_dense(variable):
        for size, gs, vs in zip(grad.shape, grad.stride(), variable.stride()):
            if size != 1:
                if gs != vs:
                    return False
            elif gs == 0:
                return False
        return True
    return grad.is_contiguous()


def clone_obey_contract(grad: torch.Tensor, variable: torch.Tensor) -> torch.Tensor:
    if _plain(variable):
        # the common case, decided in C: the leaf has the contiguous
        # strides, the ones a contiguous clone gets
        return grad.clone(memory_format=torch.contiguous_format)
    if is_non_overlapping_and_dense(variable):
        out = grad.new_empty_strided(variable.shape, variable.stride())
        return out.copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def _sparse_copy(grad: torch.Tensor) -> torch.Tensor:
    """A first sparse ``.grad`` made from ``grad`` (grad mode off).

    Eager's ``at::_sparse_coo_tensor_unsafe(indices, values, ...)`` when
    indices and values are contiguous (a new tensor whose coalesced flag is
    False), here over copies of them; ``grad.clone()`` otherwise.
    """
    indices, values = grad._indices(), grad._values()
    if indices.is_contiguous() and values.is_contiguous():
        return torch.ops.aten._sparse_coo_tensor_unsafe(
            indices.clone(), values.clone(), grad.shape, dtype=grad.dtype, device=grad.device
        )
    return grad.clone()


def _sum(old: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``old + grad`` out of place; ``grad + old`` when only ``old`` is sparse
    (sparse + dense is not defined, dense + sparse is)."""
    if old.is_sparse and not grad.is_sparse:
        return grad + old
    return old + grad


def accumulate_grad(
    variable: torch.Tensor, grad: torch.Tensor, stealable: bool, create_graph: bool | None = None
) -> None:
    """Adds ``grad`` into ``variable.grad`` as eager's AccumulateGrad does.

    Every mix of dense (strided) and sparse COO ``grad`` and ``.grad``
    follows ``AccumulateGrad::accumulateGrad`` (see the module docstring):
    ``.grad`` keeps its identity where eager adds in place (dense or sparse
    ``.grad`` plus any gradient, except sparse ``.grad`` plus a dense one).

    Args:
        variable: a leaf tensor that requires grad (strided).
        grad: its gradient: same shape, dtype and device as ``variable``
            (``validate_outputs`` made it so); strided or sparse COO.
        stealable: True when nothing else holds ``grad`` or shares its
            elements (:func:`stealable_outputs`), so a dense ``grad`` may
            become ``.grad`` without a copy (a sparse one never does, as in
            eager; a view is detached first, as eager's ``.grad`` is never
            one).
        create_graph: whether the backward builds a graph of its own
            (:func:`cagrad.autograd.run_context.create_graph`, read here if None).
            A caller that passes False and calls this for many leaves may
            hold grad mode off around all of them (:func:`accumulate_all`).

    Raises:
        RuntimeError: from the ``.grad`` setter if ``grad`` does not match
            ``variable`` (cannot happen after ``validate_outputs``).
    """
    if not variable.requires_grad:
        return  # requires_grad was switched off after the forward
    if create_graph is None:
        create_graph = run_context.create_graph()
    if create_graph:
        # grad mode on (create_graph=True): never in place and never stolen,
        # so that .grad is differentiable (accumulateGrad's GradMode branch)
        with torch.enable_grad():
            old = variable.grad
            if old is None:
                if grad.is_sparse:
                    variable.grad = grad.clone()
                else:
                    variable.grad = clone_obey_contract(grad, variable)
            else:
                variable.grad = _sum(old, grad)
        return
    if torch.is_grad_enabled():
        with torch.no_grad():
            _accumulate_no_grad(variable, grad, stealable)
    else:
        _accumulate_no_grad(variable, grad, stealable)


def _accumulate_no_grad(variable: torch.Tensor, grad: torch.Tensor, stealable: bool) -> None:
    old = variable.grad
    if old is None:
        if grad.is_sparse:
            variable.grad = _sparse_copy(grad)
        elif stealable and obeys_layout_contract(grad, variable):
            # eager's .grad is never a view (it takes ``grad.detach()``)
            variable.grad = grad.detach() if grad._is_view() else grad
        else:
            variable.grad = clone_obey_contract(grad, variable)
    elif old.is_sparse and not grad.is_sparse:
        variable.grad = grad + old
    else:
        old.add_(grad)


def stealable_outputs(outs: list[torch.Tensor], returns_input: list[bool]) -> list[bool]:
    """Which of a graph's outputs may become a ``.grad`` without a copy.

    Eager's ``AccumulateGrad`` takes a gradient uncopied when nothing else
    holds it (torch/csrc/autograd/functions/accumulate_grad.h). Here output
    ``i`` may unless ``returns_input[i]`` (the trace found it is a graph
    input itself, which its caller holds) or its memory overlaps an earlier
    output that may: a backend may hand back one buffer for two outputs
    (e.g. after CSE), and two ``.grad`` tensors must not share elements.
    Disjoint views of one buffer may both (eager takes each of the views
    ``CatBackward`` makes of its gradient). One C++ call where the extension
    is built.

    Args:
        outs: the graph's outputs (dense tensors), as a list.
        returns_input: one bool per output.

    Returns:
        One bool per output.
    """
    fast = _native_fns()
    if fast is not None:
        return fast[1](outs, returns_input)
    return _stealable_outputs(outs, returns_input)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)``: the bytes of its storage ``t`` can reach
    (empty for a tensor without elements)."""
    if t.numel() == 0:
        return 0, 0
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()


def _stealable_outputs(outs: list[torch.Tensor], returns_input: list[bool]) -> list[bool]:
    stealable = [not a for a in returns_input]
    taken: dict[int, list[tuple[int, int]]] = {}
    for i, out in enumerate(outs):
        ptr = out.untyped_storage().data_ptr()
        first, end = _byte_span(out)
        if not ptr or first == end or not stealable[i]:
            continue
        spans = taken.setdefault(ptr, [])
        if any(first < e and f < end for f, e in spans):
            stealable[i] = False
        else:
            spans.append((first, end))
    return stealable


def accumulate_all(pairs: Any, stealable: Any) -> None:
    """:func:`accumulate_grad` for each ``(variable, grad, index)`` of
    ``pairs`` with ``stealable[index]``, reading the backward's
    ``create_graph`` once and switching grad mode off once.

    Without ``create_graph``, plain dense leaves and gradients are
    accumulated by one C++ call where the extension is built
    (:func:`cagrad.native.accumulate_fns`: about 0.2 us a leaf where the
    Python code takes about 1.5 us), the rest here.
    """
    create_graph = run_context.create_graph()
    if create_graph:
        for variable, grad, i in pairs:
            accumulate_grad(variable, grad, stealable[i], True)
        return
    fast = _native_fns()
    if fast is not None:
        variables, grads, steal = [], [], []
        for variable, grad, i in pairs:
            variables.append(variable)
            grads.append(grad)
            steal.append(stealable[i])
        left = fast[0](variables, grads, steal)
        if left:
            with torch.no_grad():
                for k in left:
                    accumulate_grad(variables[k], grads[k], steal[k], False)
        return
    with torch.no_grad():
        for variable, grad, i in pairs:
            accumulate_grad(variable, grad, stealable[i], False)


_lock = threading.Lock()
_native: Any = None  # (accumulate, stealable) once self-tested; False: Python's


def _native_fns() -> Any:
    """The extension's ``(accumulate, stealable)`` once they have passed
    :func:`_self_test` against this module's Python code; None if the
    extension is unavailable or they failed (warned)."""
    global _native
    if _native is None:
        with _lock:
            if _native is None:
                fns = native.accumulate_fns()
                if fns is not None:
                    try:
                        with preserved():
                            _self_test(*fns)
                    except Exception as e:  # noqa: BLE001  (Python accumulates then)
                        log.warning("cagrad's C++ gradient accumulation failed its self-test (%s); "
                                    "Python accumulates", e)
                        fns = None
                _native = fns or False
    return _native or None


def _self_test(accumulate: Any, stealable: Any) -> None:
    """The C++ functions leave ``.grad`` as :func:`accumulate_grad` and
    :func:`_stealable_outputs` do (RuntimeError saying what differs)."""

    def cases() -> list:
        base = torch.arange(24.0).reshape(4, 6)
        return [
            # (leaf, gradient, stealable, .grad before)
            (torch.nn.Parameter(torch.zeros(4, 6)), base.clone(), True, None),
            (torch.nn.Parameter(torch.zeros(4, 6)), base.clone(), False, None),
            (torch.nn.Parameter(torch.zeros(6, 4).t()), base.clone(), True, None),  # transposed leaf
            (torch.zeros(4, 6, requires_grad=True), base.clone().t().contiguous().t(), True, None),
            (torch.nn.Parameter(torch.zeros(4, 6)), base.clone(), True, torch.ones(4, 6)),
            (torch.nn.Parameter(torch.zeros(4, 6)), base.clone(), True, torch.ones(4, 6).to_sparse()),
            (torch.zeros(4, 6, dtype=torch.float64, requires_grad=True), base.double(), True, None),
            (torch.nn.Parameter(torch.zeros(4, 6)), base.to_sparse(), True, None),
        ]

    with torch.inference_mode(False):  # the first backward may run under inference_mode
        ours, theirs = cases(), cases()
    with torch.inference_mode(False), torch.no_grad():
        for leaf, _, _, old in ours + theirs:
            leaf.grad = old.clone() if old is not None else None
        left = accumulate([c[0] for c in ours], [c[1] for c in ours], [c[2] for c in ours])
        for i in left:
            accumulate_grad(ours[i][0], ours[i][1], ours[i][2], False)
        for leaf, grad, steal, _ in theirs:
            accumulate_grad(leaf, grad, steal, False)
    if left != [5, 7]:
        raise RuntimeError(f"accumulate() left {left}, expected the sparse cases [5, 7]")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        ga, gb = a[0].grad, b[0].grad
        same = ga.layout == gb.layout and ga.dtype == gb.dtype and torch.equal(ga.to_dense(), gb.to_dense())
        if ga.layout == torch.strided:
            same = same and ga.stride() == gb.stride() and (ga is a[1]) == (gb is b[1])
        if not same:
            raise RuntimeError(f"accumulate() case {i}: .grad {ga} differs from Python's {gb}")
    a, b = torch.ones(4), torch.ones(6, 2)
    outs = [a, torch.ones(3), a[1:], torch.ones(2), torch.empty(0), torch.empty(0), b[:2], b, b[3:], b[2:3, 1]]
    inputs = [False, False, False, True, False, False, False, True, False, False]
    if stealable(outs, inputs) != _stealable_outputs(outs, inputs):
        raise RuntimeError(f"stealable() returned {stealable(outs, inputs)}, Python {_stealable_outputs(outs, inputs)}")
