"""The connector at tensor parallelism, without vLLM: the scheduler retains only once every rank reported its side
channel and then issues handles that name every rank (under the MAC); a retention that ends on one rank (a
release through its side channel, an eviction, a refusal) is reported in that rank's worker metadata, and the
next step's metadata ends it on every rank exactly once, so that every rank reports the request finished sending
(vLLM frees the blocks only then). Real ShuttleWorkers (a real TransferEngine over a small vLLM 0.32 CPU cache,
each rank holding half the KV heads) play the ranks; the facade is driven the way vLLM 0.33 drives it
(``KVOutputAggregator``: a request is finished sending once every rank reported it, worker metadata folded
with ``aggregate``). Also: ``compat.parallel_layout``, the facade's TP start-up, ``kvshuttle_peer_timeout_s``."""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from conftest import make_cache
from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm import connector as connector_module
from kvshuttle.integrations.vllm.compat import Parallel, parallel_layout
from kvshuttle.integrations.vllm.config import ConnectorConfigError
from kvshuttle.integrations.vllm.connector import KVShuttleConnector
from kvshuttle.integrations.vllm.metadata import RetainJob, ShuttleHandshake, ShuttleMetadata, ShuttleWorkerMeta
from kvshuttle.integrations.vllm.scheduler import ShuttleScheduler
from kvshuttle.integrations.vllm.stats import ShuttleStats
from kvshuttle.integrations.vllm.worker import ShuttleWorker
from kvshuttle.policy import HandleFormatError, KVHandle, block_digests, parse_handle
from test_vllm_scheduler import BS, SECRET, granted, request, words

pytestmark = pytest.mark.timeout(120)

H0 = ShuttleHandshake("127.0.0.1", 5601, 0)
H1 = ShuttleHandshake("127.0.0.1", 5602, 1)
TP, HEADS = 2, 4  # two ranks, each holding 2 of the model's 4 KV heads (test_connector_worker's GEO: 2 heads)


def tp_scheduler(tp_size: int = TP, **extra: Any) -> ShuttleScheduler:
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **extra}, model="m")
    return ShuttleScheduler(config, "eng", BS, secret=SECRET, tp_size=tp_size)


