"""Boundary and behaviour tests of the decode-side retention ledger, on a fake clock."""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvshuttle.errors import KVShuttleError
from kvshuttle.policy import KVHandle
from kvshuttle.retention import (
    BudgetExceededError,
    ClaimLostError,
    HandleConsumedError,
    HandleEvictedError,
    HandleExpiredError,
    HandleInUseError,
    HandleReleasedError,
    HandleUnavailableError,
    RetentionArgumentError,
    RetentionLedger,
    StaleHandleError,
    TamperedHandleError,
    UnknownHandleError,
)
from kvshuttle.retention._heap import COMPACT_MIN, DeadlineHeap

BS = 16
WALL0 = 1.7e9  # decode's wall clock: far from the monotonic one, as in real life


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Owner:
    """The owner's allocator as the ledger sees it: records every block handed back, never one already free."""

    freed: list[int] = field(default_factory=list)  # in order, over the test
    free: set[int] = field(default_factory=set)  # free now (retain() below takes blocks out again)

    def __call__(self, block_ids: list[int]) -> None:
        assert not set(block_ids) & self.free, f"blocks {block_ids} freed twice"
        self.freed.extend(block_ids)
        self.free.update(block_ids)


@dataclass
class Env:
    ledger: RetentionLedger
    clock: Clock
    wall: Clock
    owner: Owner


def make(**kwargs: Any) -> Env:
    clock, wall, owner = Clock(), Clock(WALL0), Owner()
    ledger = RetentionLedger("decode-0", "10.0.0.2", 5600, clock=clock, wall_clock=wall, on_free=owner, **kwargs)
    return Env(ledger, clock, wall, owner)


def digests(blocks: list[int], tag: str = "") -> list[bytes]:
    return [f"{tag}{i}:{b}".encode().ljust(16, b".") for i, b in enumerate(blocks)]


def retain(env: Env, blocks: list[int], *, tokens: int | None = None, tag: str = "", **kwargs: Any) -> KVHandle:
    tokens = len(blocks) * BS if tokens is None else tokens
    env.owner.free.difference_update(blocks)
    return env.ledger.retain("req", blocks, digests(blocks, tag), tokens, BS, **kwargs)


def advance(env: Env, dt: float) -> None:
    env.clock.now += dt
    env.wall.now += dt


# ------------------------------------------------------------------------------------------------ import
def test_imports_without_torch_cuda_or_native() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'cupy') or name == 'kvshuttle._native':\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from kvshuttle.retention import RetentionLedger\n"
        "ledger = RetentionLedger('e', 'h', 1)\n"
        "ledger.retain('r', [0], [b'd'], 1, 16)\n"
        "assert not [m for m in sys.modules if m.startswith(('torch', 'cupy', 'kvshuttle._native'))]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------------------------- the handle
def test_retain_issues_a_complete_wire_handle() -> None:
    env = make(ttl_s=300.0)
    handle = env.ledger.retain("req-7", [5, 3, 9], digests([5, 3, 9]), 40, BS, tp_size=2, conversation_id="c")
    assert (handle.engine_id, handle.request_id, handle.host, handle.port) == ("decode-0", "req-7", "10.0.0.2", 5600)
    assert handle.block_ids == (5, 3, 9) and handle.digests == tuple(digests([5, 3, 9]))
    assert (handle.num_tokens, handle.block_size, handle.tp_size, handle.ttl_s) == (40, BS, 2, 300.0)
    assert handle.issued_at == WALL0 and handle.expiry_time == WALL0 + 300.0
    assert KVHandle.from_kv_transfer_params(handle.to_kv_transfer_params(), None) == handle
    ids = {retain(env, [20 + i]).handle_id for i in range(50)} | {handle.handle_id}
    assert len(ids) == 51 and min(len(i) for i in ids) >= 22  # >= 128 random bits, url-safe


def test_wire_fields_are_consistent_on_decode_wall_clock_despite_skew() -> None:
    env = make(ttl_s=480.0)
    env.wall.now = WALL0 + 0.123456789  # an awkward float
    handle = retain(env, [1])
    assert handle.issued_at + handle.ttl_s == handle.expiry_time
    advance(env, 100.0)
    now = env.ledger.get(handle.handle_id)
    assert now is not None and now.issued_at + now.ttl_s == now.expiry_time
    assert now.ttl_s == pytest.approx(380.0) and now.expiry_time == pytest.approx(handle.expiry_time)
    renewed = env.ledger.renew(handle.handle_id)
    assert renewed.issued_at + renewed.ttl_s == renewed.expiry_time and renewed.ttl_s == 480.0
    # Internally only the monotonic clock counts: a wall-clock step changes the wire view, not the expiry.
    env.wall.now += 10_000.0
    env.clock.now += 479.0
    assert env.ledger.claim(handle.handle_id, handle.generation)
    env.wall.now -= 50_000.0
    env.clock.now += 1.0
    with pytest.raises(HandleExpiredError):
        env.ledger.claim(handle.handle_id, handle.generation)


