"""The owner's side of the side channel: handshake, ping, and packing blocks into staging for readers.

Every request comes from a peer the side channel authenticated (CURVE), identified by its connection; nothing
in a message is trusted beyond that. Each op's fields are checked for type and range before use; a pack must
name a live claim and only blocks that claim covers (when the owner keeps a ledger): the claim id is an
unguessable capability that only ever travelled, encrypted, to the peer that claimed. A pack's chunks must fit a
staging slot, and one connection may hold at most ``max_jobs`` packs in progress.

A ``pack`` request starts a :class:`PackJob` on a kept thread (``task_threads.py``). The job packs chunk after chunk
into the staging slots it reserved (on the host, or on a CUDA stream: ``executors.py``), announces each
(``ready``) once its pack completed and reuses a slot when the reader ``release``\\ s it (``chunk_slots.py``), so
the owner packs chunk i+1 while the reader reads chunk i. A job ends when every chunk is released, on ``abort``,
or when a ready chunk is not released within the staging lease (the reader died); its slots always go back to
the pool. An ``abort`` may name chunks to ``keep``: a READ of them the reader could not cancel may still read their
slots, so those go back only on their ``release`` (sent once the reader's NIXL reports the READ over) or when the
lease ends.

A claim of a retention demoted into the host tier (``host_tier.py``) packs from the tier's slots instead of the
cache: the claim names the slots (``ClaimAuthority.claimed_slots``), parallel to the block ids the reader names.
One in the disk tier (``disk_tier.py``) packs from its file's blocks, read back into host memory when the pack is
asked (on the side channel's thread, so that a file that is gone or short is refused by name before anything is
announced: ``tier_lost``, and the ledger ends the retention).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..core.blocks import as_ids, blocks_hold_tokens, check_ids
from ..core.layout import PagedKVCache
from ..errors import BlockIdError, KVShuttleError, LayoutError
from ..trust import DeploymentSecret
from .board import HandleBoard, serve_take
from .chunk_slots import ChunkSlots
from .claims import ClaimAuthority, ClaimRefusedError, serve_claim
from .disk_tier import DiskTier, TierReadError
from .errors import ProtocolError, StagingExhaustedError
from .executors import CopyExecutor, HostExecutor
from .host_tier import HostTier
from .side_channel import SideChannelServer
from .staging import Chunk, StagingPool, layout_from_wire, plan_chunks
from .task_threads import TaskThreads
from .wire import PROTOCOL_VERSION, PeerInfo, field

log = logging.getLogger(__name__)
Source = tuple[PagedKVCache, list[int]]  # where a pack reads: a tier's blocks as a paged cache, and their ids there
MAX_WINDOW = 64  # staging slots one pack may hold at once (the pool's size bounds it further)


def _validate(cache: PagedKVCache, slot_bytes: int, request: dict[str, Any]) -> None:
    """Check a pack request against this cache before reserving anything (named errors)."""
    g = cache.geometry
    ids = check_ids(as_ids(field(request, "ids", list)), g.num_blocks, "owner")
    tokens = field(request, "num_tokens", int, 1)
    per_chunk = field(request, "chunk_tokens", int, 1)
    if not blocks_hold_tokens(int(ids.size), g.block_size, tokens):
        raise BlockIdError(f"{ids.size} owner blocks of {g.block_size} tokens cannot hold {tokens} tokens")
    layout = layout_from_wire(field(request, "layout", dict))
    offset = field(request, "head_offset", int, 0, g.num_heads)
    if not 0 <= offset <= g.num_heads - layout.num_heads:
        raise LayoutError(f"heads [{offset}, {offset + layout.num_heads}) outside the owner's {g.num_heads}")
    if per_chunk % g.block_size or per_chunk % layout.block_size:
        raise LayoutError(f"chunk of {per_chunk} tokens is not whole owner blocks and staging units")
    first = plan_chunks(min(tokens, per_chunk), per_chunk, g.block_size, g.block_size, layout, g.num_planes,
                        g.row_bytes)[0]
    if first.nbytes > slot_bytes:  # it would spill into the next slots, which other readers are reading
        raise LayoutError(f"a chunk of {per_chunk} tokens needs {first.nbytes} staging bytes, more than a slot's "
                          f"{slot_bytes}")


class TierLostRefusal(ClaimRefusedError):
    """A disk tier claim whose file could not be read back whole (the reader sees ``TierLostError``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "HandleTierLostError")


