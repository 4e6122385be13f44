"""Hooks that user code registers while a backward runs, on nodes without any.

cagrad reads a backward's hooks when it keys it (:mod:`cagrad.hooks.hooks_census`).
A hook dict that exists then is a runtime object, read live: a hook added to
it later in the same backward runs, as in eager. A node (or a tensor, or a
leaf) that had *no* dict then has no hook step in the compiled backward at
all. Eager's engine reads the hooks of each node when it runs the node, so a
hook that user code inside the backward (an opaque tensor or node hook, a
custom Function's backward, a post-accumulate-grad hook) registers on a node
that has not run yet does run::

    def adds_a_hook(g):                      # a tensor hook on t = h.tanh()
        h.grad_fn.register_hook(post_hook)   # h.grad_fn had no hooks
    t.register_hook(adds_a_hook)
    t.sum().backward()                       # eager runs post_hook

The runners check for this after every call of user code: the census counts
every registration (:class:`cagrad.hooks.hooks_census.Registrations`); when
the count moved, :func:`plans_with_added` reads the hooks of the nodes that
have not run yet and, where one gained a dict the plan does not have,
returns the plans of the rest of the backward with the new dicts added
(appended to the runtime objects). The compiled segments cannot call them,
so the interpreter (:mod:`cagrad.run.interpreter`) finishes that backward
with those plans, as it does after a failed run-time check; a registration
while the interpreter runs updates its plans in place.

The node whose call registered the hooks gains them too, for its steps
still to come (a node pre-hook a tensor hook registers runs, as eager reads
pre-hooks after the tensor hooks), except while the interpreter already
runs that node. Not covered: hooks added from C++ (invisible to the census;
detected only before a backward), and hooks that a post-accumulate-grad hook
registers on nodes still to run, in a compiled part: its accumulation has
no resume point (one would hold the gradient that ``.grad`` adopts, as
eager's ``AccumulateGrad`` does, and make ``.grad`` a copy), so they do not
run there.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from ..autograd.walk import Kind, NodeHooks, NodePlan
from ..errors import Unsupported
from .hooks_census import Census

log = logging.getLogger("cagrad")


def plans_with_added(
    plans: Sequence[NodePlan], order: Sequence[Any], objects: Sequence[Any], first: int
) -> tuple[list[NodePlan], list[Any]] | None:
    """:func:`_plans_with_added`, or None where the hooks cannot be read (a
    ``retain_grad`` an in-place op moved: the backward is already running
    and cannot fall back; logged)."""
    try:
        return _plans_with_added(plans, order, objects, first)
    except Unsupported as e:
        log.warning("cagrad: hooks registered during a backward could not be read (%s); they do not run", e)
        return None


def _plans_with_added(
    plans: Sequence[NodePlan], order: Sequence[Any], objects: Sequence[Any], first: int
) -> tuple[list[NodePlan], list[Any]] | None:
    """The plans and runtime objects of a backward with the hook dicts that
    nodes at positions ``first`` and later gained since it was keyed, or
    None when none gained one.

    Args:
        plans: the backward's plans, one per position of ``order``.
        order: its nodes in run order (None for the virtual GraphRoot).
        objects: its runtime objects (the plans' hook indices point here).
        first: the first position that has not started running.

    Raises:
        Unsupported: ``invisible_hooks``, for a ``retain_grad`` that an
            in-place op moved to another node (as when keying).
    """
    census = Census()
    new_plans: list[NodePlan] | None = None
    new_objects = list(objects)

    def add(obj: Any) -> int:
        new_objects.append(obj)
        return len(new_objects) - 1

    for pos in range(first, len(order)):
        plan, node = plans[pos], order[pos]
        if node is None or plan.kind is Kind.ROOT:
            continue
        found = census.hooks_of(node, plan.kind is Kind.ACCUMULATE)
        if found is None:
            continue
        old = plan.hooks or NodeHooks()
        hooks = dataclasses.replace(old, tensor_pre=list(old.tensor_pre), retain_grad=list(old.retain_grad))
        have = {nr for nr, _ in old.tensor_pre}
        hooks.tensor_pre += [(nr, add(d)) for nr, d in found.tensor_pre if nr not in have]
        have = {nr for nr, _ in old.retain_grad}
        hooks.retain_grad += [(nr, add(ref)) for nr, ref in found.retain_grad if nr not in have]
        for field in ("pre", "post", "post_accumulate"):
            if getattr(old, field) is None and getattr(found, field) is not None:
                setattr(hooks, field, add(getattr(found, field)))
        if hooks != old:
            if new_plans is None:
                new_plans = list(plans)
            new_plans[pos] = dataclasses.replace(plan, hooks=hooks)
    return None if new_plans is None else (new_plans, new_objects)
