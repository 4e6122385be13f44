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
``torch.utils.checkpoint``) run their ``unpack`` on every read, so a backward
over such slots must run in eager. Their ``SavedVariable``\\ s refuse a second
``register_hooks``, which is how they are found: once any default hooks have
been pushed, every slot is claimed with a holder while the backward is
collected (:func:`claim`), and a refusal makes the backward fall back.
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
_default_hooks_seen = False
_original_push = torch._C._autograd._push_saved_tensors_default_hooks


def _push_default_hooks(*args: Any, **kwargs: Any) -> Any:
    global _default_hooks_seen
    _default_hooks_seen = True
    return _original_push(*args, **kwargs)


def install(graphs_alive_at_import: bool) -> None:
    """Watches for default pack hooks (``saved_tensors_hooks``).

    Args:
        graphs_alive_at_import: graphs built before the import may hold
            foreign hooks, so every slot is claimed from then on.
    """
    global _default_hooks_seen
    if torch._C._autograd._push_saved_tensors_default_hooks is not _push_default_hooks:
        torch._C._autograd._push_saved_tensors_default_hooks = _push_default_hooks
        torch.autograd._push_saved_tensors_default_hooks = _push_default_hooks
    if graphs_alive_at_import:
        _default_hooks_seen = True


def must_claim() -> bool:
    """Whether slots may carry foreign hooks, so each must be claimed."""
    return _default_hooks_seen


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


def holder(slot: Slot) -> SavedTensorHolder:
    """The slot's holder, packing one into it on first use.

    Raises:
        Unsupported: the slot carries pack hooks that are not cagrad's.
    """
    node = slot[0]
    refs = _refs(node)
    key = _key(slot)
    ref = refs.get(key)
    h = ref() if ref is not None else None
    if h is not None:
        return h
    h = SavedTensorHolder(f"{type(node).__name__}.{key}")
    try:
        _raw(slot).register_hooks(h.pack, h.unpack)
    except RuntimeError as e:
        raise Unsupported(
            "saved_tensors_hooks", f"{h.owner} has pack/unpack hooks that are not cagrad's ({e})"
        ) from e
    refs[key] = weakref.ref(h)
    return h


def claim(slot: Slot) -> None:
    """Packs a holder into the slot now, so foreign hooks show up here.

    Raises:
        Unsupported: the slot carries pack hooks that are not cagrad's.
    """
    holder(slot)


def release(slot: Slot) -> None:
    """Frees the slot's tensor as eager's ``release_variables`` would."""
    try:
        _raw(slot).register_hooks(_drop, _freed)
        return
    except RuntimeError:
        pass  # already hooked: a holder of ours (foreign hooks fell back)
    ref = _refs(slot[0]).get(_key(slot))
    h = ref() if ref is not None else None
    if h is not None:
        h.release()


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