class PackJob:
    """Packs one reader's request chunk by chunk into reserved staging slots (runs on a worker thread).

    Each pack is submitted to the service's executor (host: done at once; CUDA: enqueued on its stream), and
    a chunk is announced only once its pack completed; its slot is held until the reader releases the chunk
    (``ChunkSlots``), so packing chunk i+1 overlaps the reader's READ of chunk i.
    """

    def __init__(self, service: OwnerService, identity: bytes, tid: str, request: dict[str, Any],
                 slots: list[int], source: Source | None = None) -> None:
        self.service, self.identity, self.tid = service, identity, tid
        g = service.cache.geometry
        # Where the bytes are: the cache by block id, or a tier's host memory (same geometry but the block count)
        self.source, self.executor = service.cache, service.executor
        self.ids = as_ids(request["ids"])
        if source is not None:
            self.source, self.executor, self.ids = source[0], service.tier_packs, as_ids(source[1])
        self.num_tokens = int(request["num_tokens"])
        self.layout = layout_from_wire(request["layout"])
        self.head_offset = int(request["head_offset"])
        self.chunks = plan_chunks(self.num_tokens, int(request["chunk_tokens"]), g.block_size, g.block_size,
                                  self.layout, g.num_planes, g.row_bytes)
        self.slots = slots
        self._slots = ChunkSlots(slots)  # guarded by _cond: the side channel's thread releases chunks
        self._cond = threading.Condition()
        self._aborted = False
        self._keep: set[int] = set()  # chunks an abort asked to keep held until released (a READ may be in flight)
        self.finished: threading.Event | None = None  # set when run() returned (see OwnerService.close)

    def release(self, chunk: int) -> None:
        with self._cond:
            if self._slots.release(chunk) or chunk in self._keep:
                self._keep.discard(chunk)
                self._cond.notify_all()

    def abort(self, keep: list[int] | None = None) -> None:
        with self._cond:
            self._aborted = True
            self._keep = set(keep or ())
            self._cond.notify_all()

    def _wait_for_kept(self) -> None:
        """After an abort, wait until the reader released the kept chunks (or the lease ended)."""
        until = time.monotonic() + self.service.lease_s
        with self._cond:
            while self._keep and time.monotonic() < until:
                self._cond.wait(0.1)
            if self._keep:
                log.warning("kvshuttle: reader of %s kept chunks %s past the staging lease; reclaiming", self.tid,
                            sorted(self._keep))

    def _lease_expired(self) -> bool:
        oldest = self._slots.oldest_hold()
        return oldest is not None and time.monotonic() - oldest > self.service.lease_s

    def _wait_for_release(self) -> None:
        """Every slot is held by the reader: wait for a release (or the lease, or an abort)."""
        with self._cond:
            if self._slots.idle or self._aborted:
                return
            if self._lease_expired():
                log.warning("kvshuttle: reader of %s did not release staging within %.1f s; reclaiming",
                            self.tid, self.service.lease_s)
                self._aborted = True
                return
            self._cond.wait(0.1)

    def _drain(self) -> None:
        with self._cond:
            while self._slots.held and not self._aborted and not self._lease_expired():
                self._cond.wait(0.1)

    def _submit(self, slot: int, chunk: Chunk) -> None:
        pool = self.service.pool
        try:
            completion = self.executor.pack(
                self.source, self.ids[chunk.remote], pool.array(slot, chunk.nbytes), num_tokens=chunk.num_tokens,
                layout=self.layout, head_offset=self.head_offset)
        except BaseException:
            with self._cond:
                self._slots.give_back(slot)
            raise
        with self._cond:
            self._slots.start(chunk.index, slot, completion, hold=True)
        if self.service.pack_delay_s:
            time.sleep(self.service.pack_delay_s)

    def run(self) -> None:
        emitter = self.service.server.emitter() if self.service.server else None
        pool = self.service.pool
        waiting = deque(self.chunks)
        try:
            while True:
                with self._cond:
                    if self._aborted:
                        return
                    packed = self._slots.reap()
                    slot = self._slots.take() if waiting else None
                    if not waiting and not self._slots.copying and not packed:
                        break
                for done in packed:  # offered only now: the pack's completion is done
                    if done.error is not None:
                        raise done.error
                    if emitter is not None:
                        emitter.send(self.identity, {"op": "ready", "tid": self.tid, "chunk": done.chunk,
                                                     "addr": pool.address(done.slot),
                                                     "nbytes": self.chunks[done.chunk].nbytes,
                                                     "pack_s": done.seconds})
                if slot is not None:
                    self._submit(slot, waiting.popleft())
                elif packed:
                    continue
                elif self._slots.copying:
                    self._slots.wait_any(0.05)
                elif waiting:
                    self._wait_for_release()
            self._drain()
        except Exception as exc:
            log.exception("kvshuttle: packing %s failed", self.tid)
            if emitter is not None:
                emitter.send(self.identity, {"op": "error", "tid": self.tid, "kind": "pack",
                                             "message": f"{type(exc).__name__}: {exc}"})
        finally:
            with self._cond:
                running = self._slots.running()
            deadline = time.monotonic() + self.service.lease_s
            for completion in running:  # no slot goes back while a pack may still write it; waited for without
                completion.wait(max(0.0, deadline - time.monotonic()))  # the lock the side channel's thread takes
            with self._cond:
                kept = self._slots.held_slots(self._keep)  # a READ of theirs may be in flight on the reader
                self._keep &= {chunk for chunk in self._keep if self._slots.held_slots({chunk})}
                self._slots.settle(0.0)
                reusable = self._slots.reusable
            if len(reusable) < len(self.slots):
                log.error("kvshuttle: %d staging slots of %s kept: their pack did not finish",
                          len(self.slots) - len(reusable), self.tid)
            pool.release([slot for slot in reusable if slot not in kept])
            if kept:
                self._wait_for_kept()
                pool.release(sorted(kept))
            self.service.forget(self.identity, self.tid)
            if emitter is not None:
                emitter.close()


