"""The ledger's host tier: demotion instead of an end by TTL or budget, the copy's completion before the hot blocks
go back, the tier's own TTL, capacity and eviction order, and claims of a demoted retention.

A fake copier records each demotion order; the test completes (or fails) it, as ``transfer.HostTier`` would once
its copy landed. The real copy over NIXL is in ``test_host_tier.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvshuttle.policy import KVHandle
from kvshuttle.retention import (
    ClaimLostError,
    Demotion,
    HandleDemotingError,
    HandleExpiredError,
    HandleReleasedError,
    HandleTierEvictedError,
    HandleTierExpiredError,
    HandleTierFullError,
    RetentionArgumentError,
    RetentionLedger,
    RetentionTerms,
    StaleHandleError,
    TierTerms,
    UnknownHandleError,
)
from test_retention import Clock

BS = 16
TTL, TIER_TTL = 10.0, 100.0


@dataclass
class Env:
    ledger: RetentionLedger
    clock: Clock
    orders: list[Demotion] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def land(self, ok: bool = True) -> Demotion:
        order = self.orders.pop(0)
        order.done(ok)
        return order

    def tier(self) -> dict[str, Any]:
        metrics: dict[str, Any] = self.ledger.metrics()["tiers"]["host"]
        return metrics


def make(capacity: int = 8, **kwargs: Any) -> Env:
    clock, orders, freed, released = Clock(), list[Demotion](), list[int](), list[str]()
    ledger = RetentionLedger("decode-0", "10.0.0.2", 5600, clock=clock, wall_clock=lambda: 1.7e9,
                             terms=RetentionTerms(ttl_s=TTL, tier=TierTerms(capacity, ttl_s=TIER_TTL)),
                             bytes_per_block=1000, on_free=freed.extend, on_release=released.append,
                             on_demote=orders.append, **kwargs)
    return Env(ledger, clock, orders, freed, released)


def retain(env: Env, blocks: list[int], request: str = "req", tag: str = "") -> KVHandle:
    digests = [f"{tag}{i}:{b}".encode().ljust(16, b".") for i, b in enumerate(blocks)]
    return env.ledger.retain(request, blocks, digests, len(blocks) * BS, BS)


def read(env: Env, handle: KVHandle, *, packed: bool = True) -> Any:
    claim = env.ledger.claim(handle.handle_id, handle.generation)
    if packed:
        env.ledger.claimed_slots(claim.claim_id)
    return env.ledger.complete(claim.claim_id)


# ------------------------------------------------------------------------------------------------ terms
def test_tier_terms_are_checked_and_lengthen_the_handle() -> None:
    for bad in ({"capacity_blocks": 0}, {"capacity_blocks": True}, {"capacity_blocks": 4, "ttl_s": 0},
                {"capacity_blocks": 4, "eviction": "mru"}, {"capacity_blocks": 4, "name": "ssd"}, {},
                {"capacity_blocks": 4, "capacity_bytes": 4096}, {"capacity_bytes": 0}):
        with pytest.raises(RetentionArgumentError):
            TierTerms(**bad)
    with pytest.raises(RetentionArgumentError, match="tier must be None or a TierTerms"):
        RetentionTerms(tier=4)  # type: ignore[arg-type]
    terms = RetentionTerms(ttl_s=TTL, tier=TierTerms(4, ttl_s=TIER_TTL))
    assert terms.handle_ttl() == TTL + TIER_TTL and terms.handle_ttl(5.0) == 5.0 + TIER_TTL
    assert RetentionTerms(ttl_s=TTL).handle_ttl() == TTL
    assert RetentionTerms().overridden(tier=TierTerms(2)).tier == TierTerms(2)
    with pytest.raises(RetentionArgumentError, match="needs on_demote"):
        RetentionLedger("e", "h", 1, terms=terms)
    with pytest.raises(RetentionArgumentError, match="no tier"):
        RetentionLedger("e", "h", 1).demote("x")
    env = make()
    assert retain(env, [1]).ttl_s == TTL + TIER_TTL  # the handle names its whole life


# --------------------------------------------------------------------------------------------- demotion
def test_expiry_demotes_and_the_hot_blocks_go_back_only_when_the_copy_landed() -> None:
    env = make()
    handle = retain(env, [7, 3, 5])
    env.clock.now += TTL
    assert env.ledger.sweep() == 1
    (order,) = env.orders
    assert order.block_ids == (7, 3, 5) and len(set(order.slots)) == 3
    assert env.freed == [] and env.released == []  # the copy reads them
    with pytest.raises(HandleDemotingError):
        env.ledger.claim(handle.handle_id, handle.generation)
    assert env.ledger.metrics()["retained_blocks"] == 3 and env.tier()["copying"] == 1
    env.land()
    assert sorted(env.freed) == [3, 5, 7] and env.released == ["req"]
    claim = env.ledger.claim(handle.handle_id, handle.generation, [7, 3])
    assert claim.tier == "host" and claim.block_ids == (7, 3)
    assert env.ledger.claimed_slots(claim.claim_id) == order.slots[:2]
    env.ledger.complete(claim.claim_id)
    tier = env.tier()
    assert (tier["blocks"], tier["bytes"], tier["demotions"], tier["reads"], tier["live_handles"]) == (3, 3000, 1, 1, 1)
    assert env.ledger.metrics()["retained_blocks"] == 0
    renewed = env.ledger.get(handle.handle_id)
    assert renewed is not None and renewed.ttl_s == TIER_TTL and renewed.generation == handle.generation


def test_a_tier_claim_read_directly_is_refused_at_complete() -> None:
    env = make()
    handle = retain(env, [1, 2])
    env.ledger.demote(handle.handle_id)
    env.land()
    with pytest.raises(StaleHandleError, match="not in the blocks read by id"):
        read(env, handle, packed=False)
    assert env.ledger.metrics()["refusals"]["unpacked_tier_read"] == 1
    read(env, handle)  # the handle itself is fine
    hot = retain(env, [4], request="r2")
    assert env.ledger.claimed_slots(env.ledger.claim(hot.handle_id, hot.generation).claim_id) is None


def test_a_tier_claim_names_its_slots_and_a_read_of_them_direct_is_confirmed() -> None:
    env = make()
    handle = retain(env, [1, 2, 3])
    env.ledger.demote(handle.handle_id)
    (order,) = env.orders
    env.land()
    claim = env.ledger.claim(handle.handle_id, handle.generation, [1, 2])
    assert claim.slots == order.slots[:2]  # what a reader reads direct (the owner packs nothing)
    env.ledger.complete(claim.claim_id, tier_read=True)
    assert env.tier()["reads"] == 1 and not env.ledger.metrics()["refusals"].get("unpacked_tier_read")
    hot = retain(env, [4], request="r2")
    assert env.ledger.claim(hot.handle_id, hot.generation).slots == ()


def test_budget_eviction_demotes_instead_of_ending() -> None:
    env = make(budget_blocks=4)
    first = retain(env, [1, 2, 3], "r1")
    second = retain(env, [4, 5, 6], "r2")  # the budget evicts r1: into the tier, its blocks count as gone
    assert [o.block_ids for o in env.orders] == [(1, 2, 3)] and env.freed == []
    env.land()
    assert sorted(env.freed) == [1, 2, 3] and env.ledger.metrics()["retained_blocks"] == 3
    read(env, first)
    read(env, second)
    assert env.ledger.metrics()["evictions"] == 0 and env.tier()["demotions"] == 1


def test_a_full_tier_ends_the_retention_with_a_named_reason() -> None:
    env = make(capacity=2)
    handle = retain(env, [1, 2, 3])
    env.clock.now += TTL
    env.ledger.sweep()
    assert env.orders == [] and sorted(env.freed) == [1, 2, 3]
    with pytest.raises(HandleTierFullError, match="tier_full"):
        env.ledger.claim(handle.handle_id, handle.generation)
    tier = env.tier()
    assert (tier["full"], tier["misses"], tier["blocks"]) == (1, 1, 0)
    explicit = retain(env, [4, 5, 6], "r2")  # asked, not forced: stays hot
    assert env.ledger.demote(explicit.handle_id) is False
    assert read(env, explicit).tier == "hot"


def test_a_tier_whose_reads_pin_too_much_evicts_nothing_for_a_demotion_that_cannot_fit() -> None:
    """A resident being read cannot go: when the others could not make room, none of them is evicted for a
    retention that ends with ``tier_full`` anyway (at TP > 1 such an eviction ends them on every rank)."""
    env = make(capacity=4)
    a, b = retain(env, [1, 2], "a", "a"), retain(env, [3, 4], "b", "b")
    for handle in (a, b):
        env.ledger.demote(handle.handle_id)
        env.land()
    pin = env.ledger.claim(a.handle_id, a.generation)
    c = retain(env, [5, 6, 7], "c", "c")
    env.clock.now += TTL
    env.ledger.sweep()
    assert env.orders == [] and (env.tier()["full"], env.tier()["evictions"]) == (1, 0)
    assert read(env, b).tier == "host"
    with pytest.raises(HandleTierFullError):
        env.ledger.claim(c.handle_id, c.generation)
    env.ledger.abort(pin.claim_id)
    d = retain(env, [8, 9, 10], "d", "d")  # with a's read over, both residents can make room
    env.ledger.demote(d.handle_id)
    env.land()
    assert (env.tier()["evictions"], env.tier()["blocks"]) == (2, 3)


def test_the_tier_evicts_in_its_own_order() -> None:
    env = make(capacity=4)
    a, b = retain(env, [1, 2], "a", "a"), retain(env, [3, 4], "b", "b")
    for handle in (a, b):
        env.ledger.demote(handle.handle_id)
        env.land()
    read(env, a)  # a read touches a: b is now the least recently used of the tier
    c = retain(env, [5, 6], "c", "c")
    env.ledger.demote(c.handle_id)
    env.land()
    with pytest.raises(HandleTierEvictedError):
        env.ledger.claim(b.handle_id, b.generation)
    read(env, a)
    read(env, c)
    assert (env.tier()["evictions"], env.tier()["blocks"]) == (1, 4)


def test_the_tier_ttl_counts_from_the_landing() -> None:
    env = make()
    handle = retain(env, [1, 2])
    env.clock.now += TTL
    env.ledger.sweep()
    env.land()
    env.clock.now += TIER_TTL - 1
    assert env.ledger.sweep() == 0
    read(env, handle)
    env.clock.now += 1
    assert env.ledger.sweep() == 1
    with pytest.raises(HandleTierExpiredError):
        env.ledger.claim(handle.handle_id, handle.generation)
    assert (env.tier()["expirations"], env.tier()["blocks"], env.tier()["misses"]) == (1, 0, 1)


def test_release_ends_a_retention_on_every_tier() -> None:
    env = make()
    landed, copying = retain(env, [1, 2], "r1", "x"), retain(env, [3, 4], "r2", "y")
    env.ledger.demote(landed.handle_id)
    env.land()
    env.ledger.demote(copying.handle_id)
    assert env.ledger.release(landed.handle_id) and env.tier()["blocks"] == 2  # only the copy's slots left
    assert env.ledger.release(copying.handle_id)
    assert sorted(env.freed) == [1, 2]  # the copy in flight still reads blocks 3 and 4
    env.land()
    assert sorted(env.freed) == [1, 2, 3, 4] and env.released == ["r1", "r2"] and env.tier()["blocks"] == 0
    for handle in (landed, copying):
        with pytest.raises(HandleReleasedError):
            env.ledger.claim(handle.handle_id, handle.generation)


def test_a_demotion_waits_for_the_reads_in_flight() -> None:
    env = make()
    handle = retain(env, [1, 2])
    claim = env.ledger.claim(handle.handle_id, handle.generation)
    assert env.ledger.demote(handle.handle_id) is True
    env.clock.now += TTL  # the hot TTL ends meanwhile too: still one demotion, after the read
    env.ledger.sweep()
    assert env.orders == [] and env.ledger.metrics()["pinned_blocks"] == 2
    with pytest.raises(HandleDemotingError):
        env.ledger.claim(handle.handle_id, handle.generation)
    assert env.ledger.complete(claim.claim_id).tier == "hot"
    assert len(env.orders) == 1 and env.freed == []
    env.land()
    assert sorted(env.freed) == [1, 2]
    read(env, handle)


def test_a_failed_copy_ends_a_forced_demotion_and_keeps_an_asked_one_hot() -> None:
    env = make()
    forced, asked = retain(env, [1, 2], "r1", "x"), retain(env, [3, 4], "r2", "y")
    env.clock.now += TTL - 1
    env.ledger.demote(asked.handle_id)
    env.land(ok=False)
    assert read(env, asked).tier == "hot"
    env.clock.now += 1
    assert env.ledger.sweep() == 2  # both expire now: the asked one was demoted and kept, not renewed
    env.land(ok=False)
    env.land(ok=False)
    for handle in (forced, asked):
        with pytest.raises(HandleExpiredError):
            env.ledger.claim(handle.handle_id, handle.generation)
    assert sorted(env.freed) == [1, 2, 3, 4] and env.tier()["failed_copies"] == 3 and env.tier()["blocks"] == 0
    assert env.ledger.demoted(forced.handle_id, True) is False  # reported twice


def test_hot_block_ids_reused_never_touch_a_landed_retention() -> None:
    env = make()
    handle = retain(env, [1, 2])
    env.ledger.demote(handle.handle_id)
    env.land()
    env.ledger.block_freed(1)  # the allocator hands the blocks to another request...
    other = retain(env, [2, 1], "r2", "z")  # ...which is retained in turn
    read(env, handle)
    read(env, other)
    assert env.ledger.metrics()["stale_handles"] == 0


def test_a_hot_block_taken_back_during_the_copy_makes_the_retention_stale() -> None:
    env = make()
    handle = retain(env, [1, 2])
    env.ledger.demote(handle.handle_id)
    env.ledger.block_freed(2)  # the copy may have read other KV
    env.land()
    with pytest.raises(StaleHandleError):
        env.ledger.claim(handle.handle_id, handle.generation)
    assert env.tier()["blocks"] == 0 and env.freed == [1]


WRONG: list[Any] = [None, 3, 2.5, b"x", ["a"], {"a": 1}]


def test_the_tier_entry_points_refuse_wrong_arguments_and_change_nothing() -> None:
    env = make()
    handle = retain(env, [1, 2])
    env.ledger.claim(handle.handle_id, handle.generation)
    before = env.ledger.metrics()
    for value in WRONG:
        for call in (env.ledger.demote, lambda v: env.ledger.demoted(v, True), env.ledger.claimed_slots):
            with pytest.raises(RetentionArgumentError):
                call(value)
    assert env.ledger.metrics() == before and env.orders == []
    with pytest.raises(UnknownHandleError):
        env.ledger.demote("never-issued")
    with pytest.raises(ClaimLostError):
        env.ledger.claimed_slots("never-granted")
    assert env.ledger.demoted("never-copied", True) is False


def test_an_asked_demotion_without_room_after_its_reads_keeps_the_retention_hot_and_swept() -> None:
    env = make(capacity=2)
    handle = retain(env, [1, 2, 3])
    claim = env.ledger.claim(handle.handle_id, handle.generation)
    assert env.ledger.demote(handle.handle_id) is True  # waits for the read
    env.clock.now += TTL
    assert env.ledger.sweep() == 0  # its heap entry is popped while it waits
    env.ledger.complete(claim.claim_id)  # no room for 3 blocks in 2 slots: it stays hot...
    assert env.orders == [] and env.freed == []
    assert env.ledger.sweep() == 1  # ...and is swept again: its TTL ran out, and the tier is still too small
    with pytest.raises(HandleTierFullError):
        env.ledger.claim(handle.handle_id, handle.generation)
    assert sorted(env.freed) == [1, 2, 3]


def test_on_release_fires_when_the_hot_blocks_go_and_on_end_when_the_retention_ends() -> None:
    clock, orders, released, ended = Clock(), list[Demotion](), list[str](), list[str]()
    ledger = RetentionLedger("decode-0", "10.0.0.2", 5600, clock=clock, on_release=released.append,
                             on_end=ended.append, on_demote=orders.append,
                             terms=RetentionTerms(ttl_s=TTL, tier=TierTerms(4, ttl_s=TIER_TTL)))
    digests = [b"a" * 16, b"b" * 16]
    demoted, hot = ledger.retain("r1", [1, 2], digests, 32, BS), ledger.retain("r2", [3, 4], digests, 32, BS)
    ledger.demote(demoted.handle_id)
    orders.pop().done(True)
    assert released == ["r1"] and ended == []  # vLLM may free r1's blocks; the retention lives on
    ledger.release(hot.handle_id)
    assert released == ["r1", "r2"] and ended == ["r2"]
    clock.now += TIER_TTL
    ledger.sweep()
    assert released == ["r1", "r2"] and ended == ["r2", "r1"]  # blocks given back once; ended once
