"""The reuse read: one request's decide -> claim -> read -> wait -> finish, or recompute with a reason.

This is the whole serving-path contract in one call, used by the demo and by the vLLM connector. In go the
decode's handle (``kv_transfer_params``, untrusted), the new prompt (token ids or precomputed
:class:`~kvshuttle.policy.PromptDigests`), the local prefix-cache hit and the request's local block table;
out comes a :class:`ReuseResult`: the tokens now valid in the local cache, the local blocks that are not,
the token range still to compute, and why.

Every refusal or failure on the way is a result, never an exception: a malformed or tampered handle, an
unverified or expired range, a refused claim, an unreachable or lost decode, a failed or slow read, blocks
reused on the decode while we read them. Then only the local hit counts, and every local block the read
may have touched is reported invalid: nothing unverified or partially written is reported as reusable.
Only caller bugs raise (:class:`ReuseArgumentError`, :class:`~kvshuttle.policy.PolicyError`).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..core.blocks import as_ids, blocks_for_tokens
from ..errors import KVShuttleError, shown
from ..policy import Decision, KVHandle, PolicyConfig, PromptDigests, decide, decide_from_params, parse_handle
from ..policy.digests import TokenIds
from ..transfer import (
    ClaimRefusedError,
    ClaimTicket,
    IncompatiblePeerError,
    LayerProgress,
    Peer,
    PeerLostError,
    PeerUnreachableError,
    Settlement,
    TransferEngine,
    TransferError,
    TransferTelemetry,
    TransferTimeoutError,
)
from ..transfer.config import PATHS, Path
from ..transfer.control import rank_addresses, release_on_ranks, renew_on_ranks

log = logging.getLogger(__name__)

Action = Literal["fetched", "local", "recompute"]


class ReuseArgumentError(KVShuttleError, ValueError):
    """A reuse read called wrongly (a block table that cannot hold the prompt, a bad path): fix the call."""


class Failure(str, enum.Enum):
    """Why a fetch the policy approved did not happen (``ReuseResult.reason`` holds the value)."""

    MISALIGNED = "misaligned"  # the remote range does not start on a local block boundary after the hit
    PEER_UNREACHABLE = "peer_unreachable"
    PEER_COOLING_DOWN = "peer_cooling_down"  # it failed moments ago: refused at once, not reconnected per request
    PEER_STALLED = "peer_stalled"  # an earlier read from it is still in flight past its deadline (quarantined)
    OWNER_NOT_ALLOWED = "owner_not_allowed"  # the handle names an owner outside the allow-list
    INCOMPATIBLE_PEER = "incompatible_peer"
    PEER_LOST = "peer_lost"
    CLAIM_REFUSED = "claim_refused"  # expired, evicted, released, consumed, stale or tampered on the decode
    TRANSFER_TIMEOUT = "transfer_timeout"
    TRANSFER_FAILED = "transfer_failed"
    REUSED_MEANWHILE = "reused_meanwhile"  # the decode reused the blocks while we read them
    RANK_MAPPING = "rank_mapping"  # the TP sizes cannot split the KV heads evenly, or the handle lists no ranks


@dataclass(frozen=True)
class ReuseResult:
    """What one request gets. ``reused_tokens`` leading tokens are valid in the local cache; compute the rest."""

    action: Action
    reason: str  # a policy Reason value ("fetch", "expired", ...) or a Failure value
    message: str  # one line: why
    num_tokens: int  # prompt length
    local_tokens: int  # the local prefix-cache hit, still valid
    fetched_tokens: int  # read from the decode and confirmed
    invalid_block_ids: tuple[int, ...]  # local blocks the read may have written and that must not be used
    decision: Decision
    telemetry: TransferTelemetry | None = None
    claim_s: float = 0.0  # claim and confirmation round trips
    total_s: float = 0.0  # the whole reuse read
    owner_reason: str = ""  # the decode's own reason for a refused claim, e.g. "HandleEvictedError"
    # Settled once nothing of the read can write any more. A read NIXL could not cancel keeps
    # ``invalid_block_ids`` (and the owner's pins) quarantined until then: do not hand those blocks out before.
    settled: Settlement = field(default_factory=Settlement.settled)

    @property
    def reused_tokens(self) -> int:
        return self.local_tokens + self.fetched_tokens

    @property
    def recompute(self) -> range:
        """The token positions the model must still compute."""
        return range(self.reused_tokens, self.num_tokens)

    @property
    def bytes(self) -> int:
        return self.telemetry.bytes if self.telemetry else 0


class _CoolingDown(PeerUnreachableError):
    """Internal: the owner failed less than ``cooldown_s`` ago."""


class _NotAllowed(TransferError):
    """Internal: the owner is not on the allow-list."""


class _Stalled(TransferError):
    """Internal: a read from the owner passed its deadline and NIXL still reports it in flight."""


def _failure(exc: BaseException) -> Failure:
    if isinstance(exc, _CoolingDown):
        return Failure.PEER_COOLING_DOWN
    if isinstance(exc, _Stalled):
        return Failure.PEER_STALLED
    if isinstance(exc, _NotAllowed):
        return Failure.OWNER_NOT_ALLOWED
    if isinstance(exc, ClaimRefusedError):
        return Failure.CLAIM_REFUSED
    if isinstance(exc, PeerUnreachableError):
        return Failure.PEER_UNREACHABLE
    if isinstance(exc, IncompatiblePeerError):
        return Failure.INCOMPATIBLE_PEER
    if isinstance(exc, PeerLostError):
        return Failure.PEER_LOST
    if isinstance(exc, TransferTimeoutError):
        return Failure.TRANSFER_TIMEOUT
    return Failure.TRANSFER_FAILED


class ReuseReader:
    """Reuse reads for one prefill worker: its engine, policy and a cache of connected decodes.

    Handles are authenticated under the engine's deployment secret before anything else: a forged or edited one
    recomputes without a single connection attempt. ``allowed_owners`` (hosts, or ``host:port``), when given,
    limits where reads may come from. A decode that fails (unreachable, lost, timed out) is refused at once
    for ``cooldown_s`` (a circuit breaker: no reconnect per request, so requests behind a dead decode do not
    queue up), then reconnected by the next request that names it. A read that times out from a decode that still
    answers (heartbeats) does not trip it: that decode is busy, not dead. But while such a read is still in flight
    (NIXL could not cancel it: quarantined), requests naming that decode recompute at once (``peer_stalled``)
    instead of adding reads to a data path that does not move. ``timeout_s`` bounds claim + read +
    confirmation of one request. ``tp_rank``/``tp_size``: this reader's tensor-parallel rank (its engine's cache
    is that rank's head shard) and ``num_kv_heads`` the model's total KV heads (required at ``tp_size > 1``):
    when either side runs tensor parallel a fetch reads this rank's heads from every owner rank involved, all
    or nothing (:mod:`kvshuttle.reuse.ranks`). Safe to use from several threads at once (the vLLM worker's loads run
    concurrently): reads from one decode share its connection, reads from different decodes never wait on
    each other's.
    """

    def __init__(self, engine: TransferEngine, policy: PolicyConfig | None = None, *, timeout_s: float = 10.0,
                 path: Path = "auto", clock: Callable[[], float] = time.time, cooldown_s: float = 5.0,
                 allowed_owners: Collection[str] | None = None, tp_rank: int = 0, tp_size: int = 1,
                 num_kv_heads: int | None = None) -> None:
        if not isinstance(path, str) or path not in PATHS:
            raise ReuseArgumentError(f"path must be one of {PATHS}, not {shown(path)}")
        for name, value in (("timeout_s", timeout_s), ("cooldown_s", cooldown_s)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ReuseArgumentError(f"{name} must be a positive number of seconds, got {shown(value)}")
        if allowed_owners is not None and not all(isinstance(a, str) and a for a in allowed_owners):
            raise ReuseArgumentError("allowed_owners must be host or host:port strings")
        self.engine = engine
        self.secret = engine.secret
        self.policy = policy or PolicyConfig()
        self.timeout_s = float(timeout_s)
        self.cooldown_s = float(cooldown_s)
        self.allowed_owners = None if allowed_owners is None else frozenset(allowed_owners)
        self.path: Path = path
        self.tp_rank, self.tp_size, self.num_kv_heads = check_rank_args(engine, tp_rank, tp_size, num_kv_heads)
        self._clock = clock
        self._peers: dict[str, Peer] = {}
        self._broken: dict[str, tuple[float, str]] = {}  # address -> (refused until, why): the circuit breaker
        self._stalled: dict[str, Settlement] = {}  # address -> its timed-out reads still in flight
        self._lock = threading.Lock()  # guards the two tables
        self._connecting: dict[str, threading.Lock] = {}  # one connect at a time per address

    def read(self, kv_transfer_params: Any, prompt: TokenIds | PromptDigests, *, local_hit_tokens: int,
             local_block_ids: Sequence[int] | np.ndarray[Any, Any], clock_offset_s: float = 0.0) -> ReuseResult:
        """Reuse what can be verified and read for one prompt; see the module docstring.

        ``local_block_ids``: the request's local block table in token order (block k holds tokens
        ``[k*B, (k+1)*B)`` of the local block size), covering at least the whole prompt.
        """
        started = time.perf_counter()
        num_tokens = _length(prompt)
        handle = parse_handle(kv_transfer_params, secret=self.secret)
        if isinstance(handle, KVHandle):
            decision = decide(prompt, local_hit_tokens=local_hit_tokens, handle=handle, now_wall=self._clock(),
                              config=self.policy, clock_offset_s=clock_offset_s)
        else:  # malformed, forged, unverifiable or absent: the policy says why, we recompute
            decision = decide_from_params(prompt, kv_transfer_params, local_hit_tokens=local_hit_tokens,
                                          now_wall=self._clock(), config=self.policy, secret=self.secret)
            if decision.reason.value == "unauthenticated_handle":
                log.warning("kvshuttle: recompute, because %s", decision.message)
        local_ids = self._targets(decision, local_block_ids, num_tokens)
        if not decision.fetch or not isinstance(handle, KVHandle):
            return self._result(decision, started, num_tokens)
        if local_ids is None:
            return self._failed(decision, started, num_tokens, Failure.MISALIGNED, (),
                                f"the verified range starts at token {decision.fetch_token_range.start}, not "
                                f"where the local hit of {decision.local_tokens} tokens ends on a local block")
        return self.fetch(decision, handle, local_ids, num_tokens, started=started)

    def renew(self, kv_transfer_params: Any, ttl_s: float | None = None) -> dict[str, Any] | None:
        """Keep a decode's retention alive (a conversation still active); the refreshed params, or None when
        it cannot be renewed (malformed, forged, gone, decode unreachable): then the next turn will recompute."""
        handle = parse_handle(kv_transfer_params, secret=self.secret)
        if not isinstance(handle, KVHandle):
            return None
        try:  # every owner rank holds its own retention of the handle
            return renew_on_ranks(self._owner_ranks(handle), handle, ttl_s, self.engine.config.connect_timeout_s)
        except TransferError as exc:
            log.info("kvshuttle: retention %s... not renewed: %s", handle.handle_id[:8], exc)
            return None

    def release(self, kv_transfer_params: Any) -> bool:
        """Let a decode free a conversation's blocks now; False when there was nothing (left) to free."""
        handle = parse_handle(kv_transfer_params, secret=self.secret)
        if not isinstance(handle, KVHandle):
            return False
        try:
            return release_on_ranks(self._owner_ranks(handle, reachable=True), handle,
                                    self.engine.config.connect_timeout_s)
        except TransferError as exc:
            log.info("kvshuttle: retention %s... not released: %s", handle.handle_id[:8], exc)
            return False

    def close(self) -> None:
        """Forget every connected decode (the engine itself stays open)."""
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            self._broken.clear()
            self._stalled.clear()
        for peer in peers:
            self.engine.disconnect(peer)

    # -- internals ------------------------------------------------------------------------------------------
    def _targets(self, decision: Decision, local_block_ids: Any, num_tokens: int) -> npt.NDArray[np.int64] | None:
        """The local blocks the fetched tokens land in; None when they do not start on a local block."""
        bs = self.engine.cache.geometry.block_size
        try:
            table = as_ids(local_block_ids)  # one array, no per-block Python on the serving path
        except (KVShuttleError, TypeError, ValueError, OverflowError):
            raise ReuseArgumentError("local_block_ids must be a sequence of integers") from None
        if len(table) < blocks_for_tokens(num_tokens, bs):
            raise ReuseArgumentError(f"{len(table)} local blocks of {bs} tokens cannot hold the {num_tokens}-token "
                                     "prompt; pass the request's whole block table")
        if not decision.fetch:
            return table[:0]
        tokens = decision.fetch_token_range
        if tokens.start != decision.local_tokens or tokens.start % bs:
            return None
        first = tokens.start // bs
        return table[first:first + blocks_for_tokens(len(tokens), bs)]

    def _owner_ranks(self, handle: KVHandle, *, reachable: bool = False) -> list[Peer]:
        """The connected owner ranks of ``handle`` (one for a single owner), in rank order; ``reachable``: only
        those that answer (the first error when none does)."""
        peers: list[Peer] = []
        error: TransferError | None = None
        for address in rank_addresses(handle):
            try:
                peers.append(self._peer_at(*address.removeprefix("tcp://").rsplit(":", 1)))
            except TransferError as exc:
                if not reachable:
                    raise
                error = error or exc
        if not peers and error is not None:
            raise error
        return peers

    def _peer_at(self, host: str, port: int | str) -> Peer:
        """The connected owner (rank) at ``host:port``; the allow-list and the circuit breaker apply per address."""
        address = f"tcp://{host}:{port}"
        if self.allowed_owners is not None and not {host, f"{host}:{port}"} & self.allowed_owners:
            raise _NotAllowed(f"owner {host}:{port} is not in allowed_owners")
        with self._lock:
            lock = self._connecting.setdefault(address, threading.Lock())
        with lock:  # one connect per address at a time; other addresses never wait on it
            self._check_cooldown(address)
            self._check_stalled(address)
            with self._lock:
                peer = self._peers.get(address)
            if peer is not None and peer.connected and peer.watch() is None:
                return peer
            if peer is not None:  # found lost: this request fails as lost, the next ones are cooled down
                why = peer.lost or "the connection was closed"
                self._mark_failed(address, why)
                raise PeerLostError(f"{why}; not reconnected for {self.cooldown_s:.0f} s")
            try:
                peer = self.engine.connect(address)
            except (PeerUnreachableError, PeerLostError, IncompatiblePeerError) as exc:
                self._mark_failed(address, str(exc))
                raise
            with self._lock:
                self._peers[address] = peer
                self._broken.pop(address, None)
            return peer

    def _check_cooldown(self, address: str) -> None:
        with self._lock:
            failed = self._broken.get(address)
            if failed is not None and time.monotonic() < failed[0]:
                raise _CoolingDown(f"{address} failed {self.cooldown_s - (failed[0] - time.monotonic()):.1f} s ago "
                                   f"({failed[1]}); refused for {self.cooldown_s:.0f} s before reconnecting")

    def _check_stalled(self, address: str) -> None:
        with self._lock:
            stalled = self._stalled.get(address)
            if stalled is not None and stalled.done():
                del self._stalled[address]
                stalled = None
        if stalled is not None:
            raise _Stalled(f"an earlier read from {address} passed its deadline and is still in flight; not adding "
                           "reads to a data path that does not move")

    def hold_off(self, address: str, settled: Settlement) -> None:
        """Refuse reads from owner ``address`` at once (``peer_stalled``) until ``settled``: a read from it passed
        its deadline and NIXL still reports it in flight."""
        with self._lock:
            previous = self._stalled.get(address)
            self._stalled[address] = settled if previous is None else Settlement.of_all((previous, settled))
            if len(self._stalled) > 1024:  # bounded: settled entries go first
                for over in [a for a, s in self._stalled.items() if s.done()]:
                    del self._stalled[over]

    def _mark_failed(self, address: str, why: str) -> None:
        """Open the circuit breaker for ``address``: requests naming it recompute at once for ``cooldown_s``."""
        with self._lock:
            self._broken[address] = (time.monotonic() + self.cooldown_s, why[:300])
            peer = self._peers.pop(address, None)
            if len(self._broken) > 1024:  # bounded: forget the longest-expired first
                for stale in sorted(self._broken, key=lambda a: self._broken[a][0])[:512]:
                    del self._broken[stale]
            if len(self._connecting) > 1024:  # decodes restarting on new ports: drop idle addresses' locks
                for idle in [a for a, lock in self._connecting.items()
                             if a not in self._peers and a not in self._broken and not lock.locked()]:
                    del self._connecting[idle]
        if peer is not None:
            self.engine.disconnect(peer)

    def fetch(self, decision: Decision, handle: KVHandle, local_ids: Sequence[int] | npt.NDArray[np.int64],
              num_tokens: int, *, started: float | None = None, unknown_grace_s: float = 0.0,
              deadline: float | None = None, progress: LayerProgress | None = None) -> ReuseResult:
        """Claim, read and confirm what ``decision`` (a fetch) names into ``local_ids``: the second half of
        :meth:`read`, for a caller that decided elsewhere (vLLM's scheduler decides, its worker fetches).

        ``handle`` must be authenticated already (:func:`~kvshuttle.policy.parse_handle` with the secret).
        ``unknown_grace_s``: how long to retry a claim the owner refuses as unknown (its ledger may learn of a
        just-issued handle a step later than the reader got it). ``deadline`` (``time.monotonic()``; default
        ``timeout_s`` from now): when the whole fetch must be over, counted by the caller from when it decided,
        so time spent queued counts too. ``progress``: read layer by layer (where the path is direct) and report
        each layer on it as it lands, for a forward pass that computes layer i while later layers still arrive;
        it is ended when the fetch is over (``ok`` only once every rank confirmed the read).
        """
        started = time.perf_counter() if started is None else started
        local_ids = np.asarray(local_ids, dtype=np.int64)
        deadline = time.monotonic() + self.timeout_s if deadline is None else min(deadline, time.monotonic()
                                                                                   + self.timeout_s)
        # one implementation for every TP pair: a single owner is owner rank 0 of TP=1, read as one head slice
        return fetch_ranked(self, decision, handle, local_ids, num_tokens, started=started,
                            unknown_grace_s=unknown_grace_s, deadline=deadline, progress=progress)

    def _claim(self, peer: Peer, handle: KVHandle, num_blocks: int, deadline: float,
               grace_until: float, *, readers: int = 1) -> ClaimTicket:
        while True:
            try:
                return self.engine.claim(peer, handle, num_blocks, timeout=_left(deadline), readers=readers)
            except ClaimRefusedError as exc:
                if exc.reason != "UnknownHandleError" or time.monotonic() >= grace_until:
                    raise
            time.sleep(0.005)  # the owner's ledger hears of the handle on its next engine step

    def _result(self, decision: Decision, started: float, num_tokens: int) -> ReuseResult:
        action: Action = "local" if decision.local_tokens > 0 else "recompute"
        return ReuseResult(action, decision.reason.value, decision.message, num_tokens, decision.local_tokens, 0,
                           (), decision, total_s=time.perf_counter() - started)

    def _failed(self, decision: Decision, started: float, num_tokens: int, failure: Failure,
                invalid: tuple[int, ...], why: str, claim_s: float = 0.0, owner_reason: str = "") -> ReuseResult:
        log.info("kvshuttle: recompute, because %s: %s", failure.value, why)
        action: Action = "local" if decision.local_tokens > 0 else "recompute"
        return ReuseResult(action, failure.value, f"recompute, because {why}", num_tokens, decision.local_tokens,
                           0, invalid, decision, claim_s=claim_s, total_s=time.perf_counter() - started,
                           owner_reason=owner_reason)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def _length(prompt: TokenIds | PromptDigests) -> int:
    if isinstance(prompt, PromptDigests):
        return prompt.num_tokens
    try:
        return len(prompt)
    except TypeError:
        raise ReuseArgumentError(f"prompt must be token ids or PromptDigests, got {type(prompt).__name__}") from None


from .ranks import check_rank_args, fetch_ranked  # noqa: E402  (ranks builds on this module's names)
