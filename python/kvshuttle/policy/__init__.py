"""Reuse logic: block digests, the retention handle (``kv_transfer_params``) and the reuse-or-recompute policy.

Stdlib + numpy only: imports without torch, CUDA, NIXL or the native module.
"""

from __future__ import annotations

from .decision import (
    CostEstimate,
    CostInputs,
    Decision,
    PolicyConfig,
    PolicyError,
    Reason,
    decide,
    decide_from_params,
    estimate_clock_offset,
    parse_handle,
)
from .digests import (
    DEFAULT_DIGEST_SIZE,
    DigestError,
    PromptDigests,
    block_digests,
    from_vllm_block_hashes,
    salted_key,
)
from .kv_handle import READ_MODES, HandleAuthError, HandleFormatError, KVHandle, ReadMode

__all__ = [
    "DEFAULT_DIGEST_SIZE",
    "READ_MODES",
    "CostEstimate",
    "CostInputs",
    "Decision",
    "DigestError",
    "HandleAuthError",
    "HandleFormatError",
    "KVHandle",
    "PolicyConfig",
    "PolicyError",
    "PromptDigests",
    "ReadMode",
    "Reason",
    "block_digests",
    "decide",
    "decide_from_params",
    "estimate_clock_offset",
    "from_vllm_block_hashes",
    "parse_handle",
    "salted_key",
]