# -------------------------------------------------------------------------------------------------- TTL
def test_ttl_edge_is_exclusive_for_claims() -> None:
    env = make(ttl_s=10.0)
    handle = retain(env, [1, 2])
    env.clock.now = 100.0 + 10.0 - 1e-9
    claim = env.ledger.claim(handle.handle_id, handle.generation)
    env.ledger.abort(claim.claim_id)
    env.clock.now = 110.0  # exactly at expiry: expired
    with pytest.raises(HandleExpiredError):
        env.ledger.claim(handle.handle_id, handle.generation)
    assert sorted(env.owner.freed) == [1, 2] and env.ledger.metrics()["expirations"] == 1


def test_sweep_expires_at_exactly_the_deadline_and_not_before() -> None:
    env = make(ttl_s=10.0)
    handle = retain(env, [1])
    assert env.ledger.sweep(now=110.0 - 1e-9) == 0 and len(env.ledger) == 1
    assert env.ledger.sweep(now=110.0) == 1 and env.owner.freed == [1]
    with pytest.raises(HandleExpiredError):
        env.ledger.claim(handle.handle_id, handle.generation)
    assert env.ledger.sweep(now=1e9) == 0


def test_renew_extends_never_shortens_and_sweep_honours_it() -> None:
    env = make(ttl_s=100.0)
    handle = retain(env, [1])
    assert env.ledger.renew(handle.handle_id, ttl_s=1.0).ttl_s == 100.0  # no shortening
    advance(env, 90.0)
    renewed = env.ledger.renew(handle.handle_id)  # now 190 -> expiry 290
    assert renewed.ttl_s == 100.0 and renewed.expiry_time == env.wall.now + 100.0
    assert env.ledger.sweep(now=200.0) == 0 and len(env.ledger) == 1  # the old deadline passed harmlessly
    advance(env, 99.0)
    env.ledger.abort(env.ledger.claim(handle.handle_id, handle.generation).claim_id)
    assert env.ledger.sweep(now=290.0) == 1 and env.owner.freed == [1]
    with pytest.raises(HandleExpiredError):
        env.ledger.renew(handle.handle_id)


def test_per_request_ttl_override() -> None:
    env = make(ttl_s=100.0)
    short, default = retain(env, [1], ttl_s=5.0), retain(env, [2])
    assert (short.ttl_s, default.ttl_s) == (5.0, 100.0)
    assert env.ledger.sweep(now=105.0) == 1 and env.owner.freed == [1]


def test_get_hides_expired_handles() -> None:
    env = make(ttl_s=10.0)
    handle = retain(env, [1])
    env.clock.now = 110.0
    assert env.ledger.get(handle.handle_id) is None and env.owner.freed == [1]
    assert env.ledger.get("nope") is None


# ---------------------------------------------------------------------------------------------- modes
def test_use_once_frees_on_first_completed_read() -> None:
    env = make(mode="use_once")
    handle = retain(env, [4, 5])
    claim = env.ledger.claim(handle.handle_id, handle.generation)
    assert env.owner.freed == []
    env.ledger.complete(claim.claim_id)
    assert sorted(env.owner.freed) == [4, 5]
    with pytest.raises(HandleConsumedError):
        env.ledger.claim(handle.handle_id, handle.generation)


def test_use_once_second_claim_refused_while_first_in_flight_and_abort_reopens() -> None:
    env = make(mode="use_once")
    handle = retain(env, [4])
    first = env.ledger.claim(handle.handle_id, handle.generation)
    with pytest.raises(HandleInUseError):
        env.ledger.claim(handle.handle_id, handle.generation)
    assert env.ledger.abort(first.claim_id) and not env.ledger.abort(first.claim_id)
    retry = env.ledger.claim(handle.handle_id, handle.generation)  # a failed read leaves the handle usable
    env.ledger.complete(retry.claim_id)
    assert env.owner.freed == [4] and env.ledger.metrics()["refusals"] == {"in_use": 1}


def test_multi_read_serves_retries_and_concurrent_readers_until_expiry() -> None:
    env = make(mode="multi_read", ttl_s=50.0)
    handle = retain(env, [4, 5])
    a = env.ledger.claim(handle.handle_id, handle.generation, reader="p0")
    b = env.ledger.claim(handle.handle_id, handle.generation, reader="p1")
    env.ledger.complete(a.claim_id)
    env.ledger.complete(b.claim_id)
    env.ledger.complete(env.ledger.claim(handle.handle_id, handle.generation).claim_id)
    assert env.owner.freed == [] and env.ledger.metrics()["hits"] == 3
    env.clock.now = 150.0
    with pytest.raises(HandleExpiredError):
        env.ledger.claim(handle.handle_id, handle.generation)


