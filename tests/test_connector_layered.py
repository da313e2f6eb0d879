"""Layer-pipelined loads through the connector's two sides, without vLLM (``kvshuttle_load_mode``).

A real decode worker (its own TransferEngine, ledger and side channel over a vLLM 0.32 CPU cache) retains a finished
request's blocks; a prefill scheduler decides the next turn's read and answers vLLM with a *synchronous* load of
whole blocks; the prefill worker starts it and the test plays vLLM's forward pass: ``wait_for_layer`` for each
layer in order, then settles the step. After each layer's wait that layer's bytes must equal the decode's, byte for
byte, in permuted, poisoned target blocks. Every way the load can go wrong (a refused claim, an owner that is not
there, a layer computed without waiting, an unknown layer name, a load that could not start) must report exactly
the load's blocks invalid in that same step, never the request in ``finished_recving`` (vLLM asserts a synchronous
load never appears there), and never hang a layer past the load's deadline. ``tests/e2e`` runs the same code in
real vLLM engines."""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")
pytest.importorskip("zmq")

from conftest import POISON, Geo, HostCache, make_cache
from kvshuttle.core.layout import PagedKVCache, vllm_layer_index
from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.config import ConnectorConfigError
from kvshuttle.integrations.vllm.connector import KVShuttleConnector
from kvshuttle.integrations.vllm.metadata import LoadJob, ShuttleHandshake, ShuttleMetadata
from kvshuttle.integrations.vllm.scheduler import ShuttleScheduler
from kvshuttle.integrations.vllm.worker import ShuttleWorker
from kvshuttle.policy import Decision, parse_handle
from kvshuttle.policy.decision import Reason
from kvshuttle.transfer import LayerProgress
from prefix_cache_double import PrefixCacheDouble
from test_vllm_scheduler import SECRET, granted, request, words

pytestmark = pytest.mark.timeout(120)

BS = 16
GEO = Geo("vllm_cpu_attn", dtype="float32", num_layers=4, num_blocks=64, block_size=BS, num_heads=2, head_size=16,
          layout="LBHNC")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(GEO.num_layers)]
HISTORY = 200  # the decode holds 199 computed tokens: 12 whole blocks and 7 tokens of a 13th
DECODE_BLOCKS = list(range(40, 53))
TIMEOUT = {"kvshuttle_load_timeout_s": 5.0, "kvshuttle_layered_timeout_s": 3.0}


def worker(engine_id: str, seed: int, **extra: Any) -> tuple[ShuttleWorker, HostCache]:
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **TIMEOUT, **extra}, model="m")
    w = ShuttleWorker(config, engine_id, BS, secret=SECRET)
    cache = make_cache(np.random.default_rng(seed), GEO)
    w.register_kv_caches(dict(zip(NAMES, cache.layers, strict=True)), "CPU_ATTN")
    return w, cache


def scheduler(engine_id: str, tp_size: int = 1, num_layers: int = GEO.num_layers, **extra: Any) -> ShuttleScheduler:
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **TIMEOUT, **extra}, model="m")
    s = ShuttleScheduler(config, engine_id, BS, secret=SECRET, tp_size=tp_size, num_layers=num_layers)
    s.bind_prefix_cache(PrefixCacheDouble(BS))  # what the facade finds in vLLM (sync_loads.py)
    return s


@pytest.fixture(scope="module")
def decode() -> Iterator[tuple[ShuttleWorker, HostCache, ShuttleScheduler]]:
    w, cache = worker("dec", 1)
    s = scheduler("dec")
    handshake = w.handshake()
    assert handshake is not None
    s.address = handshake
    try:
        yield w, cache, s
    finally:
        w.shutdown()


@pytest.fixture
def prefill() -> Iterator[tuple[ShuttleWorker, HostCache]]:
    w, cache = worker("pre", 2)
    try:
        yield w, cache
    finally:
        w.shutdown()


