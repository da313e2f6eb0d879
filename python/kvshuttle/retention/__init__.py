"""Decode-side retention of finished requests' KV blocks, so a later turn's prefill can read them back.

:class:`RetentionLedger` keeps a finished request's blocks and issues a :class:`~kvshuttle.kv_handle.KVHandle`
(engine id, unguessable handle id, generation, block ids, digests, valid tokens, remaining TTL, side channel).
It fixes what vLLM's decode lacks: handles can be read many times until expiry (or once, vLLM-compatible), the
TTL is renewed on heartbeat, a reader must claim a handle first so decode refuses expired, stale (blocks
reused) or tampered handles instead of serving them, and retained memory is bounded by a budget with LRU
eviction; with a tier in its terms (``tiers.py``) a retention leaving the hot cache is demoted into host memory
instead of ended, and from there into files with a disk tier. Its :class:`RetentionTerms` (``terms.py``) hold
every retention default and decide when a retention ends; ``eviction.py`` holds the replaceable eviction order.
Expiry costs O(log n) per handle expired and O(1) when nothing is due.

Stdlib only (no torch, CUDA or native module): the ledger is bookkeeping; moving bytes is ``transfer``'s job.
"""

from __future__ import annotations

from .errors import (
    BudgetExceededError,
    ClaimLimitError,
    ClaimLostError,
    HandleConsumedError,
    HandleDemotingError,
    HandleEvictedError,
    HandleExpiredError,
    HandleInUseError,
    HandleReleasedError,
    HandleTierEvictedError,
    HandleTierExpiredError,
    HandleTierFullError,
    HandleTierLostError,
    HandleUnavailableError,
    NoTierError,
    RetentionArgumentError,
    RetentionError,
    RetentionRefusedError,
    StaleHandleError,
    TamperedHandleError,
    UnknownHandleError,
)
from .eviction import EVICTION_POLICIES, EvictionPolicy, LeastRecentlyUsed
from .ledger import MODES, Mode, RetentionLedger
from .records import Claim
from .terms import (
    DEFAULT_BUDGET_FRACTION,
    DEFAULT_MAX_TTL_S,
    DEFAULT_READ_MODE,
    DEFAULT_TTL_S,
    READ_MODES,
    ReadMode,
    RetentionTerms,
)
from .tiers import DEFAULT_DISK_TTL_S, DEFAULT_TIER_TTL_S, DISK_TIER, HOST_TIER, HOT_TIER, Demotion, TierTerms

__all__ = [
    "DEFAULT_BUDGET_FRACTION",
    "DEFAULT_DISK_TTL_S",
    "DEFAULT_MAX_TTL_S",
    "DEFAULT_READ_MODE",
    "DEFAULT_TIER_TTL_S",
    "DEFAULT_TTL_S",
    "DISK_TIER",
    "EVICTION_POLICIES",
    "HOST_TIER",
    "HOT_TIER",
    "MODES",
    "READ_MODES",
    "BudgetExceededError",
    "Claim",
    "ClaimLimitError",
    "ClaimLostError",
    "Demotion",
    "EvictionPolicy",
    "HandleConsumedError",
    "HandleDemotingError",
    "HandleEvictedError",
    "HandleExpiredError",
    "HandleInUseError",
    "HandleReleasedError",
    "HandleTierEvictedError",
    "HandleTierExpiredError",
    "HandleTierFullError",
    "HandleTierLostError",
    "HandleUnavailableError",
    "LeastRecentlyUsed",
    "Mode",
    "NoTierError",
    "ReadMode",
    "RetentionArgumentError",
    "RetentionError",
    "RetentionLedger",
    "RetentionRefusedError",
    "RetentionTerms",
    "StaleHandleError",
    "TamperedHandleError",
    "TierTerms",
    "UnknownHandleError",
]
