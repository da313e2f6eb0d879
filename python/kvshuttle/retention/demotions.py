"""The ledger's demotions: a hot retention that would end by its TTL or the budget (or that ``demote`` names) moves
into the tier of its terms instead (``tiers.py``).

Mixed into :class:`~kvshuttle.retention.ledger.RetentionLedger`, which owns every piece of state used here and
runs every method under its lock. The rules:

* The ledger takes tier slots (the tier's own victims, in the tier's eviction order, go first, but none when all
  of them would not make room: slots being read or copied into stay; without room the retention ends with
  ``tier_full``, or stays hot when ``demote`` asked) and, after its lock, hands a
  :class:`~kvshuttle.retention.tiers.Demotion` to ``on_demote`` (the tier memory's copier).
* The hot blocks go back (``on_free``, ``on_release``) only when the copier reports the copy complete
  (``demoted``). Meanwhile the handle is live but its claims and renewals are refused (``demoting``); a demotion of
  a handle with reads in flight waits for them (pins hold). The budget counts the hot blocks of copies in flight
  as gone (they are, once copied).
* Once landed, the same handle id and generation claim it: its block ids are names now, mapped to tier slots, and
  the hot ids hold no share of it, so a reuse of those blocks never touches it. Its expiry is the tier's TTL from
  the landing (a shorter one than what was left of the hot TTL is enforced on access and swept by then). A claim
  says ``tier="host"`` and must be packed from the tier (``claimed_slots``), else ``complete`` refuses it as
  stale: a direct read reads the hot cache by block id. Release ends it on every tier.
* A failed copy ends the retention with the reason it was leaving for (an explicit demotion stays hot).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TypeVar

from ._checks import check_id
from ._heap import DeadlineHeap
from .errors import NoTierError
from .eviction import EvictionPolicy
from .records import RetainedRecord
from .tiers import HOT_TIER, Demotion, TierSlots

EXPLICIT = "explicit"  # a demotion asked by demote(): without room (or if the copy fails) the handle stays hot
log = logging.getLogger(__name__)
R = TypeVar("R")


class Demotions:
    """Demotion into a tier, for :class:`RetentionLedger` (see the module docstring)."""

    # The ledger's state this half reads and writes (set in the ledger's constructor).
    _tier: TierSlots | None
    _copying: dict[str, RetainedRecord]  # handles whose demotion copy is in flight
    _orders: list[Demotion]  # copies asked by the current operation, started after the lock
    _on_demote: Callable[[Demotion], object] | None
    _evictable: EvictionPolicy
    _handles: dict[str, RetainedRecord]
    _reading: set[RetainedRecord]  # handles with reads in flight (ended ones too, until their reads end)
    _expiry: DeadlineHeap[RetainedRecord]
    _clock: Callable[[], float]

    # The ledger's operations this half calls.
    def _call(self, fn: Callable[[], R]) -> R:
        raise NotImplementedError

    def _live(self, handle_id: str, now: float, *, count: bool) -> RetainedRecord:
        raise NotImplementedError

    def _end(self, handle: RetainedRecord, reason: str) -> None:
        raise NotImplementedError

    def _release_hot(self, handle: RetainedRecord) -> None:
        raise NotImplementedError

    def _drop_holds(self, handle: RetainedRecord) -> None:
        raise NotImplementedError

    def demote(self, handle_id: str) -> bool:
        """Move a hot retention into the tier now: True when its copy started (or waits for its reads in flight),
        False when it is in a tier already, or the tier has no room (it stays hot). HandleUnavailableError when it
        is not live (``HandleDemotingError``: being demoted already); NoTierError (a RetentionArgumentError) without a
        tier."""
        check_id("handle_id", handle_id)
        if self._tier is None:
            raise NoTierError("this ledger has no tier to demote into (RetentionTerms.tier)")

        def run() -> bool:
            handle = self._live(handle_id, self._clock(), count=False)
            if handle.tier != HOT_TIER:
                return False
            self._retire(handle, EXPLICIT)
            return handle.demote is not None

        return self._call(run)

    def demoted(self, handle_id: str, ok: bool) -> bool:
        """The copier's report (``Demotion.done``): the copy of ``handle_id`` completed (``ok``) or failed. The
        hot blocks go back now; False when no copy of it was in flight (reported twice)."""
        check_id("handle_id", handle_id)
        return self._call(lambda: self._landed(handle_id, bool(ok)))

    def _expire(self, handle: RetainedRecord) -> None:
        """Its TTL ran out: a hot one is demoted (or ends), a tier one ends."""
        if handle.tier == HOT_TIER:
            self._retire(handle, "expired")
        else:
            self._end(handle, "tier_expired")

    def _order_of(self, handle: RetainedRecord) -> EvictionPolicy:
        """The eviction order a live handle sits in: the hot one or its tier's."""
        return self._evictable if handle.tier == HOT_TIER or self._tier is None else self._tier.evictable

    def _retire(self, handle: RetainedRecord, reason: str) -> None:
        """A hot handle's TTL ran out, the budget evicts it, or ``demote`` asks (``EXPLICIT``): demoted into the
        tier when there is one, else ended. With reads in flight the demotion waits for them (pins hold)."""
        if self._tier is None or handle.tier != HOT_TIER:
            self._end(handle, reason)
            return
        handle.demote = reason
        self._evictable.remove(handle.handle_id)
        if not handle.claims:
            self._start_demotion(handle)

    def _start_demotion(self, handle: RetainedRecord) -> None:
        """Take tier slots (the tier's own victims go first) and ask for the copy after the lock."""
        assert self._tier is not None and handle.demote is not None
        tier, count, reason = self._tier, len(handle.block_ids), handle.demote
        if count <= self._room(tier):  # else evicting would end residents and still not make room
            while tier.free < count and len(tier.evictable):
                self._end(self._handles[tier.evictable.victim()], "tier_evicted")
        if tier.free < count:
            handle.demote = None
            if reason == EXPLICIT:  # asked, not forced: it stays hot
                self._keep_hot(handle)
            else:
                self._end(handle, "tier_full")
            return
        handle.slots = tier.take(count)
        self._copying[handle.handle_id] = handle
        self._orders.append(Demotion(handle.handle_id, handle.block_ids, handle.slots,
                                     functools.partial(self.demoted, handle.handle_id)))

    def _room(self, tier: TierSlots) -> int:
        """The slots free or held by evictable residents: every slot but those read or copied into now."""
        held = sum(len(h.slots) for h in self._reading) + sum(len(h.slots) for h in self._copying.values())
        return tier.terms.capacity_blocks - held

    def _keep_hot(self, handle: RetainedRecord) -> None:
        """An asked demotion that did not happen: evictable and swept again as before."""
        self._evictable.admit(handle.handle_id)
        if not handle.heaped:  # a sweep popped it while it waited
            self._expiry.push(handle.expiry, handle)
            handle.heaped = True

    def _start_copy(self, order: Demotion) -> None:
        """Hand a demotion to the copier (outside the lock); a copier that raises failed the copy."""
        assert self._on_demote is not None
        try:
            self._on_demote(order)
        except Exception:
            log.exception("kvshuttle: starting the tier copy of %s failed", order.handle_id[:12])
            order.done(False)

    def _landed(self, handle_id: str, ok: bool) -> bool:
        handle = self._copying.pop(handle_id, None)
        if handle is None:
            return False
        assert self._tier is not None
        tier, reason = self._tier, handle.demote
        handle.demote = None
        if handle.ended is not None:  # released (or made stale) during the copy: nothing of it stays
            self._drop_holds(handle)
            return True
        if not ok or handle.reused:
            tier.counts["failed_copies"] += 1
            tier.give_back(handle.slots)
            handle.slots = ()
            if reason == EXPLICIT and not handle.reused:
                self._keep_hot(handle)
            else:
                self._end(handle, "stale" if handle.reused else reason or "evicted")
            return True
        self._release_hot(handle)
        handle.tier = tier.terms.name
        handle.expiry = self._clock() + tier.terms.ttl_s
        if not handle.heaped:
            self._expiry.push(handle.expiry, handle)
            handle.heaped = True
        tier.evictable.admit(handle_id)
        tier.counts["demotions"] += 1
        return True

