"""The transfer engine: one NIXL agent per worker, a side channel, and reads by the direct or packed path.

Owner (decode)::

    engine = TransferEngine(cache, EngineConfig(port=0))
    address = engine.serve()          # "tcp://127.0.0.1:<port>", handed to readers

Reader (prefill)::

    engine = TransferEngine(cache)
    peer = engine.connect(address)    # handshake: metadata + geometry, compatibility check
    handle = engine.read(peer, local_ids, remote_ids)
    telemetry = handle.wait(timeout=5.0)   # or poll(); failures name the invalid local blocks

An engine is driven from one thread (its internal threads share the NIXL agent through a lock).
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import zmq

from ..core.blocks import check_ids
from ..core.layout import PagedKVCache, StagingLayout
from ..core.plan import ReadPlan, SideGeometry, plan_read
from ..errors import BlockIdError, StagingError
from ..policy.kv_handle import KVHandle
from ._nixl import DlistHandle, MemType, NixlAgent, NixlCallError, RegHandle
from .claims import ClaimAuthority, ClaimTicket, check_done_reply, claim_request, ticket_from_reply
from .direct import DirectRequest, DirectTransfer, all_pieces, build_initialize, build_prepped
from .errors import (
    BlockRangeError,
    IncompatiblePeerError,
    PeerLostError,
    PeerUnreachableError,
    RemoteError,
    SideChannelError,
    StagingExhaustedError,
    StagingTooSmallError,
    TransferError,
)
from .owner_service import OwnerService
from .packed import PackedSetup, PackedTransfer
from .side_channel import Connection, SideChannelServer
from .staging import StagingPool, chunk_tokens, plan_chunks
from .transfer_handle import TransferHandle, TransferState, TransferTelemetry
from .wire import (
    NOTIF_PREFIX,
    PROTOCOL_VERSION,
    CacheInfo,
    PeerInfo,
    StagingInfo,
    check_compatible,
    layout_difference,
)

Path = Literal["auto", "direct", "packed"]


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Sizes in bytes, times in seconds."""

    name: str | None = None  # NIXL agent name (default: a fresh unique name)
    backends: tuple[str, ...] = ("UCX",)  # e.g. ("LIBFABRIC",) on EFA machines
    num_threads: int = 0  # backend worker threads (0: the backend default)
    progress_delay_us: int = 10_000  # NIXL progress thread idle wake-up (it also wakes on events); 0: none
    host: str = "127.0.0.1"  # side-channel bind address (serve)
    port: int = 0  # side-channel port; 0 picks a free one (see serve())
    staging_chunk_bytes: int = 16 << 20  # one staging chunk: 16 MiB x 4 in flight measured best (benchmarks/README)
    staging_chunks: int = 8  # chunks in the registered staging pool (0: no packed path): 2 reads at full depth
    pipeline_depth: int = 4  # staging chunks one packed read holds on each side
    # auto path: reads whose descriptors average below this go packed. Measured crossover on the 2-core
    # reference VM (UCX over CMA): packed wins at 4 KiB (1.6x) and 8 KiB (1.2x), loses at 16 KiB (0.84x).
    packed_threshold_bytes: int = 16 << 10
    direct_mode: Literal["initialize", "prepped"] = "initialize"
    connect_timeout_s: float = 5.0
    transfer_timeout_s: float = 60.0  # default deadline of one read
    peer_timeout_s: float = 5.0  # silence on the side channel before a ping; no pong in as long: lost
    staging_lease_s: float = 30.0  # owner reclaims a ready chunk not released within this
    debug_pack_delay_s: float = 0.0  # fault injection for tests: sleep after packing each chunk


