"""The shadow-graph cache: a trie of CacheKeys (CacheNode).

A backward is the sequence of its keys (the GraphTask key, then one key per
node in run order). Walking the trie along that sequence ends at the
:class:`CacheNode` that holds what was compiled for it, or a verdict that it
cannot be compiled. Sharing prefixes keeps the trie small when backwards
differ only near their ends (the leaves' AccumulateGrad nodes come last).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..autograd import run_context
from .cache_key import CacheKey

if TYPE_CHECKING:  # the trace (cagrad.capture) builds on the keys, not back
    from ..capture.traced import Traced


@dataclasses.dataclass
class CompiledEntry:
    """A compiled backward.

    Attributes:
        fn: compiler_fn's callable for the whole graph (None when segmented).
        traced: the captured graph and its input/output plan.
        segmented: the graph cut at its opaque calls, segments compiled.
        calls: how many times it ran; the first run also compiles.
        deopts: runs the interpreter had to finish.
        last_deopt: ``((pos, phase), pattern, layout, seen)`` of the last
            failed check: per result, whether it was defined
            (``compiler.NON_STRIDED`` for a sparse gradient the graph would
            have used as a strided one, a dimension order for a dense one in
            another layout; see ``cagrad.run.runtime._pattern``), and
            whether the check failed on a layout alone; ``seen``: the
            patterns of the speculative calls the interpreter ran after it,
            by ``(pos, phase)``.
        learn_layouts: an opaque call's dense result in another dimension
            order than the trace assumed fails the check (the interpreter
            hands it on as eager does; the next capture assumes that order)
            instead of being copied into the assumed strides.
        state: the global state a named backend compiled it in (Dynamo's
            ``GlobalStateGuard``); only a backward in that state runs it
            (:meth:`CacheNode.match`); None for a callable compiler.
    """

    fn: Callable[..., Any] | None
    traced: Traced
    segmented: Any = None
    calls: int = 0
    deopts: int = 0
    last_deopt: Any = None
    state: Any = None
    learn_layouts: bool = True

    @property
    def check(self) -> Any:
        return self.traced.check

    def state_holds(self) -> bool:
        """Whether the global state is the one it was compiled in (read
        under the grad mode the backward runs its graph in, as at compile
        time; always true for a callable compiler)."""
        if self.state is None:
            return True
        with run_context.grad_mode():
            return bool(self.state.check())

    def state_change(self) -> str:
        """What differs from the state it was compiled in (Dynamo's words:
        ``grad_mode``, ``deterministic_algorithms``, ...), or ``""``."""
        if self.state is None:
            return ""
        with run_context.grad_mode():
            if self.state.check():
                return ""
            return str(self.state.reason()) or "global state"


@dataclasses.dataclass
class FallbackVerdict:
    """This key sequence cannot be compiled; eager runs it (counted)."""

    reason: str
    detail: str


MAX_VARIANTS = 8


class CacheNode:
    """One trie node; the node that ends a key sequence holds what was compiled.

    Attributes:
        children: the next keys.
        verdict: a :class:`FallbackVerdict`, or None.
        variants: compiled graphs for this key sequence, each accepting the
            size slot values its :class:`~cagrad.keys.sizes.SizeCheck` matches
            (one per set of static sizes and specializations).
        dynamic_slots: the slots that have changed between backwards (with
            ``dynamic=False``), traced as symbols from then on.
        distinct_slots: slots that changed while others of the same value
            at capture did not: duck sizing gives them symbols of their own
            from then on (see :class:`cagrad.capture.compiler.AutogradCompilerInstance`).
        profile, respeculations: the None patterns (and layouts) seen
            where a trace's assumption failed (see
            :class:`cagrad.autograd.walk.BackwardWalk`), and how often it was
            recaptured for a None pattern.
        layout_respeculations: how often it was recaptured for a layout
            alone; past a bound, its captures copy such results into the
            assumed strides (``CompiledEntry.learn_layouts``).
        captures: on the root: how many graphs were captured under it.
        force_opaque: run-order positions of nodes that failed to trace;
            captures of this key sequence call them as they are.
        guard: the generated hit check of this key sequence
            (:class:`cagrad.keys.hit_path.HitGuard`), or None.
        guards: on the root: the guards to try before a full collection,
            most recently hit first.
    """

    __slots__ = (
        "children",
        "verdict",
        "variants",
        "dynamic_slots",
        "distinct_slots",
        "profile",
        "respeculations",
        "layout_respeculations",
        "captures",
        "force_opaque",
        "guard",
        "guards",
    )

    def __init__(self) -> None:
        self.children: dict[CacheKey, CacheNode] = {}
        self.verdict: FallbackVerdict | None = None
        self.variants: list[CompiledEntry] = []
        self.dynamic_slots: frozenset[int] = frozenset()
        self.distinct_slots: frozenset[int] = frozenset()
        self.profile: dict[Any, tuple[bool, ...]] = {}
        self.respeculations = 0
        self.layout_respeculations = 0
        self.captures = 0
        self.force_opaque: frozenset[int] = frozenset()
        self.guard: Any = None
        self.guards: list[Any] = []

    def match(self, values: Sequence[int]) -> tuple[CompiledEntry, list[int]] | None:
        """The first variant whose size check accepts ``values`` and that was
        compiled in the current global state, with its symbol values (a
        backward in another state is a miss: a variant of its own is
        captured for it, as Dynamo recompiles a frame when its global
        state guard fails)."""
        for entry in self.variants:
            sym_values = entry.check.match(values)
            if sym_values is not None and entry.state_holds():
                return entry, sym_values
        return None

    def state_change(self, values: Sequence[int]) -> str:
        """Why no variant matched ``values`` when one would at its sizes but
        was compiled in another global state (see :meth:`CompiledEntry.
        state_change`), else ``""``."""
        for entry in self.variants:
            if entry.check.match(values) is not None:
                return entry.state_change()
        return ""

    def lookup(self, keys: Sequence[CacheKey]) -> CacheNode:
        """The node for ``keys``, creating the missing part of the path."""
        node = self
        for key in keys:
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = CacheNode()
            node = child
        return node

    def find(self, keys: Sequence[CacheKey]) -> CacheNode | None:
        """The node for ``keys`` if the whole path exists (creates nothing)."""
        node = self
        for key in keys:
            node = node.children.get(key)
            if node is None:
                return None
        return node

    def longest_prefix(self, keys: Sequence[CacheKey]) -> tuple[int, CacheNode]:
        """How many leading keys are already in the trie, and where they end."""
        node = self
        for i, key in enumerate(keys):
            child = node.children.get(key)
            if child is None:
                return i, node
            node = child
        return len(keys), node

    def num_entries(self) -> int:
        count = len(self.variants) + (self.verdict is not None)
        return count + sum(c.num_entries() for c in self.children.values())
