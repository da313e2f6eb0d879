"""Block ids and token counts: the rules shared by pack/unpack, the read planner, the transfer engine, the handle,
the policy and the retention ledger (one definition each, so the layers cannot drift apart)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._values import is_int
from ..errors import BlockIdError, shown

BlockIds = Sequence[int] | npt.NDArray[np.integer[Any]]
Ids = npt.NDArray[np.int64]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that ``num_tokens`` tokens start: ``ceil(num_tokens / block_size)`` (arguments already checked)."""
    return -(-num_tokens // block_size)


def blocks_hold_tokens(num_blocks: int, block_size: int, num_tokens: int) -> bool:
    """Whether ``num_blocks`` blocks of ``block_size`` tokens hold exactly ``num_tokens`` tokens.

    True iff every block is started and only the last may be partial: ``(n-1)*B < t <= n*B``, or ``t == 0 == n``.
    False for anything that is not a non-negative integer (bool, float, None) or a block size below 1, so
    callers raise their own named error with one test.
    """
    if not (is_int(num_blocks) and is_int(block_size) and is_int(num_tokens)):
        return False
    if num_blocks < 0 or block_size < 1 or num_tokens < 0:
        return False
    return blocks_for_tokens(int(num_tokens), int(block_size)) == num_blocks


def as_ids(block_ids: BlockIds, side: str = "") -> Ids:
    """Block ids as a 1-D contiguous int64 array; BlockIdError for other shapes and types."""
    prefix = f"{side} " if side else ""
    try:
        ids = np.asarray(block_ids)
    except (ValueError, TypeError, OverflowError):  # ragged nesting, objects numpy cannot hold
        raise BlockIdError(f"{prefix}block ids must be a 1-D sequence of integers, got {shown(block_ids)}") from None
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise BlockIdError(f"{prefix}block ids must be a 1-D sequence of integers, got {ids.dtype} {ids.shape}")
    if ids.dtype.kind == "u" and ids.max() > np.iinfo(np.int64).max:
        raise BlockIdError(f"{prefix}block id {ids.max()} is not a block id")
    return np.ascontiguousarray(ids, dtype=np.int64)


_FEW_IDS = 64


def check_ids(block_ids: BlockIds, num_blocks: int, side: str = "", *, unique: bool = True) -> Ids:
    """1-D int64 ids in ``[0, num_blocks)``, each at most once when ``unique``; BlockIdError otherwise."""
    prefix = f"{side} " if side else ""
    ids = as_ids(block_ids, side)
    if ids.size == 0:
        return ids
    if ids.size <= _FEW_IDS:  # one chunk's ids: Python's min, max and set beat numpy's per-call cost
        values = ids.tolist()
        if min(values) >= 0 and max(values) < num_blocks and (not unique or len(set(values)) == len(values)):
            return ids
    if ids.min() < 0 or ids.max() >= num_blocks:
        bad = ids[(ids < 0) | (ids >= num_blocks)][0]
        raise BlockIdError(f"{prefix}block id {bad} is outside [0, {num_blocks})")
    if unique:
        # A mask over the cache's blocks: O(ids + blocks), far cheaper than sorting on the hot path.
        seen = np.zeros(num_blocks, dtype=np.bool_)
        seen[ids] = True
        if np.count_nonzero(seen) != ids.size:
            values, counts = np.unique(ids, return_counts=True)
            raise BlockIdError(f"{prefix}block id {values[counts > 1][0]} appears more than once")
    return ids
