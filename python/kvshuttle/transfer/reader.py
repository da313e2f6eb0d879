"""The reader role (prefill, for reverse reads): connect to owners, claim their blocks, read them.

``read()`` validates every argument before anything is posted (named errors), picks the path (packed for
layout transforms; for identical layouts, ``auto`` asks the peer's :class:`~.path_model.PathModel`, fed by
the reads already done, which path moved reads like this one faster) and returns a :class:`TransferHandle`.
A peer whose connection drops or whose heartbeat stops is *lost*: every read, claim and ping to it fails at
once with ``PeerLostError``; ``connect(address)`` again reaches an owner that came back.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core.blocks import blocks_hold_tokens, check_ids
from ..core.layers import split_by_layer
from ..core.layout import CacheGeometry, StagingLayout
from ..core.plan import ReadPlan, SideGeometry, plan_read
from ..core.ranks import MAX_READERS
from ..errors import BlockIdError, LayoutError, StagingError, shown
from ..policy.kv_handle import KVHandle
from ._nixl import MemType, NixlCallError
from .claims import HOT, ClaimTicket, check_done_reply, claim_request, ticket_from_reply
from .config import PATHS, Path
from .direct import DirectRequest, DirectTransfer, all_pieces, build_initialize, build_prepped
from .endpoint import Endpoint
from .errors import (
    BlockRangeError,
    IncompatiblePeerError,
    PeerLostError,
    PeerUnreachableError,
    RemoteError,
    StagingExhaustedError,
    StagingTooSmallError,
    TransferArgumentError,
    TransferError,
)
from .layered import LayeredTransfer
from .packed import PackedSetup, PackedTransfer
from .path_model import PathModel
from .peer import Peer
from .side_channel import Connection
from .staging import chunk_tokens, plan_chunks
from .transfer_handle import TransferHandle, TransferState, TransferTelemetry
from .wire import NOTIF_PREFIX, PROTOCOL_VERSION, PeerInfo, check_compatible, geometry_to_wire, layout_difference


def _loose_ids(ids: Any) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in np.asarray(ids).reshape(-1))
    except (TypeError, ValueError, OverflowError):
        return ()


def _int_arg(name: str, value: Any, minimum: int, lids: Any, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum \
            or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise TransferArgumentError(f"{name} must be an integer {bounds}, got {shown(value)}", _loose_ids(lids))
    return int(value)


def _timeout_arg(value: Any, default: float, what: str = "timeout") -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TransferArgumentError(f"{what} must be a positive number of seconds, got {shown(value)}")
    return float(value)


class _EmptyTransfer(TransferHandle):
    """A read of zero blocks: finished at once (the owner still gets its notification)."""

    def __init__(self, transfer_id: str, started: float) -> None:
        super().__init__(transfer_id, "direct", "nothing to read", np.zeros(0, dtype=np.int64))
        self._settlement.settle()
        self._finish(TransferState.DONE, telemetry=TransferTelemetry(
            transfer_id, "direct", "nothing to read", 0, 0, 0, 0, 0.0, 0.0, time.perf_counter() - started))


class ReaderRole(Endpoint):
    """Reads other engines' blocks into this endpoint's cache."""

    def connect(self, address: str, timeout: float | None = None) -> Peer:
        """Handshake with an owner: exchange metadata and geometry, check compatibility, load its agent.

        PeerUnreachableError when the connection is refused (at once) or nothing answers within
        ``timeout`` (default ``connect_timeout_s``); IncompatiblePeerError when no path can move blocks.
        """
        self._check_open()
        self._prune_lost()
        wait = _timeout_arg(timeout, self.config.connect_timeout_s)
        config = self.config
        conn = Connection(self._zmq, address, secret=self.secret, heartbeat_s=config.heartbeat_s,
                          peer_timeout_s=config.peer_timeout_s)
        try:
            reply = conn.request({"op": "hello", "protocol": PROTOCOL_VERSION, "agent": self.name,
                                  "cache": geometry_to_wire(self.cache.geometry)}, wait, "the handshake")
            if reply.get("op") == "error" and reply.get("kind") == "protocol_version":
                raise IncompatiblePeerError(f"owner at {address}: {reply.get('message')}")
            if reply.get("op") == "error":
                raise RemoteError(f"owner at {address} refused the handshake: {reply.get('message')}")
            info = PeerInfo.from_wire(reply)
            check_compatible(self.cache.geometry, info.cache)
        except BaseException:
            conn.close()
            raise
        with self._peers_lock:  # one table of peers for every thread reading through this engine
            try:
                existing = self._peers.get(info.agent_name)
                if existing is not None and existing.connected and existing.watch() is None:
                    conn.close()
                    return existing
                if existing is not None:
                    self._forget(existing)
                if self._agent.removal_pending(info.agent_name):
                    raise PeerUnreachableError(
                        f"reads from the previous connection to {address} are still in flight (quarantined until "
                        "NIXL reports them over); retry once they ended")
                name = self._agent.add_remote(info.metadata)
                self._agent.connect(name)
            except NixlCallError as exc:
                conn.close()
                raise PeerUnreachableError(f"loading the NIXL metadata of {address} failed: {exc}") from exc
            except BaseException:
                conn.close()
                raise
            peer = Peer(address, info, name, layout_difference(self.cache.geometry, info.cache), conn, self.secret,
                        config.heartbeat_s, config.peer_timeout_s,
                        path_model=PathModel(config.packed_threshold_bytes, config.auto_explore_every))
            self._peers[name] = peer
        return peer

    def ping(self, peer: Peer, timeout: float = 1.0) -> bool:
        """True when the owner answers on its side channel within ``timeout``."""
        try:
            self._live_peer(peer, ())
            return peer.request({"op": "ping"}, _timeout_arg(timeout, 1.0), "a ping").get("op") == "pong"
        except (PeerUnreachableError, PeerLostError):
            return False

    def claim(self, peer: Peer, handle: KVHandle, num_blocks: int | None = None,
              timeout: float | None = None, *, readers: int = 1) -> ClaimTicket:
        """Ask the owner to check and pin the first ``num_blocks`` blocks of ``handle`` before reading them.

        ``readers`` (1..64): how many reader ranks claim this handle on this owner (tensor parallelism:
        :func:`~kvshuttle.core.ranks.readers_of`); a use-once handle ends only after that many completed reads,
        and every rank must name the same count. Raises ClaimRefusedError (expired, evicted, stale, consumed,
        tampered...): recompute instead.
        """
        self._check_open()
        self._live_peer(peer, ())
        if not isinstance(handle, KVHandle):
            raise TransferArgumentError(f"claim() needs a KVHandle, got {type(handle).__name__}")
        count = len(handle.block_ids) if num_blocks is None else _int_arg("num_blocks", num_blocks, 0, ())
        if count > len(handle.block_ids):
            raise TransferArgumentError(f"num_blocks={count} exceeds the handle's {len(handle.block_ids)} blocks")
        expected = _int_arg("readers", readers, 1, (), MAX_READERS)
        wait = _timeout_arg(timeout, self.config.connect_timeout_s)
        reply = self._request(peer, claim_request(handle, count, expected), wait, "a claim")
        return ticket_from_reply(reply, peer.address)

    def finish_claim(self, peer: Peer, ticket: ClaimTicket, ok: bool, timeout: float | None = None) -> None:
        """Report a claimed read done (``ok``: the owner confirms the blocks were not reused meanwhile, else
        ClaimRefusedError: discard them) or failed (the owner unpins)."""
        self._check_open()
        self._live_peer(peer, ())
        wait = _timeout_arg(timeout, self.config.connect_timeout_s)
        message = {"op": "claim_done", "claim_id": ticket.claim_id, "ok": bool(ok)}
        if ticket.claim_id in peer.tier_claims:  # read direct from the tier's slots: say so, the owner cannot see it
            peer.tier_claims.discard(ticket.claim_id)
            message["tier_read"] = True
        reply = self._request(peer, message, wait, "a claim report")
        if ok:
            check_done_reply(reply, peer.address)

    def disconnect(self, peer: Peer) -> None:
        """Forget ``peer`` (its NIXL state and connections). Idempotent."""
        if isinstance(peer, Peer):
            self._forget(peer)

    def read(self, peer: Peer, local_ids: Any, remote_ids: Any, *, num_tokens: int | None = None,
             path: Path = "auto", notify: bytes = b"", timeout: float | None = None,
             num_heads: int | None = None, local_head_offset: int = 0,
             remote_head_offset: int = 0, claim: ClaimTicket | None = None) -> TransferHandle:
        """Start reading the owner's blocks ``remote_ids`` into local blocks ``local_ids`` (in order).

        ``num_tokens`` (default: every slot) may end inside the last block; the direct path copies whole
        blocks. ``num_heads``/``*_head_offset`` read a head slice (tensor-parallel shards; packed path).
        ``path="auto"`` picks packed for differing layouts, else the path that the peer's measurements say is
        faster for reads of this shape (:mod:`.path_model`; ``handle.path`` and ``telemetry.reason`` say which
        and why). ``notify`` is delivered to the owner
        with the completion notification. ``claim``: the claim covering ``remote_ids`` (an owner that keeps a
        retention ledger packs only claimed blocks); a claim in a tier is read from the tier: direct from its slots
        where the owner named them and the tier's pieces are this cache's (the path as for the hot cache), else
        packed, and then ``path="direct"`` is refused (IncompatiblePeerError). Every argument is checked before
        anything is posted: a bad one raises a named error (``TransferArgumentError``, ``BlockRangeError``...)
        and nothing is written.
        """
        started = time.perf_counter()
        self._check_open()
        self._live_peer(peer, local_ids)
        if not isinstance(path, str) or path not in PATHS:
            raise TransferArgumentError(f"path must be one of {PATHS}, not {shown(path)}", _loose_ids(local_ids))
        if not isinstance(notify, bytes):
            raise TransferArgumentError(f"notify must be bytes, got {type(notify).__name__}", _loose_ids(local_ids))
        if claim is not None and not isinstance(claim, ClaimTicket):
            raise TransferArgumentError(f"claim must be a ClaimTicket, got {type(claim).__name__}",
                                        _loose_ids(local_ids))
        tier = None if claim is None or claim.tier == HOT else self._tier_side(peer, claim)
        if claim is not None and claim.tier != HOT and tier is None:  # the owner packs it from its tier
            if path == "direct":
                raise IncompatiblePeerError(f"the claimed blocks are in the owner's {claim.tier} tier, which only a "
                                            "packed read reads here (path='packed' or 'auto')", _loose_ids(local_ids))
            path = "packed"
        wait = _timeout_arg(timeout, self.config.transfer_timeout_s)
        lids, rids, tokens = self._check_read_ids(peer, local_ids, remote_ids, num_tokens)
        g, rc = self.cache.geometry, peer.info.cache
        if g.kind.whole_blocks_only or rc.kind.whole_blocks_only:
            tokens = self._whole_blocks(g, rc, lids)
        heads = min(g.num_heads, rc.num_heads) if num_heads is None else _int_arg("num_heads", num_heads, 1, lids)
        local_offset = _int_arg("local_head_offset", local_head_offset, 0, lids)
        remote_offset = _int_arg("remote_head_offset", remote_head_offset, 0, lids)
        if not (local_offset <= g.num_heads - heads and remote_offset <= rc.num_heads - heads):
            raise BlockRangeError(f"a slice of {heads} heads at offsets {local_offset} (local, of "
                                  f"{g.num_heads}) / {remote_offset} (remote, of {rc.num_heads}) is out "
                                  "of range", lids)
        transfer_id = uuid.uuid4().hex[:16]
        deadline = time.monotonic() + wait
        if lids.size == 0:  # nothing to move; the owner still learns the read is over
            try:
                self._agent.send_notif(peer.agent_name, NOTIF_PREFIX + transfer_id.encode() + b":" + notify)
            except NixlCallError as exc:
                raise PeerLostError(f"notifying {peer.address} failed: {exc}") from exc
            return _EmptyTransfer(transfer_id, started)
        sliced = heads != g.num_heads or heads != rc.num_heads
        difference = peer.layout_difference or (f"head slice of {heads}" if sliced else None)
        chosen, reason, plan = self._choose_path(peer, lids, rids, path, difference)
        # a tier read teaches the path model nothing about the hot cache
        observer = None if claim is not None and claim.tier != HOT else self._observer(peer, lids, rids, sliced)
        if chosen == "direct" and tier is not None and claim is not None:  # the tier's slots, in host memory
            slots = self._tier_slots(claim, rids, tier, lids)
            handle: TransferHandle = self._read_direct(
                peer, transfer_id, lids, slots, plan_read(self.side, lids, tier, slots), f"host tier; {reason}",
                notify, deadline, started, mode="initialize", remote_mem="DRAM")
            peer.tier_claims.add(claim.claim_id)
        elif chosen == "direct":
            handle = self._read_direct(peer, transfer_id, lids, rids, plan, reason, notify, deadline, started,
                                       on_done=observer)
        else:
            layout = StagingLayout(g.block_size, heads, g.order)
            handle = self._read_packed(peer, transfer_id, lids, rids, tokens, layout, local_offset,
                                       remote_offset, reason, notify, deadline, started, claim, observer)
        self._active.add(handle)
        return handle

    def read_layers(self, peer: Peer, local_ids: Any, remote_ids: Any, *, groups: int | None = None,
                    notify: bytes = b"", timeout: float | None = None) -> LayeredTransfer:
        """Start a direct read of whole blocks as one NIXL request per group of consecutive layers (``groups``,
        default one per layer), to be waited for layer by layer (:class:`~.layered.LayeredTransfer`). Needs
        identical block layouts on both sides and a layer-major local cache; checked before anything is posted,
        as for :meth:`read`."""
        started = time.perf_counter()
        self._check_open()
        self._live_peer(peer, local_ids)
        if not isinstance(notify, bytes):
            raise TransferArgumentError(f"notify must be bytes, got {type(notify).__name__}", _loose_ids(local_ids))
        wait = _timeout_arg(timeout, self.config.transfer_timeout_s)
        lids, rids, _ = self._check_read_ids(peer, local_ids, remote_ids, None)
        layers = self.cache.geometry.num_layers
        count = layers if groups is None else _int_arg("groups", groups, 1, lids, maximum=layers)
        if peer.layout_difference is not None:
            raise IncompatiblePeerError(f"a layer-by-layer read is direct: it needs identical block layouts, but "
                                        f"{peer.layout_difference}", lids)
        if lids.size == 0:
            raise TransferArgumentError("a layer-by-layer read needs at least one block", lids)
        try:
            parts = split_by_layer(plan_read(self.side, lids, peer.info.side, rids), self.side, count)
        except LayoutError as exc:
            raise IncompatiblePeerError(str(exc), lids) from None
        transfer_id = uuid.uuid4().hex[:16]
        deadline = time.monotonic() + wait
        posted: list[tuple[range, DirectTransfer]] = []
        try:
            for k, (group, plan) in enumerate(parts):
                handle = self._read_direct(peer, f"{transfer_id}.{k}", lids, rids, plan, f"layers {group.start}-"
                                           f"{group.stop - 1}", notify, deadline, started, mode="initialize")
                assert isinstance(handle, DirectTransfer)
                self._active.add(handle)
                posted.append((group, handle))
        except BaseException:
            for _, handle in posted:
                handle.release()
            raise
        return LayeredTransfer(transfer_id, posted, tuple(lids.tolist()), layers)

    # -- internals ------------------------------------------------------------------------------------------
    def _live_peer(self, peer: Any, local_ids: Any) -> None:
        """PeerLostError unless ``peer`` is connected to this engine and alive (a lost one is forgotten)."""
        if not isinstance(peer, Peer) or not peer.connected or self._peers.get(peer.agent_name) is not peer:
            raise PeerLostError("that peer is not connected to this engine; call engine.connect(address)",
                                _loose_ids(local_ids))
        lost = peer.watch()
        if lost is not None:
            self._forget(peer)
            raise PeerLostError(f"{lost}; call engine.connect({peer.address!r}) again once it is back",
                                _loose_ids(local_ids))

    def _request(self, peer: Peer, message: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
        try:
            return peer.request(message, timeout, what)
        except PeerLostError:
            self._forget(peer)
            raise

    def _check_read_ids(self, peer: Peer, local_ids: Any, remote_ids: Any,
                        num_tokens: Any) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
        g, rc = self.cache.geometry, peer.info.cache
        try:
            lids = check_ids(local_ids, g.num_blocks, "local")
            rids = check_ids(remote_ids, rc.num_blocks, "remote")
        except BlockIdError as exc:
            raise BlockRangeError(f"{exc}; pass ids inside both caches", _loose_ids(local_ids)) from None
        if num_tokens is None:
            tokens = min(lids.size * g.block_size, rids.size * rc.block_size)
        else:
            tokens = _int_arg("num_tokens", num_tokens, 0, lids)
        for side, ids, bs in (("local", lids, g.block_size), ("remote", rids, rc.block_size)):
            if not blocks_hold_tokens(int(ids.size), bs, tokens):
                raise BlockRangeError(f"{ids.size} {side} blocks of {bs} tokens cannot hold exactly {tokens} "
                                      "tokens; pass one block per started block of tokens on each side", lids)
        return lids, rids, tokens

    @staticmethod
    def _whole_blocks(g: CacheGeometry, rc: CacheGeometry, lids: npt.NDArray[np.int64]) -> int:
        """CPU_ATTN blocks are opaque (K column-major inside): move whole blocks, same size and kind, or refuse."""
        if g.kind is not rc.kind or g.block_size != rc.block_size:
            raise IncompatiblePeerError(
                f"vLLM's CPU attention stores K column-major inside each block, so its blocks move only whole, "
                f"between caches of the same kind and block size; local {g.kind.value} blocks of {g.block_size}, "
                f"remote {rc.kind.value} blocks of {rc.block_size}", lids)
        return int(lids.size) * g.block_size  # a partial last block moves whole: its K columns are interleaved

    def _choose_path(self, peer: Peer, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64], path: Path,
                     difference: str | None) -> tuple[str, str, ReadPlan | None]:
        staging = self.pool.slots > 0 and peer.info.staging.slots > 0
        if path == "direct" or (path == "auto" and difference is None and not staging):
            if difference is not None:
                raise IncompatiblePeerError(f"a direct read needs identical block layouts, but {difference}; "
                                            "read with path='packed' (or 'auto')", lids)
            return "direct", "requested" if path == "direct" else "no staging on one side", None
        if not staging:
            raise IncompatiblePeerError(
                "the packed path needs staging on both sides (staging_chunks > 0; CUDA caches also need cupy)"
                + ("" if difference is None else f"; layouts differ: {difference}"),
                lids)
        if path == "packed":
            return "packed", "requested", None
        if difference is not None:
            return "packed", f"layouts differ ({difference})", None
        per_run, total = self._read_shape(lids, rids)
        choice = peer.path_model.choose(per_run, total)
        shape = f"pieces of {self.side.piece_bytes} B coalesce to {per_run:.0f} B per run"
        return choice.path, f"{shape}; {choice.reason}", None

    def _read_shape(self, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64]) -> tuple[float, int]:
        """(bytes per run, bytes) of a read: a run is a stretch of blocks consecutive on both sides, which a direct
        read moves as one descriptor per plane. The path model's bucket (:mod:`.path_model`)."""
        runs = 1 + int(np.count_nonzero((np.diff(lids) != 1) | (np.diff(rids) != 1))) if lids.size else 1
        total = int(lids.size) * self.side.num_planes * self.side.piece_bytes
        return total / (runs * self.side.num_planes), total

    def _observer(self, peer: Peer, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64],
                  tokens_sliced: bool) -> Callable[[TransferTelemetry], None] | None:
        """What feeds a finished read into the peer's path model (None for reads unlike any ``auto`` read:
        layout transforms and head slices)."""
        if tokens_sliced or peer.layout_difference is not None:
            return None
        per_run, total = self._read_shape(lids, rids)
        model = peer.path_model

        def record(tel: TransferTelemetry) -> None:
            model.record(tel.path, per_run, total, tel.transfer_time_s)

        return record

    def _tier_side(self, peer: Peer, claim: ClaimTicket) -> SideGeometry | None:
        """The owner's tier as direct-read pieces, when this side can read a tier claim direct: the owner named the
        claim's slots and its tier, and the tier's pieces are byte for byte this cache's."""
        tier, mine = peer.info.tier, self.side
        if not claim.slots or tier is None or peer.layout_difference is not None:
            return None
        same = (tier.piece_format == mine.piece_format != "" and tier.piece_bytes == mine.piece_bytes
                and tier.planes_per_layer == mine.planes_per_layer and tier.plane_bases.size == mine.plane_bases.size)
        return tier if same else None

    @staticmethod
    def _tier_slots(claim: ClaimTicket, rids: npt.NDArray[np.int64], tier: SideGeometry,
                    lids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        try:
            slots = np.asarray(claim.slots_of(rids), dtype=np.int64)
        except KeyError:
            raise BlockRangeError("a read of a tier claim names blocks outside the claim", lids) from None
        if slots.size and (slots.min() < 0 or slots.max() >= tier.num_blocks):
            raise IncompatiblePeerError(f"the owner named tier slots outside its tier of {tier.num_blocks}", lids)
        return slots

    def _read_direct(self, peer: Peer, transfer_id: str, lids: npt.NDArray[np.int64],
                     rids: npt.NDArray[np.int64], plan: ReadPlan | None, reason: str, notify: bytes,
                     deadline: float, started: float, mode: str | None = None,
                     on_done: Callable[[TransferTelemetry], None] | None = None,
                     remote_mem: MemType | None = None) -> TransferHandle:
        notif = NOTIF_PREFIX + transfer_id.encode() + b":" + notify
        rmem: MemType = remote_mem or peer.info.mem_type
        try:
            request: DirectRequest
            if (mode or self.config.direct_mode) == "prepped":
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
            if exc.disconnected:
                peer.mark_lost(str(exc))
            kind = PeerLostError if exc.disconnected else TransferError
            raise kind(f"building the direct READ from {peer.address} failed: {exc}", lids) from exc
        prep = time.perf_counter() - started
        return DirectTransfer(transfer_id, reason, lids, self._agent, self.quarantine, peer.agent_name, request,
                              prep, deadline, started, peer.watch, on_done)

    def _read_packed(self, peer: Peer, transfer_id: str, lids: npt.NDArray[np.int64],
                     rids: npt.NDArray[np.int64], tokens: int, layout: StagingLayout, local_head_offset: int,
                     remote_head_offset: int, reason: str, notify: bytes, deadline: float,
                     started: float, claim: ClaimTicket | None,
                     on_done: Callable[[TransferTelemetry], None] | None = None) -> TransferHandle:
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
            quarantine=self.quarantine,
            cache=self.cache, pool=self.pool, pool_mem=self.pool_mem, pool_device=self.pool_device,
            remote_mem="VRAM" if staging.mem_type == "VRAM" else "DRAM", remote_device=staging.device_id,
            unpacker=self.unpacks, last_unpacker=self.last_unpacks, threads=self.pipelines, local_ids=lids,
            remote_ids=rids, num_tokens=tokens, layout=layout,
            local_head_offset=local_head_offset, remote_head_offset=remote_head_offset, chunk_tokens=per_chunk,
            chunks=chunks, depth=max(1, self.config.pipeline_depth), notify=notify, deadline=deadline,
            prep_time=time.perf_counter() - started, reason=reason,
            claim_id=None if claim is None else claim.claim_id, on_done=on_done,
        )
        try:
            return PackedTransfer(transfer_id, setup, started)
        except StagingExhaustedError as exc:
            raise StagingExhaustedError(str(exc), lids) from None