def decode_turn(decode: tuple[ShuttleWorker, HostCache, ShuttleScheduler], seed: int) -> tuple[list[int],
                                                                                             dict[str, Any]]:
    """A decode request that finished holding HISTORY - 1 tokens in DECODE_BLOCKS, retained by the real worker."""
    w, _, s = decode
    history = words(HISTORY, seed=seed)
    req = request(f"d{seed}", history[:-8], granted({"remote_engine_id": "p"}), output=history[-8:])
    keep, params = s.request_finished(req, [DECODE_BLOCKS])
    assert keep and params is not None
    w.start(s.build_connector_meta())
    return history, params


def schedule(s: ShuttleScheduler, history: list[int], params: dict[str, Any], table: list[int],
             rid: str = "t2") -> tuple[tuple[int, bool], ShuttleMetadata]:
    """The next turn (the history, then 40 new tokens) as vLLM's scheduler admits it: matched tokens, then the
    allocation, then the step's metadata."""
    req = request(rid, [*history[:HISTORY - 1], *words(40, seed=99)], dict(params))
    answer = s.get_num_new_matched_tokens(req, 0)
    if answer[0]:
        if s.sync_loads is not None and isinstance(s.sync_loads.cache, PrefixCacheDouble):
            s.sync_loads.cache.allocate(rid, table, len(req.prompt_token_ids))  # vLLM's allocate_slots
        s.update_state_after_alloc(req, [table], answer[0])
    return answer, s.build_connector_meta()


def layer_blocks(cache: HostCache, layer: int, ids: Any) -> np.ndarray[Any, Any]:
    return np.array(cache.canonical(layer)[:, np.asarray(ids, dtype=np.int64)])


def poison(cache: HostCache, ids: Any) -> None:
    for layer in range(GEO.num_layers):
        cache.canonical(layer)[:, np.asarray(ids, dtype=np.int64)] = POISON


def table() -> list[int]:
    return [int(b) for b in np.random.default_rng(5).permutation(GEO.num_blocks)[:16]]  # 16 blocks hold 239 tokens


def step_report(w: ShuttleWorker) -> tuple[set[str], set[int]]:
    """What vLLM reads after the forward pass: wait_for_save, then finished_recving, then the invalid blocks."""
    w.settle_layered()
    _, recving = w.finished(set())
    return recving, w.load_errors()


# ------------------------------------------------------------------------------------------------ success
def test_each_layer_has_landed_byte_for_byte_when_its_wait_returns(decode: Any, prefill: Any) -> None:
    history, params = decode_turn(decode, 1)
    reader, local = prefill
    s = scheduler("pre", kvshuttle_load_mode="layered")
    targets = table()
    (tokens, asynchronous), meta = schedule(s, history, params, targets)
    assert (tokens, asynchronous) == (192, False)  # 199 verified, cut to 12 whole blocks, loaded in this step
    (load,) = meta.loads
    assert load.layered and load.local_block_ids == tuple(targets[:12])
    assert s.state_sizes()["awaiting"] == 0  # vLLM waits for no finished_recving of a synchronous load
    poison(local, targets)
    reader.start(meta)
    for layer, name in enumerate(NAMES):
        reader.wait_for_layer(name)
        assert np.array_equal(layer_blocks(local, layer, targets[:12]), layer_blocks(decode[1], layer,
                                                                                     DECODE_BLOCKS[:12])), layer
    recving, invalid = step_report(reader)
    assert recving == set() and invalid == set()
    assert np.all(layer_blocks(local, 0, targets[12:]) == POISON)  # the partial 13th block was not read
    stats = reader.take_stats().data
    assert stats["read.fetched"] == 1 and stats["layered.loads"] == 1 and stats["layered.wait_s"] >= 0
    assert reader.state_sizes()["loading"] == 0 and len(reader.layered) == 0


