"""The connector's host tier (issue 35), without vLLM: the ``kvshuttle_host_tier_*`` keys, the scheduler's handles
naming the retention's whole life (hot TTL, then the tier's), the worker's wiring (a retention past its hot TTL is
demoted: vLLM frees its blocks while the tier keeps it under the same handle, read back packed even by a reader
that prefers direct reads, also layer by layer), the tier's stats and Prometheus metrics, and, at TP > 1, that a
landing frees the blocks without ending the retention on the other ranks while an end in one rank's tier still
ends it on every rank. Real ShuttleWorkers over a small vLLM 0.32 CPU cache (test_connector_worker's)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from conftest import HostCache, make_cache
from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.config import ConnectorConfigError
from kvshuttle.integrations.vllm.metadata import RetainJob, ShuttleMetadata
from kvshuttle.integrations.vllm.stats import ShuttlePromMetrics, ShuttleStats, is_gauge
from kvshuttle.integrations.vllm.worker import ShuttleWorker
from kvshuttle.policy import Decision, KVHandle, block_digests
from kvshuttle.policy.decision import Reason
from kvshuttle.retention import TierTerms
from test_connector_tp import H0, H1, Engine, finish, make_rank, no_state, tp_scheduler  # noqa: F401 (fixture)
from test_vllm_scheduler import BS, SECRET

pytestmark = pytest.mark.timeout(120)

HOT_TTL_S = 0.3
TIER = {"decoder_kv_blocks_ttl": HOT_TTL_S, "kvshuttle_host_tier_blocks": 8}
DIGESTS = tuple(block_digests(list(range(64)), BS))


# ------------------------------------------------------------------------------------------------- config
def test_host_tier_keys_make_the_terms_tier() -> None:
    plain = ShuttleConfig.from_extra({}, model="m")
    assert plain.host_tier_blocks == 0 and plain.terms().tier is None and plain.tier_terms() is None
    config = ShuttleConfig.from_extra({"kvshuttle_host_tier_blocks": "64", "kvshuttle_host_tier_ttl_s": 90,
                                       "kvshuttle_host_tier_eviction": "lru"}, model="m")
    assert config.terms().tier == TierTerms(64, 90.0, "lru")
    assert ShuttleConfig.from_extra({"kvshuttle_host_tier_blocks": 4}).terms().tier == TierTerms(4, 1800.0)
    for extra, key in (({"kvshuttle_host_tier_blocks": -1}, "kvshuttle_host_tier_blocks"),
                       ({"kvshuttle_host_tier_blocks": 1.5}, "kvshuttle_host_tier_blocks"),
                       ({"kvshuttle_host_tier_blocks": 2**31}, "retention terms"),
                       ({"kvshuttle_host_tier_ttl_s": 0}, "kvshuttle_host_tier_ttl_s"),
                       ({"kvshuttle_host_tier_eviction": "fifo"}, "kvshuttle_host_tier_eviction")):
        with pytest.raises(ConnectorConfigError, match=key):
            ShuttleConfig.from_extra(extra)


def test_handles_name_the_hot_ttl_then_the_tiers() -> None:
    """A reader checks the handle's expiry: with a tier it must cover the tier's TTL too, or the next turn after
    a long pause would never read the tier."""
    for extra, life in (({"decoder_kv_blocks_ttl": 5}, 5.0),
                        ({"decoder_kv_blocks_ttl": 5, "kvshuttle_host_tier_blocks": 8,
                          "kvshuttle_host_tier_ttl_s": 100}, 105.0)):
        s = tp_scheduler(tp_size=1, **extra)
        s.set_ranks({0: H0})
        keep, params = finish(s, "d1")
        assert keep and params is not None
        assert params["kvshuttle_ttl_s"] == life
        assert abs(params["remote_blocks_expiry_time"] - time.time() - life) < 2
        (job,) = s.build_connector_meta().retains
        assert job.ttl_s == 5.0  # the ledger's hot TTL; it demotes then


# --------------------------------------------------------------------------------------- a worker with a tier
def worker(name: str, seed: int, **extra: Any) -> tuple[ShuttleWorker, HostCache]:
    from test_connector_worker import GEO

    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **extra}, model="m")
    w = ShuttleWorker(config, name, BS, secret=SECRET)
    host = make_cache(np.random.default_rng(seed), GEO)
    w.register_kv_caches({f"layer.{i}": x for i, x in enumerate(host.layers)}, "CPU_ATTN")
    return w, host


@pytest.fixture
def workers() -> Iterator[Callable[..., tuple[ShuttleWorker, HostCache]]]:
    pytest.importorskip("nixl._api")
    pytest.importorskip("zmq")
    built: list[ShuttleWorker] = []

    def make(name: str, seed: int, **extra: Any) -> tuple[ShuttleWorker, HostCache]:
        w, host = worker(name, seed, **extra)
        built.append(w)
        return w, host

    try:
        yield make
    finally:
        for w in built:
            w.shutdown()


def until(step: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = step()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def demoted(w: ShuttleWorker, rid: str = "req-a", handle_id: str = "h-a") -> None:
    """Retain ``rid`` in blocks 3, 4; vLLM names it finished; step until its demotion landed (finished sending)."""
    w.start(ShuttleMetadata(retains=[RetainJob(rid, handle_id, (3, 4), DIGESTS, 64, BS, HOT_TTL_S, False)]))
    assert w.finished({rid}) == (set(), set())  # held hot
    sending = until(lambda: w.finished(set())[0], bool)
    assert sending == {rid}


def test_past_its_hot_ttl_a_retention_lands_in_the_tier_and_vllm_frees_its_blocks(workers: Any) -> None:
    w, _ = workers("owner", 1, **TIER)
    assert w.ledger is not None and w.engine is not None and w.tier is not None
    assert w.engine.tier is w.tier and w.tier.capacity_blocks == 8
    assert w.ledger.terms.tier == TierTerms(8) and w.ledger.terms.ttl_s == HOT_TTL_S
    demoted(w)
    metrics = w.ledger.metrics()
    assert metrics["retained_blocks"] == 0 and metrics["tiers"]["host"]["blocks"] == 2
    assert w.ledger.get("h-a") is not None  # the same handle lives on
    assert w.worker_meta() is None  # (TP = 1: nothing to tell other ranks anyway)
    assert w.state_sizes()["tiered"] == 1
    stats = w.take_stats().data
    assert (stats["tier.host.blocks"], stats["tier.host.bytes"], stats["tier.host.demotions"]) == \
        (2, 2 * w.tier.block_bytes, 1)
    again = w.take_stats().data  # counters carry what happened since the last stats, gauges the state
    assert (again["tier.host.blocks"], again["tier.host.demotions"], again["tier.host.reads"]) == (2, 0, 0)
    assert w.ledger.release("h-a")
    assert w.state_sizes()["tiered"] == 0 and w.take_stats().data["tier.host.blocks"] == 0
    meta = w.worker_meta()  # its end, even at TP = 1: the scheduler's content index withdraws it only then
    assert meta is not None and meta.ended == {"req-a"}, meta
    assert no_state(w.state_sizes())


def test_a_demotion_asked_on_the_side_channel_takes_the_ttls_path_through_the_worker(workers: Any) -> None:
    """A router's ``demote_retention`` long before the hot TTL: the worker reports the request finished sending
    once the copy landed (vLLM frees its blocks) and keeps it tiered under the same handle, as a TTL's demotion."""
    from kvshuttle.transfer import demote_retention

    w, _ = workers("asked", 5, decoder_kv_blocks_ttl=600, kvshuttle_host_tier_blocks=8)
    assert w.ledger is not None
    w.start(ShuttleMetadata(retains=[RetainJob("req-a", "h-a", (3, 4), DIGESTS, 64, BS, 600.0, False)]))
    assert w.finished({"req-a"}) == (set(), set())  # held hot
    handle = w.ledger.get("h-a")
    assert handle is not None
    assert demote_retention(handle.to_kv_transfer_params(SECRET), secret=SECRET) is True
    assert until(lambda: w.finished(set())[0], bool) == {"req-a"}
    metrics = w.ledger.metrics()
    assert metrics["retained_blocks"] == 0 and metrics["tiers"]["host"]["blocks"] == 2
    assert w.ledger.get("h-a") is not None and w.state_sizes()["tiered"] == 1
    assert w.take_stats().data["tier.host.demotions"] == 1
    assert w.ledger.release("h-a") and w.state_sizes()["tiered"] == 0


