"""No per-request state outlives its request: the real ShuttleScheduler and ShuttleWorker (a real TransferEngine
over a small vLLM 0.32 CPU cache, a real retention ledger) driven the way vLLM drives them, step by step, through
10,000 requests: finished and retained (ended by TTL, budget eviction or an explicit release), finished without
a grant (not retained), and loads from a dead owner (refused at once). Afterwards every dict, set and list of
the scheduler, the worker and its reader is back to its starting length, the ledger is empty, every block is back
in the engine's free pool (each kept request was reported in ``finished_sending`` exactly once, and no other),
RSS grew by less than a generous bound and the number of gc-tracked objects stayed flat.

``EngineLoop`` is the emulated vLLM engine; tests/test_connector_blackhole.py drives the worker with it too."""

from __future__ import annotations

import gc
import resource
import socket
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")
pytest.importorskip("zmq")

from conftest import Geo, make_cache
from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.metadata import ShuttleHandshake
from kvshuttle.integrations.vllm.scheduler import ShuttleScheduler
from kvshuttle.integrations.vllm.stats import GAUGES
from kvshuttle.integrations.vllm.worker import ShuttleWorker
from kvshuttle.trust import GRANT_FIELD, DeploymentSecret, issue_grant

pytestmark = pytest.mark.timeout(240)

BS = 32
SECRET = DeploymentSecret(b"connector-leak-tests" * 2)
GEO = Geo("vllm_cpu_attn", dtype="float32", num_layers=2, num_blocks=256, block_size=BS, num_heads=2, head_size=16,
          layout="LBHNC")
PROMPT, ANSWER = 64, 8  # 71 computed tokens: 3 blocks per request


def dead_port() -> int:
    """A loopback port nothing listens on (connections to it are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tokens_for(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(5, 30000, size=n)]


@dataclass
class Req:
    """What the scheduler reads off a vLLM Request (see kvshuttle.integrations.vllm.requests)."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    status: Any = field(default_factory=lambda: SimpleNamespace(name="FINISHED_STOPPED"))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output

    @property
    def num_computed_tokens(self) -> int:
        return len(self.all_token_ids) - 1