@dataclass
class Peer:
    """A connected owner: its handshake data and this engine's per-peer NIXL state."""

    address: str
    info: PeerInfo
    agent_name: str
    layout_difference: str | None  # why a direct read is impossible, or None
    conn: Connection = field(repr=False)
    remote_dlist: DlistHandle | None = field(default=None, repr=False)
    connected: bool = True
    _streams: list[Connection] = field(default_factory=list, repr=False)  # idle packed-read connections
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def checkout(self, context: zmq.Context[Any]) -> Connection:
        """An idle side-channel connection for one packed read (TCP set-up costs ~1 ms: reuse them)."""
        with self._lock:
            if self._streams:
                return self._streams.pop()
        return Connection(context, self.address)

    def checkin(self, conn: Connection, healthy: bool) -> None:
        with self._lock:
            if healthy and self.connected and len(self._streams) < 8:
                self._streams.append(conn)
                return
        conn.close()

    def close_streams(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for conn in streams:
            conn.close()


@dataclass(frozen=True)
class ReadNotice:
    """A completion notification received by an owner: ``peer_agent`` finished reading."""

    peer_agent: str
    transfer_id: str | None  # None for notifications not sent by kvshuttle
    tag: bytes  # the reader's ``notify`` payload (or the raw message)


def _mem(cache: PagedKVCache) -> tuple[MemType, int]:
    if cache.is_cuda:
        return "VRAM", int(cache.geometry.device.partition(":")[2] or 0)
    return "DRAM", 0


def _loose_ids(ids: Any) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in np.asarray(ids).reshape(-1))
    except (TypeError, ValueError):
        return ()


class _EmptyTransfer(TransferHandle):
    """A read of zero blocks: finished at once (the owner still gets its notification)."""

    def __init__(self, transfer_id: str, started: float) -> None:
        super().__init__(transfer_id, "direct", "nothing to read", np.zeros(0, dtype=np.int64))
        self._finish(TransferState.DONE, telemetry=TransferTelemetry(
            transfer_id, "direct", "nothing to read", 0, 0, 0, 0, 0.0, 0.0, time.perf_counter() - started))


