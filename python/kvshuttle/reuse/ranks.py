"""The reuse read across tensor-parallel ranks: one reader rank reads its KV heads from the owner's ranks.

Each owner rank is its own peer (its own TransferEngine, side channel, retention ledger and head shard), and
every rank's ledger retained the same handle (id, generation, block ids, digests). A reader rank at TP ``a``
reads exactly its own heads from an owner at TP ``b``: :func:`~kvshuttle.core.ranks.plan_rank_reads` names
the head slices and the owner rank each comes from. The read is all or nothing: it connects to and claims on
every owner rank involved, reads every slice, and confirms with every rank; if any rank fails (connect,
claim, read or confirmation) every other claim still open is finished with ``ok=False`` (the owner unpins)
and every local target block is reported invalid, with the failing rank named. A read that NIXL could not cancel
keeps its blocks and the owners' pins: the claims are finished only once ``ReuseResult.settled`` is (on a thread
of their own, so no caller waits on an owner's answer after its deadline). Each claim says how many reader
ranks read that owner rank (:func:`~kvshuttle.core.ranks.readers_of`), so a use-once handle there is consumed
only once every one of them has read it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from .._values import is_int
from ..core.ranks import HeadSlice, RankMappingError, plan_rank_reads, rank_heads, readers_of, split_problem
from ..errors import shown
from ..policy import Decision, KVHandle
from ..transfer import (
    ClaimRefusedError,
    ClaimTicket,
    IncompatiblePeerError,
    LayeredTransfer,
    LayerProgress,
    Peer,
    Settlement,
    TransferEngine,
    TransferError,
    TransferHandle,
    TransferTelemetry,
    TransferTimeoutError,
)
from ..transfer.claims import HOT
from ..transfer.config import Path
from .owners import OwnerPool
from .results import Failure, ReuseArgumentError, ReuseResult, failed_result, failure_of, time_left

log = logging.getLogger(__name__)


def check_rank_args(engine: TransferEngine, tp_rank: Any, tp_size: Any, num_kv_heads: Any) -> tuple[int, int, int]:
    """``(tp_rank, tp_size, num_kv_heads)`` of a reader rank, checked against its own cache shard.

    ``num_kv_heads`` (the model's total KV heads) is required at ``tp_size > 1``; at TP=1 the shard holds every
    head, so it defaults to the shard's head count. ReuseArgumentError for anything inconsistent."""
    if not (is_int(tp_size) and tp_size >= 1):
        raise ReuseArgumentError(f"tp_size must be an int >= 1, got {shown(tp_size)}")
    if not (is_int(tp_rank) and 0 <= tp_rank < tp_size):
        raise ReuseArgumentError(f"tp_rank must be an int in 0..{int(tp_size) - 1}, got {shown(tp_rank)}")
    tp_rank, tp_size = int(tp_rank), int(tp_size)
    shard = engine.cache.geometry.num_heads
    if num_kv_heads is None:
        if tp_size != 1:
            raise ReuseArgumentError(f"num_kv_heads (the model's total KV heads) is required at tp_size={tp_size}")
        num_kv_heads = shard
    problem = split_problem(num_kv_heads, tp_size)
    if problem is not None:
        raise ReuseArgumentError(f"num_kv_heads / tp_size: {problem}")
    num_kv_heads = int(num_kv_heads)
    mine = len(rank_heads(num_kv_heads, tp_size, tp_rank))
    if shard != mine:
        raise ReuseArgumentError(f"rank {tp_rank} of TP={tp_size} holds {mine} of the {num_kv_heads} KV heads, but "
                                 f"its cache shard has {shard}")
    return tp_rank, tp_size, num_kv_heads


class _RankFailed(Exception):
    """Internal: owner rank ``rank`` failed with ``error`` (a TransferError)."""

    def __init__(self, rank: int, address: str, error: TransferError, confirming: bool = False) -> None:
        super().__init__(f"owner rank {rank} ({address}): {error}")
        self.rank, self.address, self.error, self.confirming = rank, address, error, confirming


def owner_rank_address(handle: KVHandle, rank: int) -> tuple[str, str]:
    """``(host, port)`` of owner rank ``rank``'s side channel; RankMappingError when the handle names none."""
    if handle.ranks:
        host, _, port = handle.ranks[rank].rpartition(":")
        return host, port
    if handle.tp_size == 1:
        return handle.host, str(handle.port)
    raise RankMappingError(f"the handle is at tp_size={handle.tp_size} but lists no owner ranks (kvshuttle_ranks): "
                           "no rank to read a head shard from")


@dataclass(frozen=True)
class RankedFetch:
    """What one reader rank fetches with: its engine (its cache is the rank's head shard), the owners it
    connects to, the path it prefers, its place in the TP group and how long one fetch may take."""

    engine: TransferEngine
    owners: OwnerPool
    path: Path
    tp_rank: int
    tp_size: int
    num_kv_heads: int
    timeout_s: float

    def fetch(self, decision: Decision, handle: KVHandle, local_ids: npt.NDArray[np.int64], num_tokens: int, *,
              started: float, unknown_grace_s: float, deadline: float,
              progress: LayerProgress | None = None) -> ReuseResult:
        """:meth:`ReuseReader.fetch` for every TP pair; see the module docstring. ``progress``: read layer by
        layer and report each layer as it lands (ended once the read is confirmed, or failed)."""
        ok = False
        try:
            result = _fetch_ranked(self, decision, handle, local_ids, num_tokens, started=started,
                                   unknown_grace_s=unknown_grace_s, deadline=deadline, progress=progress)
            ok = result.action == "fetched"
            return result
        finally:  # whatever happened (an exception too), whoever waits on the layers stops waiting
            if progress is not None:
                progress.end(ok)


def _fetch_ranked(reader: RankedFetch, decision: Decision, handle: KVHandle, local_ids: npt.NDArray[np.int64],
                  num_tokens: int, *, started: float, unknown_grace_s: float, deadline: float,
                  progress: LayerProgress | None) -> ReuseResult:
    try:
        slices = plan_rank_reads(reader.num_kv_heads, reader.tp_size, reader.tp_rank, handle.tp_size)
        involved = sorted({s.owner_rank for s in slices})
        addresses = {rank: owner_rank_address(handle, rank) for rank in involved}
        # every reader rank reading an owner rank claims there: a use-once handle waits for all of them
        readers = {rank: readers_of(reader.num_kv_heads, reader.tp_size, handle.tp_size, rank) for rank in involved}
    except RankMappingError as exc:  # nothing was touched: the local hit stands, no block is invalid
        return failed_result(decision, started, num_tokens, Failure.RANK_MAPPING, (), str(exc))
    invalid = tuple(local_ids.tolist())
    peers: dict[int, Peer] = {}
    tickets: dict[int, ClaimTicket] = {}  # open claims: the owner rank still pins the blocks
    transfers: list[tuple[int, TransferHandle | LayeredTransfer]] = []  # (owner rank, read) started
    claim_s = 0.0
    try:
        if time.monotonic() >= deadline:
            raise _RankFailed(involved[0], _shown_address(addresses[involved[0]]),
                              TransferTimeoutError("the load's deadline passed before it started (queued too long)"))
        for rank in involved:
            host, port = addresses[rank]
            try:
                peer = reader.owners.peer_at(host, port)
                _check_shard(peer, reader.num_kv_heads, handle.tp_size, rank)
                peers[rank] = peer
                t0 = time.perf_counter()
                tickets[rank] = _claim(reader.engine, peer, handle, decision.fetch_blocks.stop, deadline,
                                      time.monotonic() + min(unknown_grace_s, reader.timeout_s),
                                      readers=readers[rank])
                claim_s += time.perf_counter() - t0
            except TransferError as exc:
                raise _RankFailed(rank, _shown_address(addresses[rank]), exc) from exc
        telemetry = _read_slices(reader, decision, local_ids, slices, peers, tickets, addresses, deadline,
                                 progress, transfers)
        t0 = time.perf_counter()
        for rank in involved:
            ticket = tickets.pop(rank)  # confirming ends the claim either way: nothing left to unpin on this rank
            try:
                reader.engine.finish_claim(peers[rank], ticket, ok=True, timeout=time_left(deadline))
            except TransferError as exc:
                raise _RankFailed(rank, _shown_address(addresses[rank]), exc, confirming=True) from exc
        claim_s += time.perf_counter() - t0
    except _RankFailed as failed:
        # the owners unpin only once nothing of the read can still move (a read NIXL could not cancel is parked)
        settled = Settlement.of_all(t.settlement for _, t in transfers)
        opened = [(peers[rank], ticket) for rank, ticket in tickets.items()]
        if settled.done():
            _abort_claims(reader.engine, opened, time_left(deadline))
        else:  # later, on a thread of its own: the reaper that settles it must not wait on an owner's answer
            settled.on_settled(lambda: threading.Thread(target=_abort_claims, args=(reader.engine, opened, None),
                                                        name="kvshuttle-claim-abort", daemon=True).start())
        error = failed.error
        failure = Failure.REUSED_MEANWHILE if failed.confirming and isinstance(error, ClaimRefusedError) \
            else failure_of(error)
        gone = peers.get(failed.rank)
        if gone is not None and (failure in (Failure.PEER_LOST, Failure.PEER_UNREACHABLE)
                                 or (failure is Failure.TRANSFER_TIMEOUT and gone.watch() is not None)):
            reader.owners.mark_failed(gone.address, str(error))  # gone, not busy: the circuit breaker opens
        for rank, transfer in transfers:  # alive but its data path does not move: no new reads until it does
            if not transfer.settlement.done() and rank in peers:
                reader.owners.hold_off(peers[rank].address, transfer.settlement)
        single = handle.tp_size == reader.tp_size == 1  # one owner: its error says it all
        result = failed_result(decision, started, num_tokens, failure, invalid,
                                str(error) if single else str(failed), claim_s, getattr(error, "reason", ""))
        return replace(result, settled=settled)
    return ReuseResult("fetched", decision.reason.value, decision.message, num_tokens, decision.local_tokens,
                       decision.fetch_tokens, (), decision, telemetry, claim_s, time.perf_counter() - started)


def _read_slices(reader: RankedFetch, decision: Decision, local_ids: npt.NDArray[np.int64],
                 slices: tuple[HeadSlice, ...], peers: dict[int, Peer], tickets: dict[int, ClaimTicket],
                 addresses: dict[int, tuple[str, str]], deadline: float,
                 progress: LayerProgress | None,
                 started: list[tuple[int, TransferHandle | LayeredTransfer]]) -> TransferTelemetry:
    """Start every slice's read (each appended to ``started``), then wait for all; _RankFailed names the first
    rank whose read failed. With ``progress``, a slice that can be read directly is read layer by layer, and
    each layer is reported once it has landed from every slice (a slice that cannot, a head slice or a claim in the
    owner's host tier, lands whole)."""
    local_heads = reader.engine.cache.geometry.num_heads
    with contextlib.ExitStack() as running:  # a failure releases (cancels) every read still in flight
        for s in slices:
            peer, ticket = peers[s.owner_rank], tickets[s.owner_rank]
            whole = s.num_heads == local_heads == peer.info.cache.num_heads
            # A claim in the owner's tier is read from there: packed, or direct from its slots where the engine
            # finds the tier's pieces are this cache's ("auto" lets it choose); never layer by layer, which reads
            # the hot cache by block id (it would be refused at confirmation).
            in_tier = ticket.tier != HOT
            direct_ok = whole and not ticket.packed_only
            path = ("auto" if in_tier and reader.path == "direct" else reader.path) if direct_ok else "packed"
            try:
                layered = _layered_read(reader, peer, local_ids, decision, deadline) \
                    if progress is not None and direct_ok and not in_tier else None
                transfer: TransferHandle | LayeredTransfer = layered if layered is not None else reader.engine.read(
                    peer, local_ids, decision.remote_block_ids, num_tokens=decision.fetch_tokens,
                    path=path, timeout=time_left(deadline), num_heads=s.num_heads,
                    local_head_offset=s.reader_head_offset, remote_head_offset=s.owner_head_offset,
                    claim=ticket)
            except TransferError as exc:
                raise _RankFailed(s.owner_rank, _shown_address(addresses[s.owner_rank]), exc) from exc
            running.enter_context(transfer)
            started.append((s.owner_rank, transfer))
        for layer in range(progress.num_layers if progress is not None else 0):
            for rank, transfer in started:
                try:
                    if isinstance(transfer, LayeredTransfer):
                        transfer.wait_layer(layer, time_left(deadline))
                    elif layer == 0:
                        transfer.wait(time_left(deadline))
                except TransferError as exc:
                    raise _RankFailed(rank, _shown_address(addresses[rank]), exc) from exc
            assert progress is not None
            progress.advance(layer + 1)
        telemetry: list[TransferTelemetry] = []
        for rank, transfer in started:  # (already landed when read layer by layer)
            try:
                telemetry.append(transfer.wait(time_left(deadline)))
            except TransferError as exc:
                raise _RankFailed(rank, _shown_address(addresses[rank]), exc) from exc
    return _combined(telemetry)


def _claim(engine: TransferEngine, peer: Peer, handle: KVHandle, num_blocks: int, deadline: float,
           grace_until: float, *, readers: int = 1) -> ClaimTicket:
    """Claim on ``peer``, retrying a refusal as unknown until ``grace_until``, and one as demoting until
    ``deadline``: a move into a tier in flight (an idle decode starts one when a claim finds its TTL over) lands
    in milliseconds, and then the tier serves the claim."""
    while True:
        try:
            return engine.claim(peer, handle, num_blocks, timeout=time_left(deadline), readers=readers)
        except ClaimRefusedError as exc:
            until = {"UnknownHandleError": grace_until, "HandleDemotingError": deadline}.get(exc.reason)
            if until is None or time.monotonic() >= until:
                raise
        time.sleep(0.005)  # the owner's ledger hears of the handle on its next engine step, or the copy lands


def _abort_claims(engine: TransferEngine, opened: list[tuple[Peer, ClaimTicket]], timeout: float | None) -> None:
    """Finish failed reads' claims: the owners unpin (``timeout``: None for the engine's ``connect_timeout_s``)."""
    for peer, ticket in opened:
        try:
            engine.finish_claim(peer, ticket, ok=False, timeout=timeout)
        except TransferError as report:
            log.debug("kvshuttle: could not report a failed read to %s: %s", peer.address, report)


def _layered_read(reader: RankedFetch, peer: Peer, local_ids: npt.NDArray[np.int64], decision: Decision,
                  deadline: float) -> LayeredTransfer | None:
    """A direct read posted per layer, or None where it cannot be (the packed path asked for, differing layouts,
    a block-major cache): the caller reads that slice whole."""
    if reader.path == "packed" or peer.layout_difference is not None:
        return None
    try:
        return reader.engine.read_layers(peer, local_ids, decision.remote_block_ids, timeout=time_left(deadline))
    except IncompatiblePeerError:  # checked before anything was posted
        return None


def _check_shard(peer: Peer, num_kv_heads: int, owner_tp: int, rank: int) -> None:
    """IncompatiblePeerError unless owner rank ``rank`` serves the head shard its rank holds at ``owner_tp``."""
    want, got = len(rank_heads(num_kv_heads, owner_tp, rank)), peer.info.cache.num_heads
    if got != want:
        raise IncompatiblePeerError(f"it serves {got} KV heads, but rank {rank} of TP={owner_tp} holds {want} of "
                                    f"{num_kv_heads}")


def _combined(parts: list[TransferTelemetry]) -> TransferTelemetry:
    """One telemetry for the slices' reads: counts summed, the slowest read's time (they ran concurrently)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    paths = sorted({p.path for p in parts})
    return replace(first, path=paths[0] if len(paths) == 1 else "+".join(paths),
                   reason=f"{len(parts)} head slices: " + "; ".join(sorted({p.reason for p in parts})),
                   bytes=sum(p.bytes for p in parts), descriptors=sum(p.descriptors for p in parts),
                   pieces=sum(p.pieces for p in parts), chunks=sum(p.chunks for p in parts),
                   prep_time_s=sum(p.prep_time_s for p in parts), post_time_s=sum(p.post_time_s for p in parts),
                   transfer_time_s=max(p.transfer_time_s for p in parts),
                   unpack_time_s=sum(p.unpack_time_s for p in parts),
                   owner_pack_time_s=sum(p.owner_pack_time_s for p in parts), nixl_descriptors=None)


def _shown_address(address: tuple[str, str]) -> str:
    return f"{address[0]}:{address[1]}"
