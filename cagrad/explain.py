"""Why a backward misses the cache: the closest cached entry and what differs.

A backward's keys are looked up in the trie (:mod:`cagrad.keys.cache`): the
longest cached prefix ends either before a key (a node never seen at that
position, or seen with other key bytes) or at an entry whose size checks
reject the backward's sizes. :func:`diagnose` names the difference the way
torch's compiled autograd's verbose log does: the new node type and its
index, the first differing byte of the key, or the size slots that changed
(with where they come from) or the guard that failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .keys.cache import CacheNode
from .keys.cache_key import CacheKey
from .keys.sizes import SizeCheck, SizeInputs


@dataclasses.dataclass
class Diagnosis:
    """What a lookup found.

    Attributes:
        hit: the backward would run a cached graph.
        kind: ``"hit"``, ``"first"`` (nothing cached yet), ``"fallback"``
            (the keys are known to run in eager), ``"recapture"`` (the keys
            were seen, their graph dropped), ``"new_node"`` (a node type
            never seen at that position), ``"key"`` (same node type, other
            key bytes), ``"sizes"`` (same keys, sizes no variant accepts),
            ``"global_state"`` (a variant accepts the sizes but was compiled
            in another global state).
        node_index: run-order position of the node that differs.
        node_type: its type; ``cached_types``: the types cached there.
        byte_offset: first differing byte of the key (kind ``"key"``).
        changed: ``(slot, where, cached value, new value)`` (kind ``"sizes"``).
        guard: a failed guard, or a size-range violation, in words.
        detail: the fallback verdict's reason (kind ``"fallback"``), or
            what differs in the global state (kind ``"global_state"``).
    """

    hit: bool
    kind: str
    node_index: int | None = None
    node_type: str | None = None
    cached_types: list[str] = dataclasses.field(default_factory=list)
    byte_offset: int | None = None
    changed: list[tuple[int, str, int, int]] = dataclasses.field(default_factory=list)
    guard: str | None = None
    detail: str | None = None

    def __str__(self) -> str:
        if self.kind == "hit":
            return "cache hit"
        if self.kind == "first":
            return "cache miss: nothing cached yet for this compiler"
        if self.kind == "fallback":
            return f"eager runs this backward (cached verdict: {self.detail})"
        if self.kind == "global_state":
            return f"cache miss: the global state changed since the graph was compiled: {self.detail}"
        if self.kind == "recapture":
            return "cache miss: these keys were seen, but their graph was dropped after a failed speculation"
        where = "the GraphTask key" if self.node_index == -1 else f"node {self.node_index}"
        if self.kind == "new_node":
            return (
                f"cache miss: new node {self.node_type} at {where} "
                f"(cached there: {', '.join(self.cached_types) or 'nothing'})"
            )
        if self.kind == "key":
            return (
                f"cache miss: {self.node_type} at {where} differs from the cached key "
                f"at byte {self.byte_offset}"
            )
        parts = [f"{where} {old} -> {new}" for _, where, old, new in self.changed[:8]]
        more = len(self.changed) - 8
        text = "cache miss: sizes changed: " + "; ".join(parts)
        if more > 0:
            text += f"; and {more} more"
        if self.guard:
            text += f"; {self.guard}"
        return text


def _first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def diagnose(root: CacheNode, keys: Sequence[CacheKey], sizes: SizeInputs) -> Diagnosis:
    """What looking ``keys`` with ``sizes`` up under ``root`` would find."""
    depth, node = root.longest_prefix(keys)
    if depth < len(keys):
        if not root.children:
            return Diagnosis(False, "first")
        new = keys[depth]
        same_type = [k for k in node.children if k.node_type == new.node_type]
        index = depth - 1
        if same_type:
            offset = max(_first_difference(new.key, k.key) for k in same_type)
            return Diagnosis(False, "key", index, new.node_type, byte_offset=offset)
        cached = sorted({k.node_type for k in node.children})
        return Diagnosis(False, "new_node", index, new.node_type, cached)
    if node.verdict is not None:
        return Diagnosis(False, "fallback", detail=node.verdict.reason)
    if not node.variants:
        return Diagnosis(False, "recapture", len(keys) - 1)
    if node.match(sizes.values) is not None:
        return Diagnosis(True, "hit")
    state = node.state_change(sizes.values)
    if state:
        return Diagnosis(False, "global_state", detail=state)
    return _size_diagnosis(node.variants[0].check, sizes)


def _size_diagnosis(check: SizeCheck, sizes: SizeInputs) -> Diagnosis:
    values = sizes.values
    changed = [
        (slot, sizes.origin(slot), check.expected[slot], values[slot])
        for slot in sorted(check.changed(values))
    ]
    guard = None
    if not check.is_static and check._static_ok(values):
        sym_values = [values[slots[0]] for slots in check.symbols]
        for name, (lower, upper), v in zip(check.symbol_names, check.ranges, sym_values):
            if not lower <= v <= upper:
                guard = f"size {name}={v} is outside the traced range [{lower}, {upper}]"
                break
        else:
            for fn, expr in zip(check.guards, check.guard_exprs):
                if not fn(*sym_values):
                    guard = f"guard {expr} fails at {dict(zip(check.symbol_names, sym_values))}"
                    break
    return Diagnosis(False, "sizes", changed=changed, guard=guard)