class OwnerService:
    """Answers a reader's side-channel requests for one engine."""

    def __init__(self, cache: PagedKVCache, pool: StagingPool, info: Callable[[], PeerInfo],
                 lease_s: float, pack_delay_s: float = 0.0, depth: int = 2,
                 claims: ClaimAuthority | None = None, *, secret: DeploymentSecret, max_jobs: int = 8,
                 executor: CopyExecutor | None = None, tier: HostTier | None = None,
                 disk: DiskTier | None = None) -> None:
        self.cache, self.pool, self._info, self.claims = cache, pool, info, claims
        self.executor: CopyExecutor = executor or HostExecutor()  # packs: on the host, or a CUDA stream
        self.tier, self.disk = tier, disk
        # The host tier is host memory: packed on the job's thread, or on a GPU host by the CUDA stream reading it in
        # place (mapped), into the VRAM staging a reader reads. A disk tier's blocks come back into plain host
        # memory: packed on the job's thread (CPU hosts only).
        self.tier_packs: CopyExecutor = (self.executor if tier is not None and tier.cache.is_cuda
                                         else HostExecutor())
        self.lease_s, self.pack_delay_s, self.depth = lease_s, pack_delay_s, depth
        self.secret, self.max_jobs = secret, max_jobs
        self.board: HandleBoard | None = None  # handles published for a router (see board.py)
        self.server: SideChannelServer | None = None
        self._jobs: dict[tuple[bytes, str], PackJob] = {}
        self._lock = threading.Lock()
        self._workers = TaskThreads("kvshuttle-pack")

    @property
    def active_jobs(self) -> int:
        with self._lock:
            return len(self._jobs)

    def forget(self, identity: bytes, tid: str) -> None:
        with self._lock:
            self._jobs.pop((identity, tid), None)

    def close(self, timeout: float = 2.0) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.abort()
        for job in jobs:
            if job.finished is not None:
                job.finished.wait(timeout)
        self._workers.close()

    def answer(self, identity: bytes, message: dict[str, Any]) -> dict[str, Any] | None:
        """One authenticated peer's request (``identity``: its connection) -> the reply, or None for none."""
        op = message["op"]
        if op == "hello":
            protocol = message.get("protocol")
            if protocol != PROTOCOL_VERSION:
                return {"op": "error", "kind": "protocol_version", "protocol": PROTOCOL_VERSION,
                        "message": f"this owner speaks kvshuttle side-channel protocol {PROTOCOL_VERSION}, the "
                                   f"reader {str(protocol)[:20]}; run the same kvshuttle version on both sides"}
            return self._info().to_wire()
        if op == "ping":
            return {"op": "pong", "jobs": self.active_jobs}
        if op == "pack":
            return self._pack(identity, message)
        if op in ("claim", "claim_done", "renew_retention", "release_retention", "demote_retention"):
            return serve_claim(self.claims, message, reader=identity.hex(), secret=self.secret)
        if op == "take_published":
            return serve_take(self.board, message)
        if op in ("free_chunk", "abort"):  # a packed read's staging slots
            tid, chunk, keep = message.get("tid"), message.get("chunk", 0), message.get("keep", [])
            if not isinstance(tid, str) or type(chunk) is not int:
                raise ProtocolError(f"{op} needs a string 'tid' and an int 'chunk'")
            if not (isinstance(keep, list) and len(keep) <= MAX_WINDOW and all(type(c) is int for c in keep)):
                raise ProtocolError(f"{op}'s 'keep' must be a list of at most {MAX_WINDOW} chunk numbers")
            with self._lock:
                job = self._jobs.get((identity, tid))  # only the connection that asked can touch its job
            if job is not None:
                if op == "free_chunk":
                    job.release(chunk)
                else:
                    job.abort(keep)
            return None
        return {"op": "error", "kind": "protocol", "message": f"unknown side-channel op {op[:40]!r}"}

    def _authorize(self, identity: bytes, message: dict[str, Any]) -> Source | None:
        """A pack covers only blocks of a live claim (owners with a ledger). Returns where to pack from when the
        claim's blocks are in a tier (its blocks as a paged cache, and the pack's ids there); else None (the
        cache). A disk tier's file is read back here: TierReadError ends the retention (``tier_lost``)."""
        if self.claims is None:
            return None  # a bare engine (benchmarks, tests): authenticated peers may read any registered byte
        claim_id = field(message, "claim_id", str)
        try:
            held = self.claims.claimed_blocks(claim_id)
            slots = self.claims.claimed_slots(claim_id)
            tier, handle_id = self.claims.claimed_tier(claim_id) if slots is not None else ("hot", "")
        except KVShuttleError as exc:
            raise ClaimRefusedError(f"no live claim covers this pack: {exc}", type(exc).__name__) from None
        if not set(message["ids"]) <= set(held):
            raise ClaimRefusedError("the pack names blocks outside its claim", "OutsideClaim")
        if slots is None:
            return None
        if self.tier is None or (tier != "host" and (self.disk is None or self.cache.is_cuda)):
            raise ClaimRefusedError(f"the claim's blocks are in the {tier[:8]} tier, which this engine cannot pack "
                                    "from (no such tier, or a disk tier on a CUDA cache); recompute", "NoTier")
        where = dict(zip(held, slots, strict=True))
        ids = [where[b] for b in message["ids"]]
        if self.disk is None or tier == "host":
            return self.tier.cache, ids
        try:  # the blocks up to the last one named (a file's positions): usually the whole retention
            buffer = self.disk.load(handle_id, max(ids) + 1 if ids else 0)
        except TierReadError as exc:
            self.claims.tier_lost(claim_id)
            raise TierLostRefusal(f"{exc}; the retention ended (HandleTierLostError)") from None
        return self.disk.cache_of(buffer), ids

    def _pack(self, identity: bytes, message: dict[str, Any]) -> dict[str, Any]:
        tid = message.get("tid")
        if not isinstance(tid, str) or not 0 < len(tid) <= 64:
            return {"op": "error", "tid": None, "kind": "protocol", "message": "pack needs a 'tid' of 1..64 chars"}
        if self.pool.slots == 0:
            return {"op": "error", "tid": tid, "kind": "no_staging",
                    "message": "this owner has no staging (staging_chunks=0); read with path='direct'"}
        with self._lock:
            mine = sum(1 for who, _ in self._jobs if who == identity)
            duplicate = (identity, tid) in self._jobs
        if mine >= self.max_jobs or duplicate:
            why = "that tid is in progress" if duplicate else f"{mine} packs of this connection are in progress"
            return {"op": "error", "tid": tid, "kind": "too_many_jobs", "message": f"{why}; wait for them"}
        try:
            _validate(self.cache, self.pool.slot_bytes, message)
            source = self._authorize(identity, message)
            window = field(message, "window", int, 1, MAX_WINDOW)
            slots = self.pool.reserve(window, "owner")
        except StagingExhaustedError as exc:
            return {"op": "error", "tid": tid, "kind": "staging_exhausted", "message": str(exc)}
        except TierLostRefusal as exc:
            return {"op": "error", "tid": tid, "kind": "tier_lost", "message": str(exc)}
        except ClaimRefusedError as exc:
            return {"op": "error", "tid": tid, "kind": "claim", "message": str(exc)}
        except (KVShuttleError, KeyError, TypeError, ValueError) as exc:
            return {"op": "error", "tid": tid, "kind": "block_ids", "message": str(exc)}
        try:
            job = PackJob(self, identity, tid, message, slots, source)
        except (KVShuttleError, KeyError, TypeError, ValueError) as exc:
            self.pool.release(slots)
            return {"op": "error", "tid": tid, "kind": "block_ids", "message": str(exc)}
        with self._lock:
            self._jobs[(identity, tid)] = job
        try:
            job.finished = self._workers.submit(job.run)
        except RuntimeError as exc:  # closing
            self.forget(identity, tid)
            self.pool.release(slots)
            return {"op": "error", "tid": tid, "kind": "closing", "message": str(exc)}
        return {"op": "packing", "tid": tid, "chunks": len(job.chunks), "slots": len(slots)}
