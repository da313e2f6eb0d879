"""The decode-side retention ledger: which finished requests' KV blocks decode keeps, for whom, for how long.

Decisions (see also the package docstring):

* **Sharing.** A block belongs to the ledger once, however many live handles hold it: turn 2's block table
  repeats turn 1's blocks (decode's prefix cache, or a cache grown in place), so turn 2's handle shares them
  by reference count and ``on_free`` gets a block exactly once, when its last holder ends. A shared block must
  sit at the same index and either carry the same digest over the same number of valid tokens, or extend the
  recorded block (more valid tokens: an append into a partial last block; paged caches only append until a
  block is freed). Anything else means the block was reused behind the ledger's back: the ledger treats it as
  :meth:`RetentionLedger.block_freed` (its holders become stale and are refused) before retaining anew.
* **Terms.** The TTL, the longest TTL, the read mode, the budget and the eviction order are the ledger's
  :class:`~kvshuttle.retention.terms.RetentionTerms`; the ledger asks them when a handle ends and keeps only
  the bookkeeping. **TTL edge:** a handle lives while ``now < expiry`` on the monotonic clock; at ``now ==
  expiry`` it has expired (exclusive end), both for :meth:`sweep` and for lazy checks on access. ``renew``
  never shortens.
* **Budget.** Counted in distinct retained blocks (``budget_bytes // bytes_per_block`` when given in bytes).
  ``retain`` first checks that evicting every handle without a read in flight would make room; if not it
  refuses (nothing evicted) with :class:`BudgetExceededError`; otherwise it evicts the victims of the terms'
  eviction policy (least recently touched by default: retain, renew and claim end touch) until it fits. The
  budget is never exceeded.
* **Generations.** A global epoch grows by one each time any block goes back to the allocator (through
  ``on_free`` or reported by ``block_freed``); the block's generation becomes that epoch. A handle's generation
  is the epoch when it was issued, so it is stale exactly when one of its blocks has a larger generation.
* **Claims** pin the handle's blocks (no eviction, no freeing: release or expiry during a read only takes
  effect when the read ends) until ``complete``/``abort`` or ``claim_timeout_s`` (exclusive too: a complete at
  the deadline is lost). ``complete`` re-checks the generations, so a read that raced with a reuse is reported
  instead of trusted. In use-once mode a handle has at most ``readers`` claims (the reader ranks that read it
  under tensor parallelism, 1 by default; its first granted claim fixes the count, a claim naming another is
  tampered) and is consumed when that many reads completed; an abort or timeout frees its slot (like vLLM,
  only completed reads or a release free the handle).
* **Tiers.** With a tier in its terms, a retention leaving the hot cache is demoted instead of ended
  (``demotions.py``): copied into the tier's memory, then its hot blocks go back; its handle stays valid. With a
  disk tier too, one leaving the host tier moves on to a file the same way. Claims are ``reads.py``.
* **Thread safety.** One ``threading.Lock`` guards all state; every public method takes it once and does
  O(log n + blocks touched) work under it. ``on_free`` runs after the lock is released (it may call back into
  the ledger); ``clock`` and ``wall_clock`` run under it and must not.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TypeVar

from .._values import is_int
from ..errors import shown
from ..policy.kv_handle import KVHandle
from ._checks import check_block, check_callable, check_count, check_id, check_positive, check_retain, check_time
from ._heap import DeadlineHeap
from .blocks import BlockTable
from .errors import UNAVAILABLE, BudgetExceededError, RetentionArgumentError, TamperedHandleError
from .reads import Reads
from .records import OpenClaim, RetainedRecord, remember_end
from .terms import READ_MODES, ReadMode, RetentionTerms
from .tiers import HOT_TIER, TIER_END_REASONS, Demotion, TierSlots

Mode = ReadMode  # the ledger's older names for the read mode
MODES = READ_MODES
R = TypeVar("R")
# End reasons of a handle; each is also a counter in metrics().
END_REASONS = ("expired", "evicted", "released", "consumed", "stale", *TIER_END_REASONS)


class RetentionLedger(Reads):
    """Decode's record of retained blocks and the handles it issued for them; see the module docstring.

    ``on_free(block_ids)`` hands blocks back to the owner's allocator: each retained block exactly once, after
    its last holder ended; it should not raise (the ledger has already forgotten the blocks). ``on_release(
    request_id)`` says a handle let go of its request's blocks (ended, and no read in flight): for an owner that
    frees per request, as vLLM's scheduler does (a block shared by two requests is freed by vLLM's reference
    count, not here). Without it freed
    blocks are only counted (tests, benchmarks). ``terms`` (default: :class:`RetentionTerms`'s defaults);
    ``ttl_s``, ``mode``, ``max_ttl_s`` and ``budget_blocks``, when given, override them. ``budget_blocks`` may be
    changed at run time; the next retain evicts down to it. ``tombstones``: how many ended handle and claim ids
    are remembered to name a refusal.

    A block's owner contract: retain hands the ledger the request's hold on its blocks (a block already retained
    is shared, not held twice); ``on_free`` gives it back; ``block_freed`` reports one the owner took back itself.
    ``on_demote(Demotion)``: starts a demotion's copy (``transfer.HostTier.demote``); needed with a tier.
    ``on_spill(Demotion)`` starts a copy from the host tier into the disk tier (``transfer.DiskTier.spill``), and
    ``on_discard(handle_id)`` removes a retention's disk copy (``DiskTier.discard``): needed with a disk tier. With a
    tier ``on_release`` still fires once per retention, when its hot blocks go back: at its end, or when its
    demotion landed (it lives on in the tier); ``on_end(request_id)`` fires once when a retention ends on every
    tier (what a TP rank tells the others), after the lock like the others.
    """

    def __init__(self, engine_id: str, host: str, port: int, *, terms: RetentionTerms | None = None,
                 ttl_s: float | None = None, mode: Mode | None = None, budget_blocks: int | None = None,
                 budget_bytes: int | None = None, bytes_per_block: int = 0, claim_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 on_free: Callable[[list[int]], object] | None = None,
                 on_release: Callable[[str], object] | None = None, tombstones: int = 4096,
                 max_ttl_s: float | None = None, max_claims_per_reader: int = 256,
                 on_demote: Callable[[Demotion], object] | None = None,
                 on_end: Callable[[str], object] | None = None,
                 on_spill: Callable[[Demotion], object] | None = None,
                 on_discard: Callable[[str], object] | None = None) -> None:
        if not isinstance(engine_id, str) or not engine_id or not isinstance(host, str) or not host:
            raise RetentionArgumentError("engine_id and host must be non-empty strings (they go into every handle)")
        if type(port) is not int or not 0 < port < 65536:
            raise RetentionArgumentError(f"port {shown(port)} is not a TCP port (1..65535): pass the side channel's "
                                         "port")
        if terms is not None and not isinstance(terms, RetentionTerms):
            raise RetentionArgumentError(f"terms must be a RetentionTerms, got {type(terms).__name__}")
        self.terms = (terms or RetentionTerms()).overridden(ttl_s=ttl_s, read_mode=mode, max_ttl_s=max_ttl_s,
                                                            budget_blocks=budget_blocks)
        check_callable("clock", clock)
        check_callable("wall_clock", wall_clock)
        check_callable("on_free", on_free, optional=True)
        check_callable("on_release", on_release, optional=True)
        check_callable("on_demote", on_demote, optional=True)
        check_callable("on_end", on_end, optional=True)
        check_callable("on_spill", on_spill, optional=True)
        check_callable("on_discard", on_discard, optional=True)
        if self.terms.tier is not None and on_demote is None:
            raise RetentionArgumentError("a tier in the terms needs on_demote, the copier into its memory "
                                         "(kvshuttle.transfer.HostTier.demote)")
        if self.terms.disk is not None and (on_spill is None or on_discard is None):
            raise RetentionArgumentError("a disk tier in the terms needs on_spill and on_discard, the writer and "
                                         "remover of its files (kvshuttle.transfer.DiskTier.spill, .discard)")
        self._max_claims_per_reader = check_count("max_claims_per_reader", max_claims_per_reader)
        self._claim_timeout = check_positive("claim_timeout_s", claim_timeout_s)
        limit = self.terms.budget()  # the engine's block count is not the ledger's to know: blocks only
        limits = [] if limit is None else [limit]
        check_count("bytes_per_block", bytes_per_block)
        if budget_bytes is not None:
            if bytes_per_block <= 0:
                raise RetentionArgumentError("budget_bytes needs bytes_per_block > 0 (all layers' K and V of a block)")
            limits.append(check_count("budget_bytes", budget_bytes) // bytes_per_block)
        self.engine_id, self.host, self.port, self.mode = engine_id, host, port, self.terms.read_mode
        self.ranks: tuple[str, ...] = ()  # owner ranks' side channels, rank 0 = host:port: named at tp_size > 1
        self.cache_dtype = ""  # what the cache's bytes mean (KVHandle.cache_dtype): named by every renewed handle
        self.bytes_per_block = bytes_per_block
        self.budget_blocks: int | None = min(limits) if limits else None
        self._clock, self._wall_clock, self._on_free, self._on_release = clock, wall_clock, on_free, on_release
        self._tombstone_cap = check_count("tombstones", tombstones)

        self._lock = threading.Lock()
        self._handles: dict[str, RetainedRecord] = {}  # live handles
        self._evictable = self.terms.eviction_policy()  # live handles without reads in flight, in eviction order
        self._blocks = BlockTable()
        # Handles with reads in flight: their blocks are pinned. Kept per handle, not per block, so a claim costs
        # O(1) whatever the handle's size; the pinned block set is derived when the budget or metrics need it.
        self._reading: set[RetainedRecord] = set()
        self._draining = 0  # ended handles whose blocks wait for reads in flight
        self._conversations: dict[str, set[str]] = {}
        self._expiry: DeadlineHeap[RetainedRecord] = DeadlineHeap(lambda h: h.ended is None)
        self._claims: dict[str, OpenClaim] = {}
        self._open_by_reader: Counter[str] = Counter()  # open claims per reader (a connection on the side channel)
        self._claim_deadlines: DeadlineHeap[OpenClaim] = DeadlineHeap(lambda c: c.open)
        self._ended_handles: OrderedDict[str, str] = OrderedDict()  # recent handle id -> end reason
        self._ended_claims: OrderedDict[str, str] = OrderedDict()
        self._pending: list[int] = []  # blocks freed by the current operation, for on_free after the lock
        self._released: list[str] = []  # requests whose handle let go of its blocks, for on_release after it
        self._counts: Counter[str] = Counter()
        self._refusals: Counter[str] = Counter()
        self._on_demote, self._on_end = on_demote, on_end
        self._ends: list[str] = []  # requests whose retention ended, for on_end after the lock
        self._on_spill, self._on_discard = on_spill, on_discard
        self._tiers = {t.name: TierSlots(t, bytes_per_block) for t in self.terms.tiers}
        names = [HOT_TIER, *self._tiers]
        self._after = dict(itertools.pairwise(names))
        self._ttl_after = {name: sum(t.terms.ttl_s for t in list(self._tiers.values())[i:])
                           for i, name in enumerate(names)}  # a handle's life after its present tier
        self._copying: dict[str, RetainedRecord] = {}  # handles whose copy into their next tier is in flight
        self._awaiting: dict[str, RetainedRecord] = {}  # handles whose move waits for room copies give back
        self._orders: list[Demotion] = []  # copies asked by the current operation, started after the lock
        self._discards: list[str] = []  # disk copies to remove, after the lock

    # ------------------------------------------------------------------------------------------ public API
    def retain(self, request_id: str, block_ids: Iterable[int], digests: Iterable[bytes], num_tokens: int,
               block_size: int, tp_size: int = 1, conversation_id: str | None = None, *,
               ttl_s: float | None = None, handle_id: str | None = None, generation: int | None = None,
               mode: Mode | None = None) -> KVHandle:
        """Keep a finished request's blocks and issue a handle for them (``ttl_s`` overrides the ledger's TTL).

        ``handle_id`` and ``generation``: the values an issuer outside the ledger already published (vLLM's
        scheduler returns ``kv_transfer_params`` before the worker's ledger sees the retention); by default the
        ledger draws an unguessable id and uses its epoch. Raises BudgetExceededError (free ``caller_frees``
        normally) or RetentionArgumentError. ``mode`` overrides the ledger's mode for this handle (a prefill's
        forward handle is use-once while decode's reverse ones are multi-read)."""
        ids, digs = check_retain(request_id, block_ids, digests, num_tokens, block_size, tp_size, conversation_id)
        ttl = self.terms.lifetime(ttl_s)
        if handle_id is not None:
            check_id("handle_id", handle_id)
        if generation is not None and not (is_int(generation) and 0 <= generation < 2**63):
            raise RetentionArgumentError(f"generation must be an int in [0, 2**63), got {shown(generation)}")
        once = self.terms.use_once(mode)
        issued = None if generation is None else int(generation)
        return self._call(lambda: self._retain(request_id, ids, digs, num_tokens, block_size, tp_size,
                                               conversation_id, ttl, handle_id, issued, once))

    def renew(self, handle_id: str, ttl_s: float | None = None) -> KVHandle:
        """Extend the handle to ``now + ttl_s`` (never shorten; at most ``max_ttl_s``) and touch it; returns the
        updated wire handle."""
        check_id("handle_id", handle_id)
        ttl = self.terms.renewal(ttl_s)
        return self._call(lambda: self._renew(handle_id, ttl))

    def release(self, handle_id: str) -> bool:
        """End the handle (blocks freed now, or when its reads in flight end). False if it was not live."""
        check_id("handle_id", handle_id)
        return self._call(lambda: self._release([handle_id]) == 1)

    def close_conversation(self, conversation_id: str) -> int:
        """Release every live handle of a conversation; returns how many."""
        check_id("conversation_id", conversation_id)
        return self._call(lambda: self._release(list(self._conversations.get(conversation_id, ()))))

    def release_all(self) -> int:
        """Release every live handle (shutdown); returns how many."""
        return self._call(lambda: self._release(list(self._handles)))

    def block_freed(self, block_id: int) -> None:
        """The owner returned ``block_id`` to its free pool (or reused it) without the ledger: its generation
        moves on and every handle holding it becomes stale. The ledger will not hand it to ``on_free``."""
        block = check_block(block_id)
        def take_back() -> None:
            if block in self._blocks:
                self._counts["taken_back"] += 1
            for holder in self._blocks.take_back(block):
                if holder.ended is None:
                    self._end(holder, "stale")
        self._call(take_back)

    def sweep(self, now: float | None = None) -> int:
        """Expire due handles and time out due claims; returns the handles expired. Cost: O(log n) per entry
        due, O(1) when nothing is due, whatever the number of live handles."""
        due = None if now is None else check_time("now", now)
        return self._call(lambda: self._sweep(self._clock() if due is None else due))

    def get(self, handle_id: str) -> KVHandle | None:
        """The live handle as it would be issued now (remaining TTL), or None."""
        check_id("handle_id", handle_id)
        def look() -> KVHandle | None:
            now = self._clock()
            handle = self._handles.get(handle_id)
            if handle is None:
                return None
            if handle.demote is None and self.terms.expired(handle.expiry, now):
                self._expire(handle)  # a hot one may live on in the tier
            return None if handle.ended is not None else self._wire(handle, now)
        return self._call(look)

    def generation(self, block_id: int) -> int:
        block_id = check_block(block_id)
        with self._lock:
            return self._blocks.generation(block_id)

    def retained_block_ids(self) -> frozenset[int]:
        with self._lock:
            return self._blocks.ids()

    def __len__(self) -> int:
        return len(self._handles)

    def metrics(self) -> dict[str, Any]:
        """Gauges and counters, JSON-ready."""
        with self._lock:
            counts = self._counts
            return {
                "retained_blocks": len(self._blocks),
                "retained_bytes": len(self._blocks) * self.bytes_per_block,
                "budget_blocks": self.budget_blocks,
                "pinned_blocks": len(self._blocks.pinned(self._reading)),
                "live_handles": len(self._handles),
                "draining_handles": self._draining,
                "claims_in_flight": len(self._claims),
                **{name: counts[name] for name in ("retains", "renewals", "claims", "hits", "aborts",
                                                   "claim_timeouts", "freed_blocks", "taken_back", "superseded")},
                "expirations": counts["expired"],
                "evictions": counts["evicted"],
                "releases": counts["released"],
                "consumed": counts["consumed"],
                "stale_handles": counts["stale"],
                "refusals": dict(self._refusals),
                **({"tiers": {name: tier.metrics(
                    self.bytes_per_block, sum(1 for h in self._handles.values() if h.tier == name),
                    sum(1 for h in self._copying.values() if self._after[h.tier] == name))
                    for name, tier in self._tiers.items()}} if self._tiers else {}),
            }

    # ------------------------------------------------------------------------------------------- internals
    def _call(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` under the lock, then hand what it freed to ``on_free`` / ``on_release`` outside it."""
        freed: list[int] = []
        released: list[str] = []
        orders: list[Demotion] = []
        ends: list[str] = []
        discards: list[str] = []
        try:
            with self._lock:
                try:
                    return fn()
                finally:
                    freed, self._pending = self._pending, []
                    released, self._released = self._released, []
                    orders, self._orders = self._orders, []
                    ends, self._ends = self._ends, []
                    discards, self._discards = self._discards, []
        finally:
            if self._on_discard is not None:
                for handle_id in discards:
                    self._on_discard(handle_id)
            if freed and self._on_free is not None:
                self._on_free(freed)
            if self._on_release is not None:
                for request_id in released:
                    self._on_release(request_id)
            if self._on_end is not None:
                for request_id in ends:
                    self._on_end(request_id)
            for order in orders:
                self._start_copy(order)

    def _retain(self, request_id: str, ids: tuple[int, ...], digs: tuple[bytes, ...], num_tokens: int,
                block_size: int, tp_size: int, conversation_id: str | None, ttl: float, handle_id: str | None,
                generation: int | None, once: bool) -> KVHandle:
        now = self._clock()
        if handle_id is not None and (handle_id in self._handles or handle_id in self._ended_handles):
            raise RetentionArgumentError(f"handle id {handle_id[:12]}... was issued before; issue a fresh one")
        handle = RetainedRecord(handle_id or secrets.token_urlsafe(18), request_id, conversation_id, ids, digs,
                                num_tokens, block_size, tp_size, now + ttl)
        handle.once = once
        new = sum(1 for b in ids if b not in self._blocks)
        # attach first, so that no block of this request can be freed under us
        superseded, reused = self._blocks.attach(handle)
        self._counts["superseded"] += reused
        for holder in superseded:
            if holder.ended is None:
                self._end(holder, "stale")
        self._sweep(now)  # after attaching (a shared block must survive its old holder), before evicting
        limit = self.budget_blocks
        if limit is not None and len(self._blocks) > limit:
            pinned = self._blocks.pinned(self._reading)
            unevictable = len(pinned.union(ids))
            if unevictable > limit:
                self._refusals["budget"] += 1
                message = (f"retaining {len(ids)} blocks ({new} not yet retained) would exceed the budget of "
                           f"{limit} blocks: {len(self._blocks) - new} retained, {len(pinned)} pinned by reads in "
                           "flight; free the request's blocks normally (caller_frees) and let the next turn "
                           "recompute, or raise the budget")
                raise BudgetExceededError(message, caller_frees=self._blocks.detach(handle))
            # The check above counted the room: a victim is always there. A victim being demoted keeps its hot
            # blocks until its copy completed; they count as gone.
            while len(self._blocks) - len(self._blocks.held_only_by(self._leaving_hot())) > limit:
                self._retire(self._handles[self._evictable.victim()], "evicted")
        # >= every generation of its blocks (staleness itself is tracked by the reused flag, so an issuer's value
        # only has to match what readers present)
        handle.generation = self._blocks.epoch if generation is None else generation
        self._handles[handle.handle_id] = handle
        self._evictable.admit(handle.handle_id)
        self._expiry.push(handle.expiry, handle)
        if conversation_id is not None:
            self._conversations.setdefault(conversation_id, set()).add(handle.handle_id)
        self._counts["retains"] += 1
        return self._wire(handle, now, ttl)

    def _renew(self, handle_id: str, ttl: float) -> KVHandle:
        now = self._clock()
        handle = self._live(handle_id, now, count=False)
        handle.expiry = self.terms.renewed(handle.expiry, now, ttl)  # the heap entry stays: re-pushed when due
        self._order_of(handle).touch(handle_id)
        self._counts["renewals"] += 1
        return self._wire(handle, now)

    def _release(self, handle_ids: list[str]) -> int:
        released = 0
        for handle_id in handle_ids:
            handle = self._handles.get(handle_id)
            if handle is not None:
                self._end(handle, "released")
                released += 1
        return released

    def _sweep(self, now: float) -> int:
        for _, record in self._claim_deadlines.pop_due(now):
            del self._claims[record.claim.claim_id]
            record.open = False
            self._counts["claim_timeouts"] += 1
            self._close_claim(record, "timed out")
        expired = 0
        for _, handle in self._expiry.pop_due(now):
            handle.heaped = False
            if handle.demote is not None:  # being demoted: its tier expiry is pushed when the copy lands
                continue
            if not self.terms.expired(handle.expiry, now):  # renewed since it was pushed
                self._expiry.push(handle.expiry, handle)
                handle.heaped = True
            else:
                self._expire(handle)
                expired += 1
        return expired

    def _live(self, handle_id: str, now: float, *, count: bool) -> RetainedRecord:
        handle = self._handles.get(handle_id)
        if handle is None:
            reason, _, tier = self._ended_handles.get(handle_id, "unknown").partition("@")
            self._refuse(reason, handle_id, "" if reason != "unknown" else "never issued here, or ended long ago",
                         count=count, tier=tier)
        if handle.demote is None and self.terms.expired(handle.expiry, now):
            self._expire(handle)
        if handle.ended is not None:
            self._refuse(handle.ended, handle_id, count=count, tier=self._end_tier(handle, handle.ended))
        if handle.demote is not None:
            self._refuse("demoting", handle_id, "retry in a moment", count=count)
        return handle

    def _refuse(self, reason: str, handle_id: str, detail: str = "", *, count: bool = True,
                tier: str = "") -> NoReturn:
        """Refuse by name; ``tier``: the tier whose end it was (a miss of that tier)."""
        if count:
            self._refusals[reason] += 1
            if tier in self._tiers:
                self._tiers[tier].counts["misses"] += 1
        raise UNAVAILABLE[reason](handle_id, detail)

    def _tampered(self, handle_id: str, detail: str) -> NoReturn:
        self._refusals["tampered"] += 1
        raise TamperedHandleError(handle_id, detail)

    def _end(self, handle: RetainedRecord, reason: str) -> None:
        """The handle can no longer be claimed; its blocks go now, or when its last read in flight (or its
        demotion copy) ends."""
        handle.ended = reason  # before discard(): a compaction asks whether it is alive
        handle.demote = None
        del self._handles[handle.handle_id]
        self._evictable.remove(handle.handle_id)
        self._awaiting.pop(handle.handle_id, None)
        if handle.tier != HOT_TIER:
            self._tiers[handle.tier].evictable.remove(handle.handle_id)
        tier = self._end_tier(handle, reason)
        if tier:
            self._tiers[tier].counts[reason] += 1
        if handle.heaped:
            self._expiry.discard()
        # a tier's end names the tier (its misses count there): "reason@tier"
        remember_end(self._ended_handles, handle.handle_id, f"{reason}@{tier}" if tier else reason,
                     self._tombstone_cap)
        if handle.conversation_id is not None:
            ids = self._conversations.get(handle.conversation_id)
            if ids is not None:
                ids.discard(handle.handle_id)
                if not ids:
                    del self._conversations[handle.conversation_id]
        self._counts[reason] += 1
        self._ends.append(handle.request_id)
        if handle.claims:
            self._draining += 1
        elif self._copying.get(handle.handle_id) is not handle:  # a copy in flight reads its source
            self._drop_holds(handle)

    def _leaving_hot(self) -> list[RetainedRecord]:
        """Hot handles being copied into the host tier or waiting for room there: their blocks count as gone."""
        return [h for h in (*self._copying.values(), *self._awaiting.values()) if h.tier == HOT_TIER]

    def _release_hot(self, handle: RetainedRecord) -> None:
        self._released.append(handle.request_id)
        freed = self._blocks.release(handle)
        self._pending += freed
        self._counts["freed_blocks"] += len(freed)

    def _wire(self, handle: RetainedRecord, now: float, ttl_left: float | None = None) -> KVHandle:
        if ttl_left is None:
            ttl_left = max(0.0, handle.expiry - now)
        ttl_left += self._ttl_after[handle.tier]  # its whole life: RetentionTerms.handle_ttl
        issued_at = self._wall_clock()
        return KVHandle(engine_id=self.engine_id, request_id=handle.request_id, host=self.host, port=self.port,
                        block_ids=handle.block_ids, num_tokens=handle.num_tokens, expiry_time=issued_at + ttl_left,
                        tp_size=handle.tp_size, handle_id=handle.handle_id, generation=handle.generation,
                        block_size=handle.block_size, digests=handle.digests, issued_at=issued_at, ttl_s=ttl_left,
                        ranks=self.ranks if handle.tp_size > 1 else (), cache_dtype=self.cache_dtype,
                        read_mode="use_once" if handle.once else "multi_read")