def test_through_the_facade_wait_for_save_settles_the_step(decode: Any, prefill: Any) -> None:
    history, params = decode_turn(decode, 2)
    reader, local = prefill
    facade = KVShuttleConnector.__new__(KVShuttleConnector)
    facade._attach(None, reader)
    s = scheduler("pre", kvshuttle_load_mode="layered")
    targets = table()
    _, meta = schedule(s, history, params, targets)
    reader.start(meta)
    for name in NAMES:
        facade.wait_for_layer_load(name)
    facade.wait_for_save()
    assert len(reader.layered) == 0 and facade.get_block_ids_with_load_errors() == set()
    assert facade.get_finished(set()) == (None, None)
    for layer in range(GEO.num_layers):
        assert np.array_equal(layer_blocks(local, layer, targets[:12]), layer_blocks(decode[1], layer,
                                                                                     DECODE_BLOCKS[:12]))


# ----------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize(("seed", "waits"), [
    (3, NAMES[:2] + NAMES[3:]),  # layer 2 is never waited for (an attention backend that skips the hook)
    (4, [name + ".renamed" for name in NAMES]),  # names the registered cache does not know: nothing credited
])
def test_a_layer_computed_without_a_good_wait_makes_the_load_recompute(decode: Any, prefill: Any, seed: int,
                                                                        waits: list[str]) -> None:
    history, params = decode_turn(decode, seed)
    reader, _ = prefill
    s = scheduler("pre", kvshuttle_load_mode="layered")
    _, meta = schedule(s, history, params, table())
    reader.start(meta)
    for name in waits:
        reader.wait_for_layer(name)
    assert step_report(reader) == (set(), set(meta.loads[0].local_block_ids))
    assert reader.take_stats().data["read.transfer_failed"] == 1


def test_a_refused_claim_ends_every_wait_at_once_and_reports_the_blocks(decode: Any, prefill: Any) -> None:
    history, params = decode_turn(decode, 5)
    handle = parse_handle(params, secret=SECRET)
    assert decode[0].ledger is not None and not isinstance(handle, str) and handle is not None
    assert decode[0].ledger.release(handle.handle_id)  # gone on the decode before the prefill reads it
    reader, local = prefill
    s = scheduler("pre", kvshuttle_load_mode="layered")
    targets = table()
    _, meta = schedule(s, history, params, targets)
    poison(local, targets)
    reader.start(meta)
    started = time.monotonic()
    for name in NAMES:
        reader.wait_for_layer(name)
    assert time.monotonic() - started < 2.5  # the refusal ends the waits; nowhere near the 3 s deadline each
    recving, invalid = step_report(reader)
    assert recving == set() and invalid == set(targets[:12])
    assert np.all(layer_blocks(local, 0, targets) == POISON)  # nothing was written
    assert reader.take_stats().data["read.claim_refused"] == 1


def test_an_owner_that_is_not_there_costs_at_most_the_deadline(prefill: Any, decode: Any) -> None:
    history, _ = decode_turn(decode, 6)
    dead = ShuttleScheduler(decode[2].config, "dec", BS, secret=SECRET)
    dead.address = ShuttleHandshake("127.0.0.1", 1)  # nothing listens there
    req = request("d-dead", history[:-8], granted({"remote_engine_id": "p"}), output=history[-8:])
    _, dead_params = dead.request_finished(req, [DECODE_BLOCKS])
    assert dead_params is not None
    reader, _ = prefill
    s = scheduler("pre", kvshuttle_load_mode="layered")
    _, meta = schedule(s, history, dead_params, table())
    reader.start(meta)
    started = time.monotonic()
    for name in NAMES:
        reader.wait_for_layer(name)
    assert time.monotonic() - started < TIMEOUT["kvshuttle_layered_timeout_s"] + 1.0
    assert step_report(reader) == (set(), set(meta.loads[0].local_block_ids))


def test_a_layered_load_that_cannot_start_is_reported_invalid_never_received(prefill: Any) -> None:
    reader, _ = prefill
    s = scheduler("pre", kvshuttle_load_mode="layered")
    history = words(HISTORY, seed=7)
    req = request("t-fail", history, {})
    s._decisions["t-fail"] = (0, *_fake_decision(), True)  # as if get_num_new_matched_tokens said synchronous
    s.fail_load(req, [[7, 8, 9]], 2 * BS, "a bug while scheduling it")
    meta = s.build_connector_meta()
    (load,) = meta.loads
    assert load.layered and load.failure and s.state_sizes()["awaiting"] == 0
    reader.start(meta)
    assert step_report(reader) == (set(), {7, 8})


