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
from typing import Any

from .cache_key import CacheKey
from .compiler import Traced


@dataclasses.dataclass
class CompiledEntry:
    """A compiled backward.

    Attributes:
        fn: compiler_fn's callable for the whole graph (None when segmented).
        traced: the captured graph and its input/output plan.
        segmented: the graph cut at its opaque calls, segments compiled.
        calls: how many times it ran; the first run also compiles.
        deopts: runs the interpreter had to finish.
        last_deopt: ``((pos, phase), which results were defined)`` of the
            last failed check.
    """

    fn: Callable[..., Any] | None
    traced: Traced
    segmented: Any = None
    calls: int = 0
    deopts: int = 0
    last_deopt: Any = None


@dataclasses.dataclass
class FallbackVerdict:
    """This key sequence cannot be compiled; eager runs it (counted)."""

    reason: str
    detail: str


class CacheNode:
    """One trie node; ``entry`` is set on the node that ends a sequence.

    ``profile`` and ``respeculations`` belong to the node that ends a
    sequence too: the None patterns seen where a trace's assumption failed
    (see :class:`cagrad.walk.BackwardWalk`), and how often it was recaptured
    for them.
    """

    __slots__ = ("children", "entry", "profile", "respeculations")

    def __init__(self) -> None:
        self.children: dict[CacheKey, CacheNode] = {}
        self.entry: CompiledEntry | FallbackVerdict | None = None
        self.profile: dict[Any, tuple[bool, ...]] = {}
        self.respeculations = 0

    def lookup(self, keys: Sequence[CacheKey]) -> CacheNode:
        """The node for ``keys``, creating the missing part of the path."""
        node = self
        for key in keys:
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = CacheNode()
            node = child
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
        count = 1 if self.entry is not None else 0
        return count + sum(c.num_entries() for c in self.children.values())