@pytest.mark.parametrize("mode", ["use_once", "multi_read"])
def test_two_threads_racing_for_a_use_once_handle_exactly_one_wins(mode: str) -> None:
    env = make(mode=mode)
    for round_ in range(40):
        handle = retain(env, [round_])
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def reader(handle: KVHandle = handle, barrier: threading.Barrier = barrier,
                   outcomes: list[str] = outcomes) -> None:
            barrier.wait()
            try:
                claim = env.ledger.claim(handle.handle_id, handle.generation)
            except (HandleInUseError, HandleConsumedError):
                outcomes.append("refused")
                return
            env.ledger.complete(claim.claim_id)
            outcomes.append("won")

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        expected = ["refused", "won"] if mode == "use_once" else ["won", "won"]
        assert sorted(outcomes) == expected, f"round {round_}"
    assert len(env.owner.freed) == (40 if mode == "use_once" else 0)


# --------------------------------------------------------------------------------------------- budget
def test_eviction_is_least_recently_touched_first() -> None:
    env = make(budget_blocks=3)
    a, b, c = retain(env, [1]), retain(env, [2]), retain(env, [3])
    env.ledger.renew(a.handle_id)  # touch: a is now the most recent, b the oldest
    retain(env, [4])
    assert env.owner.freed == [2]
    with pytest.raises(HandleEvictedError):
        env.ledger.claim(b.handle_id, b.generation)
    env.ledger.complete(env.ledger.claim(c.handle_id, c.generation).claim_id)  # a read touches too
    retain(env, [5])
    assert env.owner.freed == [2, 1]
    assert env.ledger.metrics()["evictions"] == 2 and env.ledger.metrics()["retained_blocks"] == 3


def test_eviction_never_takes_a_handle_with_a_read_in_flight() -> None:
    env = make(budget_blocks=2)
    a, b = retain(env, [1]), retain(env, [2])
    claim = env.ledger.claim(a.handle_id, a.generation)  # a is the oldest but pinned
    c = retain(env, [3])
    assert env.owner.freed == [2]
    env.ledger.claim(c.handle_id, c.generation)
    with pytest.raises(BudgetExceededError) as info:  # both remaining handles are being read: no room
        retain(env, [4])
    assert info.value.caller_frees == (4,) and env.ledger.retained_block_ids() == {1, 3}
    env.ledger.complete(claim.claim_id)
    retain(env, [4])  # a's read ended: a is evictable again
    assert env.owner.freed == [2, 1] and b.handle_id


def test_budget_refusal_evicts_nothing_and_is_never_exceeded() -> None:
    env = make(budget_blocks=4)
    a = retain(env, [1, 2])
    b = retain(env, [3])
    claims = [env.ledger.claim(h.handle_id, h.generation) for h in (a, b)]
    with pytest.raises(BudgetExceededError, match="budget of 4 blocks") as info:
        retain(env, [7, 8])  # 3 pinned + 2 > 4
    assert info.value.caller_frees == (7, 8) and info.value.reason == "budget"
    assert env.owner.freed == [] and len(env.ledger) == 2
    assert env.ledger.metrics()["refusals"] == {"budget": 1} and env.ledger.metrics()["retained_blocks"] == 3
    with pytest.raises(BudgetExceededError):
        make(budget_blocks=2).ledger.retain("big", [1, 2, 3], digests([1, 2, 3]), 48, BS)
    for claim in claims:
        env.ledger.complete(claim.claim_id)
    retain(env, [7, 8, 9])  # now a (2 blocks, the oldest) is evicted; b stays
    assert sorted(env.owner.freed) == [1, 2] and env.ledger.metrics()["retained_blocks"] == 4


def test_budget_in_bytes_and_shared_blocks_cost_nothing() -> None:
    env = make(budget_bytes=3 * 1000 + 999, bytes_per_block=1000)
    assert env.ledger.budget_blocks == 3
    turn1 = retain(env, [1, 2], tag="c")
    turn2 = retain(env, [1, 2, 3], tag="c")  # shares 1 and 2: one new block
    assert env.ledger.metrics()["retained_bytes"] == 3000 and env.owner.freed == []
    env.ledger.claim(turn1.handle_id, turn1.generation)
    env.ledger.claim(turn2.handle_id, turn2.generation)
    with pytest.raises(BudgetExceededError) as info:  # shared blocks are not the caller's to free
        retain(env, [1, 2, 3, 4], tag="c")
    assert info.value.caller_frees == (4,)


