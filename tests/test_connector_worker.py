"""The connector's worker side on its own (a real TransferEngine over a small vLLM 0.32 CPU cache, no vLLM):
loads run concurrently on a bounded pool, each load's deadline counts from the scheduling decision (time queued
counts too), loads that cannot start are reported failed at once, NIXL notifications are drained every step,
and finished ids of requests the worker does not track are not kept."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")
pytest.importorskip("zmq")

from conftest import Geo, make_cache
from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.metadata import LoadJob, ShuttleMetadata
from kvshuttle.integrations.vllm.worker import ShuttleWorker
from kvshuttle.policy import Decision, KVHandle
from kvshuttle.policy.decision import Reason
from kvshuttle.reuse import ReuseResult
from kvshuttle.transfer import EngineConfig, TransferEngine
from kvshuttle.trust import DeploymentSecret

pytestmark = pytest.mark.timeout(120)

BS = 32
SECRET = DeploymentSecret(b"connector-worker-tests" * 2)
GEO = Geo("vllm_cpu_attn", dtype="float32", num_layers=2, num_blocks=64, block_size=BS, num_heads=2, head_size=16,
          layout="LBHNC")
LOAD_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def worker() -> Iterator[ShuttleWorker]:
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, "kvshuttle_max_concurrent_loads": 4,
                                       "kvshuttle_load_timeout_s": LOAD_TIMEOUT_S}, model="m")
    w = ShuttleWorker(config, "eng", BS, secret=SECRET)
    host = make_cache(np.random.default_rng(0), GEO)
    w.register_kv_caches({f"layer.{i}": x for i, x in enumerate(host.layers)}, "CPU_ATTN")
    try:
        yield w
    finally:
        w.shutdown()


def job(i: int, *, decided_at: float | None = None, failure: str = "") -> LoadJob:
    handle = KVHandle("far", f"r{i}", "127.0.0.1", 1, (0, 1), 64, time.time() + 60, 1, f"h{i}", 0, BS,
                      (b"\x01" * 16, b"\x02" * 16), time.time(), 60.0)
    decision = Decision("fetch", Reason.FETCH, "test", fetch_tokens=63, reused_tokens=63, fetch_blocks=range(2),
                        remote_block_ids=(0, 1), block_size=BS)
    return LoadJob(f"req-{i}", None if failure else handle, decision, (2 * i, 2 * i + 1), 64,
                   time.monotonic() if decided_at is None else decided_at, failure=failure)


def fetched(job: LoadJob) -> ReuseResult:
    return ReuseResult("fetched", "fetch", "ok", job.num_tokens, 0, 63, (), job.decision)


def collect(w: ShuttleWorker, count: int, timeout_s: float) -> tuple[dict[str, float], set[int]]:
    """Step until ``count`` loads are reported: {request id: seconds to its report}, the blocks reported invalid."""
    started, seen, invalid = time.monotonic(), {}, set()
    while len(seen) < count and time.monotonic() - started < timeout_s:
        _, done = w.finished(set())
        invalid |= w.load_errors()
        seen.update({rid: time.monotonic() - started for rid in done})
        time.sleep(0.005)
    return seen, invalid


def test_loads_run_concurrently_on_a_bounded_pool(worker: ShuttleWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight loads of 0.3 s on four loader threads: four at once (a barrier only four concurrent loads pass),
    never more, two waves rather than eight."""
    assert worker.reader is not None
    lock, active, peak = threading.Lock(), [0], [0]
    barrier = threading.Barrier(4, timeout=10.0)

    def fetch(decision: Any, handle: Any, local_ids: Any, num_tokens: int, **kwargs: Any) -> ReuseResult:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            barrier.wait()  # breaks (and the load fails) unless four run at once
            time.sleep(0.3)
        finally:
            with lock:
                active[0] -= 1
        return fetched(jobs[int(handle.request_id[1:])])

    monkeypatch.setattr(worker.reader, "fetch", fetch)
    jobs = [job(i) for i in range(8)]
    worker.start(ShuttleMetadata(loads=jobs))
    seen, invalid = collect(worker, 8, 20.0)
    assert set(seen) == {j.request_id for j in jobs} and not invalid, "every load fetched, none failed"
    assert peak[0] == 4
    assert worker.take_stats().data["read.fetched"] == 8