def _fake_decision() -> tuple[Any, Any]:
    return Decision("fetch", Reason.FETCH, "test", fetch_tokens=2 * BS, reused_tokens=2 * BS,
                    fetch_blocks=range(2), remote_block_ids=(0, 1), block_size=BS), None


# ------------------------------------------------------------------------------------- the scheduler's choice
def test_async_mode_keeps_vllms_asynchronous_load(decode: Any) -> None:
    history, params = decode_turn(decode, 8)
    s = scheduler("pre")  # the default
    (tokens, asynchronous), meta = schedule(s, history, params, table())
    assert (tokens, asynchronous) == (199, True) and not meta.loads[0].layered
    assert s.state_sizes()["awaiting"] == 1


def test_less_than_a_block_to_read_layer_by_layer_is_read_asynchronously() -> None:
    s = scheduler("pre", kvshuttle_load_mode="layered", kv_recompute_threshold=1)
    decision, _ = _fake_decision()
    short = replace(decision, fetch_tokens=BS - 1, reused_tokens=BS - 1, fetch_blocks=range(1),
                    remote_block_ids=(0,))
    assert short.whole_blocks() is None
    assert decision.whole_blocks() is decision  # already whole blocks
    cut = replace(decision, fetch_tokens=2 * BS - 3).whole_blocks()
    assert cut is not None and (cut.fetch_tokens, cut.fetch_blocks, cut.remote_block_ids) == (BS, range(1), (0,))
    assert s.config.load_mode == "layered"


PAYS = {"kv_bytes_per_token": 64, "bandwidth_bytes_per_s": 1e9, "prefill_tokens_per_s": 1}


@pytest.mark.parametrize(("reader_tp", "layers", "cost", "layered"), [
    (1, 4, PAYS, True),  # same TP (direct reads), several layers, an estimate that says it pays: layer by layer
    (1, 4, None, False),  # no estimate: never layer by layer (it would hold up the step on a guess)
    (2, 4, PAYS, False),  # owner at TP=1, reader at TP=2: head slices are packed and land whole
    (1, 1, PAYS, False),  # one layer: nothing to overlap
    (1, 4, {"kv_bytes_per_token": 2**20, "bandwidth_bytes_per_s": 1e6, "prefill_tokens_per_s": 0.01},
     False),  # the cost model expects a read longer than half of kvshuttle_layered_timeout_s
    (1, 4, "cpu host", False),  # the copy shares the compute cores: measured slower (benchmarks/README.md)
])
def test_auto_reads_layer_by_layer_where_it_pays(decode: Any, reader_tp: int, layers: int,
                                                 cost: dict[str, float] | str | None, layered: bool) -> None:
    history, params = decode_turn(decode, 9)
    extra: dict[str, Any] = {"kvshuttle_load_mode": "auto"}
    if isinstance(cost, dict) or cost == "cpu host":
        extra["kvshuttle_cost_model"] = PAYS if cost == "cpu host" else cost
    s = scheduler("pre", tp_size=reader_tp, num_layers=layers, **extra)
    s.cpu_host = cost == "cpu host"
    (tokens, asynchronous), meta = schedule(s, history, params, table())
    assert tokens > 0 and asynchronous is not layered and meta.loads[0].layered is layered


def test_load_mode_settings_are_checked() -> None:
    with pytest.raises(ConnectorConfigError, match="kvshuttle_load_mode"):
        ShuttleConfig.from_extra({"kvshuttle_load_mode": "sync"})
    with pytest.raises(ConnectorConfigError, match="kvshuttle_layered_timeout_s"):
        ShuttleConfig.from_extra({"kvshuttle_layered_timeout_s": 0})
    config = ShuttleConfig.from_extra({"kvshuttle_load_mode": "auto", "kvshuttle_layered_timeout_s": "0.5"})
    assert (config.load_mode, config.layered_timeout_s) == ("auto", 0.5)


