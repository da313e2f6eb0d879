"""Argument checks of the retention ledger: a caller bug becomes a RetentionArgumentError that names it."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

from .errors import RetentionArgumentError


def check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise RetentionArgumentError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_count(name: str, value: int) -> int:
    if type(value) is not int or value < 0:
        raise RetentionArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return value


def check_retain(request_id: str, block_ids: Iterable[int], digests: Iterable[bytes], num_tokens: int,
                  block_size: int, tp_size: int, conversation_id: str | None) -> tuple[tuple[int, ...],
                                                                                      tuple[bytes, ...]]:
    if not isinstance(request_id, str) or not request_id:
        raise RetentionArgumentError("request_id must be a non-empty string")
    if conversation_id is not None and not isinstance(conversation_id, str):
        raise RetentionArgumentError("conversation_id must be a string or None")
    try:
        ids = tuple(operator.index(b) for b in block_ids)
    except TypeError:
        raise RetentionArgumentError("block_ids must be integers") from None
    if not ids:
        raise RetentionArgumentError("nothing to retain: free the request normally")
    if min(ids) < 0 or len(set(ids)) != len(ids):
        raise RetentionArgumentError("block_ids must be distinct non-negative integers")
    digs = tuple(digests)
    if not all(isinstance(d, (bytes, bytearray, memoryview)) for d in digs):
        raise RetentionArgumentError("digests must be bytes")
    digs = tuple(bytes(d) for d in digs)
    if len(digs) != len(ids) or len({len(d) for d in digs}) != 1 or not digs[0]:
        raise RetentionArgumentError(f"need one non-empty digest of equal length per block: {len(digs)} digests "
                                     f"for {len(ids)} blocks")
    for name, value in (("block_size", block_size), ("tp_size", tp_size)):
        if type(value) is not int or value < 1:
            raise RetentionArgumentError(f"{name} must be a positive int, got {value!r}")
    if type(num_tokens) is not int or not (len(ids) - 1) * block_size < num_tokens <= len(ids) * block_size:
        raise RetentionArgumentError(f"{len(ids)} blocks of {block_size} cannot hold {num_tokens!r} tokens "
                                     "(pass exactly the blocks that hold KV)")
    return ids, digs
