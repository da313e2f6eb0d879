"""The packed path, reader side: ask the owner to pack, read each chunk as it is ready, unpack it.

One thread per transfer drives the pipeline over a side-channel connection borrowed from the peer (reused
across transfers: a new TCP connection costs about a millisecond): the owner packs
chunk i+1 while this thread READs chunk i into a local staging slot and the engine's native unpack worker
scatters chunk i-1 into the paged cache. A chunk's local blocks become valid when its unpack finishes;
on any failure the handle lists exactly the blocks of chunks not unpacked. A chunk READ that NIXL still reports
in flight when the read ends early is retired through the quarantine: its local slot stays out of the pool, the
owner is told to keep its slot (``abort`` with ``keep``) and is sent its ``free_chunk`` once NIXL reports the READ
over, and only then is the handle's ``settlement`` settled.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from ..core.layout import PagedKVCache, StagingLayout
from ._nixl import MemType, NixlAgent, NixlCallError
from .chunk_slots import ChunkSlots
from .errors import (
    BlockRangeError,
    PeerLostError,
    PeerUnreachableError,
    ProtocolError,
    RemoteError,
    StagingExhaustedError,
    TierLostError,
    TransferError,
    TransferTimeoutError,
)
from .executors import CopyExecutor
from .quarantine import Quarantine, Settlement
from .side_channel import Connection, ConnectionLender
from .staging import Chunk, StagingPool, layout_to_wire
from .task_threads import TaskThreads
from .transfer_handle import Outcome, TransferHandle, TransferState, TransferTelemetry
from .wire import NOTIF_PREFIX

log = logging.getLogger(__name__)

_REMOTE_ERRORS: dict[str, type[TransferError]] = {
    "staging_exhausted": StagingExhaustedError,
    "block_ids": BlockRangeError,
    "tier_lost": TierLostError,
}


@dataclass
class PackedSetup:
    """Everything one packed read needs, validated by the engine."""

    context: zmq.Context[Any]
    address: str
    peer: ConnectionLender
    peer_agent: str
    agent: NixlAgent
    quarantine: Quarantine
    cache: PagedKVCache
    pool: StagingPool
    pool_mem: MemType
    pool_device: int
    remote_mem: MemType
    remote_device: int
    unpacker: CopyExecutor  # the native unpack worker (host caches) or a CUDA stream (device caches)
    last_unpacker: CopyExecutor  # for the last chunk: the pipeline's own thread (host caches) or the stream
    threads: TaskThreads  # the threads pipelines run on
    local_ids: npt.NDArray[np.int64]
    remote_ids: npt.NDArray[np.int64]
    num_tokens: int
    layout: StagingLayout
    local_head_offset: int
    remote_head_offset: int
    chunk_tokens: int
    chunks: list[Chunk]
    depth: int
    notify: bytes
    deadline: float
    prep_time: float
    reason: str
    claim_id: str | None = None  # the claim covering remote_ids (owners with a ledger pack only claimed blocks)
    on_done: Callable[[TransferTelemetry], None] | None = None  # told the telemetry of a read that finished DONE


# Back-off between checks of a posted chunk READ (doubling from the first to the most).
_FIRST_PAUSE_S, _MAX_PAUSE_S = 20e-6, 1e-3


class _Stopped(Exception):
    """Internal: the caller asked the pipeline to stop."""


class PackedTransfer(TransferHandle):
    """The caller's handle on a packed read; the work happens in a :class:`_Pipeline` thread.

    The thread holds the pipeline, never this handle, so a handle the caller drops is collected and its
    finalizer stops the pipeline, which frees staging and aborts the owner's job.
    """

    def __init__(self, transfer_id: str, setup: PackedSetup, started: float) -> None:
        super().__init__(transfer_id, "packed", setup.reason, setup.local_ids, setup.on_done)
        self.started = started
        self._pipeline = _Pipeline(transfer_id, setup, started, self._outcome, self._settlement)
        self._finalizer = weakref.finalize(self, self._pipeline.stop_flag.set)
        self._pipeline.start()

    def _stop(self) -> None:
        self._pipeline.stop()

    def _invalid_ids(self) -> tuple[int, ...]:
        return () if self.state is TransferState.DONE else self._pipeline.invalid_ids()

    @property
    def chunks_done(self) -> int:
        return self._pipeline.chunks_done


class _Pipeline:
    """One packed read: borrow a side-channel connection, ask the owner to pack, READ and unpack each chunk."""

    def __init__(self, transfer_id: str, setup: PackedSetup, started: float, outcome: Outcome,
                 settlement: Settlement) -> None:
        self.transfer_id = transfer_id
        self.started = started
        self.reason = setup.reason
        self.stop_flag = threading.Event()
        self._s = setup
        self._outcome = outcome
        self._settlement = settlement
        self._in_flight: tuple[int, int, Settlement] | None = None  # (chunk, slot, its READ's settlement)
        self._done_chunks: set[int] = set()
        self._done_lock = threading.Lock()
        self._slots = setup.pool.reserve(setup.depth, "reader")
        self._posts = 0.0
        self._unpack_time = 0.0
        self._owner_pack_time = 0.0
        try:
            self._conn: Connection = setup.peer.checkout(setup.context)
        except TransferError as exc:
            setup.pool.release(self._slots)
            settlement.settle()
            raise type(exc)(str(exc), setup.local_ids) from None
        try:  # ask from the caller's thread: the owner starts packing while our thread starts
            self._conn.send({"op": "pack", "tid": transfer_id, "ids": setup.remote_ids.tolist(),
                             "num_tokens": setup.num_tokens, "layout": layout_to_wire(setup.layout),
                             "head_offset": setup.remote_head_offset, "chunk_tokens": setup.chunk_tokens,
                             "window": setup.depth, **({} if setup.claim_id is None else
                                                       {"claim_id": setup.claim_id})})
        except PeerLostError as exc:
            setup.pool.release(self._slots)
            settlement.settle()
            setup.peer.checkin(self._conn, False)
            setup.peer.mark_lost(str(exc))
            raise PeerLostError(f"cannot send the pack request to {setup.address}: {exc}",
                                setup.local_ids) from exc
        self._runner: int | None = None  # the worker thread running this pipeline
        self._finished: threading.Event | None = None

    def start(self) -> None:
        try:
            self._finished = self._s.threads.submit(self._run)
        except RuntimeError as exc:  # the engine closed meanwhile
            self._cleanup(self._conn, ChunkSlots(self._slots), send_abort=True, healthy=True)
            raise TransferError(f"packed transfer {self.transfer_id}: {exc}", self._s.local_ids) from None

    def stop(self) -> None:
        self.stop_flag.set()
        if self._finished is not None and threading.get_ident() != self._runner:
            self._finished.wait()

    def invalid_ids(self) -> tuple[int, ...]:
        with self._done_lock:
            done = set(self._done_chunks)
        ids = self._s.local_ids
        return tuple(int(b) for c in self._s.chunks if c.index not in done for b in ids[c.local])

    @property
    def chunks_done(self) -> int:
        with self._done_lock:
            return len(self._done_chunks)

    # -- pipeline -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        self._runner = threading.get_ident()
        s = self._s
        conn = self._conn
        slots = ChunkSlots(self._slots)  # a slot is read into again only once its unpack completed
        ready: deque[dict[str, Any]] = deque()
        error: TransferError | None = None
        finished, healthy = False, True
        try:
            while True:
                self._check_stop()
                self._reap(slots)
                if len(self._done_chunks) == len(s.chunks):
                    break
                slot = slots.take() if ready else None
                if slot is not None:
                    self._read_chunk(conn, ready.popleft(), slot, slots)
                    continue
                if ready or (slots.copying and len(self._done_chunks) + slots.copying == len(s.chunks)):
                    slots.wait_any(0.05)
                    continue
                # The connection raises PeerLostError as soon as the owner's process is gone or its
                # heartbeat stops (EngineConfig.peer_timeout_s).
                message = conn.receive(0.05, f"packed transfer {self.transfer_id}")
                if message is not None:
                    self._on_message(message, ready)
            finished = True  # every block is in place; a lost notification does not change that
            try:
                s.agent.send_notif(s.peer_agent, NOTIF_PREFIX + self.transfer_id.encode() + b":" + s.notify)
            except NixlCallError as exc:
                log.warning("kvshuttle: completion notification for %s not delivered: %s", self.transfer_id, exc)
        except _Stopped:
            pass
        except PeerLostError as exc:
            error, healthy = exc, False
            s.peer.mark_lost(str(exc))
        except ProtocolError as exc:
            error, healthy = exc, False
        except PeerUnreachableError as exc:  # it served this read moments ago: refusing now, its process is gone
            error, healthy = PeerLostError(f"packed transfer {self.transfer_id}: {exc}"), False
            s.peer.mark_lost(str(exc))
        except TransferError as exc:
            error = exc
        except NixlCallError as exc:
            error = (PeerLostError if exc.disconnected else TransferError)(
                f"packed transfer {self.transfer_id}: {exc}")
            healthy = not exc.disconnected
            if exc.disconnected:
                s.peer.mark_lost(str(exc))
        except Exception as exc:  # a bug or an unpack failure: report it as this transfer's failure
            error = TransferError(f"packed transfer {self.transfer_id} failed: {type(exc).__name__}: {exc}")
            healthy = False
        finally:
            self._cleanup(conn, slots, send_abort=not finished, healthy=healthy)
        if finished:
            self._outcome.finish(TransferState.DONE, telemetry=self._telemetry_record())
        elif error is not None:
            kind = type(error)
            self._outcome.finish(TransferState.FAILED, error=kind(
                f"{error.args[0] if error.args else error}; recompute the listed blocks", self.invalid_ids()))

    def _check_stop(self) -> None:
        if self.stop_flag.is_set():
            raise _Stopped
        if time.monotonic() > self._s.deadline:
            raise TransferTimeoutError(f"packed transfer {self.transfer_id} passed its deadline "
                                       f"({len(self._done_chunks)}/{len(self._s.chunks)} chunks done)")

    def _on_message(self, message: dict[str, Any], ready: deque[dict[str, Any]]) -> None:
        op = message["op"]
        if message.get("tid", self.transfer_id) != self.transfer_id:
            return  # late news of an earlier transfer on this reused connection
        if op == "ready":
            self._owner_pack_time += float(message.get("pack_s", 0.0))
            ready.append(message)
        elif op == "error":
            kind = _REMOTE_ERRORS.get(str(message.get("kind")), RemoteError)
            raise kind(f"owner refused packed transfer {self.transfer_id}: {message.get('message')}")
        elif op not in ("packing", "pong"):
            raise ProtocolError(f"unexpected side-channel message {op!r} during a packed read")

    def _read_chunk(self, conn: Connection, msg: dict[str, Any], slot: int, slots: ChunkSlots) -> None:
        s = self._s
        chunk = s.chunks[int(msg["chunk"])]
        nbytes = int(msg["nbytes"])
        if nbytes != chunk.nbytes:
            raise ProtocolError(f"owner staged {nbytes} bytes for chunk {chunk.index}, expected {chunk.nbytes}")
        local = np.array([[s.pool.address(slot), nbytes, s.pool_device]], dtype=np.uint64)
        remote = np.array([[int(msg["addr"]), nbytes, s.remote_device]], dtype=np.uint64)
        xfer = s.agent.make_xfer(local, s.pool_mem, remote, s.remote_mem, s.peer_agent)
        try:
            t0 = time.perf_counter()
            state = s.agent.post(xfer)
            pause = _FIRST_PAUSE_S
            while state == "PROC":
                self._check_stop()
                lost = conn.watch()  # UCX may wait long for a dead peer; the side channel knows at once
                if lost is not None:
                    raise PeerLostError(f"{lost} during the NIXL READ of chunk {chunk.index}")
                # Sleeping (GIL released) lets the unpack worker and NIXL's progress thread run; spinning
                # on state() took one of the two cores from them.
                time.sleep(pause)
                pause = min(2 * pause, _MAX_PAUSE_S)
                state = s.agent.state(xfer)
            self._posts += time.perf_counter() - t0
            if state != "DONE":
                raise PeerLostError(f"NIXL READ of chunk {chunk.index} from {s.peer_agent} failed (state ERR)")
        finally:
            read = s.quarantine.retire(xfer, f"packed transfer {self.transfer_id}, chunk {chunk.index}")
            if not read.done():  # it may still write this slot: kept out of the pool until it cannot
                self._in_flight = (chunk.index, slot, read)
        conn.send({"op": "free_chunk", "tid": self.transfer_id, "chunk": chunk.index})
        last = len(self._done_chunks) + slots.copying + 1 == len(s.chunks)  # no READ left to overlap
        slots.start(chunk.index, slot, (s.last_unpacker if last else s.unpacker).unpack(
            s.pool.array(slot, chunk.nbytes), s.cache, s.local_ids[chunk.local], num_tokens=chunk.num_tokens,
            layout=s.layout, head_offset=s.local_head_offset), hold=False)

    def _reap(self, slots: ChunkSlots) -> None:
        failed = None
        for done in slots.reap():  # count every chunk that landed before reporting one that did not
            if done.error is not None:
                failed = failed or done.error
                continue
            self._unpack_time += done.seconds
            with self._done_lock:
                self._done_chunks.add(done.chunk)
        if failed is not None:
            raise failed  # this transfer's failure; the chunk stays invalid

    def _cleanup(self, conn: Connection, slots: ChunkSlots, send_abort: bool, healthy: bool) -> None:
        for done in slots.settle(max(1.0, self._s.deadline - time.monotonic())):  # unpacks are short
            if done.error is None:
                self._unpack_time += done.seconds
                with self._done_lock:
                    self._done_chunks.add(done.chunk)
        in_flight = self._in_flight
        if send_abort:
            try:  # the owner keeps the slot a READ may still read until we release that chunk
                conn.send({"op": "abort", "tid": self.transfer_id,
                           **({} if in_flight is None else {"keep": [in_flight[0]]})})
            except PeerLostError:
                healthy = False
        kept = set(self._slots) - set(slots.reusable)
        if kept:  # an unpack that never finished may still read them: never hand them out again
            log.error("kvshuttle: %d staging slots of %s kept: their unpack did not finish", len(kept),
                      self.transfer_id)
        if in_flight is None:
            self._s.peer.checkin(conn, healthy)
            self._s.pool.release([slot for slot in self._slots if slot not in kept])
            self._settlement.settle()
            return
        chunk, held, read = in_flight
        self._s.pool.release([slot for slot in self._slots if slot not in kept and slot != held])
        read.on_settled(lambda: self._read_over(conn, chunk, held, healthy))

    def _read_over(self, conn: Connection, chunk: int, slot: int, healthy: bool) -> None:
        """A chunk READ left in flight is over (NIXL says so): its slot on both sides may be used again."""
        if healthy:
            try:
                conn.send({"op": "free_chunk", "tid": self.transfer_id, "chunk": chunk})
            except PeerLostError:
                healthy = False
        self._s.peer.checkin(conn, healthy)
        self._s.pool.release([slot])
        self._settlement.settle()

    def _telemetry_record(self) -> TransferTelemetry:
        s = self._s
        g = s.cache.geometry
        return TransferTelemetry(
            transfer_id=self.transfer_id, path="packed", reason=self.reason,
            bytes=sum(c.nbytes for c in s.chunks), descriptors=len(s.chunks),
            pieces=len(s.local_ids) * g.num_planes, chunks=len(s.chunks), prep_time_s=s.prep_time,
            post_time_s=self._posts, transfer_time_s=time.perf_counter() - self.started,
            unpack_time_s=self._unpack_time, owner_pack_time_s=self._owner_pack_time,
        )
