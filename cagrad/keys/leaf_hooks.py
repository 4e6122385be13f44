"""Guarded hits for graphs whose only hooks are C++ post hooks on leaves.

DDP's C++ reducer adds one post hook to each parameter's AccumulateGrad
(:mod:`cagrad.hooks.cpp_hooks` knows them by parameter). Such a backward
runs segmented: each hooked accumulation is an opaque call between
compiled segments, in eager's order, and its hook runs right after it.
Without a guard every one of these backwards took the full collection (on
this project's CPU the DDP MLP's 42 nodes took 0.65 ms of its 2.4 ms).

A :class:`LeafHooks` extends a graph's :class:`~cagrad.keys.hit_path.HitGuard`
to these graphs. The generated function checks everything but the hooked
nodes' hook lists, as for any graph; then :meth:`LeafHooks.collect` reads
each hooked leaf's hooks and requires exactly what the capture saw: only
C++ post hooks, as many as then, and as many known to
:mod:`cagrad.hooks.cpp_hooks`. It reads the hook lists in C++ (one call per
leaf, the reader the full collection's ``Census.check_invisible`` uses)
and the leaf's own hook dicts; without the C++ reader, as the full
collection reads them (``Census.hooks_of`` and ``check_invisible``). Every other
leaf must have none that cagrad knows of. It then builds the runtime
objects (leaf variables and hook tuples) in the order the collector
appends them, which is the order the compiled segments read them. Any
difference is a miss, and the full path runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..autograd.walk import Kind
from ..errors import Unsupported
from ..hooks import cpp_hooks

# the node kinds a guarded graph may hold: the virtual root, traced nodes, leaves
KINDS = (Kind.ROOT, Kind.TRACED, Kind.ACCUMULATE)


@dataclasses.dataclass(frozen=True)
class LeafHooks:
    """What a guarded hit of a graph with hooked leaves checks and builds.

    Attributes:
        hooked: ``(run position, number of C++ post hooks)`` of each hooked
            AccumulateGrad.
        plain: run positions of the other AccumulateGrad nodes.
        objects: per runtime object, in the collector's order, ``(run
            position, True)`` for a leaf's tuple of C++ post hooks or
            ``(run position, False)`` for the leaf variable itself.
    """

    hooked: tuple[tuple[int, int], ...]
    plain: tuple[int, ...]
    objects: tuple[tuple[int, bool], ...]

    def collect(self, order: Sequence[Any], census: Any) -> list[Any] | None:
        """The runtime objects of a backward whose nodes in run order are
        ``order`` (a guard accepted the rest), or None where a leaf's hooks
        are not the captured ones.

        ``census``: the backward's :class:`~cagrad.hooks.hooks_census.Census`
        (its C++ hook reader, ``counts``, reads the hooked leaves' hook
        lists where it is built).
        """
        found_at: dict[int, tuple] = {}
        counts = census.counts
        for pos, count in self.hooked:
            node = order[pos]
            hooks = _cpp_posts_only(node, count, counts) if counts is not None else _census_posts_only(node, count, census)
            if hooks is None:
                return None
            found_at[pos] = hooks
        for pos in self.plain:
            if cpp_hooks.post_hooks_of(order[pos].variable):
                return None
        return [found_at[pos] if hooks else order[pos].variable for pos, hooks in self.objects]


# what the C++ reader returns for a node whose only hooks are ``n`` C++
# post hooks (cagrad.autograd._hook_counts: foreign and Python tensor
# pre-hooks, retains-grad outputs, foreign and Python pre-hooks, foreign
# and Python post-hooks, a foreign post-accumulate hook, its Python dict)
def _only_cpp_posts(n: int) -> tuple:
    return (0, (), (), 0, (), n, (), 0, None)


def _cpp_posts_only(node: Any, count: int, counts: Any) -> tuple | None:
    """The leaf's C++ post hooks if its AccumulateGrad has exactly ``count``
    of them and no other hook, read from its hook lists in C++ (which the
    full path's ``check_invisible`` reads too: any Python hook of the leaf,
    a tensor hook or a post-accumulate hook included, is in them) and from
    the leaf's own hook dicts; else None."""
    if counts(node, True) != _only_cpp_posts(count):
        return None
    variable = node.variable
    if variable._backward_hooks or getattr(variable, "_post_accumulate_grad_hooks", None):
        return None
    hooks = cpp_hooks.post_hooks_of(variable)
    return hooks if len(hooks) == count else None


def _census_posts_only(node: Any, count: int, census: Any) -> tuple | None:
    """:func:`_cpp_posts_only` as the full collection reads it
    (``Census.hooks_of``, ``Census.check_invisible``)."""
    found = census.hooks_of(node, True)
    if (
        found is None
        or len(found.cpp_post) != count
        or found.tensor_pre
        or found.retain_grad
        or found.pre is not None
        or found.post is not None
        or found.post_accumulate is not None
    ):
        return None
    try:
        census.check_invisible(node, found, True, "AccumulateGrad")
    except Unsupported:
        return None
    return found.cpp_post


def plan(collected: Any) -> LeafHooks | str:
    """The :class:`LeafHooks` of a backward just captured, or why it has none.

    Its nodes must be traced nodes and leaves' AccumulateGrad only, and no
    code of the user's may run (no Python hook of any kind, no custom
    Function, no node run as it is). A graph without hooks gets one with
    nothing ``hooked`` (the guard's own check of hook lists finds a C++
    hook any of its leaves gained; :meth:`LeafHooks.collect` is asked for
    its objects only where its entry is segmented).
    """
    collector = collected.collector
    hooked: list[tuple[int, int]] = []
    plain: list[int] = []
    objects: dict[int, tuple[int, bool]] = {}
    for pos, (call, p) in enumerate(zip(collected.task.order, collector.plans)):
        if p.kind not in KINDS:
            return f"a node of kind {p.kind.name}"
        hooks = p.hooks
        if p.kind is not Kind.ACCUMULATE:
            if hooks is not None:
                return f"hooks on {call.name}"
            continue
        objects[p.node] = (pos, False)
        if hooks is None:
            plain.append(pos)
            continue
        if hooks.cpp_post is None or hooks.tensor_pre or hooks.retain_grad or any(
            i is not None for i in (hooks.pre, hooks.post, hooks.post_accumulate)
        ):
            return "a leaf with hooks other than C++ post hooks"
        objects[hooks.cpp_post] = (pos, True)
        hooked.append((pos, len(collector.objects[hooks.cpp_post])))
    if collector.user_code or collector.traced_hooks:
        return "code of the user's runs in the backward"
    if sorted(objects) != list(range(len(collector.objects))):
        return "runtime objects of other kinds"
    return LeafHooks(tuple(hooked), tuple(plain), tuple(objects[i] for i in range(len(objects))))


__all__ = ["KINDS", "LeafHooks", "plan"]
