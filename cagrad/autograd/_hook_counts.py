"""Hooks on an autograd node that the census cannot account for.

A hook added from C++ (``Node::add_pre_hook``, ``add_post_hook``,
``add_tensor_pre_hook``, ``add_retains_grad_hook``, a C++ ``Tensor::
register_hook`` or ``retain_grad``, a post-accumulate-grad hook set from C++)
is in none of the Python dicts :mod:`cagrad.hooks.hooks_census` reads, and a
compiled backward would silently skip it. This module reads a node's hook
lists in C++ and :func:`check` compares them with what the census found:
any difference sends the whole backward to eager
(``Unsupported("invisible_hooks")``) while it is collected, before any side
effect.

How Python-registered hooks appear in C++ (torch 2.13, checked by
``tests/cagrad/test_invisible_hooks.py``): all of a node's Python pre-hooks
are one ``PyFunctionPreHook`` holding the node's dict, all its post-hooks one
``PyFunctionPostHook`` (both stay, empty, once a hook was registered and
removed, or once the census probed the node); each non-leaf tensor with
``register_hook`` adds one ``PyFunctionTensorPreHook`` (its
``_backward_hooks`` dict) to its ``grad_fn``; a leaf's hooks are one
``PyFunctionTensorPreHook`` in its ``AccumulateGrad``'s tensor pre-hooks and
its post-accumulate-grad hooks one ``PyFunctionTensorPostAccGradHooks``;
``retain_grad`` is a C++ retains-grad hook whichever language called it (an
in-place op moves it to the tensor's new ``grad_fn``); DDP's ``Reducer`` adds
one C++ post-hook per parameter ``AccumulateGrad`` (:mod:`cagrad.hooks.cpp_hooks`).

So the C++ side classifies each hook by its dynamic type (its mangled name:
GCC/Clang) and returns, per list, how many hooks are of another type
("foreign"), the *non-empty* Python dicts, and the output numbers with a
retains-grad hook. :func:`check` requires that the foreign post-hooks are
exactly the ones :mod:`cagrad.hooks.cpp_hooks` knows (DDP's) and there are no
other foreign hooks; that the non-empty Python dicts are the ones the census
found (this also catches Python hooks registered before ``import cagrad``
that the import scan missed); and that the retains-grad hooks are on the
outputs the census noted ``retain_grad`` for, and on every one whose tensor
is alive. Empty Python dicts call nothing and are ignored, so the census need
not probe a node to know whether its dicts exist.

Lists eager would not run are not checked: pre- and post-hooks of a node
whose inputs are only captured (``autograd.grad(inputs=...)``); nodes that
neither run nor capture.

Cost: one C call per node the backward runs or captures, about 20 ns
(60-90 ns with the Python around it) when the node has no hook that calls
anything (measured on a chain of 2000 nodes).

The C++ side is ``counts`` of cagrad's extension (:mod:`cagrad.native`,
built on first need). If it cannot be built or loaded, a warning is logged
once per process on the ``cagrad`` logger and detection is off: backwards
are compiled as before, without this check.
"""
from __future__ import annotations

from typing import Any

from .. import native


def counts_fn() -> Any:
    """The C++ ``counts(node, all_lists)`` (see the module docstring), built
    on first call; None if the extension cannot be built (warned once)."""
    loaded = native.load()
    return loaded.counts if loaded is not None else None


def release_fn() -> Any:
    """The C++ ``release(nodes)``: each node's ``Node::release_variables()``
    (None items skipped), what the engine calls after running a node without
    ``retain_graph`` (``call_function`` in ``torch/csrc/autograd/engine.cpp``),
    about 20 ns a node; None if the extension cannot be built
    (:mod:`cagrad.autograd.saved_variables` then releases slot by slot in Python).

    Raises (the returned function):
        TypeError: an item is not an autograd node.
    """
    loaded = native.load()
    return loaded.release if loaded is not None else None


def check(got: Any, node: Any, found: Any, runs: bool, name: str, notes_key: str) -> None:
    """Raises Unsupported("invisible_hooks") unless the hooks ``node`` runs
    are exactly the ones the census found.

    Args:
        got: what ``counts(node, runs)`` (:func:`counts_fn`) returned.
        found: what ``Census.hooks_of(node)`` found (a FoundHooks or None).
        runs: the node runs (all its lists matter); else only its captured
            inputs' tensor pre-hooks and retains-grad hooks run.
        name: the node's type name, for the detail.
        notes_key: the key of the census's notes in ``node.metadata``
            (``(kind, output_nr, obj)``), read if the node has retains-grad
            hooks.

    Raises:
        Unsupported: a hook the census did not find (added from C++, or a
            Python hook dict it did not see), or one it found that eager
            would not call (a ``retain_grad`` moved by an in-place op).
    """
    if got is None:
        if found is None or not _found_any(found, runs):
            return
        got = (0, [], [], 0, [], 0, [], 0, None)
    tp_foreign, tp_dicts, retains, pre_foreign, pre_dicts, post_foreign, post_dicts, acc_foreign, acc_dict = (
        got
    )
    if tp_foreign:
        _raise(name, f"{tp_foreign} tensor pre-hook(s) added from C++ (tensor_pre_hooks)")
    if not _same(tp_dicts, [d for _, d in found.tensor_pre] if found is not None else []):
        _raise(name, "Python tensor hooks other than the census found (tensor_pre_hooks)")
    alive = {nr for nr, _ in found.retain_grad} if found is not None else set()
    if retains or alive:
        noted = {nr for kind, nr, _ in node.metadata.get(notes_key, ()) if kind == "retain_grad"}
        extra = set(retains) - noted
        if extra:
            _raise(
                name,
                f"retains_grad hooks on outputs {sorted(extra)} the census did not note "
                "(added from C++, or moved here by an in-place op) (retains_grad_hooks)",
            )
        missing = alive - set(retains)
        if missing:
            _raise(name, f"no retains_grad hook on outputs {sorted(missing)} (retains_grad_hooks)")
    if not runs:
        return
    if pre_foreign:
        _raise(name, f"{pre_foreign} pre-hook(s) added from C++ (pre_hooks)")
    if not _same(pre_dicts, [found.pre] if found is not None and found.pre else []):
        _raise(name, "Python pre-hooks other than the census found (pre_hooks)")
    known = len(found.cpp_post) if found is not None else 0
    if post_foreign != known:
        _raise(name, f"{post_foreign} post-hook(s) added from C++, {known} of them DDP's (post_hooks)")
    if not _same(post_dicts, [found.post] if found is not None and found.post else []):
        _raise(name, "Python post-hooks other than the census found (post_hooks)")
    if acc_foreign:
        _raise(name, "a post-accumulate-grad hook set from C++ (tensor_post_acc_grad_hooks)")
    expected = found.post_accumulate if found is not None else None
    if (acc_dict is None) != (expected is None) or (acc_dict is not None and acc_dict is not expected):
        _raise(name, "Python post-accumulate-grad hooks other than the census found")


def _found_any(found: Any, runs: bool) -> bool:
    if found.tensor_pre or found.retain_grad:
        return True
    return runs and bool(found.pre or found.post or found.post_accumulate or found.cpp_post)


def _same(dicts: list, known: list) -> bool:
    return {id(d) for d in dicts} == {id(d) for d in known if d}


def _raise(name: str, what: str) -> None:
    from ..errors import Unsupported

    raise Unsupported("invisible_hooks", f"{name} has {what}")
