"""The eager engine's ready queue, replicated so cagrad walks in eager's order.

The engine keeps ready nodes in ``std::priority_queue<NodeTask,
std::vector<NodeTask>, CompareNodeTaskTime>`` (torch/csrc/autograd/engine.h)
and pops the task whose function has the largest ``sequence_nr`` first (nodes
created later run first; ``AccumulateGrad`` has ``UINT64_MAX`` so it runs as
soon as it is ready). Ties are common (every ``AccumulateGrad``), and their
order is whatever libstdc++'s heap algorithm leaves, so this module replays
``std::push_heap`` / ``std::pop_heap`` exactly as libstdc++ implements them
(``__push_heap`` and ``__adjust_heap`` in bits/stl_heap.h). Hook call order
and the order of gradient additions then match eager's, ties included.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ReadyQueue(Generic[T]):
    """A max-heap on an integer priority with libstdc++'s tie behaviour."""

    __slots__ = ("_prio", "_items")

    def __init__(self) -> None:
        self._prio: list[int] = []
        self._items: list[T] = []

    def __len__(self) -> int:
        return len(self._prio)

    def push(self, priority: int, item: T) -> None:
        """``std::priority_queue::push``: append, then sift the hole up."""
        self._prio.append(priority)
        self._items.append(item)
        self._sift_up(len(self._prio) - 1, 0, priority, item)

    def pop(self) -> T:
        """``std::priority_queue::pop`` after ``top``: returns the top item.

        Raises:
            IndexError: if the queue is empty.
        """
        prio, items = self._prio, self._items
        top = items[0]
        last_p = prio.pop()
        last_i = items.pop()
        if prio:
            self._adjust(0, len(prio), last_p, last_i)
        return top

    def _sift_up(self, hole: int, top: int, p: int, item: T) -> None:
        # libstdc++ __push_heap: move parents down while parent < value
        prio, items = self._prio, self._items
        parent = (hole - 1) // 2
        while hole > top and prio[parent] < p:
            prio[hole] = prio[parent]
            items[hole] = items[parent]
            hole = parent
            parent = (hole - 1) // 2
        prio[hole] = p
        items[hole] = item

    def _adjust(self, hole: int, length: int, p: int, item: T) -> None:
        # libstdc++ __adjust_heap: walk the hole down to a leaf along the
        # larger child (the right one on ties), then push the value up
        prio, items = self._prio, self._items
        top = hole
        child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if prio[child] < prio[child - 1]:
                child -= 1
            prio[hole] = prio[child]
            items[hole] = items[child]
            hole = child
        if (length & 1) == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            prio[hole] = prio[child - 1]
            items[hole] = items[child - 1]
            hole = child - 1
        self._sift_up(hole, top, p, item)
