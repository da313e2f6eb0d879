"""Reads NIXL could not cancel keep their memory quarantined; a decode whose data path hangs freezes nothing else.

Real processes and real bytes: the decodes are ``kvshuttle demo``'s decode workers (paged cache, ledger, claims,
side channel) with UCX over TCP, and the stalled one freezes only the thread its UCX worker progresses on
(``stall_helpers.py``): its side channel, heartbeats and claims keep answering while no byte moves. NIXL 1.5 reports
the release of such a READ a success, and the bytes land when the decode's data path resumes; so the destination
blocks, the staging slots on both sides and the decode's pins may be used again only once NIXL reports the READ
over (``settlement``). Bounds are generous (a 2-core shared VM); the measured times are printed (``-s``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from kvshuttle.demo.workers import DemoShape, PagedWorker
from kvshuttle.policy import KVHandle, PolicyConfig, parse_handle
from kvshuttle.reuse import Failure, ReuseReader
from kvshuttle.transfer import TransferTimeoutError
from kvshuttle.transfer.config import Path
from stall_helpers import DecodeProcess, ucx_over_tcp

pytestmark = pytest.mark.timeout(180)

SHAPE = DemoShape(layers=2, kv_heads=2, head_size=64, block_size=16, cache_blocks=256, retention_budget_blocks=200)
POISON = 0xA5A5
SETTLE_S = 10.0  # the quarantine hands back within this of the data path resuming
STUCK_TIMEOUT_S = 3.0  # a read's deadline in the reuse tests
HEALTHY_READ_S = 1.0  # a healthy decode's read while another decode's data path hangs (well under the deadline)
DRAIN_S = 0.25  # one per-step notification drain, likewise


@pytest.fixture(scope="module")
def stalled() -> Iterator[DecodeProcess]:
    with DecodeProcess(SHAPE, stallable=True) as decode:
        yield decode


@pytest.fixture(scope="module")
def healthy() -> Iterator[DecodeProcess]:
    with DecodeProcess(SHAPE, stallable=False) as decode:
        yield decode


@pytest.fixture
def prefill() -> Iterator[PagedWorker]:
    with ucx_over_tcp():
        worker = PagedWorker(SHAPE, "prefill")
    try:
        yield worker
    finally:
        worker.engine.close()


@contextlib.contextmanager
def frozen(decode: DecodeProcess) -> Iterator[list[float]]:
    """The decode's data path is stopped inside the block; yields a list that gets the thaw's time."""
    thawed: list[float] = []
    assert decode.call("freeze_data") >= 1
    try:
        yield thawed
    finally:
        decode.call("thaw_data")
        thawed.append(time.monotonic())


def turn(decode: DecodeProcess, name: str, tokens: list[int]) -> dict[str, Any]:
    done = decode.call("finish_turn", conversation=name, request_id=f"{name}-{len(tokens)}", tokens=tokens,
                       held=len(tokens) - 1, ttl_s=None)
    params: dict[str, Any] = done["kv_transfer_params"]
    return params


def words(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 32_000, size=n)]


def poison(worker: PagedWorker, blocks: list[int]) -> None:
    for layer in worker.layers:
        layer[:, blocks] = POISON


def poisoned(worker: PagedWorker, blocks: list[int]) -> bool:
    return all(bool((layer[:, blocks] == POISON).all()) for layer in worker.layers)


def wait_for(condition: Any, timeout: float) -> float:
    """Seconds until ``condition()`` held (polled); AssertionError after ``timeout``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out waiting"
        time.sleep(0.005)
    return time.monotonic() - start