def test_a_claim_that_finds_its_retention_moving_waits_for_the_copy_and_reads_the_tier(
        workers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim refused because the retention is being moved into a tier (an idle decode starts a move when a claim
    finds its TTL over; here an asked demotion whose copy takes 0.5 s) is retried until the copy landed, and the
    tier serves it: before, the prefill recomputed what the tier held a moment later."""
    from kvshuttle.transfer import demote_retention
    from kvshuttle.transfer.host_tier import HostTier

    copy = HostTier._run

    def slow_copy(tier: HostTier, order: Any, written: Any) -> None:
        time.sleep(0.5)
        copy(tier, order, written)

    monkeypatch.setattr(HostTier, "_run", slow_copy)
    w, owner = workers("moving", 21, decoder_kv_blocks_ttl=600, kvshuttle_host_tier_blocks=8)
    r, mine = workers("reader", 22)
    assert w.ledger is not None and r.reader is not None
    w.start(ShuttleMetadata(retains=[RetainJob("req-a", "h-a", (3, 4), DIGESTS, 64, BS, 600.0, False)]))
    assert w.finished({"req-a"}) == (set(), set())  # held hot
    handle = w.ledger.get("h-a")
    assert handle is not None
    original = [owner.canonical(layer)[:, [3, 4]].copy() for layer in range(owner.geo.num_layers)]
    assert demote_retention(handle.to_kv_transfer_params(SECRET), secret=SECRET) is True  # copying for 0.5 s
    decision = Decision("fetch", Reason.FETCH, "test", fetch_tokens=64, reused_tokens=64, fetch_blocks=range(2),
                        remote_block_ids=(3, 4), block_size=BS)
    result = r.reader.fetch(decision, handle, np.array([10, 11]), 64, deadline=time.monotonic() + 10)
    assert result.action == "fetched", result
    assert w.ledger.metrics()["refusals"]["demoting"] >= 1  # refused while copying, retried, then served
    for layer in range(owner.geo.num_layers):
        assert np.array_equal(mine.canonical(layer)[:, [10, 11]], original[layer])
    assert w.ledger.metrics()["tiers"]["host"]["reads"] == 1


def test_without_a_tier_the_hot_ttl_ends_the_retention(workers: Any) -> None:
    w, _ = workers("plain", 2, decoder_kv_blocks_ttl=HOT_TTL_S)
    assert w.tier is None and w.engine is not None and w.engine.tier is None and w.ledger is not None
    demoted(w)
    assert len(w.ledger) == 0 and "tiers" not in w.ledger.metrics()
    assert not any(k.startswith("tier.") for k in w.take_stats().data) and no_state(w.state_sizes())


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layer_by_layer"])
def test_a_tier_claim_is_read_back_packed_by_a_reader_that_prefers_direct(workers: Any, layered: bool) -> None:
    """The owner's hot blocks are scribbled once the demotion landed (vLLM reuses them): the reader, set to
    direct reads, still gets the original bytes, packed from the tier. A direct read would be refused at
    confirmation (the claim says tier "host")."""
    from kvshuttle.transfer import LayerProgress

    w, owner = workers("owner", 3, **TIER)
    r, mine = workers("reader", 4, kvshuttle_path="direct")
    assert w.ledger is not None and r.reader is not None and r.reader.path == "direct"
    blocks = [3, 4]
    original = [owner.canonical(layer)[:, blocks].copy() for layer in range(owner.geo.num_layers)]
    demoted(w)
    for layer in range(owner.geo.num_layers):
        owner.canonical(layer)[:, blocks] = 0x11
    host, port = w.ledger.host, w.ledger.port
    handle = KVHandle("owner", "req-a", host, port, (3, 4), 64, time.time() + 60, 1, "h-a", 0, BS, DIGESTS,
                      time.time(), 60.0)
    decision = Decision("fetch", Reason.FETCH, "test", fetch_tokens=64, reused_tokens=64, fetch_blocks=range(2),
                        remote_block_ids=(3, 4), block_size=BS)
    progress = LayerProgress(owner.geo.num_layers) if layered else None
    result = r.reader.fetch(decision, handle, np.array([10, 11]), 64, deadline=time.monotonic() + 10,
                            progress=progress)
    assert result.action == "fetched", result
    assert result.telemetry is not None and result.telemetry.path == "packed"
    for layer in range(owner.geo.num_layers):
        assert np.array_equal(mine.canonical(layer)[:, [10, 11]], original[layer])
    if progress is not None:
        assert progress.ended is True and progress.landed == owner.geo.num_layers
    assert w.ledger.metrics()["tiers"]["host"]["reads"] == 1
    assert w.take_stats().data["tier.host.reads"] == 1


def test_the_reader_role_reads_a_tier_claim_packed_and_refuses_a_direct_read_of_it(
        workers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshuttle.transfer import IncompatiblePeerError

    w, owner = workers("owner", 5, **TIER)
    r, mine = workers("reader", 6)
    assert w.ledger is not None and w.engine is not None and r.engine is not None
    demoted(w)
    handle = KVHandle("owner", "req-a", w.ledger.host, w.ledger.port, (3, 4), 64, time.time() + 60, 1, "h-a", 0,
                      BS, DIGESTS, time.time(), 60.0)
    peer = r.engine.connect(w.engine.address or "")
    ticket = r.engine.claim(peer, handle, 2)
    assert ticket.tier == "host" and ticket.slots == (0, 1) and not ticket.packed_only  # vLLM layout: packed here
    recorded: list[Any] = []
    monkeypatch.setattr(peer.path_model, "record", lambda *args: recorded.append(args))
    with pytest.raises(IncompatiblePeerError, match="host tier"):
        r.engine.read(peer, [10, 11], [3, 4], path="direct", claim=ticket)
    for path in ("auto", "packed"):
        with r.engine.read(peer, [10, 11], [3, 4], path=path, claim=ticket) as read:
            assert read.wait(10).path == "packed"
    assert recorded == []  # forced reads teach the path model nothing about the hot cache
    r.engine.finish_claim(peer, ticket, ok=True)  # confirmed: a direct read would be refused here
    for layer in range(owner.geo.num_layers):
        assert np.array_equal(mine.canonical(layer)[:, [10, 11]], owner.canonical(layer)[:, [3, 4]])


# -------------------------------------------------------------------------------------------------- stats
class _Metric:
    def __init__(self, **kw: Any) -> None:
        self.name = kw["name"]
        self.values: dict[tuple[Any, ...], float] = {}
        self.key: tuple[Any, ...] = ()

    def labels(self, *values: Any) -> _Metric:
        self.key = values
        return self

    def set(self, value: float) -> None:
        self.values[self.key] = value

    def inc(self, value: float = 1) -> None:
        self.values[self.key] = self.values.get(self.key, 0) + value


class _Base:  # what vLLM's KVConnectorPromMetrics sets (the connector is tested without vLLM)
    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        self._gauge_cls = self._counter_cls = _Metric
        self.per_engine_labelvalues = per_engine_labelvalues


class _Prom(ShuttlePromMetrics, _Base):
    pass


def test_tier_stats_aggregate_and_reach_prometheus() -> None:
    from kvshuttle.integrations.vllm import compat

    if compat.vllm is not None:
        pytest.skip("vLLM's own KVConnectorPromMetrics base takes over the probe's")
    a = ShuttleStats(data={"tier.host.blocks": 5, "tier.host.bytes": 500, "tier.host.demotions": 2,
                           "tier.host.reads": 1, "tier.host.misses": 0})
    a.aggregate(ShuttleStats(data={"tier.host.blocks": 3, "tier.host.bytes": 300, "tier.host.demotions": 1,
                                   "tier.host.reads": 2, "tier.host.misses": 1}))
    assert a.data == {"tier.host.blocks": 3, "tier.host.bytes": 300, "tier.host.demotions": 3,
                      "tier.host.reads": 3, "tier.host.misses": 1}
    assert is_gauge("tier.host.capacity_blocks") and not is_gauge("tier.host.evictions")
    prom = _Prom(None, {}, ["model_name", "engine"], {0: ["m", "0"]})
    for _ in range(2):
        prom.observe(a.data)
    metrics = {m.name: m.values for m in vars(prom).values() if isinstance(m, _Metric)}
    metrics.update({m.name: m.values for group in (prom._tier_gauges, prom._tier_counters)
                    for m in group.values()})
    key = ("m", "0", "host")
    assert metrics["vllm:kvshuttle_tier_blocks"] == {key: 3} and metrics["vllm:kvshuttle_tier_bytes"] == {key: 300}
    assert metrics["vllm:kvshuttle_tier_demotions"] == {key: 6} and metrics["vllm:kvshuttle_tier_reads"] == {key: 6}
    assert metrics["vllm:kvshuttle_tier_misses"] == {key: 2}


# ---------------------------------------------------------------------------------------------- TP > 1
def test_a_landing_frees_on_every_rank_without_ending_and_a_tier_end_ends_everywhere() -> None:
    s = tp_scheduler(**TIER)
    s.set_ranks({0: H0, 1: H1})
    assert finish(s, "d1")[0] and finish(s, "d2")[0] and finish(s, "d3")[0]
    s.build_connector_meta()
    assert s.update_connector_output({"d1", "d2"}, None) == ({"d1", "d2"}, set())  # landed on every rank
    assert s.state_sizes()["tiered"] == 2 and s.state_sizes()["held"] == 1
    s.update_connector_output(None, None, None, {"d1"})  # d1 ended in rank 0's tier
    assert s.build_connector_meta().releases == ["d1"] and s.state_sizes()["tiered"] == 1
    s.update_connector_output(None, None, None, {"d1"})  # the other rank's own end, a step later
    assert s.build_connector_meta().releases == []
    s.update_connector_output({"d3"}, None, None, {"d3"})  # ended on a rank in the report that frees it:
    assert s.state_sizes()["tiered"] == 1  # another rank's report may have been a landing, so every rank ends it
    assert s.build_connector_meta().releases == ["d3"] and s.state_sizes()["releases"] == 0
    plain = tp_scheduler()
    plain.set_ranks({0: H0, 1: H1})
    assert finish(plain, "d1")[0]
    plain.update_connector_output({"d1"}, None)
    assert plain.state_sizes()["tiered"] == 0  # without a tier a freed request is over


def test_at_tp2_a_demotion_keeps_the_retention_on_every_rank_until_one_rank_ends_it(
        make_rank: Any) -> None:  # noqa: F811
    w0, w1 = make_rank(0, **TIER), make_rank(1, **TIER)
    assert w0.ledger is not None and w1.ledger is not None
    engine = Engine(tp_scheduler(**TIER), [w0, w1])
    params = engine.finish("d1")
    handle_id = params["kvshuttle_handle_id"]
    until(engine.step, lambda _: engine.freed == ["d1"])
    assert engine.freed == ["d1"], engine.remaining  # every rank's demotion landed: vLLM frees the blocks
    for w in (w0, w1):  # still live on both ranks, in their tiers: no rank's landing ended it on the other
        assert w.ledger.get(handle_id) is not None  # type: ignore[union-attr]
        assert w.ledger.metrics()["tiers"]["host"]["blocks"] == 4  # type: ignore[union-attr]
    assert all(m.releases == [] for m in engine.metas)
    assert engine.scheduler.state_sizes()["tiered"] == 1
    assert w0.ledger.release(handle_id)  # a router's release through rank 0 (or rank 0's tier TTL, eviction)
    engine.step()
    engine.step()
    assert engine.metas[-1].releases == ["d1"] and len(w1.ledger) == 0  # ended on rank 1 too
    for _ in range(2):
        engine.step()
    assert [m.releases for m in engine.metas[-2:]] == [[], []] and engine.freed == ["d1"]
    assert no_state(engine.scheduler.state_sizes())
    for w in (w0, w1):
        assert no_state(w.state_sizes()) and w.ledger.metrics()["tiers"]["host"]["blocks"] == 0  # type: ignore
    assert "stray_report" not in engine.scheduler.counts
