"""Tensor-parallel ranks: which KV heads each rank of an engine holds, and where a reader rank reads its own from.

vLLM splits a model's KV heads across its tensor-parallel ranks. With ``H`` KV heads and TP size ``t``:

* ``t <= H`` (``H % t == 0``): rank ``r`` holds heads ``[r * H/t, (r + 1) * H/t)``;
* ``t > H`` (``t % H == 0``, GQA models with fewer KV heads than ranks): each head is replicated on ``t/H``
  ranks, rank ``r`` holds head ``r // (t/H)`` alone.

MLA's latent has no heads and is replicated on every rank: it is the case ``H = 1``. A reader rank at TP ``a``
reads exactly the heads it holds from an owner at TP ``b``, each head once: from the one owner rank holding it,
or, for replicated heads, from one of the ranks holding it, spread by the reader's rank so that the owner
ranks share the load. Contiguous heads from one owner rank form one :class:`HeadSlice`: the packed path's
head-slice transform moves it in one read (``remote_head_offset`` / ``local_head_offset``). A split that is not
even is refused with :class:`RankMappingError`: the caller recomputes, with the reason. :func:`readers_of`
counts the reader ranks that read from one owner rank (several when the reader runs more ranks than the owner,
or replicated heads pair up): the claims a use-once handle on that owner rank must expect.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._values import is_int
from ..errors import KVShuttleError, shown

MAX_READERS = 64  # reader ranks one owner rank may expect to claim one handle (TP sizes are far smaller)


class RankMappingError(KVShuttleError, ValueError):
    """The TP sizes cannot split these KV heads evenly (or a rank is out of range): recompute instead of reading."""


@dataclass(frozen=True)
class HeadSlice:
    """``num_heads`` heads a reader rank reads from one owner rank: the owner's heads from ``owner_head_offset``
    land at the reader's ``reader_head_offset`` (offsets into each rank's own shard)."""

    owner_rank: int
    owner_head_offset: int
    reader_head_offset: int
    num_heads: int


def split_problem(num_kv_heads: int, tp_size: int) -> str | None:
    """Why ``tp_size`` ranks cannot split ``num_kv_heads`` KV heads the way vLLM does, or None when they can."""
    if not (is_int(num_kv_heads) and num_kv_heads >= 1):
        return f"the number of KV heads must be an int >= 1, got {shown(num_kv_heads)}"
    if not (is_int(tp_size) and tp_size >= 1):
        return f"a TP size must be an int >= 1, got {shown(tp_size)}"
    heads, tp = int(num_kv_heads), int(tp_size)
    if (tp <= heads and heads % tp) or (tp > heads and tp % heads):
        return f"TP={tp} does not split {heads} KV heads evenly (one must divide the other)"
    return None


def _check(num_kv_heads: int, tp_size: int, rank: int, what: str) -> tuple[int, int, int]:
    """The three as Python ints; RankMappingError for an uneven split or a rank out of range."""
    problem = split_problem(num_kv_heads, tp_size)
    if problem is not None:
        raise RankMappingError(f"{what}: {problem}")
    if not (is_int(rank) and 0 <= rank < tp_size):
        raise RankMappingError(f"{what}: rank {shown(rank)} is outside 0..{int(tp_size) - 1}")
    return int(num_kv_heads), int(tp_size), int(rank)


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV heads rank ``rank`` of an engine at ``tp_size`` holds (its shard, in order)."""
    heads, tp, r = _check(num_kv_heads, tp_size, rank, "rank_heads")
    if tp <= heads:
        per = heads // tp
        return range(r * per, (r + 1) * per)
    head = r // (tp // heads)
    return range(head, head + 1)


def owner_ranks_of(num_kv_heads: int, tp_size: int, head: int) -> range:
    """The ranks of an engine at ``tp_size`` that hold global head ``head`` (several when it is replicated)."""
    heads, tp, _ = _check(num_kv_heads, tp_size, 0, "owner_ranks_of")
    if not (is_int(head) and 0 <= head < heads):
        raise RankMappingError(f"owner_ranks_of: head {shown(head)} is outside 0..{heads - 1}")
    if tp <= heads:
        rank = head // (heads // tp)
        return range(rank, rank + 1)
    replicas = tp // heads
    return range(head * replicas, (head + 1) * replicas)


def plan_rank_reads(num_kv_heads: int, reader_tp: int, reader_rank: int, owner_tp: int) -> tuple[HeadSlice, ...]:
    """Where reader rank ``reader_rank`` (of an engine at ``reader_tp``) reads each of its heads from an owner at
    ``owner_tp``: one slice per run of contiguous heads that one owner rank holds. RankMappingError when either
    TP size cannot split the heads."""
    heads, _, reader = _check(num_kv_heads, reader_tp, reader_rank, "reader")
    _check(num_kv_heads, owner_tp, 0, "owner")
    mine = rank_heads(heads, reader_tp, reader)
    slices: list[HeadSlice] = []
    for k, head in enumerate(mine):
        holders = owner_ranks_of(heads, owner_tp, head)
        owner = holders[reader % len(holders)]  # replicated: the reader ranks share the owner ranks' load
        offset = head - rank_heads(heads, owner_tp, owner).start
        last = slices[-1] if slices else None
        if last is not None and last.owner_rank == owner and last.owner_head_offset + last.num_heads == offset:
            slices[-1] = HeadSlice(owner, last.owner_head_offset, last.reader_head_offset, last.num_heads + 1)
        else:
            slices.append(HeadSlice(owner, offset, k, 1))
    return tuple(slices)


def readers_of(num_kv_heads: int, reader_tp: int, owner_tp: int, owner_rank: int) -> int:
    """How many ranks of a reader at ``reader_tp`` read from owner rank ``owner_rank`` (of an owner at
    ``owner_tp``) under :func:`plan_rank_reads`: the claims that owner rank should expect for one handle (a
    use-once handle is consumed only when all of them completed). 0 when no reader rank reads from it (a
    replica the reads do not spread to). RankMappingError when either TP size cannot split the heads or the
    owner rank is out of range."""
    heads, _, owner = _check(num_kv_heads, owner_tp, owner_rank, "owner")
    _check(heads, reader_tp, 0, "reader")
    return sum(1 for reader in range(int(reader_tp))
               if any(s.owner_rank == owner for s in plan_rank_reads(heads, reader_tp, reader, owner_tp)))
