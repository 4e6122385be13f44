"""Saved tensors: reading them, swapping them during a trace, releasing them.

A generated node keeps each saved tensor in a C++ ``SavedVariable``. Python
reads it as ``node._saved_x``: that runs eager's own unpack, with eager's
checks (a tensor modified in place since it was saved, a graph already
released), so cagrad reads every saved tensor that way and lifts the result
as a graph input.

``node._raw_saved_x.register_hooks(pack, unpack)`` (allowed once per
``SavedVariable``) is how cagrad acts on a slot:

* swap, during a trace: a :class:`SavedTensorHolder` is packed into the slot,
  and :class:`SwapSavedVariables` makes its ``unpack`` return the fake tensor
  bound to the graph input, so calling the node records its backward formula
  over that input (the role of ``SwapSavedVariables`` in
  torch/csrc/dynamo/compiled_autograd.h). Outside a trace the holder returns
  the real tensor, checking the version counter itself, since eager skips
  that check for ``SavedVariable``\\ s with hooks.
* release, after a backward without ``retain_graph``: a slot without a
  holder gets hooks whose ``pack`` keeps nothing and whose ``unpack`` raises
  eager's "backward through the graph a second time" error; a slot with a
  holder has the holder drop its tensor.

The node's ``metadata`` dict keeps only weak references to holders; the
``SavedVariable`` owns them, so when eager releases the node's variables the
holders die with them.

Pack hooks that are not cagrad's (``torch.autograd.graph.saved_tensors_hooks``,
``torch.utils.checkpoint``, ``save_on_cpu``) run their ``unpack`` on every
read, so a node holding such slots runs as it is, its hooks with it. Their
``SavedVariable``\\ s refuse a second ``register_hooks``, which is how they
are found: the slots of nodes created while default hooks were pushed are
claimed with a holder while the backward is collected (:func:`claim`), and a
refusal marks the node.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import internals
from ..errors import EagerError, Unsupported
from . import _hook_counts

_METADATA_KEY = "_cagrad_saved"

# eager's message, from SavedVariable::unpack (torch/csrc/autograd/saved_variable.cpp)
FREED_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access "
    "saved tensors after they have already been freed). Saved intermediate "
    "values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward "
    "through the graph a second time or if you need to access saved tensors "
    "after calling backward."
)

Slot = tuple[Any, str, int]  # (node, attribute suffix, list index or -1)


def _modified_message(t: torch.Tensor, owner: str, saved: int) -> str:
    # same cause and wording as eager's SavedVariable::unpack error
    return (
        "one of the variables needed for gradient computation has been "
        f"modified by an inplace operation: [{t.type()} {list(t.shape)}], "
        f"which is saved by {owner}, is at version {t._version}; expected "
        f"version {saved} instead. Hint: enable anomaly detection to find the "
        "operation that failed to compute its gradient, with "
        "torch.autograd.set_detect_anomaly(True)."
    )


class SavedTensorHolder:
    """What a ``SavedVariable`` keeps once cagrad has packed it.

    Attributes:
        data: the saved tensor (``None`` once released).
        version: ``data._version`` when packed.
        swapped: the fake tensor ``unpack`` returns during a trace, else None.
        owner: ``"<NodeType>.<attr>"`` for error messages.
    """

    __slots__ = ("data", "version", "swapped", "owner", "__weakref__")

    def __init__(self, owner: str) -> None:
        self.data: torch.Tensor | None = None
        self.version = 0
        self.swapped: torch.Tensor | None = None
        self.owner = owner

    def pack(self, t: torch.Tensor) -> SavedTensorHolder:
        self.data = t
        self.version = t._version
        return self

    def unpack(self, _packed: Any) -> torch.Tensor:
        if self.swapped is not None:
            return self.swapped
        data = self.data
        if data is None:
            raise RuntimeError(FREED_MESSAGE)
        if data._version != self.version:
            raise RuntimeError(_modified_message(data, self.owner, self.version))
        return data

    def release(self) -> None:
        self.data = None


def _drop(_t: torch.Tensor) -> None:
    return None


def _freed(_packed: Any) -> torch.Tensor:
    raise RuntimeError(FREED_MESSAGE)


# -- foreign pack hooks ------------------------------------------------------
# Default pack hooks (saved_tensors_hooks, checkpoint, save_on_cpu) hook every
# tensor saved while they are pushed. Nodes get increasing sequence numbers,
# so the numbers current at push and pop bound the nodes that may carry them;
# only those are claimed (claiming an ordinary slot would skip eager's version
# check, which runs only for slots without hooks). Intervals are merged past
# a bound, which only widens them: more nodes claimed, none missed.
_MAX_INTERVALS = 256
_intervals: list[list[float]] = []  # sorted, disjoint [start, end)
_open: dict[int, list[int]] = {}  # per thread: starts of pushed contexts
# None where this torch lacks them ("saved_tensor_hooks" in cagrad.internals)
_original_push = getattr(torch._C._autograd, "_push_saved_tensors_default_hooks", None)
_original_pop = getattr(torch._C._autograd, "_pop_saved_tensors_default_hooks", None)


def _sequence_nr() -> int:
    return torch._C._autograd._get_sequence_nr()


def _add_interval(start: float, end: float) -> None:
    merged = [start, end]
    kept = []
    for iv in _intervals:
        if iv[1] < merged[0] or iv[0] > merged[1]:
            kept.append(iv)
        else:
            merged = [min(iv[0], merged[0]), max(iv[1], merged[1])]
    kept.append(merged)
    kept.sort()
    while len(kept) > _MAX_INTERVALS:
        a, b = kept.pop(0), kept.pop(0)
        kept.insert(0, [a[0], max(a[1], b[1])])
    _intervals[:] = kept


def _push_default_hooks(*args: Any, **kwargs: Any) -> Any:
    _open.setdefault(threading.get_ident(), []).append(_sequence_nr())
    return _original_push(*args, **kwargs)


def _pop_default_hooks(*args: Any, **kwargs: Any) -> Any:
    out = _original_pop(*args, **kwargs)
    starts = _open.get(threading.get_ident())
    if starts:
        _add_interval(starts.pop(), _sequence_nr())
    return out


# Out of Dynamo's sight, as torch's own functions are (torch's files are
# skipped by Dynamo's frame hook): called inside a torch.compile'd region
# (torch's compiled autograd runs checkpoint's unpack hook from its graph),
# Dynamo would trace these frames, warn about the builtins they call
# ("Dynamo does not know how to trace the builtin ..._get_sequence_nr") and
# break its graph there, where without cagrad it does neither.
_push_default_hooks = torch.compiler.disable(_push_default_hooks)
_pop_default_hooks = torch.compiler.disable(_pop_default_hooks)


def install(graphs_alive_at_import: bool) -> None:
    """Watches default pack hooks being pushed and popped.

    Args:
        graphs_alive_at_import: graphs built before the import may hold
            foreign hooks, so the nodes numbered before it are claimed.
    """
    if not internals.ok("saved_tensor_hooks"):
        return
    if torch._C._autograd._push_saved_tensors_default_hooks is not _push_default_hooks:
        torch._C._autograd._push_saved_tensors_default_hooks = _push_default_hooks
        torch._C._autograd._pop_saved_tensors_default_hooks = _pop_default_hooks
        torch.autograd._push_saved_tensors_default_hooks = _push_default_hooks
        torch.autograd._pop_saved_tensors_default_hooks = _pop_default_hooks
        if graphs_alive_at_import:
            _add_interval(0, _sequence_nr())


def any_foreign_hooks() -> bool:
    """Whether default pack hooks were ever pushed (cheap, per backward)."""
    return bool(_intervals) or any(_open.values())


def foreign_hooks_on(nodes: Any) -> bool:
    """Whether any of ``nodes`` (autograd nodes, AccumulateGrad excluded by
    the caller) may carry pack hooks that are not cagrad's: one check per
    backward where default hooks were never pushed, one per node after."""
    return any_foreign_hooks() and any(may_have_foreign_hooks(n) for n in nodes)


def may_have_foreign_hooks(node: Any) -> bool:
    """Whether ``node`` was created while default pack hooks were pushed."""
    seq = node._sequence_nr()
    if any(starts and seq >= min(starts) for starts in _open.values()):
        return True
    i = bisect.bisect_right(_intervals, [seq, math.inf]) - 1
    return i >= 0 and _intervals[i][0] <= seq < _intervals[i][1]


# -- reading, claiming, releasing -------------------------------------------
def read(node: Any, attr: str) -> Any:
    """``node._saved_<attr>`` (a tensor, None, or a tuple for tensor lists).

    Raises:
        EagerError: eager's unpack raised (released graph, in-place change).
    """
    try:
        return getattr(node, "_saved_" + attr)
    except RuntimeError as e:
        raise EagerError(e) from e


def _raw(slot: Slot) -> Any:
    node, attr, index = slot
    raw = getattr(node, "_raw_saved_" + attr)
    return raw if index < 0 else raw[index]


def _refs(node: Any) -> dict[str, Any]:
    refs = node.metadata.get(_METADATA_KEY)
    if refs is None:
        refs = node.metadata[_METADATA_KEY] = {}
    return refs


def _key(slot: Slot) -> str:
    _, attr, index = slot
    return attr if index < 0 else f"{attr}.{index}"


def _own(slot: Slot) -> SavedTensorHolder | None:
    ref = _refs(slot[0]).get(_key(slot))
    return ref() if ref is not None else None


def _pack(slot: Slot) -> tuple[SavedTensorHolder, RuntimeError | None]:
    """Packs a new holder into the slot: ``(holder, None)``, or the
    ``RuntimeError`` torch raised (the slot is hooked already, undefined or
    freed) in place of None."""
    node = slot[0]
    key = _key(slot)
    h = SavedTensorHolder(f"{type(node).__name__}.{key}")
    try:
        _raw(slot).register_hooks(h.pack, h.unpack)
    except RuntimeError as e:
        # without its traceback: the caller keeps the error in a local, and
        # the traceback's frame refers back to the caller's: a cycle through
        # every frame of the stack (the backward's roots and the program's
        # tensors in their locals) that only Python's cyclic collector frees
        return h, e.with_traceback(None)
    _refs(node)[key] = weakref.ref(h)
    return h, None


def _raise_if_freed(e: RuntimeError) -> None:
    if "freed" in str(e):
        raise EagerError(RuntimeError(FREED_MESSAGE)) from e


def holder(slot: Slot) -> SavedTensorHolder:
    """The slot's holder, packing one into it on first use.

    Raises:
        Unsupported: the slot carries pack hooks that are not cagrad's.
        EagerError: the slot was released.
    """
    h = _own(slot)
    if h is not None:
        return h
    h, e = _pack(slot)
    if e is not None:
        _raise_if_freed(e)
        raise Unsupported(
            "saved_tensors_hooks", f"{h.owner} has pack/unpack hooks that are not cagrad's ({e})"
        ) from e
    return h


def claim(slot: Slot) -> bool:
    """Packs a holder into the slot now, so foreign hooks show up here.

    Returns:
        False if the slot carries pack hooks that are not cagrad's (the node
        must then run as it is, its hooks with it); True otherwise (the slot
        is cagrad's now, or holds no tensor).

    Raises:
        EagerError: the slot was released.
    """
    if _own(slot) is not None:
        return True
    _, e = _pack(slot)
    if e is None:
        return True
    if "None" in str(e):
        return True  # an undefined optional tensor
    _raise_if_freed(e)
    return False


def release(slot: Slot) -> None:
    """Frees the slot's tensor as eager's ``release_variables`` would."""
    try:
        _raw(slot).register_hooks(_drop, _freed)
        return
    except RuntimeError:
        pass  # hooked already (a holder of ours, or foreign hooks), undefined, or freed
    h = _own(slot)
    if h is not None:
        h.release()


def release_nodes(nodes: Sequence[Any]) -> bool:
    """Frees every saved tensor of ``nodes`` (None items skipped) with the
    engine's own ``Node::release_variables()``, through the C++ extension
    of :mod:`cagrad.autograd._hook_counts`: what eager does to each node it ran
    without ``retain_graph``, foreign-hooked slots and custom Functions
    included, and a later unpack raises eager's own error.

    Returns:
        False if the extension is not available (no C++ compiler); the
        caller then releases slot by slot (:func:`release`).
    """
    fn = _hook_counts.release_fn()
    if fn is None:
        return False
    fn(nodes)
    return True


def release_node(node: Any, tensors: Sequence[str], tensor_lists: Sequence[str]) -> None:
    """Releases every saved tensor of a node that ran as it is.

    Slots with pack hooks that are not cagrad's cannot be released from
    Python; they are freed with the graph.
    """
    for attr in tensors:
        release((node, attr, -1))
    for attr in tensor_lists:
        for i in range(len(getattr(node, "_raw_saved_" + attr))):
            release((node, attr, i))


def release_custom(node: Any) -> None:
    """Releases a custom Function's ``save_for_backward`` tensors (those
    claimed with a holder too: see ``Collector._claim_custom``)."""
    for i in range(len(node._raw_saved_tensors)):
        release((node, "tensors", i))


@contextlib.contextmanager
def SwapSavedVariables(
    holders: Sequence[SavedTensorHolder], fakes: Sequence[torch.Tensor]
) -> Iterator[None]:
    """While active, each holder's unpack returns the matching fake tensor."""
    for h, f in zip(holders, fakes, strict=True):
        h.swapped = f
    try:
        yield
    finally:
        for h in holders:
            h.swapped = None
