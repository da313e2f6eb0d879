"""TP > 1 when one rank's host tier is full and another's is not (issue 35's retention tiers).

Every rank runs the same config, so the ranks' tiers differ only by what happened on them: here a prefill rank's
read in flight pins a retention (d0) in decode rank 0's tier, so when the next retention (d1) leaves the hot cache
rank 0 has no room (``tier_full``: it ends d1) while rank 1 evicts d0 for it (``tier_evicted``) and demotes d1.
The scheduler must end each retention on every rank, whichever order the ranks report in: the rank that demoted
d1 drops its copy (its slots free, nothing left readable), the rank that kept d0 drops it once its read is over.
No rank's hot blocks are freed before its own copy landed (vLLM frees a request when every rank reported it); a
reader that claims every rank gets a named refusal and leaves no claim open; the tier counters say what happened.
Each decode rank is a real ShuttleWorker in its own process (its own TransferEngine, NIXL agent, side channel,
ledger and host tier over a vLLM 0.32 CPU cache shard: tier_rank_helpers.py), driven by test_connector_tp's
``Engine`` (vLLM's scheduler and KVOutputAggregator; the step's metadata and reports cross the pipes pickled, as
under vLLM's multiprocess executor); the prefill ranks that read are real workers in this process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from conftest import HostCache
from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.worker import ShuttleWorker
from kvshuttle.policy import Decision, KVHandle
from kvshuttle.policy.decision import Reason
from kvshuttle.reuse import ReuseResult
from test_connector_host_tier import until
from test_connector_tp import HEADS, TP, Engine, no_state, tp_scheduler
from test_vllm_scheduler import BS, SECRET
from tier_rank_helpers import RankProcess, shard, start_ranks

pytestmark = pytest.mark.timeout(300)

# A hot TTL no step reaches by itself: each test says when it ran out on which rank (``expire``), the way the
# worker's own sweep does once the clock got there, so the order in which the ranks act is the test's.
HOT_TTL_S = 10.0
TIER = {"decoder_kv_blocks_ttl": HOT_TTL_S, "kvshuttle_host_tier_blocks": 4}  # one retention of 4 blocks
READER = "prefill-rank0"  # the prefill rank whose read in flight pins d0 on decode rank 0


Made = tuple[ShuttleWorker, HostCache]


@pytest.fixture
def readers() -> Iterator[Any]:
    """``make(rank, tp_size=TP, heads=2, engine="pre")``: a prefill rank, a real worker over a shard of its own."""
    pytest.importorskip("nixl._api")
    pytest.importorskip("zmq")
    built: list[ShuttleWorker] = []

    def make(rank: int, tp_size: int = TP, heads: int = 2, engine: str = "pre") -> Made:
        config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True}, model="m")
        w = ShuttleWorker(config, engine, BS, secret=SECRET, tp_rank=rank, tp_size=tp_size,
                          num_kv_heads=HEADS if tp_size > 1 else None)
        built.append(w)
        cache = shard(rank, 50 + len(built), heads)
        w.register_kv_caches({f"model.layers.{i}.self_attn": x for i, x in enumerate(cache.layers)}, "CPU_ATTN")
        return w, cache

    try:
        yield make
    finally:
        for w in built:
            w.shutdown()


@pytest.fixture
def decode() -> Iterator[list[RankProcess]]:
    """Decode ranks 0 and 1 of one engine, each in its own process, same config (a 4-block host tier each)."""
    pytest.importorskip("nixl._api")
    pytest.importorskip("zmq")
    procs = start_ranks(TP, HEADS, 100, TIER)
    try:
        yield procs
    finally:
        for proc in procs:
            proc.close()


def expire(w: RankProcess) -> None:
    """This rank's hot TTL ran out: its sweep (as in ``ShuttleWorker.finished``) demotes or ends what is due.
    (Claims time out after 30 s, later than this clock.)"""
    w.expire(HOT_TTL_S + 1)


def tier_of(w: RankProcess) -> dict[str, Any]:
    return dict(w.ledger.metrics()["tiers"]["host"])


def handle_of(params: dict[str, Any]) -> KVHandle:
    return KVHandle.from_kv_transfer_params(params, SECRET)


class Setup:
    """Decode ranks 0 and 1 (same config) under one scheduler; d0 landed in both tiers, d1 held hot on both, and
    a prefill rank's read of d0 in flight on rank 0 (its claim pins d0 there: rank 0's tier is full)."""

    def __init__(self, decode: list[RankProcess], *, pin: bool = True) -> None:
        self.w0, self.w1 = decode
        self.engine = Engine(tp_scheduler(**TIER), [self.w0, self.w1])
        self.p0 = self.engine.finish("d0")
        self.engine.step()  # every rank retains d0; vLLM named it finished
        for w in (self.w0, self.w1):
            expire(w)
        until(self.engine.step, lambda _: self.engine.freed == ["d0"])
        assert self.engine.freed == ["d0"], self.engine.remaining  # landed on both ranks: vLLM freed d0
        self.p1 = self.engine.finish("d1")
        self.engine.step()
        self.h0, self.h1 = handle_of(self.p0), handle_of(self.p1)
        assert self.ledger(0).get(self.h0.handle_id) is not None and self.ledger(1).get(self.h1.handle_id)
        if pin:
            self.pin = self.ledger(0).claim(self.h0.handle_id, 0, reader=READER)
            assert self.pin.tier == "host"
            assert len(self.ledger(0).claimed_slots(self.pin.claim_id)) == 4  # rank 0's owner packs the read from

    def ledger(self, rank: int) -> Any:
        return (self.w0, self.w1)[rank].ledger

    def settle(self) -> None:
        """Steps until every retention ended on every rank and vLLM freed every request."""
        until(self.engine.step, lambda _: self.engine.freed == ["d0", "d1"] and not self.engine.metas[-1].releases
              and all(len(w.ledger) == 0 for w in (self.w0, self.w1)))

    def check_nothing_left(self) -> None:
        assert self.engine.freed == ["d0", "d1"] and self.engine.remaining == {}
        for rank, w in enumerate((self.w0, self.w1)):
            for handle in (self.h0, self.h1):
                assert self.ledger(rank).get(handle.handle_id) is None, (rank, handle.request_id)
            tier = tier_of(w)
            assert (tier["blocks"], tier["live_handles"], tier["copying"]) == (0, 0, 0), (rank, tier)
            metrics = self.ledger(rank).metrics()
            assert (metrics["retained_blocks"], metrics["claims_in_flight"]) == (0, 0), (rank, metrics)
            assert no_state(w.state_sizes()), (rank, w.state_sizes())
        assert no_state(self.engine.scheduler.state_sizes()), self.engine.scheduler.state_sizes()
        assert "stray_report" not in self.engine.scheduler.counts


def fetch(reader: ShuttleWorker, handle: KVHandle, local: tuple[int, ...] = (20, 21, 22)) -> ReuseResult:
    """A prefill rank's read of ``handle``'s first blocks into ``local``, as its loader thread runs it."""
    assert reader.reader is not None
    n = len(local)
    decision = Decision("fetch", Reason.FETCH, "test", fetch_tokens=n * BS, reused_tokens=n * BS,
                        fetch_blocks=range(n), remote_block_ids=handle.block_ids[:n], block_size=BS)
    return reader.reader.fetch(decision, handle, np.array(local), n * BS + 1, deadline=time.monotonic() + 10)


# ------------------------------------------------------------------------------------- the TTL's demotion
def test_a_rank_out_of_tier_room_ends_it_while_the_others_copy_is_in_flight(decode: list[RankProcess]) -> None:
    """Rank 0 ends d1 (``tier_full``) and reports it while rank 1's copy of d1 is still running: the next step
    ends d1 on rank 1 too, but its hot blocks stay with vLLM until the copy is over (the copy reads them); then
    its slots go back. Rank 1's eviction of d0 ends d0 on rank 0 as soon as the read there is over."""
    s = Setup(decode)
    s.w1.close_gate()
    expire(s.w0)  # both ranks' sweeps in the same step, as their TTLs run out together
    expire(s.w1)
    assert s.ledger(0).get(s.h1.handle_id) is None and tier_of(s.w0)["full"] == 1
    assert tier_of(s.w1)["copying"] == 1 and tier_of(s.w1)["evictions"] == 1  # d0 went to make room for d1
    for _ in range(3):
        s.engine.step()
    told = [rid for m in s.engine.metas[-3:] for rid in m.releases]
    assert sorted(told) == ["d0", "d1"], told  # rank 0's end of d1 reached rank 1, rank 1's of d0 rank 0
    assert s.engine.freed == ["d0"] and s.engine.remaining == {"d1": 1}  # rank 1 still copies from its blocks
    assert s.ledger(1).metrics()["retained_blocks"] == 4 and tier_of(s.w1)["copying"] == 1
    s.w1.open_gate()
    until(s.engine.step, lambda _: "d1" in s.engine.freed)
    assert s.engine.freed == ["d0", "d1"]
    assert tier_of(s.w1)["blocks"] == 0  # the landed copy of an ended retention keeps no slot
    # Rank 1 evicted d0, so rank 0 ended it too: no new claim there, but the read in flight keeps d0's slots
    # until it is over and completes (the bytes it read were d0's; the reader's other rank, refused, recomputes).
    with pytest.raises(RuntimeError, match="HandleReleasedError"):
        s.ledger(0).claim(s.h0.handle_id, 0, reader="prefill-rank0-later")
    assert tier_of(s.w0)["blocks"] == 4 and tier_of(s.w0)["live_handles"] == 0
    assert s.ledger(0).complete(s.pin.claim_id).handle_id == s.h0.handle_id
    s.settle()
    s.check_nothing_left()