def test_expired_handles_go_before_live_ones_are_evicted() -> None:
    env = make(budget_blocks=2, ttl_s=10.0)
    retain(env, [1])
    advance(env, 5.0)
    live = retain(env, [2])
    advance(env, 5.0)  # the first one is due now
    retain(env, [3])
    assert env.owner.freed == [1] and env.ledger.metrics()["evictions"] == 0
    assert env.ledger.get(live.handle_id) is not None


# ---------------------------------------------------------------------------------------------- claims
def test_claim_timeout_unpins_and_complete_then_reports_the_read_lost() -> None:
    env = make(budget_blocks=1, claim_timeout_s=30.0)
    handle = retain(env, [1])
    claim = env.ledger.claim(handle.handle_id, handle.generation)
    assert claim.deadline == 130.0 and env.ledger.metrics()["pinned_blocks"] == 1
    env.ledger.sweep(now=130.0)
    assert env.ledger.metrics()["pinned_blocks"] == 0 and env.ledger.metrics()["claim_timeouts"] == 1
    retain(env, [2])  # unpinned: evictable again
    assert env.owner.freed == [1]
    with pytest.raises(ClaimLostError, match="timed out"):
        env.ledger.complete(claim.claim_id)


def test_complete_after_the_deadline_is_lost_even_without_a_sweep() -> None:
    env = make(claim_timeout_s=5.0)
    handle = retain(env, [1])
    claim = env.ledger.claim(handle.handle_id, handle.generation)
    env.clock.now += 5.0
    with pytest.raises(ClaimLostError):
        env.ledger.complete(claim.claim_id)
    with pytest.raises(ClaimLostError, match="timed out"):
        env.ledger.complete(claim.claim_id)
    with pytest.raises(ClaimLostError, match="never granted"):
        env.ledger.complete("bogus")
    assert env.ledger.metrics()["hits"] == 0


@pytest.mark.parametrize("tamper", ["generation", "ids", "order", "longer", "digest", "digest_count", "empty"])
def test_tampered_handles_are_refused_and_stay_valid(tamper: str) -> None:
    env = make()
    h = retain(env, [4, 5, 6])
    ids, digs, gen = list(h.block_ids), list(h.digests), h.generation
    if tamper == "generation":
        gen += 1
    elif tamper == "ids":
        ids[1] = 7
    elif tamper == "order":
        ids = [5, 4, 6]
    elif tamper == "longer":
        ids = [*ids, 8]
    elif tamper == "digest":
        digs[2] = b"x" * 16
    elif tamper == "digest_count":
        digs = digs[:2]
    else:
        ids = []
    with pytest.raises(TamperedHandleError, match="recompute"):
        env.ledger.claim(h.handle_id, gen, ids, digs)
    assert env.ledger.metrics()["refusals"] == {"tampered": 1}
    assert env.ledger.claim(h.handle_id, h.generation, h.block_ids, h.digests)


def test_a_prefix_of_the_blocks_may_be_claimed() -> None:
    env = make()
    h = retain(env, [4, 5, 6], tokens=40)
    claim = env.ledger.claim(h.handle_id, h.generation, [4, 5], h.digests[:2])
    assert claim.block_ids == (4, 5) and claim.num_tokens == 32
    assert env.ledger.claim(h.handle_id, h.generation).num_tokens == 40


def test_refusals_name_why_the_handle_is_gone() -> None:
    env = make(mode="use_once", budget_blocks=1)
    released, consumed = retain(env, [1]), None
    env.ledger.release(released.handle_id)
    consumed = retain(env, [2])
    env.ledger.complete(env.ledger.claim(consumed.handle_id, consumed.generation).claim_id)
    evicted = retain(env, [3])
    retain(env, [4])
    cases = [(released, HandleReleasedError), (consumed, HandleConsumedError), (evicted, HandleEvictedError)]
    for handle, error in cases:
        with pytest.raises(error) as info:
            env.ledger.claim(handle.handle_id, handle.generation)
        assert isinstance(info.value, HandleUnavailableError) and isinstance(info.value, KVShuttleError)
        assert "recompute" in str(info.value)
    with pytest.raises(UnknownHandleError):
        env.ledger.claim("never-issued", 0)
    refusals = env.ledger.metrics()["refusals"]
    assert refusals == {"released": 1, "consumed": 1, "evicted": 1, "unknown": 1}


def test_tombstones_are_bounded() -> None:
    env = make(tombstones=2)
    handles = [retain(env, [b]) for b in range(3)]
    for h in handles:
        env.ledger.release(h.handle_id)
    with pytest.raises(UnknownHandleError):  # forgotten: the oldest of three with room for two
        env.ledger.claim(handles[0].handle_id, 0)
    with pytest.raises(HandleReleasedError):
        env.ledger.claim(handles[2].handle_id, 0)


