"""Decode-side retention of finished requests' KV blocks, so a later turn's prefill can read them back.

:class:`RetentionLedger` keeps a finished request's blocks and issues a :class:`~kvshuttle.kv_handle.KVHandle`
(engine id, unguessable handle id, generation, block ids, digests, valid tokens, remaining TTL, side channel).
It fixes what vLLM's decode lacks: handles can be read many times until expiry (or once, vLLM-compatible), the
TTL is renewed on heartbeat, a reader must claim a handle first so decode refuses expired, stale (blocks
reused) or tampered handles instead of serving them, and retained memory is bounded by a budget with LRU
eviction. Expiry costs O(log n) per handle expired and O(1) when nothing is due.

Stdlib only (no torch, CUDA or native module): the ledger is bookkeeping; moving bytes is ``transfer``'s job.
"""

from __future__ import annotations

from .errors import (
    BudgetExceededError,
    ClaimLimitError,
    ClaimLostError,
    HandleConsumedError,
    HandleEvictedError,
    HandleExpiredError,
    HandleInUseError,
    HandleReleasedError,
    HandleUnavailableError,
    RetentionArgumentError,
    RetentionError,
    RetentionRefusedError,
    StaleHandleError,
    TamperedHandleError,
    UnknownHandleError,
)
from .ledger import DEFAULT_MAX_TTL_S, DEFAULT_TTL_S, MODES, Mode, RetentionLedger
from .records import Claim

__all__ = [
    "DEFAULT_MAX_TTL_S",
    "DEFAULT_TTL_S",
    "MODES",
    "BudgetExceededError",
    "Claim",
    "ClaimLimitError",
    "ClaimLostError",
    "HandleConsumedError",
    "HandleEvictedError",
    "HandleExpiredError",
    "HandleInUseError",
    "HandleReleasedError",
    "HandleUnavailableError",
    "Mode",
    "RetentionArgumentError",
    "RetentionError",
    "RetentionLedger",
    "RetentionRefusedError",
    "StaleHandleError",
    "TamperedHandleError",
    "UnknownHandleError",
]
