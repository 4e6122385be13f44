"""Finding every hook a backward would run.

No public API lists a node's hooks, so cagrad watches them being registered
and looks them up where they live:

* leaf tensors: ``AccumulateGrad.variable`` is the leaf; its
  ``_backward_hooks`` (tensor hooks) and ``_post_accumulate_grad_hooks`` are
  plain dicts on the tensor, read on every backward.
* node pre- and post-hooks (``grad_fn.register_prehook`` /
  ``register_hook``, C++ nodes and custom Functions alike): the C++ side
  creates the node's hook dict by calling the Python staticmethod
  ``torch.autograd.function._HookMixin._register_hook``, which cagrad wraps to
  keep a weak set of every such dict. Which node holds a dict is only visible
  by *probing* the node: registering a hook returns a handle whose
  ``hooks_dict_ref()`` is the node's dict, and the probe is removed at once.
  A probe costs several microseconds, so cagrad probes only while some node
  hook dict anywhere is non-empty.
* hooks on non-leaf tensors (``Tensor.register_hook``, ``retain_grad``): the
  node holds them in C++, so cagrad wraps those two methods to note, in the
  node's ``metadata``, that the tensor it produced has hooks, and keeps weak
  references to the tensors' hook dicts to know whether any are live.

At import, graphs reachable from live tensors are scanned once (``gc``) for
hooks registered before cagrad was imported.

* hooks added from C++ by Python objects cagrad watches being constructed
  (DDP's ``Reducer``): see :mod:`cagrad.hooks.cpp_hooks`.

Not visible here: hooks added from C++ by anything else (an extension calling
``Node::add_pre_hook``/``add_post_hook``/``add_tensor_pre_hook``/
``add_retains_grad_hook``, a C++ ``Tensor::register_hook`` or
``retain_grad``), and Python hooks registered before ``import cagrad`` on a
graph that no live tensor reached at the import. They are *detected*: before
a backward is compiled, :meth:`Census.check_invisible` reads each node's hook
lists in C++ (:mod:`cagrad.autograd._hook_counts`, a small extension built on first
need) and, if a node has a hook the census did not find (or the census found
one the node no longer has: a ``retain_grad`` moved by an in-place op), the
whole backward runs in eager autograd with the reason ``invisible_hooks``.
Without a C++ compiler the extension cannot be built: a warning is logged
once and these hooks are then not detected. Import cagrad before building
graphs with hooks.

The hooks found are passed to the compiled graph at run time, so a cache
hit calls the hooks registered now; their kinds and counts are in the key.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.autograd.function as _function

from ..autograd import _hook_counts, saved_variables
from ..errors import Unsupported
from . import cpp_hooks

_TENSOR_HOOKS_KEY = "_cagrad_tensor_hooks"

# None where this torch lacks one ("tensor_hooks" in cagrad.internals: then
# install() is not called and every backward falls back)
_original_register_hook = getattr(torch.Tensor, "register_hook", None)
_original_retain_grad = getattr(torch.Tensor, "retain_grad", None)
_original_node_register_hook = getattr(getattr(_function, "_HookMixin", None), "_register_hook", None)
_original_post_accumulate = getattr(torch.Tensor, "register_post_accumulate_grad_hook", None)

# hooks registered (tensor, retain_grad, node pre/post, post-accumulate-grad)
# since import: a backward that runs user code compares it before and after
# (cagrad.hooks.added_hooks)
_registrations = 0


class Registrations:
    """One run's view of the registration count: :meth:`moved` says whether
    a hook was registered through the wrapped APIs since it was made or last
    said so."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen = _registrations

    def moved(self) -> bool:
        if _registrations == self._seen:
            return False
        self._seen = _registrations
        return True