# ----------------------------------------------------------------------------------- generations, stale
def test_block_freed_makes_holders_stale_and_is_never_freed_again() -> None:
    env = make()
    h = retain(env, [1, 2, 3])
    before = env.ledger.generation(2)
    env.ledger.block_freed(2)
    assert env.ledger.generation(2) > before
    assert sorted(env.owner.freed) == [1, 3]  # 2 is the owner's already
    with pytest.raises(StaleHandleError):
        env.ledger.claim(h.handle_id, h.generation)
    env.ledger.block_freed(2)  # not retained: only its generation moves
    assert env.owner.freed.count(2) == 0 and env.ledger.metrics()["taken_back"] == 1
    fresh = retain(env, [2])
    assert fresh.generation > h.generation and env.ledger.claim(fresh.handle_id, fresh.generation)


def test_a_read_racing_with_a_reuse_is_reported_at_complete() -> None:
    env = make()
    h = retain(env, [1, 2])
    claim = env.ledger.claim(h.handle_id, h.generation)
    env.ledger.block_freed(1)
    assert env.owner.freed == []  # 2 stays pinned until the read ends
    with pytest.raises(StaleHandleError, match="discard"):
        env.ledger.complete(claim.claim_id)
    assert env.owner.freed == [2] and env.ledger.metrics()["draining_handles"] == 0


def test_a_block_taken_back_outside_the_claimed_prefix_leaves_the_read_good() -> None:
    """Found by the ledger's state machine (test_retention_properties): a reader that claimed only block 1's prefix
    read nothing the owner took back when block 2 goes; its read completes, a read of both blocks is stale."""
    env = make()
    h = retain(env, [1, 2])
    prefix = env.ledger.claim(h.handle_id, h.generation, [1], digests([1, 2])[:1])
    both = env.ledger.claim(h.handle_id, h.generation)
    env.ledger.block_freed(2)
    env.ledger.complete(prefix.claim_id)  # block 1 was pinned and untouched: a good read
    with pytest.raises(StaleHandleError, match="discard"):
        env.ledger.complete(both.claim_id)
    assert env.owner.freed == [1] and env.ledger.metrics()["draining_handles"] == 0


def test_generations_only_grow() -> None:
    env = make()
    seen = []
    for i in range(5):
        h = retain(env, [1, 2])
        seen.append((h.generation, env.ledger.generation(1), env.ledger.generation(2)))
        if i % 2:
            env.ledger.release(h.handle_id)
        else:
            env.ledger.block_freed(1)
    assert all(a <= b for x, y in itertools.pairwise(seen) for a, b in zip(x, y, strict=True))
    assert seen[-1][0] > seen[0][0]


# ---------------------------------------------------------------------------------------------- sharing
def test_turns_of_a_conversation_share_blocks_and_free_each_once() -> None:
    env = make()
    turn1 = retain(env, [1, 2], tokens=20, tag="c", conversation_id="conv")  # block 2 holds 4 tokens
    turn2 = retain(env, [1, 2, 3], tokens=40, tag="c", conversation_id="conv")  # 2 filled up in place
    assert turn2.generation == turn1.generation
    env.ledger.release(turn1.handle_id)
    assert env.owner.freed == [] and env.ledger.retained_block_ids() == {1, 2, 3}
    assert env.ledger.claim(turn2.handle_id, turn2.generation)
    env.ledger.release(turn2.handle_id)
    assert env.owner.freed == []  # the read in flight pins them
    env.ledger.sweep(now=env.clock.now + 30.0)  # the claim times out
    assert sorted(env.owner.freed) == [1, 2, 3]


def test_a_next_turn_keeps_the_blocks_of_an_expired_unswept_turn() -> None:
    env = make(ttl_s=10.0)
    turn1 = retain(env, [1, 2], tag="c")
    env.clock.now = 110.0  # turn 1 is due, nobody swept yet; decode's prefix cache still hit its blocks
    turn2 = retain(env, [1, 2, 3], tag="c")
    assert env.owner.freed == [] and env.ledger.retained_block_ids() == {1, 2, 3}
    with pytest.raises(HandleExpiredError):
        env.ledger.claim(turn1.handle_id, turn1.generation)
    assert env.ledger.claim(turn2.handle_id, turn2.generation)


def test_a_refused_retain_after_a_supersede_hands_the_reused_block_to_the_caller() -> None:
    env = make(budget_blocks=2)
    old = retain(env, [1, 2], tokens=32, tag="a")
    claim = env.ledger.claim(old.handle_id, old.generation)
    with pytest.raises(BudgetExceededError) as info:  # block 2 rewritten behind our back, 1 shared and pinned
        env.ledger.retain("r", [1, 2, 3], [*digests([1], "a"), b"rewritten!!!!!!!", b"new............."], 40, BS)
    assert sorted(info.value.caller_frees) == [2, 3] and env.ledger.retained_block_ids() == {1}
    with pytest.raises(StaleHandleError):
        env.ledger.complete(claim.claim_id)
    assert env.owner.freed == [1]  # never 2: the caller frees it


