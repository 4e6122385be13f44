"""Finding every hook a backward would run.

No public API lists a node's hooks, so cagrad finds them three ways:

* leaf tensors: ``AccumulateGrad.variable`` is the leaf; its
  ``_backward_hooks`` (tensor hooks) and ``_post_accumulate_grad_hooks`` are
  plain dicts on the tensor.
* node pre- and post-hooks registered from Python
  (``grad_fn.register_prehook`` / ``register_hook``): registering a probe hook
  returns a handle whose ``hooks_dict_ref()`` is the node's one dict of that
  kind; the probe is removed at once and the dict tells what else is there.
* hooks on non-leaf tensors (``Tensor.register_hook``, ``retain_grad``): the
  node holds them in C++ where Python cannot look, so cagrad sees them when
  they are registered. At import it wraps ``torch.Tensor.register_hook`` and
  ``torch.Tensor.retain_grad`` to note, in the node's ``metadata``, that the
  tensor it produced has hooks, and it scans the live tensors (``gc``) once
  for hooks registered before the import.

Not visible: hooks added from C++ (extensions calling ``add_hook``), and a
hook registered before ``import cagrad`` on a non-leaf tensor that was freed
before the import while its ``grad_fn`` lived on. Import cagrad before
building graphs that carry such hooks.

This version compiles no hooks: a backward with any hook falls back to
eager, counted as ``hooks``.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from .errors import Unsupported

_TENSOR_HOOKS_KEY = "_cagrad_tensor_hooks"

_original_register_hook = torch.Tensor.register_hook
_original_retain_grad = torch.Tensor.retain_grad


def _note_tensor_hooks(t: torch.Tensor, kind: str) -> None:
    fn = t.grad_fn
    if fn is None:
        return  # leaf hooks live on the tensor itself
    entries = fn.metadata.setdefault(_TENSOR_HOOKS_KEY, [])
    if kind == "retain_grad":
        if ("retain_grad", t.output_nr, None) not in entries:
            entries.append(("retain_grad", t.output_nr, None))
        return
    hooks = t._backward_hooks
    if hooks is not None and not any(e[2] is hooks for e in entries):
        entries.append(("tensor_pre_hook", t.output_nr, hooks))


def _register_hook(self: torch.Tensor, hook: Any) -> Any:
    handle = _original_register_hook(self, hook)
    if isinstance(self, torch.Tensor):
        _note_tensor_hooks(self, "tensor_pre_hook")
    return handle


def _retain_grad(self: torch.Tensor) -> None:
    _original_retain_grad(self)
    if isinstance(self, torch.Tensor) and self.grad_fn is not None:
        _note_tensor_hooks(self, "retain_grad")


_register_hook.__doc__ = _original_register_hook.__doc__
_retain_grad.__doc__ = _original_retain_grad.__doc__


def install() -> None:
    """Wraps the registration APIs and notes hooks that already exist."""
    if torch.Tensor.register_hook is _register_hook:
        return
    torch.Tensor.register_hook = _register_hook  # type: ignore[method-assign]
    torch.Tensor.retain_grad = _retain_grad  # type: ignore[method-assign]
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.grad_fn is not None:
            if obj._backward_hooks:
                _note_tensor_hooks(obj, "tensor_pre_hook")
            if obj.retains_grad:
                _note_tensor_hooks(obj, "retain_grad")


def _probe(*args: Any) -> None:
    return None


def node_hook_dicts(node: Any) -> tuple[dict, dict]:
    """The node's dicts of Python pre-hooks and post-hooks (live objects)."""
    handle = node.register_prehook(_probe)
    pre = handle.hooks_dict_ref()
    handle.remove()
    handle = node.register_hook(_probe)
    post = handle.hooks_dict_ref()
    handle.remove()
    return pre, post


def check(node: Any, call: Any) -> None:
    """Raises Unsupported if ``node`` would run any hook.

    Raises:
        Unsupported: with reason ``hooks`` and the kind of hook in the detail.
    """
    pre, post = node_hook_dicts(node)
    name = type(node).__name__
    if pre or post:
        raise Unsupported("hooks", f"{name} has node {'pre-' if pre else 'post-'}hooks")
    entries = node.metadata.get(_TENSOR_HOOKS_KEY)
    if entries:
        for kind, _, hooks in entries:
            if kind == "retain_grad" or hooks:
                raise Unsupported("hooks", f"a tensor made by {name} has a {kind}")
    if call.schema.kind.value == "accumulate_grad":
        variable = node.variable
        if variable._backward_hooks:
            raise Unsupported("hooks", "a leaf tensor has a tensor hook")
        if getattr(variable, "_post_accumulate_grad_hooks", None):
            raise Unsupported("hooks", "a leaf tensor has a post-accumulate-grad hook")