def test_a_rank_out_of_tier_room_after_the_others_landing_still_ends_it_there(decode: list[RankProcess]) -> None:
    """Rank 0's demotion of d1 waits for its read in flight, so rank 1's landing is reported first and rank 0's
    end comes in the same report that frees d1 (every rank reported it). vLLM's aggregate cannot say whether
    rank 1 ended d1 or landed it: the scheduler must end it on every rank, or rank 1's tier keeps a copy no one
    can read for the tier's whole TTL (a reader's claim on rank 0 is refused), crowding out live retentions."""
    s = Setup(decode)
    read = s.ledger(0).claim(s.h1.handle_id, 0, reader=READER)  # d1 is being read on rank 0 as its TTL ends
    expire(s.w0)
    expire(s.w1)
    until(s.engine.step, lambda _: s.engine.remaining.get("d1") == 1)
    assert s.engine.freed == ["d0"] and tier_of(s.w1)["demotions"] == 2  # rank 1 landed d1 (and reported it)
    assert s.ledger(0).metrics()["retained_blocks"] == 4  # rank 0 still hot: its demotion waits for the read
    s.ledger(0).complete(read.claim_id)  # the read ends: rank 0's demotion finds no room, d1 ends there
    assert tier_of(s.w0)["full"] == 1
    until(s.engine.step, lambda _: "d1" in s.engine.freed)
    assert s.engine.freed == ["d0", "d1"]
    until(s.engine.step, lambda _: s.ledger(1).get(s.h1.handle_id) is None, timeout_s=3)
    assert s.ledger(1).get(s.h1.handle_id) is None, "rank 1's tier still serves d1, which rank 0 ended"
    assert tier_of(s.w1)["blocks"] == 0
    s.ledger(0).abort(s.pin.claim_id)
    s.settle()
    s.check_nothing_left()