@pytest.mark.parametrize("path", ["direct", "packed"])
def test_an_uncancellable_read_keeps_its_memory_until_nixl_says_it_is_over(
        stalled: DecodeProcess, prefill: PagedWorker, path: Path) -> None:
    engine = prefill.engine
    history = words(1, 320)
    handle = parse_handle(turn(stalled, f"q-{path}", history), secret=engine.secret)
    assert isinstance(handle, KVHandle)
    count = len(handle.block_ids)
    blocks = prefill.allocate(count * SHAPE.block_size)
    poison(prefill, blocks)
    engine.pool.buffer[:] = 0xA5
    peer = engine.connect(stalled.address)
    ticket = engine.claim(peer, handle)  # an owner with a ledger packs only claimed blocks
    free_before, owner_free_before = engine.stats()["staging_free"], stalled.call("staging_free")
    other = words(2, count * SHAPE.block_size)
    recomputed = threading.Event()

    def recompute() -> None:  # what vLLM does with blocks the moment it hears they failed: another request's KV
        if read.settlement.wait(SETTLE_S + 5):
            prefill.write(blocks, other, 0, len(other))
            recomputed.set()

    with frozen(stalled) as thawed:
        read = engine.read(peer, blocks, handle.block_ids, path=path, timeout=0.5, claim=ticket)
        with pytest.raises(TransferTimeoutError):
            read.wait()
        threading.Thread(target=recompute, daemon=True).start()
        time.sleep(0.3)  # however long it waits, NIXL still moves it: nothing is handed back
        assert not read.settlement.done(), "a READ still in flight was handed back"
        stats = engine.stats()
        assert stats["quarantined_xfers"] == 1 and poisoned(prefill, blocks)
        if path == "packed":  # the slot its READ may still fill is out of the pool, on both sides
            assert stats["staging_free"] == free_before - 1
            assert stalled.call("staging_free") == owner_free_before - 1
    assert read.settlement.wait(SETTLE_S), "the quarantine never handed the read back"
    released_after = time.monotonic() - thawed[0]
    held = engine.quarantine.stats()
    print(f"\n{path}: quarantine released {released_after * 1e3:.1f} ms after the data path resumed "
          f"(parked {held.last_release_s:.3f} s in all)")
    assert engine.stats()["quarantined_xfers"] == 0 and held.released_total >= 1
    if path == "packed":
        assert (engine.pool.buffer != 0xA5).any(), "the late READ landed in the slot kept out of the pool"
        assert engine.stats()["staging_free"] == free_before
        wait_for(lambda: stalled.call("staging_free") == owner_free_before, SETTLE_S)
    assert recomputed.wait(5.0)
    time.sleep(0.5)  # whatever the other request computed there stays: nothing of the old read lands later
    assert prefill.holds(blocks, other, len(other)), "a read landed in blocks handed back as reusable"
    engine.finish_claim(peer, ticket, ok=False)


def test_a_stalled_decode_holds_up_no_other_read_and_keeps_its_claim_until_the_read_is_over(
        stalled: DecodeProcess, healthy: DecodeProcess, prefill: PagedWorker) -> None:
    reader = ReuseReader(prefill.engine, PolicyConfig(threshold_tokens=64), timeout_s=STUCK_TIMEOUT_S,
                         cooldown_s=60.0)
    engine = prefill.engine

    def healthy_read(seed: int) -> float:
        history = words(seed, 300)
        prompt = history + words(seed + 1, 20)
        blocks = prefill.allocate(len(prompt))
        t0 = time.monotonic()
        result = reader.read(turn(healthy, f"h{seed}", history), prompt, local_hit_tokens=0, local_block_ids=blocks)
        took = time.monotonic() - t0
        assert result.action == "fetched", result.message
        assert prefill.holds(blocks, prompt, result.reused_tokens)
        prefill.free.extend(blocks)
        return took

    def drain() -> float:
        t0 = time.monotonic()
        engine.notifications()  # what the connector's worker does every step
        return time.monotonic() - t0

    quiet_reads = [healthy_read(100 + i) for i in range(5)]
    quiet_drains = [drain() for _ in range(20)]

    history = words(7, 320)
    prompt = history + words(8, 16)
    params = turn(stalled, "stuck", history)
    stuck_blocks = prefill.allocate(len(prompt))
    poison(prefill, stuck_blocks)
    got: list[Any] = []
    with frozen(stalled) as thawed:  # frozen before the first contact: the connect happens while it hangs
        stuck = threading.Thread(target=lambda: got.append(reader.read(params, prompt, local_hit_tokens=0,
                                                                       local_block_ids=stuck_blocks)))
        stuck.start()
        busy_reads: list[float] = []
        busy_drains: list[float] = []
        while stuck.is_alive():
            busy_reads.append(healthy_read(200 + len(busy_reads)))
            busy_drains.extend(drain() for _ in range(5))
            time.sleep(0.05)
        stuck.join()
        result = got[0]
        assert result.reason == Failure.TRANSFER_TIMEOUT.value and not result.settled.done()
        assert set(result.invalid_block_ids) <= set(stuck_blocks) and poisoned(prefill, stuck_blocks)
        assert stalled.call("claims_open") == 1, "the owner unpinned blocks a READ may still read"
        t0 = time.monotonic()  # it answers heartbeats: not cooled down, but no new read joins the stuck one
        again = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=stuck_blocks)
        assert again.reason == Failure.PEER_STALLED.value and time.monotonic() - t0 < 0.5
    assert result.settled.wait(SETTLE_S)
    released_after = time.monotonic() - thawed[0]
    claim_after = wait_for(lambda: stalled.call("claims_open") == 0, SETTLE_S)
    print(f"\nhealthy read ms quiet {max(quiet_reads) * 1e3:.1f} max / stalled peer {max(busy_reads) * 1e3:.1f} max "
          f"({len(busy_reads)} reads); drain ms quiet {max(quiet_drains) * 1e3:.2f} max / stalled peer "
          f"{max(busy_drains) * 1e3:.2f} max; quarantine released {released_after * 1e3:.1f} ms after the data path "
          f"resumed, claim released {claim_after * 1e3:.1f} ms later")
    assert len(busy_reads) >= 2 and max(busy_reads) < HEALTHY_READ_S
    assert max(busy_drains) < DRAIN_S
    # the breaker did not trip (cool-down 60 s): the decode serves the next read, byte for byte
    fresh = prefill.allocate(len(prompt))
    after = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=fresh)
    assert after.action == "fetched", after.message
    assert prefill.holds(fresh, prompt, after.reused_tokens)
    reader.close()


