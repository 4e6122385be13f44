"""Sizes handed to a Dynamo-based ``compiler_fn`` as dimensions it keeps symbolic.

Where a backward lifts a tensor with a dimension marked by
``torch._dynamo.mark_dynamic`` (a forward input saved for backward, or an
accumulated leaf), cagrad traces its sizes as symbols
(:func:`cagrad.compile.variants.slots_to_trace_dynamic`), and its graph reads them
from the ``sizes`` list. A user ``compiler_fn`` that runs Dynamo on that
graph (``torch.compile``) then sees the marked tensor among the ``inputs``,
and plain ints in ``sizes``; Dynamo traces ints as constants at a frame's
first compile, the graph ties the marked dimension to one of them (a
gradient of the marked tensor's shape), and Dynamo raises
``ConstraintViolationError`` ("You marked ... as dynamic but your code
specialized it to be a constant"): the backward fell back to eager.

For such graphs (tagged ``gm.meta[MARKED]`` at capture) a callable
``compiler_fn`` gets a copy of the graph that reads each size as dimension 1
of a ``sizes`` entry (``aten.sym_size.int(sizes[i], 1)``), and the compiled
function is called with ``torch.empty(0, n)`` in place of each size ``n``,
dimension 1 marked with ``torch._dynamo.maybe_mark_dynamic`` (Dynamo may
still specialize it without error; torch's compiled autograd hands its
sizes to Dynamo the same way). The values are the same; only the type of
the ``sizes`` entries changes, and only for these graphs. A graph reads only
the sizes it traced as symbols, which are 0 or more
(:class:`cagrad.keys.sizes.SizeInputs`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

MARKED = "cagrad_marked_dynamic"
"""``GraphModule.meta`` key: the graph's sizes include a marked dimension."""


def _size_reads(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    ph = next((n for n in graph.nodes if n.op == "placeholder" and n.target == "sizes"), None)
    if ph is None:
        return []
    return [u for u in ph.users if u.op == "call_function" and u.target is operator.getitem and u.args[0] is ph]


def wants_size_tensors(gm: torch.fx.GraphModule) -> bool:
    """The graph was tagged at capture and reads some size."""
    return bool(gm.meta.get(MARKED)) and bool(_size_reads(gm.graph))


def with_size_tensors(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that reads ``sizes[i]`` as ``sym_size.int(sizes[i], 1)``.

    ``gm`` itself is left as it is (cagrad's interpreter runs it with int
    sizes after a failed check)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for read in _size_reads(graph):
        with graph.inserting_after(read):
            size = graph.call_function(torch.ops.aten.sym_size.int, (read, 1))
        read.replace_all_uses_with(size, delete_user_cb=lambda user, size=size: user is not size)
    graph.lint()
    copied = torch.fx.GraphModule(gm, graph, gm.__class__.__name__)
    copied.meta.update(gm.meta)
    return copied


def calling_with_size_tensors(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a function compiled from :func:`with_size_tensors`'s graph to
    take the graph's usual arguments ``(inputs, sizes, scalars, hooks,
    packed_inputs)``, ``sizes`` a list of ints."""

    def call(inputs: Any, sizes: Any, *rest: Any) -> Any:
        boxed = [torch.empty(0, n) for n in sizes]
        for t in boxed:
            torch._dynamo.maybe_mark_dynamic(t, 1)
        return compiled(inputs, boxed, *rest)

    call.__wrapped__ = compiled  # type: ignore[attr-defined]
    return call
