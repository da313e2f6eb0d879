"""The ledger's demotions: a hot retention that would end by its TTL or the budget (or that ``demote`` names) moves
into the host tier of its terms instead, and one leaving the host tier (its TTL there, or that tier's eviction)
moves on into the disk tier when the terms have one (``tiers.py``).

Mixed into :class:`~kvshuttle.retention.ledger.RetentionLedger`, which owns every piece of state used here and
runs every method under its lock. The rules, the same for both moves:

* The ledger takes slots in the next tier (that tier's own victims, in its eviction order, go first: a host
  victim moves on to disk in turn, a disk victim ends; none when all of them would not make room, since slots
  being read or copied into stay) and, after its lock, hands a
  :class:`~kvshuttle.retention.tiers.Demotion` to the tier memory's copier (``on_demote`` into host memory,
  ``on_spill`` into a file). Without room the retention ends with ``tier_full`` (or stays hot when ``demote``
  asked); when the room will come back from host victims being written to disk, it waits for those writes.
* The source goes back (hot blocks: ``on_free``, ``on_release``; host slots: to the host tier) only when the copier
  reports the copy complete (``demoted``). Meanwhile the handle is live but its claims and renewals are refused
  (``demoting``); a move of a handle with reads in flight waits for them (pins hold). The budget counts the hot
  blocks of copies in flight (and of moves waiting for room) as gone (they are, once copied).
* Once landed, the same handle id and generation claim it: its block ids are names now, mapped to tier slots (a
  file's positions on disk), and the hot ids hold no share of it, so a reuse of those blocks never touches it. Its
  expiry is the new tier's TTL from the landing (a shorter one than what was left is enforced on access and swept
  by then). A claim names its tier and must be packed from it (``claimed_slots``), else ``complete`` refuses it as
  stale: a direct read reads the hot cache by block id. Release ends it on every tier; a disk copy is removed
  (``on_discard``, after the lock) once nothing reads or writes it.
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
from .tiers import DISK_TIER, HOST_TIER, HOT_TIER, TIER_END_REASONS, Demotion, TierSlots

EXPLICIT = "explicit"  # a demotion asked by demote(): without room (or if the copy fails) the handle stays hot
log = logging.getLogger(__name__)
R = TypeVar("R")


class Demotions:
    """Demotion into the tiers, for :class:`RetentionLedger` (see the module docstring)."""

    # The ledger's state this half reads and writes (set in the ledger's constructor).
    _tiers: dict[str, TierSlots]  # the terms' tiers by name, in the order a retention moves through them
    _after: dict[str, str]  # where a retention in a tier (or hot) goes next
    _copying: dict[str, RetainedRecord]  # handles whose copy into their next tier is in flight
    _awaiting: dict[str, RetainedRecord]  # handles waiting for room that copies in flight give back
    _orders: list[Demotion]  # copies asked by the current operation, started after the lock
    _discards: list[str]  # handles whose disk copy goes, removed after the lock
    _on_demote: Callable[[Demotion], object] | None
    _on_spill: Callable[[Demotion], object] | None
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

    def demote(self, handle_id: str) -> bool:
        """Move a hot retention into the host tier now: True when its copy started (or waits for its reads in flight
        or for room), False when it is in a tier already, or the tier has no room (it stays hot).
        HandleUnavailableError when it is not live (``HandleDemotingError``: being demoted already); NoTierError (a
        RetentionArgumentError) without a tier."""
        check_id("handle_id", handle_id)
        if HOST_TIER not in self._tiers:
            raise NoTierError("this ledger has no tier to demote into (RetentionTerms.tier)")

        def run() -> bool:
            handle = self._live(handle_id, self._clock(), count=False)
            if handle.tier != HOT_TIER:
                return False
            self._retire(handle, EXPLICIT)
            return handle.demote is not None

        return self._call(run)

    def demoted(self, handle_id: str, ok: bool) -> bool:
        """The copier's report (``Demotion.done``): the copy of ``handle_id`` into its next tier completed (``ok``)
        or failed. Its source goes back now; False when no copy of it was in flight (reported twice)."""
        check_id("handle_id", handle_id)
        return self._call(lambda: self._landed(handle_id, bool(ok)))

    def _expire(self, handle: RetainedRecord) -> None:
        """Its TTL ran out: it moves on to its next tier, or ends in its last."""
        self._retire(handle, "expired" if handle.tier == HOT_TIER else "tier_expired")

    def _order_of(self, handle: RetainedRecord) -> EvictionPolicy:
        """The eviction order a live handle sits in: the hot one or its tier's."""
        return self._evictable if handle.tier == HOT_TIER else self._tiers[handle.tier].evictable

    def _end_tier(self, handle: RetainedRecord, reason: str) -> str:
        """The tier an end for ``reason`` is counted in ("" for none): the one it found full, else its own."""
        if reason not in TIER_END_REASONS:
            return ""
        return self._after.get(handle.tier, "") if reason == "tier_full" else handle.tier

    def _retire(self, handle: RetainedRecord, reason: str) -> None:
        """A TTL ran out, an eviction picked it, or ``demote`` asks (``EXPLICIT``): it moves into its next tier
        when there is one, else it ends. With reads in flight the move waits for them (pins hold)."""
        if handle.tier not in self._after:
            self._end(handle, reason)
            return
        handle.demote = reason
        self._order_of(handle).remove(handle.handle_id)
        if not handle.claims:
            self._start_demotion(handle)

    def _start_demotion(self, handle: RetainedRecord) -> None:
        """Take slots in the next tier (its own victims go first) and ask for the copy after the lock."""
        assert handle.demote is not None
        tier, count, reason = self._tiers[self._after[handle.tier]], len(handle.block_ids), handle.demote
        room = self._room(tier)
        if count <= room:  # else evicting would move or end residents and still not make room
            while tier.free < count and len(tier.evictable):
                self._retire(self._handles[tier.evictable.victim()], "tier_evicted")
        if tier.free < count:
            leaving = sum(len(h.slots) for h in self._copying.values() if h.tier == tier.terms.name)
            if count <= room and tier.free + leaving >= count:  # victims being written to disk: wait for them
                self._awaiting[handle.handle_id] = handle
                return
            handle.demote = None
            if reason == EXPLICIT:  # asked, not forced: it stays hot
                self._keep_hot(handle)
            else:
                self._end(handle, "tier_full")
            return
        handle.moving = tier.take(count)
        self._copying[handle.handle_id] = handle
        source = handle.block_ids if handle.tier == HOT_TIER else handle.slots
        self._orders.append(Demotion(handle.handle_id, source, handle.moving,
                                     functools.partial(self.demoted, handle.handle_id), tier.terms.name))

    def _room(self, tier: TierSlots) -> int:
        """The slots of ``tier`` free now or once its residents move on: all but those being read or copied into."""
        name = tier.terms.name
        read = sum(len(h.slots) for h in self._reading if h.tier == name)
        arriving = sum(len(h.moving) for h in self._copying.values() if self._after.get(h.tier) == name)
        return tier.capacity - read - arriving

    def _keep_hot(self, handle: RetainedRecord) -> None:
        """An asked demotion that did not happen: evictable and swept again as before."""
        self._evictable.admit(handle.handle_id)
        if not handle.heaped:  # a sweep popped it while it waited
            self._expiry.push(handle.expiry, handle)
            handle.heaped = True

    def _start_copy(self, order: Demotion) -> None:
        """Hand a copy to its tier's copier (outside the lock); a copier that raises failed the copy."""
        copier = self._on_spill if order.target == DISK_TIER else self._on_demote
        assert copier is not None
        try:
            copier(order)
        except Exception:
            log.exception("kvshuttle: starting the %s tier copy of %s failed", order.target, order.handle_id[:12])
            order.done(False)

    def _drop_holds(self, handle: RetainedRecord) -> None:
        """Give back all it holds: hot blocks, its tier's slots, the next tier's being copied into, a disk copy."""
        nxt = self._after.get(handle.tier)
        if handle.tier == DISK_TIER or (handle.moving and nxt == DISK_TIER):
            self._discards.append(handle.handle_id)
        if handle.tier == HOT_TIER:
            self._release_hot(handle)
        elif handle.slots:
            self._tiers[handle.tier].give_back(handle.slots)
        handle.slots = ()
        if handle.moving and nxt is not None:
            self._tiers[nxt].give_back(handle.moving)
        handle.moving = ()

    def _landed(self, handle_id: str, ok: bool) -> bool:
        handle = self._copying.pop(handle_id, None)
        if handle is None:
            return False
        try:
            self._arrive(handle, ok)
        finally:
            waiting, self._awaiting = self._awaiting, {}  # room may have come back: the waiting try again in order
            for other in waiting.values():
                if other.ended is None and other.demote is not None:
                    self._start_demotion(other)
        return True

    def _arrive(self, handle: RetainedRecord, ok: bool) -> None:
        tier, reason = self._tiers[self._after[handle.tier]], handle.demote
        handle.demote = None
        if handle.ended is not None:  # released (or made stale) during the copy: nothing of it stays
            self._drop_holds(handle)
            return
        if not ok or handle.reused:
            tier.counts["failed_copies"] += 1
            tier.give_back(handle.moving)
            handle.moving = ()
            if tier.terms.name == DISK_TIER:  # a partial file may be there
                self._discards.append(handle.handle_id)
            if reason == EXPLICIT and not handle.reused:
                self._keep_hot(handle)
            else:
                self._end(handle, "stale" if handle.reused else reason or "evicted")
            return
        if handle.tier == HOT_TIER:
            self._release_hot(handle)
        else:
            self._tiers[handle.tier].give_back(handle.slots)
        handle.slots, handle.moving = handle.moving, ()
        handle.tier = tier.terms.name
        handle.expiry = self._clock() + tier.terms.ttl_s
        if not handle.heaped:
            self._expiry.push(handle.expiry, handle)
            handle.heaped = True
        tier.evictable.admit(handle.handle_id)
        tier.counts["demotions"] += 1