class TransferEngine:
    """One worker's NIXL agent, registered cache and staging, side channel, peers and transfers."""

    def __init__(self, cache: PagedKVCache, config: EngineConfig | None = None, *, staging: Any = None,
                 claims: ClaimAuthority | None = None) -> None:
        """Create the agent and register ``cache`` and the staging pool (``staging``: an optional host buffer
        of ``staging_chunks * staging_chunk_bytes`` bytes to use instead of a new numpy allocation).
        ``claims`` (an owner's retention ledger) answers readers' claims; without it claims are refused."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError("pass a PagedKVCache (PagedKVCache.from_arrays(layers, kind))")
        self.config = config = config or EngineConfig()
        if config.name is None:
            self.config = config = replace(config, name=f"kvshuttle-{uuid.uuid4().hex[:12]}")
        assert config.name is not None
        self.name = config.name
        self.cache = cache
        self._claims = claims
        self.mem_type, self.device_id = _mem(cache)
        self.side = SideGeometry.from_cache(cache, self.device_id)
        self.cache_info = CacheInfo.from_geometry(cache.geometry, self.mem_type)
        # CUDA pack/unpack are asynchronous and the native module has no stream-sync binding yet, so a
        # chunk could be announced or reused before its copy ran: device caches use the direct path only.
        slots = 0 if cache.is_cuda else config.staging_chunks
        self.pool = StagingPool(config.staging_chunk_bytes, slots, staging if slots else None)
        self._agent = NixlAgent(config.name, config.backends, num_threads=config.num_threads,
                                progress_delay_us=config.progress_delay_us)
        self._registrations: list[RegHandle] = []
        self._local_dlist: DlistHandle | None = None
        self._peers: dict[str, Peer] = {}
        self._active: weakref.WeakSet[TransferHandle] = weakref.WeakSet()
        self._zmq: zmq.Context[Any] = zmq.Context()
        self._unpacker = ThreadPoolExecutor(1, thread_name_prefix="kvshuttle-unpack")
        self._server: SideChannelServer | None = None
        self._owner: OwnerService | None = None
        self._closed = False
        try:
            self._registrations.append(self._agent.register(cache.regions(), self.mem_type, self.device_id))
            if self.pool.slots:
                pool_mem: MemType = "VRAM" if self.pool.view.is_cuda else "DRAM"
                self._registrations.append(self._agent.register(
                    [(self.pool.base, self.pool.nbytes)], pool_mem, self._pool_device()))
        except NixlCallError as exc:
            self.close()
            raise TransferError(f"registering the KV cache with NIXL failed: {exc}") from exc

    # -- owner side -----------------------------------------------------------------------------------------
    def serve(self) -> str:
        """Start answering readers on the side channel; returns its address (``tcp://host:port``)."""
        self._check_open()
        if self._server is None:
            metadata = self._agent.metadata()
            info = PeerInfo(self.name, metadata, self.side, self.cache_info, self._staging_info())
            self._owner = OwnerService(self.cache, self.pool, lambda: info, self.config.staging_lease_s,
                                       self.config.debug_pack_delay_s, self.config.pipeline_depth, self._claims)
            try:
                self._server = SideChannelServer(self._zmq, self.config.host, self.config.port,
                                                 self._owner.handle)
            except OSError as exc:
                raise SideChannelError(str(exc)) from exc
            self._owner.server = self._server
        return self._server.address

    @property
    def address(self) -> str | None:
        return self._server.address if self._server else None

    def notifications(self) -> list[ReadNotice]:
        """Completion notifications from readers since the last call (owner side)."""
        notices = []
        for agent, messages in self._agent.notifs().items():
            for message in messages:
                if message.startswith(NOTIF_PREFIX):
                    tid, _, tag = message[len(NOTIF_PREFIX):].partition(b":")
                    notices.append(ReadNotice(agent, tid.decode(errors="replace"), tag))
                else:
                    notices.append(ReadNotice(agent, None, message))
        return notices

    # -- reader side ----------------------------------------------------------------------------------------
    def connect(self, address: str, timeout: float | None = None) -> Peer:
        """Handshake with an owner: exchange metadata and geometry, check compatibility, load its agent."""
        self._check_open()
        conn = Connection(self._zmq, address)
        try:
            reply = conn.request({"op": "hello", "protocol": PROTOCOL_VERSION, "agent": self.name,
                                  "cache": self.cache_info.to_wire()},
                                 self.config.connect_timeout_s if timeout is None else timeout, "the handshake")
            if reply.get("op") == "error":
                raise RemoteError(f"owner at {address} refused the handshake: {reply.get('message')}")
            info = PeerInfo.from_wire(reply)
            check_compatible(self.cache_info, info.cache)
            existing = self._peers.get(info.agent_name)
            if existing is not None and existing.connected:
                conn.close()
                return existing
            name = self._agent.add_remote(info.metadata)
            self._agent.connect(name)
        except NixlCallError as exc:
            conn.close()
            raise PeerUnreachableError(f"loading the NIXL metadata of {address} failed: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        peer = Peer(address, info, name, layout_difference(self.cache_info, info.cache), conn)
        self._peers[name] = peer
        return peer

    def ping(self, peer: Peer, timeout: float = 1.0) -> bool:
        """True when the owner answers on its side channel within ``timeout``."""
        try:
            return peer.conn.request({"op": "ping"}, timeout, "a ping").get("op") == "pong"
        except PeerUnreachableError:
            return False

    @property
    def claims(self) -> ClaimAuthority | None:
        """The authority answering readers' claims (settable after serve(): a ledger needs the address)."""
        return self._claims

    @claims.setter
    def claims(self, authority: ClaimAuthority | None) -> None:
        self._claims = authority
        if self._owner is not None:
            self._owner.claims = authority

    def claim(self, peer: Peer, handle: KVHandle, num_blocks: int | None = None,
              timeout: float | None = None) -> ClaimTicket:
        """Ask the owner to check and pin the first ``num_blocks`` blocks of ``handle`` before reading them.

        Raises ClaimRefusedError (expired, evicted, stale, consumed, tampered...): recompute instead.
        """
        reply = peer.conn.request(claim_request(handle, num_blocks, self.name),
                                  self.config.connect_timeout_s if timeout is None else timeout, "a claim")
        return ticket_from_reply(reply, peer.address)

    def finish_claim(self, peer: Peer, ticket: ClaimTicket, ok: bool, timeout: float | None = None) -> None:
        """Report a claimed read done (``ok``: the owner confirms the blocks were not reused meanwhile, else
        ClaimRefusedError: discard them) or failed (the owner unpins)."""
        reply = peer.conn.request({"op": "claim_done", "claim_id": ticket.claim_id, "ok": ok},
                                  self.config.connect_timeout_s if timeout is None else timeout, "a claim report")
        if ok:
            check_done_reply(reply, peer.address)

    def disconnect(self, peer: Peer) -> None:
        if not peer.connected:
            return
        peer.connected = False
        self._peers.pop(peer.agent_name, None)
        try:
            if peer.remote_dlist is not None:
                self._agent.release_dlist(peer.remote_dlist)
            self._agent.remove_remote(peer.agent_name)
        except NixlCallError:
            pass
        peer.conn.close()
        peer.close_streams()

    def read(self, peer: Peer, local_ids: Any, remote_ids: Any, *, num_tokens: int | None = None,
             path: Path = "auto", notify: bytes = b"", timeout: float | None = None,
             num_heads: int | None = None, local_head_offset: int = 0,
             remote_head_offset: int = 0) -> TransferHandle:
        """Start reading the owner's blocks ``remote_ids`` into local blocks ``local_ids`` (in order).

        ``num_tokens`` (default: every slot) may end inside the last block; the direct path copies whole
        blocks. ``num_heads``/``*_head_offset`` read a head slice (tensor-parallel shards; packed path).
        ``path="auto"`` picks packed for small descriptors or differing layouts, else direct
        (``handle.path`` and ``telemetry.reason`` say which and why). ``notify`` is delivered to the owner
        with the completion notification. Raises before starting on bad ids or an impossible path.
        """
        started = time.perf_counter()
        self._check_open()
        self._check_peer(peer, local_ids)
        transfer_id = uuid.uuid4().hex[:16]
        deadline = time.monotonic() + (self.config.transfer_timeout_s if timeout is None else timeout)
        lids, rids, tokens = self._check_read_ids(peer, local_ids, remote_ids, num_tokens)
        if lids.size == 0:  # nothing to move; the owner still learns the read is over
            try:
                self._agent.send_notif(peer.agent_name, NOTIF_PREFIX + transfer_id.encode() + b":" + notify)
            except NixlCallError as exc:
                raise PeerLostError(f"notifying {peer.address} failed: {exc}") from exc
            return _EmptyTransfer(transfer_id, started)
        g, rc = self.cache.geometry, peer.info.cache
        heads = num_heads or min(g.num_heads, rc.num_heads)
        if not (0 <= local_head_offset <= g.num_heads - heads and 0 <= remote_head_offset <= rc.num_heads - heads):
            raise BlockRangeError(f"a slice of {heads} heads at offsets {local_head_offset} (local, of "
                                  f"{g.num_heads}) / {remote_head_offset} (remote, of {rc.num_heads}) is out "
                                  "of range", lids)
        sliced = heads != g.num_heads or heads != rc.num_heads
        difference = peer.layout_difference or (f"head slice of {heads}" if sliced else None)
        chosen, reason, plan = self._choose_path(peer, lids, rids, path, difference)
        if chosen == "direct":
            handle: TransferHandle = self._read_direct(peer, transfer_id, lids, rids, plan, reason, notify,
                                                       deadline, started)
        else:
            layout = StagingLayout(g.block_size, heads, g.order)
            handle = self._read_packed(peer, transfer_id, lids, rids, tokens, layout, local_head_offset,
                                       remote_head_offset, reason, notify, deadline, started)
        self._active.add(handle)
        return handle

    # -- housekeeping ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Live NIXL objects and engine state (flat over time when nothing leaks)."""
        counts = self._agent.counts()
        return {
            "registrations": counts["registration"], "dlists": counts["dlist"],
            "xfer_handles": counts["xfer"], "stuck_xfer_handles": counts["stuck_xfer"],
            "active_transfers": sum(1 for h in list(self._active) if h.state is TransferState.PENDING),
            "owner_jobs": self._owner.active_jobs if self._owner else 0,
            "staging_free": self.pool.free, "staging_chunks": self.pool.slots, "peers": len(self._peers),
        }

    def close(self) -> None:
        """Cancel transfers, stop serving, forget peers, release every NIXL object. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._active):
            handle.cancel()
        if self._server is not None:
            self._server.close()
        if self._owner is not None:
            self._owner.close()
        for peer in list(self._peers.values()):
            self.disconnect(peer)
        agent = getattr(self, "_agent", None)
        if agent is not None:
            agent.retry_stuck()
            if self._local_dlist is not None:
                agent.release_dlist(self._local_dlist)
            for registration in self._registrations:
                agent.deregister(registration)
        self._unpacker.shutdown(wait=True)
        self._zmq.term()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("this TransferEngine is closed; create a new one")

    def _check_peer(self, peer: Peer, local_ids: Any) -> None:
        if not isinstance(peer, Peer) or not peer.connected or self._peers.get(peer.agent_name) is not peer:
            raise PeerLostError("that peer is not connected to this engine; call engine.connect(address)",
                                _loose_ids(local_ids))

    def _pool_device(self) -> int:
        return int(self.pool.view.device.partition(":")[2] or 0) if self.pool.view.is_cuda else 0

    def _staging_info(self) -> StagingInfo:
        mem = "VRAM" if self.pool.view.is_cuda else "DRAM"
        return StagingInfo(self.pool.slot_bytes, self.pool.slots, mem, self._pool_device())

    def _check_read_ids(self, peer: Peer, local_ids: Any, remote_ids: Any,
                        num_tokens: int | None) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
        g, rc = self.cache.geometry, peer.info.cache
        try:
            lids = check_ids(local_ids, g.num_blocks, "local")
            rids = check_ids(remote_ids, rc.num_blocks, "remote")
        except BlockIdError as exc:
            raise BlockRangeError(f"{exc}; pass ids inside both caches", _loose_ids(local_ids)) from None
        tokens = min(lids.size * g.block_size, rids.size * rc.block_size) if num_tokens is None else num_tokens
        for side, ids, bs in (("local", lids, g.block_size), ("remote", rids, rc.block_size)):
            if not ((ids.size - 1) * bs < tokens <= ids.size * bs or tokens == ids.size == 0):
                raise BlockRangeError(f"{ids.size} {side} blocks of {bs} tokens cannot hold exactly {tokens} "
                                      "tokens; pass one block per started block of tokens on each side", lids)
        return lids, rids, int(tokens)

    def _choose_path(self, peer: Peer, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64], path: Path,
                     difference: str | None) -> tuple[str, str, ReadPlan | None]:
        staging = self.pool.slots > 0 and peer.info.staging.slots > 0
        threshold = self.config.packed_threshold_bytes
        if path not in ("auto", "direct", "packed"):
            raise ValueError(f"path must be 'auto', 'direct' or 'packed', not {path!r}")
        if path == "direct" or (path == "auto" and difference is None and not staging):
            if difference is not None:
                raise IncompatiblePeerError(f"a direct read needs identical block layouts, but {difference}; "
                                            "read with path='packed' (or 'auto')", lids)
            return "direct", "requested" if path == "direct" else "no staging on one side", None
        if not staging:
            raise IncompatiblePeerError(
                "the packed path needs staging on both sides (staging_chunks > 0 and host caches: CUDA caches "
                "read direct only for now)" + ("" if difference is None else f"; layouts differ: {difference}"),
                lids)
        if path == "packed":
            return "packed", "requested", None
        if difference is not None:
            return "packed", f"layouts differ ({difference})", None
        piece = self.side.piece_bytes
        if piece >= threshold:
            return "direct", f"pieces of {piece} B >= threshold {threshold} B", None
        plan = plan_read(self.side, lids, peer.info.side, rids)
        if plan.bytes_per_descriptor >= threshold:
            return "direct", (f"pieces of {piece} B coalesce to {plan.bytes_per_descriptor:.0f} B per "
                              f"descriptor >= threshold {threshold} B"), plan
        return "packed", (f"{plan.bytes_per_descriptor:.0f} B per descriptor after coalescing < threshold "
                          f"{threshold} B"), None

    def _read_direct(self, peer: Peer, transfer_id: str, lids: npt.NDArray[np.int64],
                     rids: npt.NDArray[np.int64], plan: ReadPlan | None, reason: str, notify: bytes,
                     deadline: float, started: float) -> TransferHandle:
        notif = NOTIF_PREFIX + transfer_id.encode() + b":" + notify
        rmem: MemType = "VRAM" if peer.info.cache.mem_type == "VRAM" else "DRAM"
        try:
            request: DirectRequest
            if self.config.direct_mode == "prepped":
                if self._local_dlist is None:
                    self._local_dlist = self._agent.prep_dlist(None, all_pieces(self.side), self.mem_type)
                if peer.remote_dlist is None:
                    peer.remote_dlist = self._agent.prep_dlist(peer.agent_name, all_pieces(peer.info.side), rmem)
                request = build_prepped(self._agent, self.side, self._local_dlist, lids, peer.info.side,
                                        peer.remote_dlist, rids, notif)
            else:
                plan = plan or plan_read(self.side, lids, peer.info.side, rids)
                request = build_initialize(self._agent, plan, self.mem_type, rmem, peer.agent_name, notif)
        except NixlCallError as exc:
            kind = PeerLostError if exc.disconnected else TransferError
            raise kind(f"building the direct READ from {peer.address} failed: {exc}", lids) from exc
        prep = time.perf_counter() - started
        return DirectTransfer(transfer_id, reason, lids, self._agent, peer.agent_name, request, prep, deadline,
                              started)

    def _read_packed(self, peer: Peer, transfer_id: str, lids: npt.NDArray[np.int64],
                     rids: npt.NDArray[np.int64], tokens: int, layout: StagingLayout, local_head_offset: int,
                     remote_head_offset: int, reason: str, notify: bytes, deadline: float,
                     started: float) -> TransferHandle:
        g, rc = self.cache.geometry, peer.info.cache
        slot_bytes = min(self.pool.slot_bytes, peer.info.staging.slot_bytes)
        try:
            per_chunk = chunk_tokens(g.block_size, rc.block_size, layout, g.num_planes, g.row_bytes, slot_bytes)
        except StagingError as exc:
            raise StagingTooSmallError(str(exc), lids) from None
        chunks = plan_chunks(tokens, per_chunk, g.block_size, rc.block_size, layout, g.num_planes, g.row_bytes)
        staging = peer.info.staging
        setup = PackedSetup(
            context=self._zmq, address=peer.address, peer=peer, peer_agent=peer.agent_name, agent=self._agent,
            cache=self.cache, pool=self.pool, pool_mem="VRAM" if self.pool.view.is_cuda else "DRAM",
            pool_device=self._pool_device(), remote_mem="VRAM" if staging.mem_type == "VRAM" else "DRAM",
            remote_device=staging.device_id, unpacker=self._unpacker, local_ids=lids, remote_ids=rids,
            num_tokens=tokens, layout=layout, local_head_offset=local_head_offset,
            remote_head_offset=remote_head_offset, chunk_tokens=per_chunk, chunks=chunks,
            depth=max(1, self.config.pipeline_depth), notify=notify, deadline=deadline,
            peer_timeout_s=self.config.peer_timeout_s, prep_time=time.perf_counter() - started, reason=reason,
        )
        try:
            return PackedTransfer(transfer_id, setup, started)
        except StagingExhaustedError as exc:
            raise StagingExhaustedError(str(exc), lids) from None