def test_the_worker_reports_a_quarantined_load_only_once_its_read_is_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM recomputes a load's invalid blocks as soon as the worker reports it: a load whose read is still in
    quarantine is reported (finished_recving and its invalid blocks) only once its settlement is settled."""
    from conftest import Geo, make_cache
    from kvshuttle.integrations.vllm import ShuttleConfig
    from kvshuttle.integrations.vllm.metadata import LoadJob, ShuttleMetadata
    from kvshuttle.integrations.vllm.worker import ShuttleWorker
    from kvshuttle.policy import Decision
    from kvshuttle.policy.decision import Reason
    from kvshuttle.reuse import ReuseResult
    from kvshuttle.transfer import Settlement
    from kvshuttle.trust import DeploymentSecret

    bs = 32
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, "kvshuttle_load_timeout_s": 3.0}, model="m")
    worker = ShuttleWorker(config, "eng", bs, secret=DeploymentSecret(b"quarantine-worker-tests" * 2))
    geo = Geo("vllm_cpu_attn", dtype="float32", num_layers=2, num_blocks=16, block_size=bs, num_heads=2,
              head_size=16, layout="LBHNC")
    worker.register_kv_caches({f"layer.{i}": x for i, x in enumerate(make_cache(np.random.default_rng(0),
                                                                                geo).layers)}, "CPU_ATTN")
    try:
        assert worker.reader is not None
        pending = Settlement()
        handle = KVHandle("far", "r0", "127.0.0.1", 1, (0, 1), 64, time.time() + 60, 1, "h0", 0, bs,
                          (b"\x01" * 16, b"\x02" * 16), time.time(), 60.0)
        decision = Decision("fetch", Reason.FETCH, "test", fetch_tokens=63, reused_tokens=63, fetch_blocks=range(2),
                            remote_block_ids=(0, 1), block_size=bs)
        load = LoadJob("req-q", handle, decision, (4, 5), 64, time.monotonic())
        timed_out = ReuseResult("recompute", Failure.TRANSFER_TIMEOUT.value, "stuck", 64, 0, 0, (4, 5), decision,
                                settled=pending)
        monkeypatch.setattr(worker.reader, "fetch", lambda *args, **kwargs: timed_out)
        worker.start(ShuttleMetadata(loads=[load]))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the fetch returned long ago; its blocks are still quarantined
            _, done = worker.finished(set())
            assert not done and not worker.load_errors(), "a quarantined load was reported"
            time.sleep(0.01)
        pending.settle()
        _, done = worker.finished(set())
        assert done == {"req-q"} and worker.load_errors() == {4, 5}
    finally:
        worker.shutdown()
