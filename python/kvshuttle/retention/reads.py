"""The ledger's reads: claims pin a handle's blocks for a READ until ``complete``, ``abort`` or their deadline.

Mixed into :class:`~kvshuttle.retention.ledger.RetentionLedger` (its module docstring has the rules), which owns
every piece of state used here and runs every method under its lock (through ``_call``). A claim of a retention
in a tier names the tier; the owner asks where the bytes are (``claimed_slots``, ``claimed_tier``) and packs them
from there, and reports a tier copy it could not read back (``tier_lost``).
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import NoReturn

from .._values import is_int
from ..errors import shown
from ._checks import as_tuple, check_id, check_readers
from ._heap import DeadlineHeap
from .demotions import Demotions
from .errors import ClaimLimitError, ClaimLostError, RetentionArgumentError, StaleHandleError
from .records import Claim, OpenClaim, RetainedRecord, remember_end, same_as_issued
from .terms import RetentionTerms
from .tiers import DISK_TIER, HOST_TIER, HOT_TIER


class Reads(Demotions):
    """Claims of retained handles, for :class:`RetentionLedger` (see the ledger's module docstring)."""

    # The ledger's state this half reads and writes (set in the ledger's constructor).
    terms: RetentionTerms
    _claims: dict[str, OpenClaim]
    _open_by_reader: Counter[str]
    _claim_deadlines: DeadlineHeap[OpenClaim]
    _ended_claims: OrderedDict[str, str]
    _reading: set[RetainedRecord]
    _counts: Counter[str]
    _refusals: Counter[str]
    _draining: int
    _tombstone_cap: int
    _max_claims_per_reader: int
    _claim_timeout: float

    # The ledger's operations this half calls.
    def _refuse(self, reason: str, handle_id: str, detail: str = "", *, count: bool = True) -> NoReturn:
        raise NotImplementedError

    def _tampered(self, handle_id: str, detail: str) -> NoReturn:
        raise NotImplementedError

    def claim(self, handle_id: str, generation: int, block_ids: Sequence[int] | None = None,
              digests: Sequence[bytes] | None = None, *, reader: str = "", readers: int = 1) -> Claim:
        """Check and pin a handle before a READ. ``block_ids``/``digests``, when given, must be the issued ones
        or a prefix of them (the reader may read fewer blocks). ``readers`` (1..64): how many reader ranks will
        claim a use-once handle here (multi-read handles ignore it). Raises HandleUnavailableError or
        TamperedHandleError; the reader then recomputes."""
        # Compared element-wise with what was issued, so no per-element conversion (O(n) Python at 1,536 blocks).
        check_id("handle_id", handle_id)
        if not is_int(generation):
            raise RetentionArgumentError(f"generation must be an int, got {shown(generation)}")
        check_id("reader", reader)
        expected = check_readers(readers)
        ids, digs = as_tuple("block_ids", block_ids), as_tuple("digests", digests)
        return self._call(lambda: self._claim(handle_id, generation, ids, digs, reader, expected))

    def complete(self, claim_id: str, tier_read: bool = False) -> Claim:
        """The read finished. Raises ClaimLostError (timed out) or StaleHandleError (blocks reused meanwhile):
        then the reader must discard what it read. In use-once mode the handle's last expected read frees it.
        ``tier_read``: the reader says it read a host tier claim's slots direct (not the hot blocks by id)."""
        check_id("claim_id", claim_id)
        return self._call(lambda: self._complete(claim_id, tier_read is True))

    def abort(self, claim_id: str) -> bool:
        """The read failed or was abandoned: unpin. The handle stays claimable. False if the claim was not live."""
        check_id("claim_id", claim_id)
        return self._call(lambda: self._abort(claim_id))

    def claimed_blocks(self, claim_id: str) -> tuple[int, ...]:
        """The blocks a live claim pins; ClaimLostError when it is not live (what an owner checks before it packs)."""
        check_id("claim_id", claim_id)
        return self._call(lambda: self._open_claim(claim_id).claim.block_ids)

    def claimed_slots(self, claim_id: str) -> tuple[int, ...] | None:
        """Where a live claim's blocks are: None in the hot cache (by block id), else their tier slots, parallel to
        the claim's block ids (the owner packs from the tier, and the claim counts as packed). ClaimLostError when
        the claim is not live."""
        check_id("claim_id", claim_id)

        def look() -> tuple[int, ...] | None:
            record = self._open_claim(claim_id)
            count = len(record.claim.block_ids)
            if record.claim.tier == HOT_TIER:
                return None
            record.packed = True
            # on disk, a file per retention holds its blocks in order: the slots only count its room
            return tuple(range(count)) if record.claim.tier == DISK_TIER else record.handle.slots[:count]

        return self._call(look)

    def claimed_tier(self, claim_id: str) -> tuple[str, str]:
        """``(tier, handle id)`` of a live claim: where its bytes are ("hot", "host", "disk") and whose they are
        (a disk tier's file is its handle's). ClaimLostError when the claim is not live."""
        check_id("claim_id", claim_id)

        def look() -> tuple[str, str]:
            claim = self._open_claim(claim_id).claim
            return claim.tier, claim.handle_id

        return self._call(look)

    def tier_lost(self, claim_id: str) -> bool:
        """The tier copy a live claim reads could not be read back whole (a disk file deleted or truncated behind
        the ledger's back): its retention ends (``tier_lost``; claims then say so) and the claim stays open until
        the reader aborts it. False when the claim is not live or its retention ended already."""
        check_id("claim_id", claim_id)

        def lose() -> bool:
            record = self._claims.get(claim_id)
            if record is None or record.handle.ended is not None or record.claim.tier == HOT_TIER:
                return False
            self._end(record.handle, "tier_lost")
            return True

        return self._call(lose)


    # ------------------------------------------------------------------------------------------- internals
    def _claim(self, handle_id: str, generation: int, ids: tuple[int, ...] | None, digs: tuple[bytes, ...] | None,
               reader: str, readers: int) -> Claim:
        now = self._clock()
        handle = self._live(handle_id, now, count=True)
        count = len(handle.block_ids)
        if generation != handle.generation:
            self._tampered(handle_id, f"generation {shown(generation)} presented, {handle.generation} issued")
        if ids is not None:
            if not ids or not same_as_issued(ids, handle.block_ids[: len(ids)]):
                self._tampered(handle_id, "block ids are not the issued ones or a prefix of them")
            count = len(ids)
        if digs is not None:
            issued = handle.digests[: len(digs)]
            if not digs or not same_as_issued(digs, issued) or (ids is not None and len(digs) != count):
                self._tampered(handle_id, "digests are not the issued ones")
            count = len(digs)
        problem = handle.slot_problem(readers) if handle.once else None
        if problem is not None:
            if problem[0] == "tampered":
                self._tampered(handle_id, problem[1])
            self._refuse("in_use", handle_id, problem[1])
        if self._open_by_reader[reader] >= self._max_claims_per_reader:
            self._refusals["claim_limit"] += 1
            raise ClaimLimitError(f"reader {reader[:16]} holds {self._max_claims_per_reader} open claims already; "
                                  "finish them first")
        self._open_by_reader[reader] += 1
        if handle.once:
            handle.readers = handle.readers or readers
        if handle.claims == 0:
            self._order_of(handle).remove(handle_id)  # a handle being read is never evicted
            self._reading.add(handle)
        handle.claims += 1
        claim = Claim(secrets.token_urlsafe(18), handle_id, handle.generation, handle.block_ids[:count],
                      min(handle.num_tokens, count * handle.block_size), now + self._claim_timeout, reader,
                      handle.tier, handle.slots[:count] if handle.tier == HOST_TIER else ())  # disk: packed only
        record = OpenClaim(claim, handle)
        self._claims[claim.claim_id] = record
        self._claim_deadlines.push(claim.deadline, record)
        self._counts["claims"] += 1
        return claim

    def _complete(self, claim_id: str, tier_read: bool) -> Claim:
        now = self._clock()
        record = self._pop_claim(claim_id)
        if record is None:
            raise ClaimLostError(claim_id, self._ended_claims.get(claim_id, "never granted here"))
        handle, claim = record.handle, record.claim
        if self.terms.expired(claim.deadline, now):  # past its deadline the blocks were not guaranteed pinned
            self._counts["claim_timeouts"] += 1
            self._close_claim(record, "timed out")
            raise ClaimLostError(claim_id, "timed out")
        stale = not handle.reused.isdisjoint(claim.block_ids)  # a block outside the claimed prefix does not matter
        # A tier claim must have been read from its tier (packed by the owner, or a host tier's slots read direct):
        # a reader that read the hot cache by block id read blocks that went back when the demotion landed.
        unpacked = claim.tier != HOT_TIER and not (record.packed or (tier_read and claim.tier == HOST_TIER))
        self._close_claim(record, "stale" if stale or unpacked else "completed")
        if stale:
            self._refusals["stale"] += 1
            raise StaleHandleError(handle.handle_id, "its blocks were reused during the read: discard them")
        if unpacked:
            self._refusals["unpacked_tier_read"] += 1
            raise StaleHandleError(handle.handle_id, f"it is in the {claim.tier} tier, not in the blocks read by id "
                                   "(read it with its claim ticket): discard the blocks read")
        if claim.tier != HOT_TIER:
            self._tiers[claim.tier].counts["reads"] += 1
        self._counts["hits"] += 1
        if handle.once and handle.ended is None:
            handle.done += 1
            if self.terms.consumed(handle.done, handle.readers):
                self._end(handle, "consumed")
        return claim

    def _abort(self, claim_id: str) -> bool:
        record = self._pop_claim(claim_id)
        if record is None:
            return False
        self._counts["aborts"] += 1
        self._close_claim(record, "aborted")
        return True

    def _open_claim(self, claim_id: str) -> OpenClaim:
        record = self._claims.get(claim_id)
        if record is None or self.terms.expired(record.claim.deadline, self._clock()):
            raise ClaimLostError(claim_id, self._ended_claims.get(claim_id, "never granted here"))
        return record

    def _pop_claim(self, claim_id: str) -> OpenClaim | None:
        record = self._claims.pop(claim_id, None)
        if record is not None:
            record.open = False
            self._claim_deadlines.discard()
        return record

    def _close_claim(self, record: OpenClaim, why: str) -> None:
        remember_end(self._ended_claims, record.claim.claim_id, why, self._tombstone_cap)
        reader = record.claim.reader
        self._open_by_reader[reader] -= 1
        if self._open_by_reader[reader] <= 0:
            del self._open_by_reader[reader]  # no per-reader state outlives its claims
        handle = record.handle
        handle.claims -= 1
        if handle.claims:
            return
        self._reading.discard(handle)
        if handle.ended is None and handle.demote is not None:
            self._start_demotion(handle)  # it waited for its reads
        elif handle.ended is None:
            self._order_of(handle).admit(handle.handle_id)  # a finished read is a touch
        else:
            self._draining -= 1
            self._drop_holds(handle)
