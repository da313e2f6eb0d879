"""A min-heap of deadlines with lazy deletion: push O(log n), discard O(1), popping k due entries O(k log n).

Items are never removed from the middle: a caller that ends an item early calls :meth:`discard` and the entry
is dropped when it reaches the top (or at a compaction, once dead entries outnumber live ones, so memory stays
within twice the live count and the amortized cost per discard stays O(1)).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

COMPACT_MIN = 1024  # below this many dead entries a rebuild is not worth it


class DeadlineHeap(Generic[T]):
    def __init__(self, alive: Callable[[T], bool]) -> None:
        self._alive = alive
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()  # ties broken by insertion order; items are never compared
        self._dead = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, deadline: float, item: T) -> None:
        heapq.heappush(self._heap, (deadline, next(self._seq), item))

    def discard(self) -> None:
        """One item in the heap stopped being alive (the caller made ``alive(item)`` false)."""
        self._dead += 1
        if self._dead >= COMPACT_MIN and 2 * self._dead > len(self._heap):
            self._heap = [entry for entry in self._heap if self._alive(entry[2])]
            heapq.heapify(self._heap)
            self._dead = 0

    def pop_due(self, now: float) -> Iterator[tuple[float, T]]:
        """Pop and yield the live entries with ``deadline <= now``, earliest first; dead ones are dropped.

        The caller may push while iterating (a renewed item goes back with its new deadline)."""
        while self._heap and self._heap[0][0] <= now:  # re-read: a discard may compact while we yield
            deadline, _, item = heapq.heappop(self._heap)
            if self._alive(item):
                yield deadline, item
            else:
                self._dead -= 1
