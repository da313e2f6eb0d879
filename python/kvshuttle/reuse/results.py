"""What a reuse read returns, and why it did not fetch: the result, the failure names, the caller-bug error.

The bottom of ``reuse/``: :mod:`.owners` raises the refusals named here, :mod:`.ranks` turns any failure into a
result, :mod:`.read` returns them.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from ..errors import KVShuttleError
from ..policy import Decision
from ..transfer import (
    ClaimRefusedError,
    IncompatiblePeerError,
    PeerLostError,
    PeerUnreachableError,
    Settlement,
    TransferError,
    TransferTelemetry,
    TransferTimeoutError,
)

log = logging.getLogger("kvshuttle.reuse.read")  # one logger for the whole reuse read, as before the split

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


class OwnerCoolingDown(PeerUnreachableError):
    """The owner failed less than the reader's ``cooldown_s`` ago: refused without a connection attempt."""


class OwnerNotAllowed(TransferError):
    """The owner is not on the reader's allow-list."""


class OwnerStalled(TransferError):
    """A read from the owner passed its deadline and NIXL still reports it in flight."""


def failure_of(exc: BaseException) -> Failure:
    """The :class:`Failure` a fetch that raised ``exc`` reports."""
    if isinstance(exc, OwnerCoolingDown):
        return Failure.PEER_COOLING_DOWN
    if isinstance(exc, OwnerStalled):
        return Failure.PEER_STALLED
    if isinstance(exc, OwnerNotAllowed):
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


def not_fetched(decision: Decision, started: float, num_tokens: int) -> ReuseResult:
    """The result of a read the policy did not approve: the local hit, if any, else a recompute."""
    action: Action = "local" if decision.local_tokens > 0 else "recompute"
    return ReuseResult(action, decision.reason.value, decision.message, num_tokens, decision.local_tokens, 0,
                       (), decision, total_s=time.perf_counter() - started)


def failed_result(decision: Decision, started: float, num_tokens: int, failure: Failure,
                  invalid: tuple[int, ...], why: str, claim_s: float = 0.0, owner_reason: str = "") -> ReuseResult:
    """The result of an approved fetch that did not happen: the local hit stands, ``invalid`` must not be used."""
    log.info("kvshuttle: recompute, because %s: %s", failure.value, why)
    action: Action = "local" if decision.local_tokens > 0 else "recompute"
    return ReuseResult(action, failure.value, f"recompute, because {why}", num_tokens, decision.local_tokens,
                       0, invalid, decision, claim_s=claim_s, total_s=time.perf_counter() - started,
                       owner_reason=owner_reason)


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), never 0: a call given it still times out cleanly."""
    return max(deadline - time.monotonic(), 0.001)
