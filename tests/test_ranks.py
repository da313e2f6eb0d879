"""Tensor-parallel rank mapping (kvshuttle.core.ranks), checked by moving real bytes: every owner rank's shard is
cut from one random full cache, every reader rank reads its heads through pack (owner head offset) and unpack
(reader head offset) into a poisoned shard, and each reader shard must equal its slice of the full cache."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvshuttle as ks
from kvshuttle.core.ranks import (
    RankMappingError,
    owner_ranks_of,
    plan_rank_reads,
    rank_heads,
    readers_of,
    split_problem,
)

SIZES = (1, 2, 4, 8)
BLOCKS, BLOCK, HEAD = 6, 16, 8


def shard(full: list[np.ndarray], heads: range) -> list[np.ndarray]:
    return [np.ascontiguousarray(layer[:, :, :, heads.start:heads.stop]) for layer in full]  # [2, N, B, H, D]


@pytest.mark.parametrize(("kv_heads", "reader_tp", "owner_tp"),
                         [c for c in itertools.product((1, 2, 4, 8), SIZES, SIZES)
                          if split_problem(c[0], c[1]) is None and split_problem(c[0], c[2]) is None])
def test_every_reader_rank_gets_exactly_its_heads(kv_heads: int, reader_tp: int, owner_tp: int) -> None:
    rng = np.random.default_rng(kv_heads * 100 + reader_tp * 10 + owner_tp)
    full = [rng.integers(1, 2**16, size=(2, BLOCKS, BLOCK, kv_heads, HEAD), dtype=np.uint16) for _ in range(2)]
    owners = [ks.PagedKVCache.from_arrays(shard(full, rank_heads(kv_heads, owner_tp, r)), "flash_attn")
              for r in range(owner_tp)]
    remote_ids = rng.permutation(BLOCKS)[:4].astype(np.int64)  # permuted block tables on both sides
    local_ids = rng.permutation(BLOCKS)[:4].astype(np.int64)
    load = [0] * owner_tp
    for reader in range(reader_tp):
        mine = rank_heads(kv_heads, reader_tp, reader)
        layers = [np.full((2, BLOCKS, BLOCK, len(mine), HEAD), 0xA5A5, dtype=np.uint16) for _ in range(2)]
        local = ks.PagedKVCache.from_arrays(layers, "flash_attn")
        moved = 0
        for piece in plan_rank_reads(kv_heads, reader_tp, reader, owner_tp):
            layout = ks.StagingLayout(block_size=BLOCK, num_heads=piece.num_heads, order=ks.TokenOrder.NHD)
            staging = np.empty(ks.staging_nbytes(owners[piece.owner_rank], num_tokens=4 * BLOCK, layout=layout),
                               np.uint8)
            ks.pack(owners[piece.owner_rank], remote_ids, staging, layout=layout, head_offset=piece.owner_head_offset)
            ks.unpack(staging, local, local_ids, layout=layout, head_offset=piece.reader_head_offset)
            moved += piece.num_heads
            load[piece.owner_rank] += 1
        assert moved == len(mine)  # each head read exactly once
        for got, want in zip(layers, full, strict=True):
            assert np.array_equal(got[:, local_ids], want[:, remote_ids][:, :, :, mine.start:mine.stop])
            untouched = np.setdiff1d(np.arange(BLOCKS), local_ids)
            assert (got[:, untouched] == 0xA5A5).all()
    if owner_tp > kv_heads and reader_tp >= owner_tp:  # replicated heads: the reads spread over their holders
        assert min(load) >= 1


@pytest.mark.parametrize(("kv_heads", "tp"), [(6, 4), (4, 3), (2, 3), (8, 12), (0, 1), (4, 0), (True, 1)])
def test_uneven_splits_are_refused_with_the_reason(kv_heads: int, tp: int) -> None:
    assert split_problem(kv_heads, tp) is not None
    with pytest.raises(RankMappingError):
        plan_rank_reads(kv_heads, tp, 0, 1)
    with pytest.raises(RankMappingError):
        plan_rank_reads(kv_heads, 1, 0, tp)


def test_shards_follow_vllm() -> None:
    assert [rank_heads(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [rank_heads(2, 8, r) for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4  # GQA: replicated
    assert owner_ranks_of(2, 8, 1) == range(4, 8) and owner_ranks_of(8, 2, 5) == range(1, 2)
    with pytest.raises(RankMappingError, match="rank"):
        rank_heads(8, 4, 4)


def test_slices_coalesce_heads_of_one_owner_rank() -> None:
    """TP=1 reading from TP=2 of 8 heads: two reads of 4 heads, not eight of one."""
    slices = plan_rank_reads(8, 1, 0, 2)
    assert [(s.owner_rank, s.owner_head_offset, s.reader_head_offset, s.num_heads) for s in slices] == [
        (0, 0, 0, 4), (1, 0, 4, 4)]
    assert [(s.owner_rank, s.owner_head_offset, s.reader_head_offset, s.num_heads)
            for s in plan_rank_reads(8, 4, 3, 2)] == [(1, 2, 0, 2)]


# --------------------------------------------------------------------------- readers of one owner rank
@pytest.mark.parametrize(("kv_heads", "reader_tp", "owner_tp", "want"), [
    (4, 1, 2, [1, 1]),  # TP1 reader of a TP2 owner: its one rank reads both owner ranks
    (4, 2, 1, [2]),  # TP2 reader of a TP1 owner: both reader ranks read owner rank 0
    (4, 4, 1, [4]),
    (4, 2, 2, [1, 1]),  # direct pairing
    (4, 4, 2, [2, 2]),
    (2, 2, 4, [1, 0, 0, 1]),  # GQA, 2 heads replicated on 4 owner ranks: reader ranks 0, 1 read owner ranks 0, 3
    (2, 1, 4, [1, 0, 1, 0]),  # one reader rank reads head 0 from owner rank 0 and head 1 from owner rank 2
    (2, 4, 4, [1, 1, 1, 1]),  # the replicas share the load
    (2, 8, 4, [2, 2, 2, 2]),
    (2, 4, 2, [2, 2]),  # replicated on the reader's side: two reader ranks hold each head
    (1, 4, 1, [4]),  # MLA: one latent, replicated everywhere
    (1, 2, 4, [1, 1, 0, 0]),
])
def test_readers_of_counts_the_reader_ranks_of_each_owner_rank(kv_heads: int, reader_tp: int, owner_tp: int,
                                                                want: list[int]) -> None:
    assert [readers_of(kv_heads, reader_tp, owner_tp, r) for r in range(owner_tp)] == want


@pytest.mark.parametrize(("kv_heads", "reader_tp", "owner_tp"),
                         [c for c in itertools.product((1, 2, 4, 8), (*SIZES, 16), (*SIZES, 16))
                          if split_problem(c[0], c[1]) is None and split_problem(c[0], c[2]) is None])
def test_readers_of_agrees_with_every_reader_ranks_plan(kv_heads: int, reader_tp: int, owner_tp: int) -> None:
    """Brute force: the reader ranks whose planned reads touch an owner rank, counted from the plans themselves."""
    plans = [plan_rank_reads(kv_heads, reader_tp, r, owner_tp) for r in range(reader_tp)]
    counts = [readers_of(kv_heads, reader_tp, owner_tp, o) for o in range(owner_tp)]
    for owner in range(owner_tp):
        assert counts[owner] == sum(1 for plan in plans if owner in {s.owner_rank for s in plan})
    assert sum(counts) == sum(len({s.owner_rank for s in plan}) for plan in plans)  # one claim per rank pair
    assert max(counts) >= 1


@pytest.mark.parametrize(("args", "match"), [
    ((4, 2, 2, 2), "rank 2 is outside 0..1"),
    ((4, 2, 2, -1), "rank -1"),
    ((4, 2, 2, True), "rank True"),
    ((4, 2, 2, 1.0), "rank 1.0"),
    ((4, 3, 2, 0), "reader: TP=3 does not split"),
    ((4, 2, 3, 0), "owner: TP=3 does not split"),
    ((0, 1, 1, 0), "KV heads"),
    ((4, 0, 1, 0), "TP size"),
    ((4, "2", 1, 0), "TP size"),
    ((4, 1, None, 0), "TP size"),
])
def test_readers_of_refuses_bad_input_with_the_reason(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(RankMappingError, match=match):
        readers_of(*args)  # type: ignore[arg-type]
