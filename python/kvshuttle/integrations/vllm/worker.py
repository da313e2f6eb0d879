"""The worker side (vLLM's worker process): serve this engine's KV blocks, keep finished ones, read others'.

One TransferEngine per worker plays both roles on one NIXL agent: owner (its side channel answers claims
against the retention ledger, NIXL reads its registered cache) and reader (a bounded pool of loader threads,
``kvshuttle_max_concurrent_loads``, runs the scheduled loads concurrently: claim, read, confirm). The ledger
lives here, where claims are answered and the data is served; the scheduler pins the blocks until this side
reports the request in ``finished_sending``.

Loads never fail a request: a refused, expired, evicted or failed read reports the request's target blocks
as invalid, and vLLM recomputes from the first of them (the scheduler side forces
``kv_load_failure_policy="recompute"``). Every load ends within ``kvshuttle_load_timeout_s`` of the scheduling
decision (``LoadJob.decided_at``), however long it queued here, so a request never waits forever for KV; one
frozen decode costs each load at most its detection time, not the sum of every earlier load's.

Per-request state lives only while the request does: a load's entry until it is reported, a retention's until
its ``finished_sending`` is reported; ids vLLM names as finished are kept only for requests this worker still
tracks (others for a few steps, in case their retention is on its way).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...core.layout import PagedKVCache, vllm_layer_index
from ...policy.kv_handle import PREFIX
from ...retention import BudgetExceededError, RetentionLedger
from ...reuse import Failure, ReuseReader, ReuseResult
from ...transfer import DiskTierError, EngineConfig, HandleBoard, LayerProgress, TransferEngine
from ...transfer.disk_tier import DiskTier
from ...transfer.host_tier import HostTier
from ...trust import DeploymentSecret
from .config import ConnectorConfigError, ShuttleConfig
from .cpu_pinning import check_cpus, pin, thread_ids
from .layered import LayeredLoads, load_failure
from .metadata import LoadJob, RetainJob, ShuttleHandshake, ShuttleMetadata, ShuttleWorkerMeta
from .stats import ShuttleStats

HANDLE_ID_FIELD = PREFIX + "handle_id"
log = logging.getLogger("vllm.kvshuttle")
UNKNOWN_HANDLE_GRACE_S = 0.5  # the owner's ledger learns of a fresh handle one engine step after issuing it
UNMATCHED_STEPS = 8  # steps a finished id without a retention here is kept, in case its RetainJob is late


def _settled(future: Future[ReuseResult]) -> bool:
    """The load finished and nothing of its read can still write its blocks."""
    if not future.done():
        return False
    try:
        return future.result().settled.done()
    except BaseException:  # cancelled at shutdown or a bug: it never read anything
        return True


class ShuttleWorker:
    def __init__(self, config: ShuttleConfig, engine_id: str, block_size: int,
                 secret: DeploymentSecret | None = None, *, tp_rank: int = 0, tp_size: int = 1,
                 num_kv_heads: int | None = None) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_rank, self.tp_size, self.num_kv_heads = tp_rank, tp_size, num_kv_heads
        self.secret = secret if secret is not None else config.deployment_secret()
        self.engine: TransferEngine | None = None
        self.ledger: RetentionLedger | None = None
        self.reader: ReuseReader | None = None
        self._loader = ThreadPoolExecutor(config.max_concurrent_loads, thread_name_prefix="kvshuttle-load")
        self._lock = threading.Lock()
        self._loading: dict[str, tuple[Future[ReuseResult], LoadJob]] = {}  # submitted, not yet reported
        self._failed: dict[str, tuple[tuple[int, ...], bool]] = {}  # loads that never ran -> (blocks, layered)
        self.layered = LayeredLoads({}, 0)  # this step's layer-pipelined loads (layered.py)
        self._retained: dict[str, str] = {}  # request -> handle id: its RetainJob came here, not reported yet
        self._ended: set[str] = set()  # retentions that ended here since the last worker_meta (TP > 1, or a tier)
        # Host tier: a retention's hot blocks go back (on_release, reported in finished_sending) when its demotion
        # lands, while it lives on in the tier until it ends (on_end). Reported requests still live there -> handle
        # id (what a release from another rank names); ended ones not reported yet.
        self._tiered: dict[str, str] = {}
        self._over: set[str] = set()
        self.tier: HostTier | None = None
        self.disk: DiskTier | None = None  # the disk tier what leaves the host tier goes to (kvshuttle_disk_tier_*)
        self._tier_counts: dict[str, int] = {}  # the tier's counters as last reported (stats carry the increase)
        self._landed: set[str] = set()  # layered loads settled whole since the last worker_meta
        self._released: set[str] = set()  # of those, the ones whose retention ended
        self._seen_finished: set[str] = set()  # of those, the ones vLLM named finished (a report needs both)
        self._unmatched: dict[str, int] = {}  # finished ids with no retention here (yet) -> step seen
        self._step = 0
        self._load_errors: set[int] = set()
        self._stats = ShuttleStats(data={})  # finished loads and notifications since the last stats read
        self._warned: set[str] = set()
        # Handles a streaming router takes (board.py). Routers take from rank 0's board only: there a handle no
        # router took ends at once (every rank then, through worker_meta), instead of holding blocks to its TTL.
        self.board = HandleBoard(on_unclaimed=self._unclaimed if tp_rank == 0 else None)
        self._transfer_cpus = frozenset(config.transfer_cpus or ())
        self._transfer_tids: set[int] = set()  # the threads the transfer engine started (cpu_pinning.py)

    # -- set-up ---------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], backend: str) -> None:
        cache = PagedKVCache.from_vllm(kv_caches, backend)
        if cache.geometry.block_size != self.block_size:
            raise ConnectorConfigError(
                f"the KV cache's kernel blocks hold {cache.geometry.block_size} tokens but vLLM's blocks "
                f"{self.block_size}; kvshuttle needs them equal (set --block-size to the kernel block size)")
        c = self.config
        name = f"kvshuttle-{self.engine_id}" + (f"-tp{self.tp_rank}" if self.tp_size > 1 else "")
        rank_port = c.port + self.tp_rank if c.port else 0  # kvshuttle_port is rank 0's; rank r: port + r
        if rank_port > 65535:
            raise ConnectorConfigError(f"kvshuttle_port={c.port} leaves no port for TP rank {self.tp_rank} (rank r "
                                       f"listens on kvshuttle_port + r <= 65535)")
        problem = check_cpus(self._transfer_cpus) if self._transfer_cpus else None
        if problem:
            raise ConnectorConfigError(f"kvshuttle_transfer_cpus: {problem}")
        terms = c.terms()
        if terms.disk is not None and cache.is_cuda:  # its files are read back into host memory, packed on the host
            raise ConnectorConfigError("kvshuttle_disk_tier_dir: the disk tier is served on CPU caches only (a GPU "
                                       "owner cannot pack reads from it yet); leave it unset on this engine")
        g = cache.geometry
        bytes_per_block = g.block_size * g.bytes_per_token
        before = thread_ids()
        self.tier = (HostTier(cache, terms.tier.blocks(bytes_per_block), on_copied=_log_demotion)
                     if terms.tier is not None else None)
        if terms.disk is not None and self.tier is not None and c.disk_tier_dir:
            try:
                self.disk = DiskTier(self.tier, c.disk_tier_dir)
            except DiskTierError as exc:
                self.tier.close()
                raise ConnectorConfigError(f"kvshuttle_disk_tier_dir: {exc}") from exc
        self.engine = TransferEngine(cache, EngineConfig(name=name, backends=c.backends, host=c.host,
                                                         advertise_host=c.advertise_host, port=rank_port,
                                                         transfer_timeout_s=c.load_timeout_s,
                                                         peer_timeout_s=c.peer_timeout_s, secret=self.secret),
                                     tier=self.tier, disk=self.disk)
        self._transfer_tids = thread_ids() - before
        self._pin_transfer_threads(loader=False)  # (never this thread: it is the engine's)
        address = self.engine.serve()
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        budget = c.retention_budget(g.num_blocks)
        self.ledger = RetentionLedger(self.engine_id, c.advertise_host or host, int(port), terms=terms,
                                      budget_blocks=budget, bytes_per_block=bytes_per_block,
                                      on_release=self._on_release, on_end=self._on_end,
                                      on_demote=self.tier.demote if self.tier is not None else None,
                                      on_spill=self.disk.spill if self.disk is not None else None,
                                      on_discard=self.disk.discard if self.disk is not None else None)
        self.engine.claims = self.ledger
        self.engine.board = self.board
        self.layered = LayeredLoads(vllm_layer_index(kv_caches), g.num_layers)
        self.reader = ReuseReader(self.engine, c.policy(), timeout_s=c.load_timeout_s, path=c.path,
                                  allowed_owners=c.allowed_owners, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                  num_kv_heads=self.num_kv_heads)
        log.info("kvshuttle: rank %d of TP=%d serving %s on %s; retention budget %d of %d blocks, up to %d loads at "
                 "once%s", self.tp_rank, self.tp_size, g.describe(), address, budget, g.num_blocks,
                 c.max_concurrent_loads, "" if self.tier is None else
                 f"; host tier of {self.tier.capacity_blocks} blocks ({self.tier.nbytes / 2**20:.1f} MiB)" +
                 ("" if self.disk is None else
                  f"; disk tier of {c.disk_tier_bytes / 2**20:.1f} MiB in {self.disk.dir}"))

    def handshake(self) -> ShuttleHandshake | None:
        if self.ledger is None:
            return None
        return ShuttleHandshake(self.ledger.host, self.ledger.port, self.tp_rank)

    def worker_meta(self) -> ShuttleWorkerMeta | None:
        """The retentions that ended on this rank since the last call (TP > 1: the scheduler ends them on every
        rank) and the layered loads that landed whole (their blocks may enter the prefix cache); None when there is
        nothing to say."""
        self.settle_layered()  # (vLLM calls wait_for_save first; a step's loads are reported in its own output)
        with self._lock:
            ended, self._ended = self._ended, set()
            landed, self._landed = self._landed, set()
        return ShuttleWorkerMeta(ended, dict.fromkeys(landed, 1)) if ended or landed else None

    # -- every step -----------------------------------------------------------------------------------------
    def start(self, meta: ShuttleMetadata) -> None:
        """Take the step's retentions and start its loads (non-blocking). Each item is handled on its own: one
        that fails is refused (a retention) or reported failed (a load), never dropped."""
        refused: set[str] = set()
        for job in meta.retains:
            if not self._retain(job):
                refused.add(job.request_id)
        for request_id in meta.releases:  # ended on another rank: no rank may serve it any more
            self._release(request_id)
        for pub in meta.publications:  # after the retains: a published handle is already claimable
            try:
                self.board.put(pub.key, None if pub.request_id in refused else pub.params)
            except Exception as exc:
                self._warn_once("publish", f"kvshuttle: publishing request {pub.request_id} failed: {exc!r}")
        for load in meta.loads:
            self._submit(load)

    def wait_for_layer(self, layer_name: str) -> None:
        """The forward pass is about to compute ``layer_name``: wait until this step's layer-pipelined loads have
        landed it (layered.py). Never raises."""
        self.layered.wait_layer(layer_name)

    def settle_layered(self) -> None:
        """After the forward pass: end this step's layer-pipelined loads; those that must recompute have their
        blocks reported invalid in this step's output. Idempotent; never raises."""
        if not len(self.layered):
            return
        settled = self.layered.settle()
        with self._lock:
            for job, result in settled:
                self._stats.add_result(result)
                self._load_errors.update(result.invalid_block_ids)
                if result.action == "fetched":
                    self._landed.add(job.request_id)
            self._stats.data["layered.loads"] = self._stats.data.get("layered.loads", 0) + len(settled)
            self._stats.data["layered.wait_s"] = self._stats.data.get("layered.wait_s", 0.0) + self.layered.waited_s
            if self.layered.quarantine_wait_s:
                self._stats.data["layered.quarantine_wait_s"] = (self._stats.data.get("layered.quarantine_wait_s", 0.0)
                                                                 + self.layered.quarantine_wait_s)
            self.layered.waited_s = self.layered.quarantine_wait_s = 0.0

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) since the last call. Never raises."""
        self.settle_layered()  # (vLLM calls wait_for_save first; this is the backstop)
        self._step += 1
        self._sweep()
        self.board.sweep()
        self._drain_notifications()
        with self._lock:
            for request_id in finished_req_ids:
                if request_id in self._retained:
                    self._seen_finished.add(request_id)
                else:
                    self._unmatched[request_id] = self._step
            while self._unmatched:  # oldest first (insertion order = step order)
                request_id, step = next(iter(self._unmatched.items()))
                if self._step - step <= UNMATCHED_STEPS:
                    break
                del self._unmatched[request_id]
            sending = {rid for rid in self._released if rid in self._seen_finished}
            self._released -= sending
            self._seen_finished -= sending
            for request_id in sending:
                handle_id = self._retained.pop(request_id)
                if request_id in self._over:  # ended: nothing of it is left
                    self._over.discard(request_id)
                elif self.tier is not None:  # its demotion landed: it lives on in the tier
                    self._tiered[request_id] = handle_id
            # a load whose read NIXL could not cancel stays unreported (its blocks quarantined) until it is over
            done = {rid for rid, (future, _) in self._loading.items() if _settled(future)}
            for request_id in done:
                future, job = self._loading.pop(request_id)
                result = self._outcome(future, job)
                self._stats.add_result(result)
                self._load_errors.update(result.invalid_block_ids)
            for request_id, (blocks, layered) in self._failed.items():
                self._load_errors.update(blocks)
                if not layered:  # vLLM waits for an asynchronous load's finished_recving, never a synchronous one's
                    done.add(request_id)
                self._stats.data["read.not_started"] = self._stats.data.get("read.not_started", 0) + 1
            self._failed.clear()
        return sending, done

    def take_stats(self) -> ShuttleStats:
        """Reads finished since the last call, notifications drained, and the retention gauges."""
        with self._lock:
            stats, self._stats = self._stats, ShuttleStats(data={})
        if self.ledger is not None:
            metrics = self.ledger.metrics()
            stats.data.update({k: metrics[k] for k in ("retained_blocks", "retained_bytes", "live_handles")})
            for name, tier in metrics.get("tiers", {}).items():
                stats.data.update(self._tier_stats(name, tier))
        return stats

    def _tier_stats(self, name: str, tier: dict[str, int]) -> dict[str, int]:
        """A tier's gauges (``tier.<name>.blocks``/``bytes``) and its counters' increase since the last stats
        (``tier.<name>.demotions``/``reads``/``misses``/...): the stats path sums counters across reports."""
        out = {f"tier.{name}.{k}": tier[k] for k in ("blocks", "bytes", "capacity_blocks", "live_handles")}
        for key in ("demotions", "reads", "misses", "evictions", "expirations", "full", "failed_copies", "lost"):
            full = f"tier.{name}.{key}"
            out[full] = tier[key] - self._tier_counts.get(full, 0)
            self._tier_counts[full] = tier[key]
        return out

    def load_errors(self) -> set[int]:
        self.settle_layered()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def state_sizes(self) -> dict[str, int]:
        """How many entries each per-request structure holds (all return to 0 when no request is in flight)."""
        with self._lock:
            return {"loading": len(self._loading), "failed": len(self._failed), "retained": len(self._retained),
                    "released": len(self._released), "seen_finished": len(self._seen_finished),
                    "unmatched": len(self._unmatched), "load_errors": len(self._load_errors),
                    "landed": len(self._landed), "tiered": len(self._tiered), "over": len(self._over)}

    def release_cache(self) -> None:
        """The KV cache is about to be released or remapped (vLLM 0.33's sleep or a discard): nothing it holds may
        be served again. Every retention ends (reported as finished sending), the side channel and the NIXL
        registrations go, and later loads recompute; kvshuttle stays off on this worker until it restarts."""
        if self.ledger is not None:
            ended = self.ledger.release_all()
            log.warning("kvshuttle: the KV cache is being released; %d retentions ended, serving and reading stop "
                        "until this engine restarts", ended)
        reader, engine, self.reader, self.engine = self.reader, self.engine, None, None
        if reader is not None:
            reader.close()
        if engine is not None:
            engine.close()

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)  # loads in flight end by their deadlines
        if self.reader is not None:
            self.reader.close()
        if self.engine is not None:
            self.engine.close()

    # -- internals ------------------------------------------------------------------------------------------
    def _retain(self, job: RetainJob) -> bool:
        with self._lock:
            self._retained[job.request_id] = job.handle_id
            if self._unmatched.pop(job.request_id, None) is not None:  # vLLM named it finished already
                self._seen_finished.add(job.request_id)
        try:
            if self.ledger is None:
                raise ConnectorConfigError("the worker has no KV cache registered")
            if job.ranks:  # the same for every handle of this engine: what a renewal's params name
                self.ledger.ranks = job.ranks
            self.ledger.cache_dtype = job.cache_dtype  # one per engine, as the ranks
            self.ledger.retain(job.request_id, job.block_ids, job.digests, job.num_tokens, job.block_size,
                               tp_size=self.tp_size, ttl_s=job.ttl_s, handle_id=job.handle_id, generation=0,
                               mode="use_once" if job.use_once else "multi_read")
            return True
        except BudgetExceededError as exc:
            log.info("kvshuttle: request %s not retained: %s", job.request_id, exc)
        except Exception as exc:  # never the engine: the blocks go back to vLLM at once
            log.warning("kvshuttle: request %s not retained: %r", job.request_id, exc)
        self._on_end(job.request_id)  # (other ranks end theirs)
        self._on_release(job.request_id)
        return False

    def _submit(self, job: LoadJob) -> None:
        why = job.failure or ("" if job.handle is not None and self.reader is not None else "no reader")
        progress = self.layered.progress() if job.layered else None
        if not why:
            try:
                future = self._loader.submit(self._load, job, progress)
            except RuntimeError as exc:  # the pool is shut down
                why = str(exc)
        if why:
            log.info("kvshuttle: request %s recomputes, because its load could not start: %s", job.request_id, why)
            with self._lock:
                self._failed[job.request_id] = (tuple(job.local_block_ids), job.layered)
            return
        if progress is not None:  # waited for layer by layer in this step's forward pass
            self.layered.add(job, future, progress, job.decided_at + self._timeout(job))
            return
        with self._lock:
            self._loading[job.request_id] = (future, job)

    def _timeout(self, job: LoadJob) -> float:
        """A load's budget from its scheduling decision; a layered one also holds up the step's forward pass."""
        c = self.config
        return min(c.load_timeout_s, c.layered_timeout_s) if job.layered else c.load_timeout_s

    def _pin_transfer_threads(self, *, loader: bool = True) -> None:
        """Keep the transfer threads (and, ``loader``, the calling loader thread) on ``kvshuttle_transfer_cpus``."""
        if self._transfer_cpus:
            pin({*self._transfer_tids, 0} if loader else self._transfer_tids, self._transfer_cpus)

    def _load(self, job: LoadJob, progress: LayerProgress | None = None) -> ReuseResult:
        assert self.reader is not None and job.handle is not None
        self._pin_transfer_threads()
        budget = self._timeout(job)
        deadline = job.decided_at + budget
        try:
            if time.monotonic() >= deadline:  # it waited out its whole budget in the queue
                result = load_failure(job, Failure.TRANSFER_TIMEOUT, f"the load waited {budget:g} s (its whole "
                                      "budget) for a loader thread")
            else:
                result = self.reader.fetch(job.decision, job.handle, job.local_block_ids, job.num_tokens,
                                           unknown_grace_s=UNKNOWN_HANDLE_GRACE_S, deadline=deadline,
                                           progress=progress)
        except Exception as exc:  # a bug must cost a recompute, never the engine
            log.exception("kvshuttle: load of request %s failed", job.request_id)
            result = load_failure(job, Failure.TRANSFER_FAILED, repr(exc))
        finally:
            if progress is not None:  # (ended by the fetch already, unless it never ran)
                progress.end(False)
        if result.action == "fetched":
            telemetry = result.telemetry
            log.info("kvshuttle: request %s read %d tokens (%.1f MiB, %d descriptors, %s path%s) in %.1f ms",
                     job.request_id, result.fetched_tokens, result.bytes / 2**20,
                     telemetry.descriptors if telemetry else 0, telemetry.path if telemetry else "-",
                     ", layer by layer" if job.layered else "", result.total_s * 1e3)
        else:
            log.info("kvshuttle: request %s recomputes, because %s: %s", job.request_id, result.reason, result.message)
        return result

    def _outcome(self, future: Future[ReuseResult], job: LoadJob) -> ReuseResult:
        try:
            return future.result()
        except BaseException as exc:  # cancelled at shutdown: the blocks were never written
            return load_failure(job, Failure.TRANSFER_FAILED, repr(exc))

    def _sweep(self) -> None:
        if self.ledger is None:
            return
        try:
            self.ledger.sweep()  # TTLs: a retention whose time is up is released now
        except Exception as exc:
            self._warn_once("sweep", f"kvshuttle: the retention sweep failed: {exc!r}")

    def _drain_notifications(self) -> None:
        """Readers' NIXL completion notifications pile up in the agent unless read: drain them every step."""
        if self.engine is None:
            return
        try:
            count = len(self.engine.notifications())
        except Exception as exc:
            self._warn_once("notifications", f"kvshuttle: reading NIXL notifications failed: {exc!r}")
            return
        if count:
            with self._lock:
                self._stats.data["notifications"] = self._stats.data.get("notifications", 0) + count

    def _release(self, request_id: str) -> None:
        with self._lock:
            handle_id = self._retained.get(request_id) or self._tiered.get(request_id)
        if handle_id is None or self.ledger is None:
            return
        try:
            self.ledger.release(handle_id)  # False when it ended here already
        except Exception as exc:
            self._warn_once("release", f"kvshuttle: ending request {request_id}'s retention failed: {exc!r}")

    def _unclaimed(self, params: dict[str, Any]) -> None:
        """A published handle no router took within the board's TTL: no next turn can name it."""
        handle_id = params.get(HANDLE_ID_FIELD)
        if not isinstance(handle_id, str) or self.ledger is None:
            return
        try:
            ended = self.ledger.release(handle_id)
        except Exception as exc:
            self._warn_once("unclaimed", f"kvshuttle: ending an unclaimed handle's retention failed: {exc!r}")
            return
        if ended:
            with self._lock:
                self._stats.data["board.unclaimed_released"] = self._stats.data.get("board.unclaimed_released", 0) + 1

    def _on_release(self, request_id: str) -> None:
        """The retention's hot blocks went back (it ended, or its demotion landed): vLLM may free them."""
        with self._lock:
            if request_id in self._retained:
                self._released.add(request_id)

    def _on_end(self, request_id: str) -> None:
        """The retention ended on every tier of this rank: at TP > 1 every rank ends it (worker_meta). Not when
        only its hot blocks went back: that would end a demoted retention on every rank."""
        with self._lock:
            tiered = self._tiered.pop(request_id, None) is not None
            if request_id in self._retained:
                self._over.add(request_id)
            elif not tiered:
                return
            if self.tp_size > 1 or self.tier is not None:  # (with a tier: the scheduler's index withdraws it)
                self._ended.add(request_id)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message + " (logged once)")


def _log_demotion(handle_id: str, nbytes: int, seconds: float) -> None:
    """One line per demotion copy, as per read: its size and time (``kvshuttle bench demotion`` reads them)."""
    log.info("kvshuttle: host tier: demoted %s (%.1f MiB) in %.1f ms (%.2f GB/s)", handle_id[:12], nbytes / 2**20,
             seconds * 1e3, nbytes / max(seconds, 1e-9) / 1e9)
