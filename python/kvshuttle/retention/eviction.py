"""Eviction order: which retention goes first when the budget is full. A small replaceable policy.

The ledger owns the bookkeeping (which retentions exist, which are being read) and tells its policy what became
evictable, what was used and what stopped being evictable; when it must make room it asks the policy for a victim
and ends it. A new retention tier (host memory, disk) brings its own order as another policy, registered under a
name in :data:`EVICTION_POLICIES`, instead of another loop in the ledger.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from .errors import RetentionError


class EvictionPolicy(Protocol):
    """The order in which evictable retentions (live, no read in flight) go. Keyed by handle id."""

    def admit(self, handle_id: str) -> None:
        """``handle_id`` became evictable: retained, or its last read in flight ended (a use: a touch too)."""

    def touch(self, handle_id: str) -> None:
        """``handle_id`` was used (renewed); nothing when it is not evictable now."""

    def remove(self, handle_id: str) -> None:
        """``handle_id`` stopped being evictable (a read in flight, or it ended); nothing when absent."""

    def victim(self) -> str:
        """The evictable handle to end first (not removed: the ledger ends it, which removes it).
        EvictionEmptyError when nothing is evictable."""

    def __len__(self) -> int:
        """How many handles are evictable."""


class EvictionEmptyError(RetentionError, LookupError):
    """A victim was asked of a policy with nothing evictable: the ledger checks for room first (a ledger bug)."""


class LeastRecentlyUsed:
    """Least recently used first: retain, renew and the end of a read touch a handle. O(1) per call."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # oldest first

    def admit(self, handle_id: str) -> None:
        self._order[handle_id] = None
        self._order.move_to_end(handle_id)

    def touch(self, handle_id: str) -> None:
        if handle_id in self._order:
            self._order.move_to_end(handle_id)

    def remove(self, handle_id: str) -> None:
        self._order.pop(handle_id, None)

    def victim(self) -> str:
        for handle_id in self._order:
            return handle_id
        raise EvictionEmptyError("no retention is evictable (every one has a read in flight)")

    def __len__(self) -> int:
        return len(self._order)


# Name -> a factory of fresh policies (one per ledger: a policy holds that ledger's order).
EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LeastRecentlyUsed}