@pytest.mark.parametrize("conflict", ["other_index", "other_digest", "fewer_tokens"])
def test_a_block_reused_behind_the_ledger_supersedes_its_old_holders(conflict: str) -> None:
    env = make()
    old = retain(env, [1, 2], tokens=32, tag="a")
    keep = retain(env, [5], tag="k")
    if conflict == "other_index":
        new = env.ledger.retain("r", [2, 9], digests([2, 9], "a"), 32, BS)
    elif conflict == "other_digest":
        new = retain(env, [1, 2], tag="b")
    else:
        new = retain(env, [1, 2], tokens=20, tag="a")
    with pytest.raises(StaleHandleError):
        env.ledger.claim(old.handle_id, old.generation)
    assert env.ledger.claim(new.handle_id, new.generation) and env.ledger.claim(keep.handle_id, keep.generation)
    assert env.owner.freed == ([1] if conflict == "other_index" else [])
    assert env.ledger.metrics()["superseded"] >= 1


def test_close_conversation_releases_only_its_handles() -> None:
    env = make()
    a1, a2 = retain(env, [1], conversation_id="a"), retain(env, [1, 2], conversation_id="a")
    b = retain(env, [3], conversation_id="b")
    assert env.ledger.close_conversation("a") == 2 and env.ledger.close_conversation("a") == 0
    assert sorted(env.owner.freed) == [1, 2]
    for h in (a1, a2):
        with pytest.raises(HandleReleasedError):
            env.ledger.claim(h.handle_id, h.generation)
    assert env.ledger.claim(b.handle_id, b.generation)
    assert env.ledger.release_all() == 1 and len(env.ledger) == 0


def test_release_or_expiry_during_a_read_waits_for_it() -> None:
    env = make(ttl_s=10.0)
    released, expired = retain(env, [1]), retain(env, [2])
    c1 = env.ledger.claim(released.handle_id, released.generation)
    c2 = env.ledger.claim(expired.handle_id, expired.generation)
    assert env.ledger.release(released.handle_id) and not env.ledger.release(released.handle_id)
    assert env.ledger.sweep(now=110.0) == 1
    assert env.owner.freed == [] and env.ledger.metrics()["draining_handles"] == 2
    env.clock.now = 110.0
    env.ledger.complete(c1.claim_id)  # the blocks were pinned the whole read: a good read
    env.ledger.complete(c2.claim_id)
    assert sorted(env.owner.freed) == [1, 2] and env.ledger.metrics()["hits"] == 2


def test_lowering_the_budget_at_run_time_evicts_at_the_next_retain() -> None:
    env = make()
    for b in range(5):
        retain(env, [b])
    env.ledger.budget_blocks = 2
    retain(env, [9])
    assert env.owner.freed == [0, 1, 2, 3] and env.ledger.retained_block_ids() == {4, 9}


def test_concurrent_readers_and_writers_keep_the_books() -> None:
    """Threads retain, read, renew, release and sweep at once; afterwards every block came back exactly once."""
    env = make(mode="use_once", budget_blocks=64)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        mine: list[KVHandle] = []
        try:
            for i in range(400):
                op = rnd.random()
                if op < 0.4 or not mine:
                    block = seed * 10_000 + i
                    with lock:
                        env.owner.free.discard(block)
                    with contextlib.suppress(BudgetExceededError):
                        mine.append(env.ledger.retain("r", [block], [b"d" * 8], 1, BS))
                    continue
                handle = rnd.choice(mine)
                try:
                    if op < 0.7:
                        claim = env.ledger.claim(handle.handle_id, handle.generation)
                        if rnd.random() < 0.8:
                            env.ledger.complete(claim.claim_id)
                        else:
                            env.ledger.abort(claim.claim_id)
                    elif op < 0.8:
                        env.ledger.renew(handle.handle_id)
                    elif op < 0.9:
                        env.ledger.release(handle.handle_id)
                    else:
                        env.ledger.sweep()
                except HandleUnavailableError:
                    pass
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(env.ledger.retained_block_ids()) <= 64
    env.ledger.release_all()
    m = env.ledger.metrics()
    assert (m["retained_blocks"], m["live_handles"], m["claims_in_flight"], m["draining_handles"]) == (0, 0, 0, 0)
    assert len(env.owner.freed) == len(set(env.owner.freed)) == m["retains"]


