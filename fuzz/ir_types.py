"""The parts of a program IR (:class:`fuzz.ir.Program`): leaves, ops, hooks,
and what shape inference knows about a value.

* :class:`Leaf`: an input tensor (name, shape, dtype in :data:`DTYPES`,
  ``requires_grad``);
* :class:`Op`: ``name = op(*inputs, **attrs)``, ``op`` a name of the catalog
  :mod:`fuzz.ops`;
* :class:`Hook`: an autograd hook registered after the forward, of a kind in
  :data:`HOOK_KINDS` with one of its actions;
* :class:`ValueInfo`: the shape, dtype, ``requires_grad`` and memory
  (view) facts :func:`fuzz.ir_validate.validate` infers for a value.

Their JSON forms are their ``to_dict()``; reading and checking them is
:mod:`fuzz.ir` and :mod:`fuzz.ir_validate`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

DTYPES = ("float32", "float64")
MODES = ("backward", "grad")
LOSSES = ("sum", "separate")

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Leaf:
    name: str
    shape: Shape
    dtype: str = "float32"
    requires_grad: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "requires_grad": self.requires_grad,
        }


@dataclasses.dataclass(frozen=True)
class Op:
    """``name = op(*inputs, **attrs)``; ``inputs`` are value references."""

    name: str
    op: str
    inputs: tuple[str, ...]
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "inputs": list(self.inputs),
            "attrs": _jsonable(self.attrs),
        }

    def __hash__(self) -> int:  # attrs is a dict; hash by its JSON form
        return hash((self.name, self.op, self.inputs, json.dumps(_jsonable(self.attrs), sort_keys=True)))


# hook kind -> the actions it takes (the first is the simplest)
HOOK_KINDS: dict[str, tuple[str, ...]] = {
    "tensor": ("observe", "scale", "shift", "zero", "callback", "pure_scale", "pure_shift", "inner_grad", "warn"),
    "retain_grad": ("observe",),
    "pre": ("observe", "scale", "pure_scale"),
    "post": ("observe", "scale", "drop", "pure_scale"),
    "post_accumulate": ("observe", "callback"),
}
# actions a program may hold but that generation draws only when asked
# (GenConfig.hook_actions, --hook-actions): drawing them by default moves
# every seed's programs, which the suite's seed-chosen campaign tests and
# issue 38's coverage figure for seed 1 were measured on
OPT_IN_HOOK_ACTIONS: frozenset[tuple[str, str]] = frozenset(
    {("pre", "pure_scale"), ("post", "pure_scale"), ("tensor", "warn")}
)
# hook kind -> the actions generation draws by default
DEFAULT_HOOK_ACTIONS: dict[str, tuple[str, ...]] = {
    kind: tuple(a for a in actions if (kind, a) not in OPT_IN_HOOK_ACTIONS) for kind, actions in HOOK_KINDS.items()
}
# actions that take an ``arg``: a number, or (drop) an index
ARG_ACTIONS = {
    "scale": "number",
    "shift": "number",
    "pure_scale": "number",
    "pure_shift": "number",
    "drop": "index",
}


@dataclasses.dataclass(frozen=True)
class Hook:
    """An autograd hook registered on value ``target`` after the forward.

    ``kind``:

    * ``"tensor"``: ``target.register_hook(fn)``; ``fn(g)`` records ``g`` and
      returns None (``observe``), ``g * arg`` (``scale``), ``g + arg``
      (``shift``) or ``torch.zeros_like(g)`` (``zero``); ``callback``
      returns None and queues (``queue_callback``) a callback that records
      ``g`` again under ``"<label> callback"`` after the whole backward;
      ``pure_scale`` and ``pure_shift`` return ``g * arg`` and ``g + arg``
      and record nothing: pure functions of the gradient, which cagrad
      traces into its graph (``cagrad.hooks.hook_tracing``) where nothing else of
      the user's runs in the backward; ``inner_grad`` starts a backward
      inside the hook: ``torch.autograd.grad`` of ``(a.sin() * a).sum()``
      for ``a = g.detach().requires_grad_()`` (a small graph of its own),
      records that grad ``d`` and returns ``g + d``
      (:func:`fuzz.features_graph.inner_grad_hook`); ``warn`` records ``g``,
      calls ``warnings.warn("<label> saw a gradient")`` (a ``UserWarning``,
      which the oracle counts: :mod:`harness.warnings_seen`) and returns
      None;
    * ``"retain_grad"``: ``target.retain_grad()`` on a non-leaf; its
      ``.grad`` is compared after the backward like a leaf's;
    * ``"pre"``: ``target.grad_fn.register_prehook(fn)``; ``fn(grad_outputs)``
      records them, returns None or (``scale``) each times ``arg``;
      ``pure_scale`` returns each times ``arg`` and records nothing (a pure
      node hook, which cagrad traces);
    * ``"post"``: ``target.grad_fn.register_hook(fn)``; ``fn(grad_inputs,
      grad_outputs)`` records both, returns None, each grad input times
      ``arg`` (``scale``), or the grad inputs with entry ``arg % len`` set to
      None (``drop``); ``pure_scale`` returns each grad input times ``arg``
      and records nothing;
    * ``"post_accumulate"``: ``leaf.register_post_accumulate_grad_hook(fn)``;
      ``fn(p)`` records ``p.grad``; ``callback`` also queues a callback that
      records ``p.grad`` as it is once the whole backward is done.

    The trace label is :attr:`label` (``"h0 tensor v3"``), never an id.
    """

    name: str
    kind: str
    target: str
    action: str = "observe"
    arg: float | int | None = None

    @property
    def label(self) -> str:
        return f"{self.name} {self.kind} {self.target}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "target": self.target, "action": self.action}
        if self.arg is not None:
            out["arg"] = self.arg
        return out


@dataclasses.dataclass(frozen=True)
class ValueInfo:
    """What shape inference knows about one value.

    ``is_leaf``: the tensor is a leaf (a leaf itself, or an op that returned
    a leaf unchanged, like ``x.to(x.dtype)``); ``fresh``: a newly allocated
    tensor that is not a view of anything (in-place ops may write to it).

    The view model (what eager allows after an in-place op, see
    :func:`fuzz.ir_validate.inplace_conflicts`): ``base`` is the value whose
    memory this tensor shares, resolved through views and ops that return
    their input (torch's ``._base``, or the tensor itself); empty for a value that owns
    its memory (:attr:`memory` is then its own ref). ``multi_view``: a view
    made by a multi-output view op (``split``, ``unbind``), or a view of one;
    torch forbids using such a view, or modifying it, once its base was
    modified in place.
    """

    ref: str
    shape: Shape
    dtype: str
    requires_grad: bool
    is_leaf: bool = False
    fresh: bool = False
    base: str = ""
    multi_view: bool = False

    @property
    def memory(self) -> str:
        """The ref of the value that owns this tensor's memory."""
        return self.base or self.ref


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


__all__ = ["ARG_ACTIONS", "DEFAULT_HOOK_ACTIONS", "DTYPES", "HOOK_KINDS", "OPT_IN_HOOK_ACTIONS", "LOSSES", "MODES", "Hook", "Leaf", "Op", "Shape", "ValueInfo"]