class _LiveDicts:
    """A weak set of objects by identity: dicts are unhashable, and tensors
    compare elementwise (``weakref.WeakSet`` compares the referents of equal
    hashes, so adding a tensor twice would raise)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, d: Any) -> None:
        key = id(d)
        if key not in self._refs:
            refs = self._refs
            refs[key] = weakref.ref(d, lambda _, key=key: refs.pop(key, None))

    def any_nonempty(self) -> bool:
        return any(len(r() or ()) for r in list(self._refs.values()))

    def __len__(self) -> int:
        return len(self._refs)


# every node hook dict and tensor hook dict alive, and tensors retaining grad
_node_hook_dicts = _LiveDicts()
_tensor_hook_dicts = _LiveDicts()
_retaining_tensors = _LiveDicts()  # of tensors
_probing = False


def _note_tensor_hooks(t: torch.Tensor, kind: str) -> None:
    fn = t.grad_fn
    if fn is None:
        return  # leaf hooks live on the tensor itself
    entries = fn.metadata.setdefault(_TENSOR_HOOKS_KEY, [])
    if kind == "retain_grad":
        _retaining_tensors.add(t)
        if not any(e[0] == "retain_grad" and e[1] == t.output_nr for e in entries):
            entries.append(("retain_grad", t.output_nr, weakref.ref(t)))
        return
    hooks = t._backward_hooks
    if hooks is not None:
        _tensor_hook_dicts.add(hooks)
        if not any(e[2] is hooks for e in entries):
            entries.append(("tensor_pre_hook", t.output_nr, hooks))


def _register_hook(self: torch.Tensor, hook: Any) -> Any:
    global _registrations
    _registrations += 1
    handle = _original_register_hook(self, hook)
    if isinstance(self, torch.Tensor):
        _note_tensor_hooks(self, "tensor_pre_hook")
    return handle


def _retain_grad(self: torch.Tensor) -> None:
    global _registrations
    _registrations += 1
    _original_retain_grad(self)
    if isinstance(self, torch.Tensor) and self.grad_fn is not None:
        _note_tensor_hooks(self, "retain_grad")


def _node_register_hook(backward_hooks: Any, hook: Any) -> Any:
    global _registrations
    hooks, handle = _original_node_register_hook(backward_hooks, hook)
    if not _probing:
        _registrations += 1
        _node_hook_dicts.add(hooks)
    return hooks, handle


def _register_post_accumulate(self: torch.Tensor, hook: Any) -> Any:
    global _registrations
    _registrations += 1
    return _original_post_accumulate(self, hook)


_register_hook.__doc__ = getattr(_original_register_hook, "__doc__", None)
_retain_grad.__doc__ = getattr(_original_retain_grad, "__doc__", None)
_register_post_accumulate.__doc__ = getattr(_original_post_accumulate, "__doc__", None)


def install() -> None:
    """Wraps the registration APIs and notes hooks that already exist."""
    if torch.Tensor.register_hook is _register_hook:
        return
    torch.Tensor.register_hook = _register_hook  # type: ignore[method-assign]
    torch.Tensor.retain_grad = _retain_grad  # type: ignore[method-assign]
    _function._HookMixin._register_hook = staticmethod(_node_register_hook)
    if _original_post_accumulate is not None:
        torch.Tensor.register_post_accumulate_grad_hook = _register_post_accumulate  # type: ignore[method-assign]
    saved_variables.install(graphs_alive_at_import=_scan_existing_graphs())


def _scan_existing_graphs() -> bool:
    """Notes hooks on graphs alive now; returns whether any graph is alive."""
    roots = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.grad_fn is not None:
            if obj._backward_hooks:
                _note_tensor_hooks(obj, "tensor_pre_hook")
            if obj.retains_grad:
                _note_tensor_hooks(obj, "retain_grad")
            roots.append(obj.grad_fn)
    seen: set[Any] = set()
    while roots:
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for d in node_hook_dicts(node):
            if d:
                _node_hook_dicts.add(d)
        roots.extend(fn for fn, _ in node.next_functions)
    return bool(seen)


def _probe(*args: Any) -> None:
    return None


def node_hook_dicts(node: Any) -> tuple[OrderedDict, OrderedDict]:
    """The node's dicts of Python pre-hooks and post-hooks (live objects)."""
    global _probing
    _probing = True
    try:
        handle = node.register_prehook(_probe)
        pre = handle.hooks_dict_ref()
        handle.remove()
        handle = node.register_hook(_probe)
        post = handle.hooks_dict_ref()
        handle.remove()
    finally:
        _probing = False
    return pre, post


@dataclasses.dataclass
class FoundHooks:
    """The hooks one node runs, as the live objects eager will call.

    Attributes:
        tensor_pre: ``(input_nr, hook dict)`` in the order eager calls them.
        retain_grad: ``(input_nr, weakref to the tensor)``.
        pre, post: the node's pre-/post-hook dicts (non-empty) or None.
        post_accumulate: a leaf's post-accumulate-grad hook dict or None.
        cpp_post: hooks a Python object added from C++ to a leaf's
            AccumulateGrad (:mod:`cagrad.hooks.cpp_hooks`), each a callable, in
            order; eager runs them after the post-accumulate-grad hooks and
            before the Python post-hooks registered after them.
    """

    tensor_pre: list[tuple[int, OrderedDict]]
    retain_grad: list[tuple[int, weakref.ref]]
    pre: OrderedDict | None
    post: OrderedDict | None
    post_accumulate: OrderedDict | None
    cpp_post: tuple = ()