# ------------------------------------------------------------------------------------ callbacks, metrics
def test_on_free_runs_outside_the_lock() -> None:
    calls: list[dict[str, Any]] = []
    clock = Clock()

    def on_free(blocks: list[int]) -> None:
        calls.append(ledger.metrics())  # would deadlock under the (non-reentrant) lock
        ledger.block_freed(blocks[0])

    ledger = RetentionLedger("e", "h", 1, clock=clock, on_free=on_free)
    handle = ledger.retain("r", [1], [b"d"], 1, BS)
    worker = threading.Thread(target=ledger.release, args=(handle.handle_id,))
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and calls and calls[0]["retained_blocks"] == 0


def test_metrics_count_everything_and_are_json_ready() -> None:
    env = make(mode="multi_read", budget_blocks=2, bytes_per_block=64, ttl_s=10.0)
    a, b = retain(env, [1]), retain(env, [2])
    env.ledger.complete(env.ledger.claim(a.handle_id, a.generation).claim_id)
    env.ledger.abort(env.ledger.claim(a.handle_id, a.generation).claim_id)
    open_claim = env.ledger.claim(a.handle_id, a.generation)
    env.ledger.renew(b.handle_id)
    retain(env, [3])  # evicts b
    with pytest.raises(TamperedHandleError):
        env.ledger.claim(a.handle_id, a.generation + 5)
    m = env.ledger.metrics()
    json.dumps(m)
    assert (m["retained_blocks"], m["retained_bytes"], m["live_handles"], m["claims_in_flight"]) == (2, 128, 2, 1)
    assert (m["retains"], m["claims"], m["hits"], m["aborts"], m["renewals"], m["evictions"]) == (3, 3, 1, 1, 1, 1)
    assert m["refusals"] == {"tampered": 1} and m["pinned_blocks"] == 1 and m["freed_blocks"] == 1
    env.ledger.sweep(now=env.clock.now + 100.0)
    m = env.ledger.metrics()
    assert (m["expirations"], m["claim_timeouts"], m["live_handles"], m["retained_blocks"]) == (2, 1, 0, 0)
    assert open_claim.reader == ""


# ------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(("args", "match"), [
    (("", [1], [b"d"], 1, BS), "request_id"),
    (("r", [], [], 0, BS), "nothing to retain"),
    (("r", [1, 1], [b"d", b"d"], 20, BS), "distinct"),
    (("r", [-1], [b"d"], 1, BS), "distinct"),
    (("r", [1.5], [b"d"], 1, BS), "integers"),
    (("r", [1], [b"d", b"e"], 1, BS), "one non-empty digest"),
    (("r", [1, 2], [b"d", b"ee"], 20, BS), "one non-empty digest"),
    (("r", [1], [b""], 1, BS), "one non-empty digest"),
    (("r", [1], [3], 1, BS), "bytes"),
    (("r", [1, 2], [b"d", b"e"], 16, BS), "cannot hold"),
    (("r", [1], [b"d"], 17, BS), "cannot hold"),
    (("r", [1], [b"d"], 1, 0), "block_size"),
])
def test_bad_retain_arguments_are_named(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(RetentionArgumentError, match=match):
        make().ledger.retain(*args)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"ttl_s": 0.0}, "ttl_s"),
    ({"ttl_s": float("inf")}, "ttl_s"),
    ({"claim_timeout_s": -1.0}, "claim_timeout_s"),
    ({"mode": "twice"}, "mode"),
    ({"budget_blocks": -1}, "budget_blocks"),
    ({"budget_bytes": 100}, "bytes_per_block"),
])
def test_bad_ledger_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(RetentionArgumentError, match=match):
        RetentionLedger("e", "h", 1, **kwargs)
    with pytest.raises(RetentionArgumentError, match="port"):
        RetentionLedger("e", "h", 0)


def test_renew_rejects_a_bad_ttl() -> None:
    env = make()
    handle = retain(env, [1])
    with pytest.raises(RetentionArgumentError):
        env.ledger.renew(handle.handle_id, ttl_s=-5.0)


# -------------------------------------------------------------------------------------------- the heap
def test_heap_pops_only_due_entries_and_compacts_dead_ones() -> None:
    alive: dict[int, bool] = {}
    heap: DeadlineHeap[int] = DeadlineHeap(lambda i: alive[i])
    for i in range(4 * COMPACT_MIN):
        alive[i] = True
        heap.push(float(i), i)
    assert list(heap.pop_due(-1.0)) == [] and len(heap) == 4 * COMPACT_MIN
    for i in range(0, 4 * COMPACT_MIN, 2):  # end half of them early
        alive[i] = False
        heap.discard()
    assert len(heap) <= 2 * (2 * COMPACT_MIN) + COMPACT_MIN  # dead entries never outnumber live ones for long
    assert [i for _, i in heap.pop_due(9.0)] == [1, 3, 5, 7, 9]


