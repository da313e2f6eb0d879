"""The ledger's disk tier: a retention leaving the host tier (its TTL there, or that tier's eviction) moves on to
disk instead of ending; the host slots go back only once the file is written; the disk tier's own terms (bytes,
TTL, eviction order); its file is discarded when the retention ends on every path.

The copiers are recorders: the test completes (or fails) each order, as ``transfer.HostTier`` and
``transfer.DiskTier`` would once their copy landed. The real files over NIXL are in ``test_disk_tier.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvshuttle.policy import KVHandle
from kvshuttle.retention import (
    Demotion,
    HandleDemotingError,
    HandleReleasedError,
    HandleTierEvictedError,
    HandleTierExpiredError,
    HandleTierFullError,
    HandleTierLostError,
    RetentionArgumentError,
    RetentionLedger,
    RetentionTerms,
    TierTerms,
)
from test_retention import Clock

BS, BLOCK_BYTES = 16, 1000
TTL, HOST_TTL, DISK_TTL = 10.0, 100.0, 1000.0


@dataclass
class Env:
    ledger: RetentionLedger
    clock: Clock
    orders: list[Demotion] = field(default_factory=list)
    discards: list[str] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)

    def land(self, target: str, ok: bool = True) -> Demotion:
        order = next(o for o in self.orders if o.target == target)
        self.orders.remove(order)
        order.done(ok)
        return order

    def tier(self, name: str) -> dict[str, Any]:
        metrics: dict[str, Any] = self.ledger.metrics()["tiers"][name]
        return metrics

    def to_host(self, handle: KVHandle) -> None:
        assert self.ledger.demote(handle.handle_id) is True
        self.land("host")

    def to_disk(self, handle: KVHandle) -> Demotion:
        """Hot -> host -> disk: the host TTL runs out, the write lands."""
        self.to_host(handle)
        self.clock.now += HOST_TTL
        self.ledger.sweep()
        return self.land("disk")


def make(host_blocks: int = 8, disk_bytes: int = 8 * BLOCK_BYTES) -> Env:
    clock, orders, discards, freed = Clock(), list[Demotion](), list[str](), list[int]()
    terms = RetentionTerms(ttl_s=TTL, tier=TierTerms(host_blocks, HOST_TTL),
                           disk=TierTerms(ttl_s=DISK_TTL, name="disk", capacity_bytes=disk_bytes))
    ledger = RetentionLedger("decode-0", "10.0.0.2", 5600, clock=clock, wall_clock=lambda: 1.7e9, terms=terms,
                             claim_timeout_s=10 * DISK_TTL,
                             bytes_per_block=BLOCK_BYTES, on_free=freed.extend, on_demote=orders.append,
                             on_spill=orders.append, on_discard=discards.append)
    return Env(ledger, clock, orders, discards, freed)


def retain(env: Env, blocks: list[int], request: str = "req") -> KVHandle:
    digests = [f"{i}:{b}:{request}".encode().ljust(16, b".") for i, b in enumerate(blocks)]
    return env.ledger.retain(request, blocks, digests, len(blocks) * BS, BS)


def refusal(env: Env, handle: KVHandle) -> type[Exception]:
    with pytest.raises(Exception) as refused:
        env.ledger.claim(handle.handle_id, handle.generation)
    return type(refused.value)


def test_disk_terms_are_checked_counted_in_bytes_and_lengthen_the_handle() -> None:
    disk = TierTerms(ttl_s=DISK_TTL, name="disk", capacity_bytes=4500)
    with pytest.raises(RetentionArgumentError, match="give tier too"):
        RetentionTerms(disk=disk)
    with pytest.raises(RetentionArgumentError, match="named 'disk'"):
        RetentionTerms(tier=TierTerms(4), disk=TierTerms(4))
    with pytest.raises(RetentionArgumentError, match="named 'host'"):
        RetentionTerms(tier=disk)
    terms = RetentionTerms(ttl_s=TTL, tier=TierTerms(4, HOST_TTL), disk=disk)
    assert terms.handle_ttl() == TTL + HOST_TTL + DISK_TTL and terms.tiers == (TierTerms(4, HOST_TTL), disk)
    with pytest.raises(RetentionArgumentError, match="on_spill and on_discard"):
        RetentionLedger("e", "h", 1, terms=terms, bytes_per_block=BLOCK_BYTES, on_demote=print)
    with pytest.raises(RetentionArgumentError, match="bytes_per_block"):  # bytes mean nothing without it
        RetentionLedger("e", "h", 1, terms=terms, on_demote=print, on_spill=print, on_discard=print)
    with pytest.raises(RetentionArgumentError, match="hold no block"):
        RetentionLedger("e", "h", 1, terms=terms, bytes_per_block=5000, on_demote=print, on_spill=print,
                        on_discard=print)
    env = make(disk_bytes=4500)
    assert env.tier("disk")["capacity_blocks"] == 4 and env.tier("disk")["capacity_bytes"] == 4000
    assert retain(env, [1]).ttl_s == TTL + HOST_TTL + DISK_TTL  # the handle names its whole life


def test_the_host_ttl_moves_a_retention_to_disk_and_its_slots_go_back_only_once_written() -> None:
    env = make()
    handle = retain(env, [7, 3, 9])
    env.to_host(handle)
    reading = env.ledger.claim(handle.handle_id, handle.generation)
    host_slots = env.ledger.claimed_slots(reading.claim_id)
    assert host_slots is not None
    env.clock.now += HOST_TTL
    env.ledger.sweep()  # the read is still open: the move waits for it
    assert not [o for o in env.orders if o.target == "disk"]
    env.ledger.complete(reading.claim_id)
    spill = next(o for o in env.orders if o.target == "disk")
    assert spill.block_ids == host_slots and len(spill.slots) == 3 and spill.handle_id == handle.handle_id
    assert env.tier("host")["blocks"] == 3 and env.tier("disk")["copying"] == 1  # held while the file is written
    assert refusal(env, handle) is HandleDemotingError
    env.land("disk")
    assert (env.tier("host")["blocks"], env.tier("disk")["blocks"], env.tier("disk")["bytes"]) == (0, 3, 3000)
    claim = env.ledger.claim(handle.handle_id, handle.generation)
    assert claim.tier == "disk" and env.ledger.claimed_tier(claim.claim_id) == ("disk", handle.handle_id)
    assert env.ledger.claimed_slots(claim.claim_id) == (0, 1, 2)  # the file's positions
    env.ledger.complete(claim.claim_id)
    assert env.tier("disk")["reads"] == 1 and env.tier("disk")["demotions"] == 1 and not env.discards
    env.clock.now += DISK_TTL - 1
    env.ledger.sweep()
    assert env.ledger.get(handle.handle_id) is not None  # the disk TTL counts from the landing
    env.clock.now += 1
    env.ledger.sweep()
    assert refusal(env, handle) is HandleTierExpiredError and env.discards == [handle.handle_id]
    disk = env.tier("disk")
    assert (disk["expirations"], disk["misses"], disk["blocks"]) == (1, 1, 0) and env.tier("host")["misses"] == 0


def test_a_host_eviction_moves_the_victim_to_disk_and_the_new_demotion_waits_for_its_file() -> None:
    env = make(host_blocks=4)
    first, second = retain(env, [1, 2, 3], "first"), retain(env, [4, 5, 6], "second")
    env.to_host(first)
    assert env.ledger.demote(second.handle_id) is True  # the host tier's victim (first) goes to disk first
    spill = next(o for o in env.orders if o.target == "disk")
    assert spill.handle_id == first.handle_id and not [o for o in env.orders if o.target == "host"]
    assert refusal(env, second) is HandleDemotingError and 4 not in env.freed  # still hot, waiting for room
    env.land("disk")
    demotion = env.land("host")  # the room came back: second's copy started into first's old slots
    assert sorted(demotion.slots) == sorted(spill.block_ids)
    assert sorted(env.freed) == [1, 2, 3, 4, 5, 6]
    assert env.ledger.claim(first.handle_id, first.generation).tier == "disk"
    assert env.ledger.claim(second.handle_id, second.generation).tier == "host"


def test_the_disk_tier_is_bounded_by_its_bytes_and_evicts_in_its_own_order() -> None:
    env = make(disk_bytes=5 * BLOCK_BYTES + 999)
    first = retain(env, [1, 2, 3], "first")
    env.to_disk(first)
    second = retain(env, [4, 5, 6], "second")  # (retained after: the clock moved on)
    env.to_disk(second)  # 3 + 3 blocks in 5: the first goes
    assert refusal(env, first) is HandleTierEvictedError and env.discards == [first.handle_id]
    disk = env.tier("disk")
    assert (disk["blocks"], disk["evictions"], disk["misses"], disk["capacity_blocks"]) == (3, 1, 1, 5)
    big = retain(env, list(range(10, 16)), "big")  # 6 blocks never fit in 5
    env.to_host(big)
    env.clock.now += HOST_TTL
    env.ledger.sweep()
    assert refusal(env, big) is HandleTierFullError and env.tier("disk")["full"] == 1
    assert env.tier("host")["blocks"] == 0 and env.ledger.get(second.handle_id) is not None


def test_release_removes_the_file_even_during_its_write() -> None:
    env = make()
    landed = retain(env, [1, 2], "landed")
    env.to_disk(landed)
    assert env.ledger.release(landed.handle_id) and env.discards == [landed.handle_id]
    writing = retain(env, [3, 4], "writing")
    env.to_host(writing)
    env.clock.now += HOST_TTL
    env.ledger.sweep()
    assert env.ledger.close_conversation("none") == 0 and env.ledger.release(writing.handle_id)
    assert env.tier("host")["blocks"] == 2 and env.discards == [landed.handle_id]  # the write reads them still
    env.land("disk")
    assert env.discards == [landed.handle_id, writing.handle_id]
    assert (env.tier("host")["blocks"], env.tier("disk")["blocks"]) == (0, 0)
    assert refusal(env, writing) is HandleReleasedError


def test_a_failed_write_ends_the_retention_and_removes_what_was_written() -> None:
    env = make()
    handle = retain(env, [5, 6])
    env.to_host(handle)
    env.clock.now += HOST_TTL
    env.ledger.sweep()
    assert not env.discards
    env.land("disk", ok=False)  # a full disk
    assert refusal(env, handle) is HandleTierExpiredError and env.discards == [handle.handle_id]
    assert env.tier("disk")["failed_copies"] == 1 and env.tier("host")["blocks"] == 0


def test_a_lost_file_ends_the_retention_by_name_and_is_discarded_when_its_read_ends() -> None:
    env = make()
    handle = retain(env, [8, 9])
    env.to_disk(handle)
    claim = env.ledger.claim(handle.handle_id, handle.generation)
    assert env.ledger.tier_lost(claim.claim_id) is True and env.ledger.tier_lost(claim.claim_id) is False
    assert refusal(env, handle) is HandleTierLostError and not env.discards  # its read is still open
    env.ledger.abort(claim.claim_id)
    assert env.discards == [handle.handle_id]
    assert (env.tier("disk")["lost"], env.tier("disk")["misses"], env.tier("disk")["blocks"]) == (1, 1, 0)
    hot = retain(env, [1])
    assert env.ledger.tier_lost(env.ledger.claim(hot.handle_id, hot.generation).claim_id) is False