def test_a_reader_of_every_rank_is_refused_by_name_and_leaves_no_claim_open(decode: list[RankProcess],
                                                                                readers: Any) -> None:
    """Between rank 0's end of d1 and the step that ends it on rank 1, a prefill at TP 1 (it claims both decode
    ranks) is refused by rank 0 (``tier_full``, a tier miss), recomputes every block and holds nothing on rank 1;
    a prefill at TP 2 has its rank 1 read rank 1's tier while its rank 0 is refused: vLLM recomputes from the
    first invalid block of the union on every rank, so the heads rank 1 read are computed again. Once rank 1 ended
    d1 too, it refuses as well."""
    whole, _ = readers(0, tp_size=1, heads=HEADS)  # (before the setup: its clock runs from there)
    pre0, _ = readers(0, engine="pre2")
    pre1, _ = readers(1, engine="pre2")
    s = Setup(decode)
    s.w1.close_gate()
    expire(s.w0)
    expire(s.w1)
    s.w1.open_gate()
    until(lambda: tier_of(s.w1), lambda tier: tier["copying"] == 0)
    assert tier_of(s.w1)["live_handles"] == 1  # d1 landed in rank 1's tier, ended on rank 0; no step yet
    refused = fetch(whole, s.h1)
    assert refused.action != "fetched" and refused.reason == "claim_refused", refused
    assert refused.owner_reason == "HandleTierFullError" and "tier_full" in refused.message, refused
    assert set(refused.invalid_block_ids) == {20, 21, 22}
    assert tier_of(s.w0)["misses"] == 1
    assert s.ledger(1).metrics()["claims_in_flight"] == 0 and tier_of(s.w1)["reads"] == 0
    mine0, mine1 = fetch(pre0, s.h1), fetch(pre1, s.h1)
    assert mine0.reason == "claim_refused" and set(mine0.invalid_block_ids) == {20, 21, 22}, mine0
    assert mine1.action == "fetched", mine1  # its own heads, from rank 1's tier: vLLM discards them (above)
    until(s.engine.step, lambda _: s.ledger(1).get(s.h1.handle_id) is None, timeout_s=3)
    late = fetch(pre1, s.h1, (30, 31, 32))
    assert late.action != "fetched" and set(late.invalid_block_ids) == {30, 31, 32}, late
    assert s.ledger(1).metrics()["claims_in_flight"] == 0
    stats0, stats1 = s.w0.take_stats().data, s.w1.take_stats().data
    assert (stats0["tier.host.full"], stats0["tier.host.misses"], stats0["tier.host.demotions"]) == (1, 2, 1)
    assert (stats1["tier.host.full"], stats1["tier.host.evictions"], stats1["tier.host.demotions"],
            stats1["tier.host.reads"]) == (0, 1, 2, 1)
    s.ledger(0).abort(s.pin.claim_id)
    s.settle()
    s.check_nothing_left()


