"""The worker side (vLLM's worker process): serve this engine's KV blocks, keep finished ones, read others'.

One TransferEngine per worker plays both roles on one NIXL agent: owner (its side channel answers claims
against the retention ledger, NIXL reads its registered cache) and reader (a loader thread runs each
scheduled load: claim, read, confirm). The ledger lives here, where claims are answered and the data is
served; the scheduler pins the blocks until this side reports the request in ``finished_sending``.

Loads never fail a request: a refused, expired, evicted or failed read reports the request's target blocks
as invalid, and vLLM recomputes from the first of them (the scheduler side forces
``kv_load_failure_policy="recompute"``). Every load ends within ``kvshuttle_load_timeout_s``, so a request
never waits forever for KV.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...core.layout import PagedKVCache
from ...errors import KVShuttleError
from ...policy import KVHandle, parse_handle
from ...retention import BudgetExceededError, RetentionLedger
from ...reuse import Failure, ReuseReader, ReuseResult
from ...transfer import EngineConfig, HandleBoard, TransferEngine
from .config import ConnectorConfigError, ShuttleConfig
from .metadata import LoadJob, ShuttleHandshake, ShuttleMetadata
from .stats import ShuttleStats

log = logging.getLogger("vllm.kvshuttle")
UNKNOWN_HANDLE_GRACE_S = 0.5  # the owner's ledger learns of a fresh handle one engine step after issuing it


class ShuttleWorker:
    def __init__(self, config: ShuttleConfig, engine_id: str, block_size: int) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.engine: TransferEngine | None = None
        self.ledger: RetentionLedger | None = None
        self.reader: ReuseReader | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvshuttle-load")
        self._lock = threading.Lock()
        self._loading: dict[str, Future[ReuseResult]] = {}
        self._released: set[str] = set()  # requests whose retention ended (to report once vLLM named them)
        self._seen_finished: set[str] = set()  # ids vLLM passed as finished (finished_sending must be among them)
        self._load_errors: set[int] = set()
        self._results: list[ReuseResult] = []  # finished loads since the last stats read
        self.board = HandleBoard()  # handles a streaming router takes (board.py)

    # -- set-up ---------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], backend: str) -> None:
        cache = PagedKVCache.from_vllm(kv_caches, backend)
        if cache.geometry.block_size != self.block_size:
            raise ConnectorConfigError(
                f"the KV cache's kernel blocks hold {cache.geometry.block_size} tokens but vLLM's blocks "
                f"{self.block_size}; kvshuttle needs them equal (set --block-size to the kernel block size)")
        c = self.config
        self.engine = TransferEngine(cache, EngineConfig(name=f"kvshuttle-{self.engine_id}", backends=c.backends,
                                                         host=c.host, port=c.port,
                                                         transfer_timeout_s=c.load_timeout_s))
        address = self.engine.serve()
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        g = cache.geometry
        self.ledger = RetentionLedger(self.engine_id, host, int(port), ttl_s=c.decode_ttl_s, mode=c.reads,
                                      budget_blocks=c.budget_blocks, bytes_per_block=g.block_size * g.bytes_per_token,
                                      on_release=self._on_release)
        self.engine.claims = self.ledger
        self.engine.board = self.board
        self.reader = ReuseReader(self.engine, c.policy(), timeout_s=c.load_timeout_s, path=c.path)
        log.info("kvshuttle: serving %s on %s", g.describe(), address)

    def handshake(self) -> ShuttleHandshake | None:
        if self.ledger is None:
            return None
        return ShuttleHandshake(self.ledger.host, self.ledger.port)

    # -- every step -----------------------------------------------------------------------------------------
    def start(self, meta: ShuttleMetadata) -> None:
        """Take the step's retentions and start its loads (non-blocking)."""
        if self.ledger is None or self.reader is None:
            return
        refused: set[str] = set()
        for job in meta.retains:
            try:
                self.ledger.retain(job.request_id, job.block_ids, job.digests, job.num_tokens, job.block_size,
                                   ttl_s=job.ttl_s, handle_id=job.handle_id, generation=0,
                                   mode="use_once" if job.use_once else "multi_read")
            except BudgetExceededError as exc:
                log.info("kvshuttle: request %s not retained: %s", job.request_id, exc)
                refused.add(job.request_id)
                self._on_release(job.request_id)
            except KVShuttleError as exc:
                log.warning("kvshuttle: request %s not retained: %s", job.request_id, exc)
                refused.add(job.request_id)
                self._on_release(job.request_id)
        for pub in meta.publications:  # after the retains: a published handle is already claimable
            self.board.put(pub.key, None if pub.request_id in refused else pub.params)
        for load in meta.loads:
            with self._lock:
                self._loading[load.request_id] = self._loader.submit(self._load, load)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) since the last call."""
        if self.ledger is not None:
            self.ledger.sweep()  # TTLs: a retention whose time is up is released now
        with self._lock:
            self._seen_finished |= finished_req_ids
            sending = self._released & self._seen_finished
            self._released -= sending
            self._seen_finished -= sending
            done = {rid for rid, f in self._loading.items() if f.done()}
            for rid in done:
                result = self._loading.pop(rid).result()
                self._results.append(result)
                self._load_errors.update(result.invalid_block_ids)
        return sending, done

    def take_stats(self) -> ShuttleStats:
        """Reads finished since the last call, and the retention gauges."""
        with self._lock:
            results, self._results = self._results, []
        stats = ShuttleStats(data={})
        for result in results:
            stats.add_result(result)
        if self.ledger is not None:
            metrics = self.ledger.metrics()
            stats.data.update({k: metrics[k] for k in ("retained_blocks", "retained_bytes", "live_handles")})
        return stats

    def load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        if self.reader is not None:
            self.reader.close()
        if self.engine is not None:
            self.engine.close()

    # -- internals ------------------------------------------------------------------------------------------
    def _load(self, job: LoadJob) -> ReuseResult:
        assert self.reader is not None
        handle = parse_handle(job.params)
        try:
            if not isinstance(handle, KVHandle):  # cannot happen: the scheduler decided on this very handle
                raise KVShuttleError(f"the load's params hold no handle: {handle.message}")
            result = self.reader.fetch(job.decision, handle, job.local_block_ids, job.num_tokens,
                                       unknown_grace_s=UNKNOWN_HANDLE_GRACE_S)
        except Exception as exc:  # a bug must cost a recompute, never the engine (get_finished re-raises)
            log.exception("kvshuttle: load of request %s failed", job.request_id)
            result = ReuseResult("recompute", Failure.TRANSFER_FAILED.value, f"recompute, because {exc}",
                                 job.num_tokens, job.decision.local_tokens, 0, tuple(job.local_block_ids),
                                 job.decision)
        if result.action == "fetched":
            telemetry = result.telemetry
            log.info("kvshuttle: request %s read %d tokens (%.1f MiB, %s path) in %.1f ms", job.request_id,
                     result.fetched_tokens, result.bytes / 2**20, telemetry.path if telemetry else "-",
                     result.total_s * 1e3)
        else:
            log.info("kvshuttle: request %s recomputes, because %s: %s", job.request_id, result.reason, result.message)
        return result

    def _on_release(self, request_id: str) -> None:
        with self._lock:
            self._released.add(request_id)