# ------------------------------------------------------------------------------------------ the pieces
def test_layer_progress_never_outlasts_its_timeout_and_ends_once() -> None:
    p = LayerProgress(3)
    started = time.monotonic()
    assert not p.wait(0, 0.05) and time.monotonic() - started < 1.0
    p.advance(2)
    assert p.wait(1, 0.0) and not p.wait(2, 0.01)
    p.end(False)
    assert not p.wait(0, 0.0) and p.ended is False  # a failed read credits no layer, landed or not
    p.end(True)
    p.advance(3)
    assert p.ended is False and p.landed == 2  # an end is final
    ok = LayerProgress(2)
    ok.end(True)
    assert ok.wait(1, 0.0) and ok.landed == 2


def test_layer_names_map_to_the_caches_layers_and_shared_views_share_one() -> None:
    cache = make_cache(np.random.default_rng(3), GEO)
    views = {"a": cache.layers[0], "b": cache.layers[1], "b_shared": cache.layers[1], "c": cache.layers[2],
             "d": cache.layers[3]}
    assert vllm_layer_index(views) == {"a": 0, "b": 1, "b_shared": 1, "c": 2, "d": 3}
    assert PagedKVCache.from_vllm(views, "CPU_ATTN").geometry.num_layers == 4


def test_a_layered_job_survives_pickling() -> None:
    decision, _ = _fake_decision()
    job = LoadJob("r", None, decision, (1, 2), 64, 0.0, failure="x", layered=True)
    assert pickle.loads(pickle.dumps(job)) == job


# ---------------------------------------------------------------------------------- kvshuttle_transfer_cpus
def _allowed(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


def test_transfer_threads_stay_on_their_cpus(decode: Any) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    target = [cpus[-1]]
    w, _ = worker("pinned", 3, kvshuttle_transfer_cpus=target)
    try:
        assert w._transfer_tids, "the transfer engine started threads (NIXL progress, side channel)"
        assert all(_allowed(t) == set(target) for t in w._transfer_tids if os.path.exists(f"/proc/self/task/{t}"))
        assert _allowed(0) == set(cpus)  # the engine's own thread is left where it was
        for t in w._transfer_tids:  # something pins the whole process elsewhere; the next load moves them back
            with contextlib.suppress(OSError):
                os.sched_setaffinity(t, set(cpus))
        history, params = decode_turn(decode, 10)
        s = scheduler("pinned", kvshuttle_load_mode="layered")
        _, meta = schedule(s, history, params, table())
        w.start(meta)
        for name in NAMES:
            w.wait_for_layer(name)
        assert step_report(w) == (set(), set())
        assert all(_allowed(t) == set(target) for t in w._transfer_tids if os.path.exists(f"/proc/self/task/{t}"))
    finally:
        w.shutdown()


def test_transfer_cpus_are_checked() -> None:
    for bad in ([], [-1], ["1"], 3, [True]):
        with pytest.raises(ConnectorConfigError, match="kvshuttle_transfer_cpus"):
            ShuttleConfig.from_extra({"kvshuttle_transfer_cpus": bad})
    assert ShuttleConfig.from_extra({"kvshuttle_transfer_cpus": [1, 0, 1]}).transfer_cpus == (0, 1)
    outside = max(os.sched_getaffinity(0)) + 1000
    config = ShuttleConfig.from_extra({"kvshuttle_transfer_cpus": [outside], **TIMEOUT}, model="m")
    w = ShuttleWorker(config, "bad", BS, secret=SECRET)
    with pytest.raises(ConnectorConfigError, match="not among"):
        w.register_kv_caches(dict(zip(NAMES, make_cache(np.random.default_rng(4), GEO).layers, strict=True)),
                             "CPU_ATTN")
    w.shutdown()
