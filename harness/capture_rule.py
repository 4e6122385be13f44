"""Size sequences: one program re-run at new sizes, and cagrad's capture rule.

A *size sequence* is a program with several *size variants*: the same
program built at its own sizes, then at each new set of sizes. The oracle
runs every variant under one subject without resetting it in between (the
compiled-graph cache carries over: that is the point), compares each
variant's results with eager's, and records the captures of each variant.

The rule cagrad's captures must obey (:func:`allowed_captures`) is stated
over each variant's *shapes*: the shape of every value of the program
(leaves, then every op output, in program order), and their *0/1 pattern*
(each size as ``0``, ``1`` or ``2+``; torch and cagrad specialize sizes 0
and 1, so a size that becomes or leaves 0/1 may be recaptured, and so may a
variant whose values have other ranks or another count, like ``unbind``
over a dimension that grew):

* a variant with the same shapes as an earlier one: no capture;
* a variant whose backward graph has node types no earlier variant's had
  (``x[0:2]`` is an ``AliasBackward0`` at size 2, a ``SliceBackward0`` at
  size 5) counts as a new 0/1 pattern; so does one whose size slots (the
  sizes, strides and offsets cagrad's cache key reads, reported by the
  subject: :class:`harness.subjects.SizeProbe`) are equal in a way no
  earlier variant's were (:func:`size_classes`): cagrad duck-sizes (slots
  of equal value share a symbol, as ``torch.compile`` does), so a batch of
  4 beside a width of 4, then a batch of 5, costs a capture;
* ``dynamic=True`` (sizes are symbols from the first capture): a variant
  whose 0/1 pattern an earlier variant had (it differs only in sizes >= 2):
  no capture; a new pattern: at most one;
* ``dynamic=None`` (``cagrad.enable``'s default: a graph's first capture
  is static, the first backward at other sizes captures it symbolic): as
  ``dynamic=True``, and one capture more for the first variant with new
  shapes but a 0/1 pattern and graph seen before (per pattern and graph);
* ``dynamic=False`` (static first, then the sizes that changed become
  dynamic): at most one capture for a variant with a new 0/1 pattern or one
  that changes a size (against the first variant) that no earlier variant
  changed to a value >= 2 (a size changed to 0 or 1 stays specialized), or
  whose size slots tie as those of no variant after the first (the first
  graph is static: its ties bind no symbols, so ``[4, 5]``, ``[2, 2]``,
  ``[8, 5]`` may capture three times, the second graph having one symbol
  for both sizes); none otherwise.

The check (:func:`check_captures`) is cumulative: after every variant, the
captures so far must not exceed the captures allowed so far (a capture may
come one variant late, never more of them); each allowed capture counts as
many graphs as the first variant captured (a program whose second backward
differs in a node captures twice at every size). A graph that
keeps sizes static by design (cagrad: a generated node with ``SymInt``
attributes and no Python formula, see ``cagrad.autograd.formulas``; the subject names
them, :meth:`harness.subjects.Subject.static_sizes`) is checked by the
weaker rule: shapes seen before, no capture; new shapes, at most one. A
graph dropped after a failed speculation (cagrad's ``deopts``) allows one
more capture, and so does every graph captured before a variant that
raised (as eager raised: the harness resets the subject after an error, so
the next variant starts from an empty cache). So is a graph whose trace
recorded guards on its size symbols (a ``view`` to constant sizes guards divisibility, say: a new size
that breaks a guard recaptures, as cagrad documents). Why a backward
missed: cagrad's ``cagrad.verbose`` log.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

Sizes = tuple[int, ...]
Shapes = tuple[Sizes, ...]


@dataclasses.dataclass(frozen=True)
class SizeVariant:
    """One variant of a size sequence.

    Attributes:
        label: how reports name it (``"x0[6, 3]"``).
        sizes: every leaf shape entry, flattened, in leaf order (for reports).
        program: the harness program building this variant.
        shapes: the shape of every value of the program, in program order
            (what the capture rule looks at); ``()``: use ``(sizes,)``.
    """

    label: str
    sizes: Sizes
    program: Any
    shapes: Shapes = ()

    def rule_shapes(self) -> Shapes:
        return self.shapes or (tuple(self.sizes),)


@dataclasses.dataclass(frozen=True)
class CaptureRule:
    """How a subject's captures are checked: ``dynamic`` as given to
    ``cagrad.enable`` (None, True or False; see the module docstring)."""

    dynamic: bool | None


def pattern(shapes: Shapes) -> Shapes:
    """Each size as 0, 1 or 2 (meaning 2 or more), shapes kept apart."""
    return tuple(tuple(min(int(d), 2) for d in shape) for shape in shapes)


def size_classes(values: Sequence[int | None]) -> tuple:
    """Which of an engine's size slots are equal: per slot, ``None`` (it
    stays static), ``0`` or ``1`` (specialized), or ``("=", i)`` where ``i``
    is the first slot with the same value >= 2. Two variants with the same
    classes bind their sizes to symbols the same way under duck sizing
    (slots of equal value share one symbol)."""
    first: dict[int, int] = {}
    out: list[Any] = []
    for i, v in enumerate(values):
        out.append(v if v is None or v < 2 else ("=", first.setdefault(v, i)))
    return tuple(out)


def _flat(shapes: Shapes) -> Sizes:
    return tuple(d for shape in shapes for d in shape)


def allowed_captures(
    sequence: Sequence[Shapes], dynamic: bool | None, static: bool = False, graphs: Sequence[Hashable] | None = None
) -> list[int]:
    """The most captures each variant may make (see the module docstring);
    ``sequence`` has the shapes of every variant, in run order. ``static``:
    the graph keeps some sizes static by design, so only the weaker rule
    holds (new shapes: at most one capture; shapes seen before: none).
    ``graphs``: per variant, what its backward graph is made of (node type
    names) and how its size slots bind to symbols (:func:`size_classes`);
    a variant whose graph no earlier variant had counts as a new 0/1
    pattern (at most one capture)."""
    if not sequence:
        return []
    graphs = list(graphs) if graphs is not None else [None] * len(sequence)
    first = tuple(sequence[0])
    seen_shapes = {first}
    seen_patterns = {pattern(first)}
    seen_graphs = {graphs[0]}
    dynamic_positions: set[int] = set()
    generalized: set[Hashable] = set()  # dynamic=None: (pattern, graph) captured symbolic
    symbolic_graphs: set[Hashable] = set()  # dynamic=False: graphs of the variants after the first
    allowed = [1]
    for shapes, graph in zip(sequence[1:], graphs[1:]):
        shapes = tuple(shapes)
        if shapes in seen_shapes:
            allowed.append(0)
            continue
        new_pattern = pattern(shapes) not in seen_patterns or graph not in seen_graphs
        seen_graphs.add(graph)
        if static:
            allowed.append(1)
        elif dynamic is None:
            key = (pattern(shapes), graph)
            allowed.append(1 if new_pattern or key not in generalized else 0)
            if not new_pattern:
                generalized.add(key)
        elif dynamic:
            allowed.append(1 if new_pattern else 0)
        else:
            # same pattern: same ranks, so the flattened sizes line up
            changed = {i for i, (a, b) in enumerate(zip(_flat(first), _flat(shapes))) if a != b}
            # the first graph is static, so its slots' equalities bind no
            # symbols: a graph whose slots tie as only the first variant's
            # did is new to the symbolic graphs ([4, 5], [2, 2] duck-sized to
            # one symbol, then [8, 5])
            untied = changed and graph not in symbolic_graphs
            allowed.append(1 if new_pattern or untied or not changed <= dynamic_positions else 0)
            symbolic_graphs.add(graph)
            if not new_pattern or len(_flat(first)) == len(_flat(shapes)):
                dynamic_positions |= {i for i in changed if _flat(shapes)[i] >= 2}
        seen_shapes.add(shapes)
        seen_patterns.add(pattern(shapes))
    return allowed


def check_captures(
    captures: Sequence[int],
    sequence: Sequence[Shapes],
    dynamic: bool | None,
    *,
    static: bool = False,
    dropped: Sequence[int] = (),
    graphs: Sequence[Hashable] | None = None,
) -> str | None:
    """None when ``captures`` (one count per variant) obey the rule, else a
    sentence giving both per-variant lists (naming the first variant where
    the running total exceeds the allowed one).

    ``static``: see :func:`allowed_captures`. ``dropped``: graphs the
    subject dropped in each variant (cagrad's ``deopts``: a failed
    speculation drops the graph, so a later run captures it again); each
    allows one more capture from the next variant on. ``graphs``: see
    :func:`allowed_captures`."""
    allowed = allowed_captures(sequence, dynamic, static, graphs)
    # a variant runs one backward per ``repeat``; a program whose own sizes
    # took several graphs (a second backward that differs in a node) may
    # take as many again at each new size that the rule allows
    graphs = max(1, captures[0]) if captures else 1
    total = limit = 0
    dropped = list(dropped) + [0] * (len(allowed) - len(dropped))
    for i, (got, most) in enumerate(zip(captures, allowed)):
        total += got
        limit += most * graphs + (dropped[i - 1] if i else 0)
        if total > limit:
            mode = (
                "weaker rule"
                if static
                else {None: "static first, then dynamic", True: "dynamic sizes", False: "static sizes"}[dynamic]
            )
            per = f" ({graphs} graphs per allowed capture, as at the first sizes)" if graphs > 1 else ""
            return (
                f"{total} capture(s) by size variant {i}, at most {limit} allowed ({mode}){per}: "
                f"captures per variant {list(captures)}, allowed {allowed}"
            )
    return None


__all__ = ["CaptureRule", "Shapes", "SizeVariant", "Sizes", "allowed_captures", "check_captures", "pattern", "size_classes"]