def test_a_copy_that_fails_on_one_rank_ends_the_retention_on_every_rank(decode: list[RankProcess]) -> None:
    """Both tiers have room (no read pins d0), but rank 1's copy of d1 fails: d1 ends there (with its TTL's
    reason) while rank 0's copy lands, in the same step. Rank 0 must drop its copy too."""
    s = Setup(decode, pin=False)
    s.w1.fail_copies()
    expire(s.w0)
    expire(s.w1)
    assert tier_of(s.w1)["failed_copies"] == 1 and s.ledger(1).get(s.h1.handle_id) is None
    until(lambda: tier_of(s.w0), lambda tier: tier["copying"] == 0)
    assert tier_of(s.w0)["demotions"] == 2  # landed on rank 0 (d0 evicted for it on both ranks)
    s.settle()
    assert s.ledger(0).get(s.h1.handle_id) is None, "rank 0's tier still serves d1, which rank 1 ended"
    s.check_nothing_left()


# ------------------------------------------------------------------------------------ an asked demotion
def test_a_demotion_asked_of_every_rank_moves_it_where_there_is_room_and_the_ttl_ends_the_rest(
        decode: list[RankProcess], readers: Any) -> None:
    """A router's ``demote_retention`` (every rank) while rank 0's tier is full: rank 0 keeps d1 hot (an asked
    demotion never ends a retention), rank 1 evicts d0 and moves d1 into its tier. vLLM keeps the blocks (rank
    0 holds them); a read meanwhile takes rank 0's heads from its hot cache and rank 1's from its tier, and gets
    the bytes the request computed. When rank 0's hot TTL runs out with its tier still full, d1 ends there and
    then on rank 1."""
    from kvshuttle.transfer import demote_retention

    whole, mine = readers(0, tp_size=1, heads=HEADS)  # (before the setup: its clock runs from there)
    s = Setup(decode)
    c0, c1 = s.w0.cache(), s.w1.cache()
    assert demote_retention(s.p1, secret=SECRET) is True  # rank 1 started; rank 0 said no (no room)
    until(lambda: tier_of(s.w1), lambda tier: tier["demotions"] == 2 and tier["copying"] == 0)
    assert tier_of(s.w0)["full"] == 0 and s.ledger(0).metrics()["retained_blocks"] == 4  # hot, still retained
    assert tier_of(s.w1)["evictions"] == 1 and s.ledger(1).metrics()["retained_blocks"] == 0
    until(s.engine.step, lambda _: s.engine.remaining.get("d1") == 1)  # rank 1 reported its landing
    assert s.engine.freed == ["d0"]
    got = fetch(whole, s.h1)
    assert got.action == "fetched", got
    assert (tier_of(s.w0)["reads"], tier_of(s.w1)["reads"]) == (0, 1)  # rank 0 served it hot, rank 1 packed it
    for layer in range(c0.geo.num_layers):  # reader heads 0-1 from rank 0 (hot), 2-3 from rank 1 (tier)
        read = mine.canonical(layer)[:, [20, 21, 22]]
        assert np.array_equal(read[:, :, :, :2], c0.canonical(layer)[:, [4, 5, 6]])
        assert np.array_equal(read[:, :, :, 2:], c1.canonical(layer)[:, [4, 5, 6]])
    expire(s.w0)  # rank 0's hot TTL: its tier is still full (d0's read), so d1 ends there
    assert tier_of(s.w0)["full"] == 1
    until(s.engine.step, lambda _: "d1" in s.engine.freed)
    until(s.engine.step, lambda _: s.ledger(1).get(s.h1.handle_id) is None, timeout_s=3)
    assert s.ledger(1).get(s.h1.handle_id) is None, "rank 1's tier still serves d1, which rank 0 ended"
    s.ledger(0).abort(s.pin.claim_id)
    s.settle()
    s.check_nothing_left()