def test_the_deadline_counts_from_the_scheduling_decision(worker: ShuttleWorker,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker.reader is not None
    deadlines: list[float] = []

    def fetch(decision: Any, handle: Any, local_ids: Any, num_tokens: int, **kwargs: Any) -> ReuseResult:
        deadlines.append(kwargs["deadline"])
        return fetched(load)

    monkeypatch.setattr(worker.reader, "fetch", fetch)
    load = job(0, decided_at=time.monotonic() - 1.0)  # decided a second ago (the worker was busy)
    worker.start(ShuttleMetadata(loads=[load]))
    seen, _ = collect(worker, 1, 10.0)
    assert list(seen) == [load.request_id] and deadlines == [load.decided_at + LOAD_TIMEOUT_S]


def test_a_load_that_waited_out_its_deadline_fails_without_reading(worker: ShuttleWorker,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker.reader is not None
    calls: list[Any] = []
    monkeypatch.setattr(worker.reader, "fetch", lambda *a, **k: calls.append(a))
    late = job(3, decided_at=time.monotonic() - LOAD_TIMEOUT_S - 0.1)
    never = job(4, failure="the scheduler could not plan it")
    worker.start(ShuttleMetadata(loads=[late, never]))
    seen, invalid = collect(worker, 2, 10.0)
    assert set(seen) == {late.request_id, never.request_id} and not calls
    assert invalid == set(late.local_block_ids) | set(never.local_block_ids)  # vLLM recomputes them
    stats = worker.take_stats().data
    assert stats["read.transfer_timeout"] == 1 and stats["read.not_started"] == 1


def test_nixl_notifications_are_drained_every_step(worker: ShuttleWorker) -> None:
    """Every read of this worker's blocks leaves a NIXL notification in its agent; they are read (and counted)
    each step instead of piling up."""
    handshake = worker.handshake()
    assert handshake is not None
    cache = make_cache(np.random.default_rng(1), replace(GEO, num_blocks=8))
    reader = TransferEngine(cache.cache(), EngineConfig(secret=SECRET))
    try:
        peer = reader.connect(f"tcp://{handshake.host}:{handshake.port}")
        for _ in range(3):
            reader.read(peer, [], []).wait(10.0)  # an empty read: only its completion notification travels
        counted, deadline = 0, time.monotonic() + 10.0
        while counted < 3 and time.monotonic() < deadline:
            worker.finished(set())
            counted += worker.take_stats().data.get("notifications", 0)
            time.sleep(0.01)
        assert counted == 3
    finally:
        reader.close()


def test_finished_ids_of_requests_kept_nowhere_are_forgotten(worker: ShuttleWorker) -> None:
    """vLLM names every finished request to the worker; those it never retained must not pile up."""
    for step in range(20):
        worker.finished({f"gone-{step}-{i}" for i in range(50)})
    assert worker.state_sizes()["unmatched"] <= 50 * 9  # the last few steps' worth at most
    for _ in range(12):
        worker.finished(set())
    assert all(n == 0 for n in worker.state_sizes().values())


def test_a_released_cache_is_never_served_again() -> None:
    """vLLM 0.33 releases the KV cache on sleep or discard: every retention ends (reported finished sending), the
    side channel stops answering, and later loads recompute instead of reading."""
    from kvshuttle.integrations.vllm.connector import KVShuttleConnector
    from kvshuttle.policy import block_digests
    from kvshuttle.transfer import PeerUnreachableError

    assert KVShuttleConnector.supports_sleep_mode() is False  # vLLM refuses enable_sleep_mode with kvshuttle
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True}, model="m")
    w = ShuttleWorker(config, "sleepy", BS, secret=SECRET)
    host = make_cache(np.random.default_rng(5), GEO)
    w.register_kv_caches({f"layer.{i}": x for i, x in enumerate(host.layers)}, "CPU_ATTN")
    assert w.ledger is not None and w.engine is not None
    address = w.engine.address
    assert address is not None
    from kvshuttle.integrations.vllm.metadata import RetainJob

    w.start(ShuttleMetadata(retains=[RetainJob("req-s", "hs", (3, 4), tuple(block_digests(list(range(64)), BS)), 64,
                                               BS, 60.0, False)]))
    assert len(w.ledger) == 1
    w.finished({"req-s"})  # vLLM named it finished: its blocks wait for the retention to end
    try:
        w.release_cache()
        sending, _ = w.finished(set())
        assert sending == {"req-s"} and len(w.ledger) == 0
        reader = TransferEngine(make_cache(np.random.default_rng(6), GEO).cache(),
                                EngineConfig(secret=SECRET, connect_timeout_s=0.5))
        try:
            with pytest.raises(PeerUnreachableError):
                reader.connect(address)
        finally:
            reader.close()
        w.start(ShuttleMetadata(loads=[job(30)]))
        _, invalid = collect(w, 1, 10.0)
        assert invalid == {60, 61}  # the load recomputes: its target blocks are reported invalid
    finally:
        w.shutdown()


def test_a_published_handle_no_router_took_ends_when_the_board_drops_it() -> None:
    """A streamed turn's handle waits on the board for its router; one never taken (the router's take failed,
    the router died) can never be named by a next turn, so its retention ends when the board drops it (its blocks
    go back to vLLM then, not at the handle's TTL). A taken one stays retained; a rank other than 0 (no router
    takes from it) leaves it to rank 0."""
    from kvshuttle.integrations.vllm.metadata import Publication, RetainJob
    from kvshuttle.policy import block_digests

    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True}, model="m")
    digests = tuple(block_digests(list(range(64)), BS))
    params = {rid: {"kvshuttle_handle_id": f"h-{rid}", "kvshuttle_request_id": rid} for rid in ("taken", "left")}
    for rank in (0, 1):
        w = ShuttleWorker(config, f"board{rank}", BS, secret=SECRET, tp_rank=rank, tp_size=2, num_kv_heads=4)
        host = make_cache(np.random.default_rng(7), GEO)
        w.register_kv_caches({f"layer.{i}": x for i, x in enumerate(host.layers)}, "CPU_ATTN")
        assert w.ledger is not None
        try:
            w.board.ttl_s = 0.3
            w.start(ShuttleMetadata(
                retains=[RetainJob(rid, f"h-{rid}", (2 * i, 2 * i + 1), digests, 64, BS, 60.0, False)
                         for i, rid in enumerate(params)],
                publications=[Publication(rid, f"key-{rid}", p) for rid, p in params.items()]))
            w.finished(set(params))  # vLLM named both finished: their blocks wait for their retentions
            assert w.board.take("key-taken") == (True, params["taken"])
            time.sleep(0.4)
            sending, _ = w.finished(set())
            assert len(w.board) == 0 and w.board.dropped == 1
            if rank == 0:
                assert sending == {"left"} and len(w.ledger) == 1
                assert w.take_stats().data.get("board.unclaimed_released") == 1
                assert w.worker_meta() is not None  # TP > 1: the scheduler ends it on every rank
            else:
                assert sending == set() and len(w.ledger) == 2
        finally:
            w.shutdown()
