"""Saved tensors: owning them, swapping them during a trace, releasing them.

A generated node keeps each saved tensor in a C++ ``SavedVariable``. Its
Python handle ``node._raw_saved_x`` has ``register_hooks(pack, unpack)``:
``pack`` runs at once with the tensor and the ``SavedVariable`` keeps only
what ``pack`` returned; every later unpack, by the node's own backward or by
``node._saved_x``, calls ``unpack``. cagrad packs each saved tensor into a
:class:`SavedTensorHolder`, which makes it

* liftable: the holder's tensor is a graph input on every backward;
* swappable: during a trace :class:`SwapSavedVariables` makes ``unpack``
  return the fake tensor bound to the graph input, so calling the node
  records its backward formula over that input (the role of
  ``SwapSavedVariables`` in torch/csrc/dynamo/compiled_autograd.h);
* releasable: after a backward without ``retain_graph`` the holder drops its
  tensor, and a later unpack raises eager's "backward through the graph a
  second time" error.

Eager checks a saved tensor's version counter only for ``SavedVariable``\\ s
without hooks, so the holder does the check itself. Before packing, reading
``node._saved_x`` runs eager's own check once (a tensor modified in place
before the first backward raises there, with eager's message).

The C++ ``SavedVariable`` owns the holder; the node's ``metadata`` dict keeps
only a weak reference. When eager autograd releases the node's variables
(``release_variables`` drops the hooks), the holder dies with them and cagrad
sees the graph as freed, as eager does.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .errors import EagerError, Unsupported

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
        data: the saved tensor (detached; ``None`` once released).
        version: ``data._version`` when packed; a mismatch at unpack time
            means the tensor was modified in place.
        swapped: the fake tensor unpack returns during a trace, else None.
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
        return self.get()

    def get(self) -> torch.Tensor:
        """The saved tensor, checked as eager's unpack checks it.

        Raises:
            RuntimeError: eager's messages for a released graph and for a
                tensor modified in place since it was saved.
        """
        data = self.data
        if data is None:
            raise RuntimeError(FREED_MESSAGE)
        if data._version != self.version:
            raise RuntimeError(_modified_message(data, self.owner, self.version))
        return data

    def release(self) -> None:
        self.data = None


class _Undefined:
    """Marks a saved slot that holds an undefined (``None``) tensor."""

    def __call__(self) -> _Undefined:
        return self


UNDEFINED = _Undefined()


def _holder_of(node: Any, attr: str, name: str, raw: Any, refs: dict[str, Any]) -> Any:
    # first visit of this slot: let eager's unpack check version and release,
    # then take the tensor over
    try:
        value = getattr(node, "_saved_" + name)
    except RuntimeError as e:
        raise EagerError(e) from e
    if value is None:
        refs[attr] = UNDEFINED
        return UNDEFINED
    holder = SavedTensorHolder(f"{type(node).__name__}.{attr}")
    try:
        raw.register_hooks(holder.pack, holder.unpack)
    except RuntimeError as e:
        raise Unsupported(
            "saved_tensors_hooks",
            f"{holder.owner} already has pack/unpack hooks ({e})",
        ) from e
    refs[attr] = weakref.ref(holder)
    return holder


def _lookup(refs: dict[str, Any], attr: str) -> Any:
    ref = refs.get(attr)
    if ref is None:
        return None
    holder = ref()
    if holder is None:
        # eager released this node's variables (its hooks, our holder with them)
        raise EagerError(RuntimeError(FREED_MESSAGE))
    return holder


def saved_tensor(node: Any, attr: str) -> SavedTensorHolder | _Undefined:
    """The holder of ``node._saved_<attr>``, packing it on first use.

    Returns:
        the holder, or :data:`UNDEFINED` when the slot holds no tensor.

    Raises:
        EagerError: the slot was released or its tensor modified in place;
            eager raises the matching RuntimeError when it runs.
        Unsupported: the slot already has hooks (``saved_tensors_hooks``).
    """
    refs = node.metadata.get(_METADATA_KEY)
    if refs is None:
        refs = node.metadata[_METADATA_KEY] = {}
    holder = _lookup(refs, attr)
    if holder is None:
        holder = _holder_of(node, attr, attr, getattr(node, "_raw_saved_" + attr), refs)
    if holder is not UNDEFINED:
        try:
            holder.get()
        except RuntimeError as e:
            raise EagerError(e) from e
    return holder


def saved_tensor_list(node: Any, attr: str) -> list[SavedTensorHolder | _Undefined]:
    """Holders of every element of the saved tensor list ``node._saved_<attr>``."""
    refs = node.metadata.get(_METADATA_KEY)
    if refs is None:
        refs = node.metadata[_METADATA_KEY] = {}
    count_key = attr + "#"
    count = refs.get(count_key)
    if count is None:
        try:
            values = getattr(node, "_saved_" + attr)
        except RuntimeError as e:
            raise EagerError(e) from e
        raws = getattr(node, "_raw_saved_" + attr)
        holders = []
        for i, (value, raw) in enumerate(zip(values, raws)):
            key = f"{attr}.{i}"
            if value is None:
                refs[key] = UNDEFINED
                holders.append(UNDEFINED)
                continue
            holder = SavedTensorHolder(f"{type(node).__name__}.{key}")
            try:
                raw.register_hooks(holder.pack, holder.unpack)
            except RuntimeError as e:
                raise Unsupported("saved_tensors_hooks", f"{holder.owner}: {e}") from e
            refs[key] = weakref.ref(holder)
            holders.append(holder)
        refs[count_key] = len(holders)
        return holders
    holders = [_lookup(refs, f"{attr}.{i}") for i in range(count)]
    for h in holders:
        if h is not UNDEFINED:
            try:
                h.get()
            except RuntimeError as e:
                raise EagerError(e) from e
    return holders


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
