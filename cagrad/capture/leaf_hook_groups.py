"""Grouping the accumulations of leaves whose only hooks are DDP's.

A graph with opaque calls accumulates its leaves in order, inside the graph
(the user's code in an opaque call may read ``.grad``), so each leaf's
accumulation is an opaque call too; DDP's reducer adds a C++ post hook to
every parameter's AccumulateGrad (:mod:`cagrad.hooks.cpp_hooks`), one more
opaque call per parameter. Cut at each of them
(:func:`cagrad.capture.segments.split`), an 8-layer DDP MLP became 16
segments of a few ops each, and their calls cost more than the ops.

An accumulation without Python post-accumulate-grad hooks and the C++ hooks
on a leaf are *movable*: they read and write that leaf's ``.grad`` (and the
reducer's bookkeeping: its hook marks the gradient ready and, once a
bucket's parameters are all ready, launches the bucket's allreduce), which
no tensor op of the graph reads (traced code reads no ``.grad``: traced
hooks and custom Functions read their gradients and constants only). Their
effects depend on their order among themselves and the graph's other
opaque calls, which eager's run order fixes, and not on where the tensor
ops fall between them. So :func:`ordered_nodes` moves each movable call
later, in order, to the first point where the gradients still waiting add
up to :func:`group_bytes`, or to just before the next opaque call that is
not movable (a hook of the user's, a node run as it is, a checkpoint's
recomputation), whichever comes first; the tensor ops between merge into
one segment. The gradients and every ``.grad`` are eager's when any of the
user's code runs; what changes is when each bucket's allreduce can start:
at most ``group_bytes`` of gradients later than in eager. The default,
1 MiB, is DDP's first bucket's size (``torch.distributed``
``_DEFAULT_FIRST_BUCKET_BYTES``; later buckets are 25 MiB), so
communication still overlaps the backward's compute.

In python-reducer mode (``torch._dynamo.config.optimize_ddp =
"python_reducer"``) DDP reduces in a Python post-accumulate-grad hook on
each parameter (:func:`cagrad.hooks.cpp_hooks.is_ddp_python_hook`): it
all-reduces its own parameter's ``.grad`` and copies the result into it,
reading and writing nothing else of the backward. An accumulation whose
post-accumulate-grad dict holds such hooks only (the collector marks it,
and its key says so) moves the same way; any other Python hook (an
optimizer step in the backward changes a parameter a later node may read)
keeps every call in place. The collectives keep their order, so every rank
still issues the same sequence.

``CAGRAD_LEAF_HOOK_GROUP_BYTES`` sets the size in bytes at capture (0: a
segment per accumulation, as before).
"""

from __future__ import annotations

import operator
import os

import torch.fx

from . import runtime_ops

DEFAULT_GROUP_BYTES = 1 << 20

# the opaque calls that may move later: a leaf's accumulation without
# Python post-accumulate-grad hooks (or with DDP's python-reducer hooks
# only), and C++ post hooks on a leaf
_MOVABLE = (runtime_ops.accumulate, runtime_ops.cpp_post_hooks)


def group_bytes() -> int:
    """The gradient bytes after which waiting accumulations run
    (``CAGRAD_LEAF_HOOK_GROUP_BYTES``, default 1 MiB; 0 turns grouping off).

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    text = os.environ.get("CAGRAD_LEAF_HOOK_GROUP_BYTES", "")
    if not text:
        return DEFAULT_GROUP_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"CAGRAD_LEAF_HOOK_GROUP_BYTES={text!r}: expected a number of bytes (0 or more)")
    return value


def _movable(node: torch.fx.Node, opaque: frozenset) -> bool | None:
    """True: a movable opaque call; False: another opaque call; None: not opaque."""
    if node.op != "call_function" or node.target not in opaque:
        return None
    if node.target is runtime_ops.accumulate and (len(node.args) != 3 or node.args[2] is not None):
        # Python post-accumulate-grad hooks: user code, unless they are DDP's
        # python-reducer hooks only (each reduces its own parameter's .grad)
        if not node.meta.get("cagrad_ddp_python_hooks"):
            return False
    return node.target in _MOVABLE and not node.users


def _grad_bytes(node: torch.fx.Node) -> int | None:
    """The bytes of an accumulation's gradient, from the trace's value; for
    symbolic sizes, from the capture's sizes (the symbols' hints, read
    without adding a guard: where a group ends is a matter of speed only);
    None where unknown."""
    grad = node.args[1]
    val = grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return 0 if grad is None else None
    numel = val.numel()
    if not isinstance(numel, int):
        # int() of a SymInt would guard on its value and specialize the graph
        hint = getattr(getattr(numel, "node", None), "hint", None)
        if not isinstance(hint, int):
            return None
        numel = hint
    return numel * val.element_size()


def _reads_placeholder(node: torch.fx.Node) -> bool:
    """An item read of a placeholder (the graph's inputs, hooks, sizes):
    where it stands does not cut the graph, and a group must not end
    between an accumulation and its hooks at the read of those hooks."""
    return node.op == "placeholder" or (
        node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "placeholder"
    )


def ordered_nodes(graph: torch.fx.Graph, opaque: frozenset) -> list[torch.fx.Node]:
    """``graph``'s nodes in the order :func:`~cagrad.capture.segments.split`
    cuts them: each movable opaque call (``opaque``: the targets that are
    opaque) moves later as the module docstring says, never past another
    opaque call. A move keeps every node after its inputs: a moved call's
    result has no users.

    Raises:
        ValueError: ``CAGRAD_LEAF_HOOK_GROUP_BYTES`` is malformed.
    """
    nodes = list(graph.nodes)
    kinds = [_movable(n, opaque) for n in nodes]
    if True not in kinds:
        return nodes
    limit = group_bytes()
    if limit == 0:
        return nodes
    out: list[torch.fx.Node] = []
    waiting: list[torch.fx.Node] = []
    waiting_bytes = 0
    for node, kind in zip(nodes, kinds):
        if kind:
            waiting.append(node)
            if node.target is runtime_ops.accumulate:
                size = _grad_bytes(node)
                waiting_bytes += limit if size is None else size
            continue
        if waiting and (
            waiting_bytes >= limit and not _reads_placeholder(node) or node.op == "output" or kind is False
        ):
            # (never past another opaque call: the user's code there keeps
            # seeing the .grad values and reducer state eager's order gives)
            out.extend(waiting)
            waiting, waiting_bytes = [], 0
        out.append(node)
    out.extend(waiting)  # none: the output node comes last
    return out
