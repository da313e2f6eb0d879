"""Retention tiers: where a retention goes when it would leave the hot cache, and the bookkeeping of its slots.

A decode may keep a retention past its hot TTL or a budget eviction by *demoting* it: its blocks are copied into
a pool of ``capacity_blocks`` slots of host memory (``transfer/host_tier.py`` holds the memory and makes the
copy), then the hot blocks go back to the allocator. A retention leaving the host tier (its TTL there, or that
tier's eviction) may go on to the disk tier the same way (``transfer/disk_tier.py``: a file per retention, bounded
by ``capacity_bytes``), the last tier: it ends there. The retention keeps its handle (same id, same generation:
its block ids become names, mapped to tier slots), and its claims are served from the tier. Each tier has its
own TTL (counted from the demotion), capacity and eviction order, all in :class:`TierTerms`, part of the one
:class:`~kvshuttle.retention.terms.RetentionTerms` value.

:class:`TierSlots` is the ledger's view of one tier: which slots are free, which retentions sit there (in the
tier's eviction order), and the tier's counters. Not thread-safe: the ledger calls it under its lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._values import is_int
from ..errors import shown
from ._checks import check_positive
from .errors import RetentionArgumentError
from .eviction import EVICTION_POLICIES, EvictionPolicy

HOST_TIER = "host"
DISK_TIER = "disk"
HOT_TIER = "hot"  # where a retention lives until it is demoted: the engine's own KV cache
TIER_NAMES = (HOST_TIER, DISK_TIER)  # in the order a retention moves through them
DEFAULT_TIER_TTL_S = 1800.0  # a demoted retention outlives a long pause (half an hour) in host memory
DEFAULT_DISK_TTL_S = 4 * 3600.0  # on disk, a pause of hours (a meeting, a night's first hours)
# End reasons a tier adds to the ledger's: no room to demote into, evicted from the tier, expired in it, its copy
# found unreadable (a disk file deleted or truncated behind the ledger's back).
TIER_END_REASONS = ("tier_full", "tier_evicted", "tier_expired", "tier_lost")


@dataclass(frozen=True)
class TierTerms:
    """One retention tier: ``capacity_blocks`` slots (or ``capacity_bytes``, whole blocks of the ledger's
    ``bytes_per_block``: one of the two), ``ttl_s`` from the demotion, ``eviction`` order, ``name`` (host, disk)."""

    capacity_blocks: int | None = None
    ttl_s: float = DEFAULT_TIER_TTL_S
    eviction: str = "lru"  # a name in EVICTION_POLICIES
    name: str = HOST_TIER
    capacity_bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.capacity_blocks is None) == (self.capacity_bytes is None):
            raise RetentionArgumentError("a tier needs one of capacity_blocks and capacity_bytes")
        for field, limit in (("capacity_blocks", 2**31), ("capacity_bytes", 2**62)):
            value = getattr(self, field)
            if value is not None:
                if not (is_int(value) and 0 < value < limit):
                    raise RetentionArgumentError(f"tier {field} must be an int in [1, {limit}), got {shown(value)}")
                object.__setattr__(self, field, int(value))
        object.__setattr__(self, "ttl_s", check_positive("tier ttl_s", self.ttl_s))
        if not (isinstance(self.eviction, str) and self.eviction in EVICTION_POLICIES):
            raise RetentionArgumentError(f"tier eviction {shown(self.eviction)}: use one of "
                                         f"{sorted(EVICTION_POLICIES)}")
        if self.name not in TIER_NAMES:
            raise RetentionArgumentError(f"tier name {shown(self.name)}: use one of {list(TIER_NAMES)}")

    def blocks(self, bytes_per_block: int) -> int:
        """The tier's capacity in blocks of ``bytes_per_block`` bytes (all layers' K and V of one block)."""
        if self.capacity_blocks is not None:
            return self.capacity_blocks
        assert self.capacity_bytes is not None
        if bytes_per_block <= 0:
            raise RetentionArgumentError(f"the {self.name} tier's capacity_bytes needs the ledger's bytes_per_block")
        if self.capacity_bytes < bytes_per_block:
            raise RetentionArgumentError(f"the {self.name} tier's {self.capacity_bytes} bytes hold no block of "
                                         f"{bytes_per_block} bytes")
        return self.capacity_bytes // bytes_per_block


@dataclass(frozen=True)
class Demotion:
    """A copy the ledger asks of a tier's memory: hot ``block_ids`` into host tier ``slots`` (parallel tuples);
    for the disk tier (``target="disk"``), ``block_ids`` are the host tier slots the retention leaves and ``slots``
    its disk slots (the file holds its blocks in ``block_ids``' order).

    The copier calls ``done(ok)`` exactly once, when the copy completed (``ok``) or failed; only then does the
    ledger give the source blocks back (``on_free``, or to the host tier). ``done`` may be called from any thread,
    even before the ledger's call that asked for the copy returned."""

    handle_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    done: Callable[[bool], Any]
    target: str = HOST_TIER


class TierSlots:
    """The ledger's bookkeeping of one tier: free slots, resident retentions in eviction order, counters."""

    def __init__(self, terms: TierTerms, bytes_per_block: int) -> None:
        self.terms = terms
        self.capacity = terms.blocks(bytes_per_block)
        self._free = list(range(self.capacity - 1, -1, -1))  # popped from the end: low slots first
        self.evictable: EvictionPolicy = EVICTION_POLICIES[terms.eviction]()  # resident, no read in flight
        self.counts: Counter[str] = Counter()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def fits(self, count: int) -> bool:
        """Whether ``count`` blocks could ever sit in this tier (evicting everything else)."""
        return count <= self.capacity

    def take(self, count: int) -> tuple[int, ...]:
        """``count`` free slots (the caller made room first), ascending where possible: contiguous copies."""
        taken = sorted(self._free[-count:]) if count else []
        del self._free[len(self._free) - count:]
        return tuple(taken)

    def give_back(self, slots: tuple[int, ...]) -> None:
        self._free.extend(sorted(slots, reverse=True))

    def metrics(self, bytes_per_block: int, live: int, copying: int) -> dict[str, Any]:
        counts = self.counts
        return {"blocks": self.used, "bytes": self.used * bytes_per_block,
                "capacity_blocks": self.capacity, "capacity_bytes": self.capacity * bytes_per_block,
                "live_handles": live, "copying": copying,
                "demotions": counts["demotions"], "reads": counts["reads"], "misses": counts["misses"],
                "evictions": counts["tier_evicted"], "expirations": counts["tier_expired"],
                "full": counts["tier_full"], "failed_copies": counts["failed_copies"],
                "lost": counts["tier_lost"]}