def finish(s: ShuttleScheduler | KVShuttleConnector, rid: str, tokens: int = 300,
           first: int = 0) -> tuple[bool, dict[str, Any] | None]:
    """A granted decode request ``rid`` finished holding ``tokens - 1`` computed tokens (10 blocks at 300) in
    blocks ``first``, ``first + 1``, ..."""
    history = history_of(rid, tokens)
    req = request(rid, history[:-8], granted({"remote_engine_id": "p"}), output=history[-8:])
    return s.request_finished(req, [list(range(first, first + -(-(tokens - 1) // BS)))])


def history_of(rid: str, tokens: int = 300) -> list[int]:
    return words(tokens, seed=sum(map(ord, rid)))


def no_state(sizes: dict[str, int]) -> bool:
    return all(n == 0 for n in sizes.values())


# ------------------------------------------------------------------------------------- scheduler: the ranks
def test_nothing_is_retained_until_every_rank_reported_its_side_channel() -> None:
    s = tp_scheduler()
    s.set_ranks({0: H0})  # rank 1 has not reported
    assert s.address is None and s.counts["ranks"] == 1
    assert finish(s, "d1") == (False, None)
    assert s.counts["address"] == 1 and s.build_connector_meta().retains == [] and no_state(s.state_sizes())
    for partial in ({1: H1}, {0: H0, 2: ShuttleHandshake("127.0.0.1", 5603, 2)},  # rank 1 missing
                    {0: H0, 1: H1, 2: ShuttleHandshake("127.0.0.1", 5603, 2)},  # a rank beyond tp_size
                    {0: H0, 1: SimpleNamespace(host="127.0.0.1", port=5602)},  # not a ShuttleHandshake
                    {0: H0, 1: ShuttleHandshake("127.0.0.1", 5602, 0)}):  # says it is rank 0, keyed as rank 1
        s.set_ranks(partial)
        assert s.address is None, partial
        assert finish(s, "d1") == (False, None)
    assert s.counts["ranks"] == 6
    s.address = H0  # the single-owner setter: one rank of two
    assert s.address is None
    s.set_ranks({1: H1, 0: H0})  # vLLM's dict, in any order
    assert s.address == H0 and finish(s, "d1")[0]
    s.set_ranks({0: H0})  # a later incomplete report: nothing retained any more
    assert s.address is None and finish(s, "d2") == (False, None)


def test_handles_name_every_rank_under_the_mac() -> None:
    s = tp_scheduler()
    s.set_ranks({1: H1, 0: H0})
    keep, params = finish(s, "d1")
    assert keep and params is not None
    assert params["tp_size"] == TP and params["kvshuttle_ranks"] == ["127.0.0.1:5601", "127.0.0.1:5602"]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 5601)  # rank 0 is the owner
    handle = KVHandle.from_kv_transfer_params(params, SECRET)
    assert handle.tp_size == TP and handle.ranks == ("127.0.0.1:5601", "127.0.0.1:5602")
    assert isinstance(parse_handle(params, secret=SECRET), KVHandle)
    (job,) = s.build_connector_meta().retains  # every rank retains this one handle
    assert (job.handle_id, job.block_ids) == (handle.handle_id, handle.block_ids)
    tampered = [
        {**params, "kvshuttle_ranks": ["127.0.0.1:5601", "10.6.6.6:5602"]},  # rank 1 redirected
        {**params, "kvshuttle_ranks": ["127.0.0.1:5601", "127.0.0.1:5603"]},
        {**params, "kvshuttle_ranks": ["127.0.0.1:5602", "127.0.0.1:5601"]},  # swapped
        {**params, "kvshuttle_ranks": ["127.0.0.1:5601"]},  # a rank dropped
        {**params, "kvshuttle_ranks": ["127.0.0.1:5601", "127.0.0.1:5602", "127.0.0.1:5603"], "tp_size": 3},
        {**params, "tp_size": 1, "kvshuttle_ranks": ["127.0.0.1:5601"]},
        {k: v for k, v in params.items() if k != "kvshuttle_ranks"},  # ranks stripped
    ]
    reader, prompt = tp_scheduler(), [*history_of("d1")[:299], 1]  # what d1 computed, then one more token
    assert reader.get_num_new_matched_tokens(request("g", prompt, dict(params, do_remote_decode=True)), 0) \
        == (299, True)  # the untouched handle reads everything
    for i, bad in enumerate(tampered):
        with pytest.raises(HandleFormatError):
            KVHandle.from_kv_transfer_params(bad, SECRET)
        assert reader.get_num_new_matched_tokens(request(f"t{i}", prompt, dict(bad, do_remote_decode=True)), 0) \
            == (0, False), i
    assert reader.counts["unauthenticated_handle"] + reader.counts.get("malformed_handle", 0) == len(tampered)


def test_at_tp1_handles_carry_no_rank_list() -> None:
    s = tp_scheduler(tp_size=1)
    s.set_ranks({0: H0})
    keep, params = finish(s, "d1")
    assert keep and params is not None and params["tp_size"] == 1 and "kvshuttle_ranks" not in params
    assert KVHandle.from_kv_transfer_params(params, SECRET).ranks == ()
    assert "ranks" not in s.counts


# ----------------------------------------------------------------------------------- scheduler: the ends
def held(*rids: str) -> ShuttleScheduler:
    s = tp_scheduler()
    s.set_ranks({0: H0, 1: H1})
    for rid in rids:
        assert finish(s, rid)[0]
    assert len(s.build_connector_meta().retains) == len(rids)
    return s


def test_an_end_on_one_rank_goes_to_every_rank_once() -> None:
    s = held("d1", "d2")
    assert s.update_connector_output(None, None, None, {"d1", "unknown"}) == (set(), set())
    assert s.build_connector_meta().releases == ["d1"]  # an id this side never kept is not sent anywhere
    assert s.state_sizes()["releases"] == 0 and s.state_sizes()["ending"] == 1
    s.update_connector_output(None, None, None, {"d1"})  # the other rank's own end report, a step later
    assert s.build_connector_meta().releases == []
    s.update_connector_output(set(), set(), set(), {"d1", "d2"})
    s.update_connector_output(None, None, None, {"d2"})  # reported twice before the next step: queued once
    assert s.build_connector_meta().releases == ["d2"]
    assert s.update_connector_output({"d1", "d2"}, None) == ({"d1", "d2"}, set())  # every rank reported them
    s.update_connector_output(None, None, None, {"d1"})  # a late end report for a freed request
    assert s.build_connector_meta().releases == []
    assert no_state(s.state_sizes())


def test_at_tp1_ended_is_ignored() -> None:
    s = tp_scheduler(tp_size=1)
    s.set_ranks({0: H0})
    assert finish(s, "d1")[0]
    s.build_connector_meta()
    s.update_connector_output(None, None, None, {"d1"})
    assert s.build_connector_meta().releases == [] and s.state_sizes()["ending"] == 0
    assert s.update_connector_output({"d1"}, None) == ({"d1"}, set()) and no_state(s.state_sizes())


def test_a_request_ended_and_freed_in_one_report_is_not_released_again() -> None:
    """Both ranks' sweeps expire a retention in the same step: vLLM's aggregated output then names the request in
    finished_sending and in the worker metadata's ``ended`` at once. It is no longer held, so the next step must
    not carry a release for it (a release goes by request id: with the id reused, a fresh retention taken in that
    very step, whose RetainJob a worker applies before the releases, would end at once)."""
    s = held("d1")
    assert s.update_connector_output({"d1"}, None, None, {"d1"}) == ({"d1"}, set())
    assert s.state_sizes()["releases"] == 0, "a release was queued for a request that is no longer held"
    assert s.build_connector_meta().releases == []


def test_worker_metadata_aggregates_as_vllm_folds_it() -> None:
    a, b = ShuttleWorkerMeta({"x"}), ShuttleWorkerMeta({"y", "x"})
    both = a.aggregate(b)
    assert both.ended == {"x", "y"} and a.ended == {"x"} and b.ended == {"y", "x"}  # neither is changed
    assert a.aggregate(SimpleNamespace()).ended == {"x"} and a.aggregate(ShuttleWorkerMeta()).ended == {"x"}
    assert fold([None, ShuttleWorkerMeta({"p"}), None, ShuttleWorkerMeta({"q"})]).ended == {"p", "q"}
    assert fold([None, None]) is None


def test_what_crosses_process_boundaries_survives_pickling() -> None:
    """vLLM's multiprocess executor pickles the handshakes (workers -> EngineCore), the step's metadata (->
    every rank) and the worker metadata (every rank -> EngineCore)."""
    for obj in (H1, ShuttleWorkerMeta({"a", "b"}), ShuttleMetadata(releases=["a"], retains=[retain_job("a", "h")])):
        assert pickle.loads(pickle.dumps(obj)) == obj
    assert pickle.loads(pickle.dumps(H1)).address == "127.0.0.1:5602"


def fold(metas: list[Any]) -> Any:
    """vLLM 0.33's KVOutputAggregator: the first worker's metadata (or None) accumulates the others'."""
    acc = None
    for meta in metas:
        if acc is None:
            acc = meta
        elif meta:
            acc = acc.aggregate(meta)
    return acc


# ------------------------------------------------------------------------------------------- the facade
def facade(scheduler: ShuttleScheduler | None, worker: Any = None) -> KVShuttleConnector:
    c = KVShuttleConnector.__new__(KVShuttleConnector)  # no vLLM: skip the base class's constructor
    c._attach(scheduler, worker)
    return c


def output(sending: set[str] | None = None, worker_meta: Any = None) -> SimpleNamespace:
    return SimpleNamespace(finished_sending=sending, finished_recving=None, invalid_block_ids=set(),
                           kv_connector_worker_meta=worker_meta)


def test_the_facade_takes_every_ranks_handshake_and_the_workers_ends() -> None:
    s = tp_scheduler()
    c = facade(s)
    c.set_xfer_handshake_metadata({0: H0, 1: object()})  # rank 1's is not ours
    assert s.address is None and c.request_finished(request("x", [1] * 40, None), [[0, 1]]) == (False, None)
    c.set_xfer_handshake_metadata({0: H0, 1: H1})
    assert s.address == H0
    assert finish(c, "d1")[0] and len(c.build_connector_meta(None).retains) == 1
    c.update_connector_output(SimpleNamespace(finished_sending=None, invalid_block_ids=set()))  # no worker meta
    c.update_connector_output(output(None, None))
    assert c.build_connector_meta(None).releases == []
    out = output(None, ShuttleWorkerMeta({"d1", "stranger"}))
    c.update_connector_output(out)
    assert out.finished_sending is None and c.build_connector_meta(None).releases == ["d1"]
    out = output({"d1"}, ShuttleWorkerMeta({"d1"}))
    c.update_connector_output(out)
    assert out.finished_sending == {"d1"} and c.build_connector_meta(None).releases == []
    assert no_state(s.state_sizes()) and not hook_errors(c)


def hook_errors(c: KVShuttleConnector) -> dict[str, Any]:
    stats = c.get_kv_connector_stats()
    return {k: v for k, v in (stats.data if stats is not None else {}).items() if k.startswith("hook_error")}


def test_build_connector_worker_meta_is_guarded() -> None:
    meta = ShuttleWorkerMeta({"r"})
    assert facade(None, SimpleNamespace(worker_meta=lambda: meta)).build_connector_worker_meta() is meta
    assert facade(None, SimpleNamespace(worker_meta=lambda: None)).build_connector_worker_meta() is None
    assert facade(tp_scheduler()).build_connector_worker_meta() is None  # the scheduler side has none

    def boom() -> Any:
        raise RuntimeError("a bug inside kvshuttle")

    c = facade(None, SimpleNamespace(worker_meta=boom, take_stats=lambda: ShuttleStats(data={})))
    assert c.build_connector_worker_meta() is None and c.build_connector_worker_meta() is None
    stats = c.get_kv_connector_stats()
    assert stats is not None and stats.data["hook_error.build_connector_worker_meta"] == 2


# --------------------------------------------------------------------------------- start-up: the layout
def vllm_config(extra: dict[str, Any] | None = None, /, **parallel: int) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(**parallel),
                           model_config=SimpleNamespace(model="m", get_total_num_kv_heads=lambda: 8,
                                                        dtype="torch.bfloat16"),
                           kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, engine_id="eng"),
                           cache_config=SimpleNamespace(block_size=BS))


def test_parallel_layout_takes_tensor_parallelism_only() -> None:
    assert parallel_layout(vllm_config(tensor_parallel_size=2)) == Parallel(2, 8)
    assert parallel_layout(vllm_config()) == Parallel(1, 8)  # older vLLMs: absent means 1
    assert parallel_layout(vllm_config(tensor_parallel_size=4, pipeline_parallel_size=1,
                                       prefill_context_parallel_size=1, decode_context_parallel_size=1)) \
        == Parallel(4, 8)
    for name in ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"):
        with pytest.raises(ValueError, match=name):
            parallel_layout(vllm_config(tensor_parallel_size=2, **{name: 2}))


def test_parallel_layout_counts_the_mla_latent_as_one_replicated_head() -> None:
    """vLLM's total KV heads of a DeepSeek model is its config's num_key_value_heads (8 here), but every rank's
    cache holds the one latent: the reader must plan with 1 head (else its shard check refuses the cache)."""
    mla = vllm_config(tensor_parallel_size=2)
    mla.model_config.use_mla = True
    assert parallel_layout(mla) == Parallel(2, 1)
    mla.model_config.use_mla = False
    assert parallel_layout(mla) == Parallel(2, 8)


class _Base:
    def __init__(self, *args: Any) -> None:  # stands in for vLLM's KVConnectorBase_V1 constructor
        pass


class _Probe(KVShuttleConnector, _Base):
    """The facade with a constructor base to call (without vLLM its base is ``object``)."""


ROLES = SimpleNamespace(SCHEDULER="scheduler", WORKER="worker")


def test_the_facade_starts_up_at_tp_and_refuses_other_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connector_module, "KVConnectorRole", ROLES)
    monkeypatch.setattr(connector_module, "worker_tp_rank", lambda: 1)
    monkeypatch.setattr(connector_module, "on_cpu", lambda: True)  # (asks vLLM's platform)
    monkeypatch.setenv("KVSHUTTLE_SECRET", "facade-start-up-secret-" * 2)
    monkeypatch.delenv("KVSHUTTLE_SECRET_FILE", raising=False)
    for name in ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"):
        with pytest.raises(ConnectorConfigError, match=name):
            _Probe(vllm_config({}, tensor_parallel_size=2, **{name: 2}), ROLES.WORKER)
    scheduler = _Probe(vllm_config({}, tensor_parallel_size=2), ROLES.SCHEDULER)._scheduler
    assert scheduler is not None and scheduler.tp_size == 2 and scheduler.cpu_host  # auto: never layered here
    worker = _Probe(vllm_config({"kvshuttle_peer_timeout_s": 3}, tensor_parallel_size=2), ROLES.WORKER)._worker
    assert worker is not None
    try:
        assert (worker.tp_rank, worker.tp_size, worker.num_kv_heads) == (1, 2, 8)
        assert worker.config.peer_timeout_s == 3.0
    finally:
        worker.shutdown()


def test_peer_timeout_is_a_checked_key() -> None:
    assert ShuttleConfig.from_extra({}).peer_timeout_s == 1.0
    assert ShuttleConfig.from_extra({"kvshuttle_peer_timeout_s": 2.5}).peer_timeout_s == 2.5
    for bad in (0, -1, "soon", True, float("inf"), None):
        with pytest.raises(ConnectorConfigError, match="kvshuttle_peer_timeout_s"):
            ShuttleConfig.from_extra({"kvshuttle_peer_timeout_s": bad})


# ----------------------------------------------------------------------------------- real worker ranks
def free_port_pair() -> int:
    """A loopback port p with p and p + 1 both free (rank 0 listens on p, rank 1 on p + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no two adjacent free ports")


Maker = Callable[..., ShuttleWorker]


@pytest.fixture
def make_rank() -> Iterator[Maker]:
    """Builds a real worker for one rank: its own cache shard (half the heads), its own engine and ledger."""
    pytest.importorskip("nixl._api")
    pytest.importorskip("zmq")
    from test_connector_worker import GEO  # 2 heads per shard, 64 blocks of BS tokens

    built: list[ShuttleWorker] = []

    def make(rank: int, tp_size: int = TP, num_kv_heads: int | None = HEADS, **extra: Any) -> ShuttleWorker:
        config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **extra}, model="m")
        w = ShuttleWorker(config, "eng", BS, secret=SECRET, tp_rank=rank, tp_size=tp_size, num_kv_heads=num_kv_heads)
        built.append(w)
        shard = make_cache(np.random.default_rng(rank), GEO)
        w.register_kv_caches({f"model.layers.{i}.self_attn": x for i, x in enumerate(shard.layers)}, "CPU_ATTN")
        return w

    try:
        yield make
    finally:
        for w in built:
            w.shutdown()


def retain_job(rid: str, handle_id: str, blocks: tuple[int, ...] = (3, 4)) -> RetainJob:
    tokens = len(blocks) * BS
    return RetainJob(rid, handle_id, blocks, tuple(block_digests(list(range(tokens)), BS)), tokens, BS, 60.0, False)


def test_each_rank_is_its_own_peer_on_port_plus_rank(make_rank: Maker) -> None:
    port = free_port_pair()
    w0 = make_rank(0, kvshuttle_port=port, kvshuttle_peer_timeout_s=2.5)
    w1 = make_rank(1, kvshuttle_port=port, kvshuttle_peer_timeout_s=2.5)
    assert w0.handshake() == ShuttleHandshake("127.0.0.1", port, 0)
    assert w1.handshake() == ShuttleHandshake("127.0.0.1", port + 1, 1)
    assert w0.engine is not None and w1.engine is not None and w0.reader is not None and w1.reader is not None
    assert (w0.engine.config.name, w1.engine.config.name) == ("kvshuttle-eng-tp0", "kvshuttle-eng-tp1")
    assert w0.engine.config.peer_timeout_s == w1.engine.config.peer_timeout_s == 2.5
    assert (w1.reader.tp_rank, w1.reader.tp_size, w1.reader.num_kv_heads) == (1, TP, HEADS)
    single = make_rank(0, tp_size=1, num_kv_heads=None)
    assert single.engine is not None and single.engine.config.name == "kvshuttle-eng"
    assert single.engine.config.peer_timeout_s == 1.0


def test_a_shard_that_does_not_match_the_split_refuses_to_start(make_rank: Maker) -> None:
    with pytest.raises(Exception, match="holds 1 of the 2 KV heads"):
        make_rank(1, num_kv_heads=2)  # 2 heads over 2 ranks is 1 per rank, but this shard has 2


def test_an_end_on_rank_0_is_reported_and_a_release_ends_it_on_rank_1(make_rank: Maker) -> None:
    w0, w1 = make_rank(0), make_rank(1)
    assert w0.ledger is not None and w1.ledger is not None
    meta = ShuttleMetadata(retains=[retain_job("req-t", "h-t")])
    for w in (w0, w1):
        w.start(meta)
        assert len(w.ledger) == 1 and w.worker_meta() is None  # type: ignore[arg-type]
        assert w.finished({"req-t"}) == (set(), set())  # vLLM named it finished: it waits for the retention
    assert w0.ledger.release("h-t")  # a router's release through rank 0's side channel, or an eviction there
    assert w0.worker_meta() == ShuttleWorkerMeta({"req-t"})
    assert w0.worker_meta() is None  # cleared by the call
    assert w1.worker_meta() is None and len(w1.ledger) == 1
    assert w0.finished(set())[0] == {"req-t"} and w1.finished(set())[0] == set()
    w1.start(ShuttleMetadata(releases=["req-t", "never-kept"]))
    assert len(w1.ledger) == 0
    assert w1.worker_meta() == ShuttleWorkerMeta({"req-t"})  # its own end too (the scheduler ignores it)
    assert w1.finished(set())[0] == {"req-t"}
    w0.start(ShuttleMetadata(releases=["req-t"]))  # a release after the report: nothing left to end
    for w in (w0, w1):
        assert w.finished(set())[0] == set() and w.worker_meta() is None
        assert no_state(w.state_sizes()) and w.ledger.metrics()["retained_blocks"] == 0  # type: ignore[union-attr]


def test_a_release_before_vllm_named_the_request_finished_waits_for_it(make_rank: Maker) -> None:
    w1 = make_rank(1)
    w1.start(ShuttleMetadata(retains=[retain_job("req-e", "h-e")]))
    w1.start(ShuttleMetadata(releases=["req-e"]))
    assert w1.finished(set())[0] == set()  # vLLM still runs it (or has not told this rank yet)
    assert w1.finished({"req-e"})[0] == {"req-e"}
    assert w1.finished(set())[0] == set() and no_state(w1.state_sizes())


def test_at_tp1_a_worker_reports_no_ends(make_rank: Maker) -> None:
    w = make_rank(0, tp_size=1, num_kv_heads=None)
    assert w.ledger is not None
    w.start(ShuttleMetadata(retains=[retain_job("req-1", "h-1")]))
    assert w.ledger.release("h-1") and w.worker_meta() is None
    assert w.finished({"req-1"})[0] == {"req-1"}


# ------------------------------------------------------------------------------------- the whole loop
class Engine:
    """vLLM 0.33's view of one engine at TP=2: the scheduler-side facade, one worker facade per rank, and the
    KVOutputAggregator between them (finished_sending once every rank reported; worker metadata folded)."""

    def __init__(self, scheduler: ShuttleScheduler, workers: list[ShuttleWorker]) -> None:
        self.scheduler, self.workers = scheduler, workers
        self.connector = facade(scheduler)
        self.ranks = [facade(None, w) for w in workers]
        self.connector.set_xfer_handshake_metadata({w.tp_rank: w.handshake() for w in workers})
        self.remaining: dict[str, int] = {}
        self.requests = 0
        self.finished_ids: set[str] = set()
        self.freed: list[str] = []  # what vLLM freed, in order
        self.metas: list[ShuttleMetadata] = []

    def finish(self, rid: str) -> dict[str, Any]:
        keep, params = finish(self.connector, rid, 100, first=4 * self.requests)  # 4 blocks each, its own
        assert keep and params is not None
        self.requests += 1
        self.finished_ids.add(rid)
        return params

    def step(self) -> None:
        meta = self.connector.build_connector_meta(None)
        assert isinstance(meta, ShuttleMetadata)
        self.metas.append(meta)
        finished, self.finished_ids = self.finished_ids, set()
        sent: set[str] = set()
        worker_metas = []
        for rank in self.ranks:
            rank._get_connector_metadata = lambda meta=meta: meta  # type: ignore[method-assign]
            rank.start_load_kv(None)
            sending, _ = rank.get_finished(finished)
            for rid in sending or ():
                left = self.remaining.get(rid, len(self.ranks)) - 1
                self.remaining[rid] = left
                if left == 0:
                    sent.add(rid)
                    del self.remaining[rid]
            worker_metas.append(rank.build_connector_worker_meta())
        out = output(sent or None, fold(worker_metas))
        self.connector.update_connector_output(out)
        assert out.finished_sending is None or out.finished_sending == sent
        self.freed.extend(sorted(out.finished_sending or ()))


def test_an_end_on_either_rank_frees_the_request_on_every_rank(make_rank: Maker) -> None:
    w0, w1 = make_rank(0), make_rank(1)
    assert w0.ledger is not None and w1.ledger is not None
    engine = Engine(tp_scheduler(), [w0, w1])
    p1, p2 = engine.finish("d1"), engine.finish("d2")
    assert p1["kvshuttle_ranks"] == [w0.handshake().address, w1.handshake().address]  # type: ignore[union-attr]
    engine.step()
    for ledger in (w0.ledger, w1.ledger):  # both ranks hold both handles: same ids, same blocks
        for params in (p1, p2):
            kept = ledger.get(params["kvshuttle_handle_id"])
            assert kept is not None and kept.block_ids == tuple(params["remote_block_ids"])
    engine.step()
    assert engine.freed == [] and engine.metas[-1].releases == []
    assert w0.ledger.release(p1["kvshuttle_handle_id"])  # d1 ends on rank 0 only
    assert w1.ledger.release(p2["kvshuttle_handle_id"])  # d2 on rank 1 only
    engine.step()  # each rank reports its own; neither request is free yet
    assert engine.freed == [] and engine.remaining == {"d1": 1, "d2": 1}
    engine.step()  # the releases reach every rank: the other rank ends and reports
    assert sorted(engine.metas[-1].releases) == ["d1", "d2"]
    assert engine.freed == ["d1", "d2"]
    for _ in range(3):
        engine.step()
    assert [m.releases for m in engine.metas[-3:]] == [[], [], []] and engine.freed == ["d1", "d2"]
    assert no_state(engine.scheduler.state_sizes()) and engine.remaining == {}
    for w in (w0, w1):
        assert no_state(w.state_sizes()) and w.ledger.metrics()["live_handles"] == 0  # type: ignore[union-attr]
        assert w.ledger.metrics()["retained_blocks"] == 0  # type: ignore[union-attr]
    assert "stray_report" not in engine.scheduler.counts  # no rank reported an id the scheduler did not hold
    assert not any(hook_errors(c) for c in (engine.connector, *engine.ranks))


def test_a_retention_refused_on_one_rank_ends_on_every_rank(make_rank: Maker) -> None:
    """Rank 1's budget cannot hold the request: it refuses (its blocks go back to vLLM at once), reports the
    end, and rank 0 is told to end its retention too, so that no handle names a shard nobody holds."""
    w0, w1 = make_rank(0), make_rank(1, kvshuttle_retention_budget_blocks=3)
    assert w0.ledger is not None and w1.ledger is not None
    engine = Engine(tp_scheduler(), [w0, w1])
    engine.finish("d1")  # 4 blocks
    engine.step()
    assert len(w0.ledger) == 1 and len(w1.ledger) == 0 and engine.remaining == {"d1": 1}
    engine.step()
    assert engine.metas[-1].releases == ["d1"] and engine.freed == ["d1"] and len(w0.ledger) == 0
    engine.step()
    assert no_state(engine.scheduler.state_sizes()) and engine.remaining == {}
    assert no_state(w0.state_sizes()) and no_state(w1.state_sizes())