class Census:
    """What one backward must look for; decided once per backward, before
    any of its hooks runs.

    Attributes:
        probe_nodes: some node hook dict is non-empty somewhere, so every
            node is probed.
        tensor_hooks: some non-leaf tensor hook or ``retain_grad`` is live,
            so every node's notes are read.
        claim_slots: saved-tensor slots may carry foreign pack hooks, so
            each is claimed while collected (see :mod:`cagrad.autograd.saved_variables`).
        counts: the C++ reader of a node's hook lists
            (:mod:`cagrad.autograd._hook_counts`), or None when detection is off.

    ``probe_nodes`` and ``tensor_hooks`` scan every live hook dict, so they
    are read on first use: a guarded hit, which reads the C++ hook lists of
    its own nodes instead, never scans them. The full collection reads them
    before any hook of the backward runs.
    """

    __slots__ = ("_probe_nodes", "_tensor_hooks", "claim_slots", "cpp_hooks", "counts")

    def __init__(self) -> None:
        self.counts = _hook_counts.counts_fn()  # None: detection off
        self.cpp_hooks = cpp_hooks.any_live()
        self.claim_slots = saved_variables.any_foreign_hooks()
        self._probe_nodes: bool | None = None
        self._tensor_hooks: bool | None = None

    @property
    def probe_nodes(self) -> bool:
        if self._probe_nodes is None:
            self._probe_nodes = _node_hook_dicts.any_nonempty()
        return self._probe_nodes

    @property
    def tensor_hooks(self) -> bool:
        if self._tensor_hooks is None:
            self._tensor_hooks = bool(_retaining_tensors) or _tensor_hook_dicts.any_nonempty()
        return self._tensor_hooks

    def hooks_of(self, node: Any, is_leaf_sink: bool) -> FoundHooks | None:
        """The hooks ``node`` runs, or None if it runs none."""
        tensor_pre: list[tuple[int, OrderedDict]] = []
        retain: list[tuple[int, weakref.ref]] = []
        pre = post = post_acc = None
        cpp_post: tuple = ()
        if is_leaf_sink:
            variable = node.variable
            if variable._backward_hooks:
                tensor_pre.append((0, variable._backward_hooks))
            post_acc = getattr(variable, "_post_accumulate_grad_hooks", None) or None
            if self.cpp_hooks:
                cpp_post = cpp_hooks.post_hooks_of(variable)
        if self.probe_nodes:
            pre, post = node_hook_dicts(node)
            pre = pre or None
            post = post or None
        if self.tensor_hooks and not is_leaf_sink:
            for kind, output_nr, obj in node.metadata.get(_TENSOR_HOOKS_KEY, ()):
                if kind == "retain_grad":
                    tensor = obj()
                    if tensor is not None:
                        if tensor.grad_fn is not node:
                            # an in-place op moved the retains-grad hook to the tensor's new grad_fn
                            raise Unsupported(
                                "invisible_hooks", f"{node.name()}: a retain_grad moved to another node by an in-place op"
                            )
                        retain.append((output_nr, obj))
                elif obj:
                    tensor_pre.append((output_nr, obj))
        if tensor_pre or retain or pre or post or post_acc or cpp_post:
            return FoundHooks(tensor_pre, retain, pre, post, post_acc, cpp_post)
        return None

    def check_invisible(self, node: Any, found: FoundHooks | None, runs: bool, name: str) -> None:
        """Raises Unsupported("invisible_hooks") if ``node`` has hooks that
        ``found`` (from :meth:`hooks_of`) does not account for: added from
        C++, or Python hooks the census missed (see :mod:`cagrad.autograd._hook_counts`).

        Args:
            runs: the node runs; else only its captured inputs' tensor
                pre-hooks and retains-grad hooks are checked.
        """
        counts = self.counts
        if counts is None:
            return
        try:
            got = counts(node, runs)
        except (TypeError, RuntimeError) as e:  # a node object it cannot read
            raise Unsupported("invisible_hooks", f"cannot read the hooks of {name}: {e}") from e
        if got is not None or found is not None:
            _hook_counts.check(got, node, found, runs, name, _TENSOR_HOOKS_KEY)
