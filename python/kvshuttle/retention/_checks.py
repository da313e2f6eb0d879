"""Argument checks of the retention ledger: a caller bug becomes a RetentionArgumentError that names it.

Every check runs before the ledger's state is touched, so a refused call changes nothing.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

from .._values import as_float, is_finite, is_int
from ..core.blocks import blocks_hold_tokens
from ..core.ranks import MAX_READERS
from ..errors import shown
from ..policy.kv_handle import INT64_MAX, MAX_DIGEST_SIZE
from .errors import RetentionArgumentError


def check_positive(name: str, value: float) -> float:
    if not (is_finite(value) and value > 0):
        raise RetentionArgumentError(f"{name} must be a finite number of seconds > 0, got {shown(value)}")
    return float(value)


def check_count(name: str, value: int) -> int:
    if type(value) is not int or value < 0:
        raise RetentionArgumentError(f"{name} must be a non-negative int, got {shown(value)}")
    return value


def check_id(name: str, value: str) -> str:
    """A handle, claim or conversation id: a str (anything else cannot name one, and may not even hash)."""
    if not isinstance(value, str):
        raise RetentionArgumentError(f"{name} must be a str, got {type(value).__name__}")
    return value


def check_readers(readers: int) -> int:
    """A claim's ``readers``: how many reader ranks will claim the handle (an int, not a bool, in 1..64)."""
    if not (is_int(readers) and 1 <= readers <= MAX_READERS):
        raise RetentionArgumentError(f"readers must be an int in 1..{MAX_READERS} (how many reader ranks claim this "
                                     f"handle here), got {shown(readers)}")
    return int(readers)


def check_block(block_id: int) -> int:
    if not (is_int(block_id) and 0 <= block_id <= INT64_MAX):
        raise RetentionArgumentError(f"block id must be an int in [0, 2**63), got {shown(block_id)}")
    return int(block_id)


def check_time(name: str, value: float) -> float:
    number = as_float(value)
    if number is None or math.isnan(number):  # NaN compares false with every deadline: nothing would happen
        raise RetentionArgumentError(f"{name} must be a real number of seconds, not NaN, got {shown(value)}")
    return number


def check_callable(name: str, value: Any, optional: bool = False) -> None:
    if not (callable(value) or (optional and value is None)):
        raise RetentionArgumentError(f"{name} must be callable{' or None' if optional else ''}, "
                                     f"got {type(value).__name__}")


def as_tuple(name: str, values: Iterable[Any] | None) -> tuple[Any, ...] | None:
    """``values`` as a tuple (None stays None); RetentionArgumentError for a non-iterable."""
    if values is None:
        return None
    if isinstance(values, (str, bytes)):
        raise RetentionArgumentError(f"{name} must be a sequence, not {type(values).__name__}")
    try:
        return tuple(values)
    except TypeError:
        raise RetentionArgumentError(f"{name} must be a sequence, got {type(values).__name__}") from None


def check_retain(request_id: str, block_ids: Iterable[int], digests: Iterable[bytes], num_tokens: int,
                 block_size: int, tp_size: int, conversation_id: str | None) -> tuple[tuple[int, ...],
                                                                                     tuple[bytes, ...]]:
    """What a retention's handle must satisfy on the wire (KVHandle's parser) is checked here, at the source."""
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
    if min(ids) < 0 or max(ids) > INT64_MAX or len(set(ids)) != len(ids):
        raise RetentionArgumentError("block_ids must be distinct integers in [0, 2**63)")
    digs = as_tuple("digests", digests) or ()
    if not all(isinstance(d, (bytes, bytearray, memoryview)) for d in digs):
        raise RetentionArgumentError("digests must be bytes")
    digs = tuple(bytes(d) for d in digs)
    if len(digs) != len(ids) or len({len(d) for d in digs}) != 1 or not 1 <= len(digs[0]) <= MAX_DIGEST_SIZE:
        raise RetentionArgumentError(f"need one non-empty digest of at most {MAX_DIGEST_SIZE} bytes, all of equal "
                                     f"length, per block: {len(digs)} digests for {len(ids)} blocks")
    for name, value in (("block_size", block_size), ("tp_size", tp_size)):
        if type(value) is not int or not 1 <= value <= INT64_MAX:
            raise RetentionArgumentError(f"{name} must be an int in [1, 2**63), got {shown(value)}")
    if type(num_tokens) is not int or not blocks_hold_tokens(len(ids), block_size, num_tokens):
        raise RetentionArgumentError(f"{len(ids)} blocks of {block_size} cannot hold {shown(num_tokens)} tokens "
                                     "(pass exactly the blocks that hold KV)")
    return ids, digs