class EngineLoop:
    """vLLM's side of one kv_both engine, as the connector sees it: a block allocator, admission (local hit 0),
    asynchronous loads, finishes, and each step's metadata -> worker -> KVConnectorOutput -> scheduler round
    trip, with vLLM's own assertion that finished_sending names only requests kept by request_finished."""

    def __init__(self, extra: dict[str, Any], geo: Geo = GEO) -> None:
        config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **extra}, model="m")
        self.scheduler = ShuttleScheduler(config, "eng", BS, secret=SECRET)
        self.worker = ShuttleWorker(config, "eng", BS, secret=SECRET)
        self.host = make_cache(np.random.default_rng(0), geo)
        self.worker.register_kv_caches({f"layer.{i}": x for i, x in enumerate(self.host.layers)}, "CPU_ATTN")
        handshake = self.worker.handshake()
        assert handshake is not None
        self.scheduler.address = handshake
        self.free: deque[int] = deque(range(geo.num_blocks))
        self.held: dict[str, list[int]] = {}  # kept by request_finished: freed on finished_sending
        self.waiting: dict[str, Req] = {}  # WAITING_FOR_REMOTE_KVS
        self.loaded: list[tuple[Req, bool]] = []  # (request, its load failed) as reported, to finish next step
        self.finished_ids: set[str] = set()  # what the next step's scheduler output names as finished
        self.kept_params: dict[str, dict[str, Any]] = {}
        self.load_results: list[tuple[str, float]] = []  # (request id, seconds from admission to report)
        self._admitted_at: dict[str, float] = {}
        self.steps = 0
        self.stats: dict[str, Any] = {}  # both sides' connector stats, summed over every step

    def alloc(self, n: int) -> list[int]:
        """vLLM admits a request only when its blocks are free: step until they are (bounded)."""
        deadline = time.monotonic() + 30.0
        while len(self.free) < n:
            assert time.monotonic() < deadline, "no blocks came back for 30 s: something is never freed"
            self.step()
            time.sleep(0.001)
        return [self.free.popleft() for _ in range(n)]

    def admit(self, req: Req) -> bool:
        """Admission; True when the request now waits for an asynchronous load."""
        blocks = self.alloc(-(-(len(req.prompt_token_ids) + ANSWER) // BS))
        tokens, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        req.blocks = blocks
        self.scheduler.update_state_after_alloc(req, [req.blocks], tokens or 0)
        if is_async:
            self.waiting[req.request_id] = req
            self._admitted_at[req.request_id] = time.monotonic()
        return is_async

    def finish(self, req: Req) -> dict[str, Any] | None:
        req.output = tokens_for(hash(req.request_id) & 0xFFFF, ANSWER)
        keep, params = self.scheduler.request_finished(req, [req.blocks])
        self.finished_ids.add(req.request_id)
        if keep:
            assert params is not None
            self.held[req.request_id] = req.blocks
            self.kept_params[req.request_id] = params
        else:
            self.free.extend(req.blocks)
        return params

    def step(self) -> None:
        self.steps += 1
        for req, _ in self.loaded:  # loaded (or recomputed) last step: generated, finished now
            self.finish(req)
        self.loaded = []
        meta = self.scheduler.build_connector_meta()
        self.worker.start(meta)
        finished, self.finished_ids = self.finished_ids, set()
        sending, recving = self.worker.finished(finished)
        errors = self.worker.load_errors()
        assert sending <= set(self.held), f"finished_sending for requests never kept: {sending - set(self.held)}"
        assert recving <= set(self.waiting), f"finished_recving for requests not waiting: {recving - set(self.waiting)}"
        assert self.scheduler.update_connector_output(sending, errors, recving) == (sending, recving)
        for request_id in sending:
            self.free.extend(self.held.pop(request_id))
            self.kept_params.pop(request_id, None)
        now = time.monotonic()
        for request_id in recving:
            req = self.waiting.pop(request_id)
            self.load_results.append((request_id, now - self._admitted_at.pop(request_id)))
            self.loaded.append((req, bool(set(req.blocks) & errors)))
        for stats in (self.scheduler.take_stats(), self.worker.take_stats()):  # vLLM reads both every step
            for key, value in stats.data.items():
                self.stats[key] = value if key in GAUGES else self.stats.get(key, 0) + value

    def idle(self) -> bool:
        ledger = self.worker.ledger
        assert ledger is not None
        return not (self.held or self.waiting or self.loaded or self.finished_ids) and \
            ledger.metrics()["live_handles"] == 0

    def drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.idle() and time.monotonic() < deadline:
            self.step()
            time.sleep(0.002)
        for _ in range(12):  # ids of requests kept nowhere are forgotten after a few steps
            self.step()

    def close(self) -> None:
        self.worker.shutdown()


def containers(obj: Any) -> dict[str, int]:
    """The length of every dict, set, list and deque among ``obj``'s attributes."""
    return {name: len(value) for name, value in vars(obj).items()
            if isinstance(value, (dict, set, frozenset, list, deque))}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.fixture
def loop() -> Iterator[EngineLoop]:
    engine = EngineLoop({"decoder_kv_blocks_ttl": 1.0, "kv_lease_duration": 1.0})
    try:
        yield engine
    finally:
        engine.close()


def remote_handle(port: int) -> tuple[list[int], dict[str, Any]]:
    """A history and the signed handle a decode at ``port`` (nothing listens there) issued for it."""
    remote = ShuttleScheduler(ShuttleConfig.from_extra({"bidirectional_kv_xfer": True}, model="m"), "far", BS,
                              secret=SECRET)
    remote.address = ShuttleHandshake("127.0.0.1", port)
    history = tokens_for(1, 3 * BS)
    req = Req("far-1", history[:-8], {GRANT_FIELD: issue_grant(SECRET), "remote_engine_id": "x"},
              output=history[-8:])
    keep, params = remote.request_finished(req, [[0, 1, 2]])
    assert keep and params is not None
    return [*history, 7], params


def run(engine: EngineLoop, start: int, count: int, per_step: int, history: list[int],
        handle: dict[str, Any]) -> dict[str, int]:
    """``count`` requests, ``per_step`` admitted each step; returns how many of each kind."""
    kinds = {"retained": 0, "released": 0, "not_retained": 0, "load": 0}
    to_release: list[str] = []
    ledger = engine.worker.ledger
    assert ledger is not None
    for first in range(start, start + count, per_step):
        for i in range(first, min(first + per_step, start + count)):
            rid = f"req-{i}"
            kind = ("retained", "not_retained", "load", "released")[i % 4]
            kinds[kind] += 1
            if kind == "load":
                assert engine.admit(Req(rid, history, dict(handle, do_remote_decode=True)))
                continue
            params = {"remote_engine_id": "p"}
            if kind != "not_retained":
                params[GRANT_FIELD] = issue_grant(SECRET)
            req = Req(rid, tokens_for(i, PROMPT), params)
            assert not engine.admit(req)
            out = engine.finish(req)
            assert (out is not None) == (kind != "not_retained")
            if kind == "released" and out is not None:
                to_release.append(out["kvshuttle_handle_id"])
        for handle_id in to_release[:-2]:  # a router's release a couple of steps later (may be evicted already)
            ledger.release(handle_id)
        del to_release[:-2]
        engine.step()
    for handle_id in to_release:
        ledger.release(handle_id)
    return kinds


def test_ten_thousand_requests_leave_no_state_behind(loop: EngineLoop) -> None:
    history, handle = remote_handle(dead_port())
    ledger, reader = loop.worker.ledger, loop.worker.reader
    assert ledger is not None and reader is not None
    run(loop, 0, 1000, 20, history, handle)  # warm-up: caches, first-use allocations, every log-once kind
    loop.drain(30.0)
    gc.collect()
    before = (containers(loop.scheduler), containers(loop.worker), containers(reader), containers(loop.worker.board))
    rss0, objects0 = rss_bytes(), len(gc.get_objects())
    started = time.monotonic()
    kinds = run(loop, 1000, 10_000, 20, history, handle)
    loop.drain(30.0)
    elapsed = time.monotonic() - started
    gc.collect()
    rss1, objects1 = rss_bytes(), len(gc.get_objects())
    after = (containers(loop.scheduler), containers(loop.worker), containers(reader), containers(loop.worker.board))
    print(f"10,000 requests {kinds} in {elapsed:.1f} s over {loop.steps} steps: RSS {rss0 / 2**20:.1f} -> "
          f"{rss1 / 2**20:.1f} MiB, gc objects {objects0} -> {objects1}, state {after}")

    assert loop.idle() and len(loop.free) == GEO.num_blocks, "every block is back in the free pool"
    assert after == before, "a per-request structure did not return to its starting size"
    assert all(n == 0 for n in loop.scheduler.state_sizes().values())
    assert all(n == 0 for n in loop.worker.state_sizes().values())
    metrics = ledger.metrics()
    assert metrics["live_handles"] == 0 and metrics["retained_blocks"] == 0
    reported = [rid for rid, _ in loop.load_results if int(rid.removeprefix("req-")) >= 1000]
    assert len(reported) == len(set(reported)) == kinds["load"] == 2500  # every load reported, exactly once
    assert rss1 - rss0 < 64 << 20, f"RSS grew {(rss1 - rss0) / 2**20:.1f} MiB over 10,000 requests"
    assert objects1 - objects0 < 2000, f"{objects1 - objects0} more gc-tracked objects after 10,000 requests"