def test_expiry_heap_stays_bounded_under_churn() -> None:
    env = make(ttl_s=1e6)
    for i in range(6 * COMPACT_MIN):
        env.ledger.release(retain(env, [i]).handle_id)
    assert len(env.ledger._expiry) < 2 * COMPACT_MIN


# ------------------------------------------------------------------ an issuer outside the ledger (vLLM)
def test_retain_with_issued_handle_id_and_generation() -> None:
    env = make()
    handle = retain(env, [4, 5], handle_id="issued-by-scheduler-0123", generation=0)
    assert (handle.handle_id, handle.generation) == ("issued-by-scheduler-0123", 0)
    claim = env.ledger.claim("issued-by-scheduler-0123", 0, [4, 5], digests([4, 5]))
    env.ledger.complete(claim.claim_id)
    with pytest.raises(RetentionArgumentError, match="issued before"):
        retain(env, [6], handle_id="issued-by-scheduler-0123")
    with pytest.raises(RetentionArgumentError, match="generation"):
        retain(env, [7], handle_id="another-id-0123456789", generation=-1)


def test_on_release_names_each_request_once_when_its_blocks_are_let_go() -> None:
    released: list[str] = []
    env = make(on_release=released.append, budget_blocks=4, ttl_s=10.0, claim_timeout_s=100.0)
    first = env.ledger.retain("r1", [1, 2], digests([1, 2]), 2 * BS, BS)
    env.ledger.retain("r2", [1, 2, 3], digests([1, 2, 3]), 3 * BS, BS)  # shares r1's blocks
    assert env.ledger.release(first.handle_id) and released == ["r1"]  # r1 let go; blocks 1, 2 live on in r2
    assert env.owner.freed == []  # no block freed: r2 still holds them all
    third = env.ledger.retain("r3", [8, 9], digests([8, 9]), 2 * BS, BS)  # budget 4: evicts r2
    assert released == ["r1", "r2"]
    claim = env.ledger.claim(third.handle_id, third.generation)
    advance(env, 20.0)
    env.ledger.sweep()  # expired, but a read is in flight: the blocks stay until it ends
    assert released == ["r1", "r2"]
    env.ledger.abort(claim.claim_id)
    assert released == ["r1", "r2", "r3"]


def test_a_handle_can_be_use_once_in_a_multi_read_ledger() -> None:
    env = make()  # multi_read by default
    once = retain(env, [1, 2], mode="use_once")
    many = retain(env, [3], tag="m")
    first = env.ledger.claim(once.handle_id, once.generation)
    with pytest.raises(HandleInUseError):
        env.ledger.claim(once.handle_id, once.generation)
    env.ledger.complete(first.claim_id)
    with pytest.raises(HandleConsumedError):
        env.ledger.claim(once.handle_id, once.generation)
    for _ in range(2):  # the multi-read one stays
        env.ledger.complete(env.ledger.claim(many.handle_id, many.generation).claim_id)
    with pytest.raises(RetentionArgumentError, match="mode"):
        retain(env, [9], mode="twice")  # type: ignore[arg-type]


# ------------------------------------------------------------------------ bounds a peer cannot exceed
def test_renewals_are_clamped_to_max_ttl() -> None:
    env = make(ttl_s=100.0, max_ttl_s=600.0)
    handle = retain(env, [1, 2])
    assert env.ledger.renew(handle.handle_id, ttl_s=1e9).ttl_s == pytest.approx(600.0)
    assert env.ledger.renew(handle.handle_id, ttl_s=50.0).ttl_s == pytest.approx(600.0)  # never shortened
    advance(env, 599.0)
    assert env.ledger.get(handle.handle_id) is not None
    advance(env, 2.0)
    env.ledger.sweep()
    assert env.ledger.get(handle.handle_id) is None


def test_open_claims_are_capped_per_reader_and_forgotten_when_closed() -> None:
    from kvshuttle.retention import ClaimLimitError

    env = make(max_claims_per_reader=2)
    handle = retain(env, [1, 2])
    first = [env.ledger.claim(handle.handle_id, handle.generation, reader="a") for _ in range(2)]
    with pytest.raises(ClaimLimitError):
        env.ledger.claim(handle.handle_id, handle.generation, reader="a")
    other = env.ledger.claim(handle.handle_id, handle.generation, reader="b")  # another reader is not affected
    assert env.ledger.claimed_blocks(other.claim_id) == (1, 2)
    env.ledger.complete(first[0].claim_id)
    env.ledger.abort(first[1].claim_id)
    env.ledger.claim(handle.handle_id, handle.generation, reader="a")  # room again
    advance(env, 31.0)  # past claim_timeout_s: timed-out claims free their reader's count too
    env.ledger.sweep()
    assert not env.ledger._open_by_reader  # no per-reader state outlives its claims
    with pytest.raises(ClaimLostError):
        env.ledger.claimed_blocks(other.claim_id)
