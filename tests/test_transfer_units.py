"""The transfer engine's pure parts, without processes: chunk planning, the wire format, the compatibility
check, the staging pool and the error types."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("msgpack")
pytest.importorskip("zmq")

from conftest import Geo, make_cache
from kvshuttle import BlockIdError, CacheGeometry, KVShuttleError, StagingError, StagingLayout, TokenOrder
from kvshuttle.core.blocks import check_ids
from kvshuttle.core.plan import SideGeometry
from kvshuttle.transfer import (
    BlockRangeError,
    IncompatiblePeerError,
    ProtocolError,
    StagingExhaustedError,
    StagingTooSmallError,
    TransferError,
    TransferTimeoutError,
)
from kvshuttle.transfer.staging import StagingPool, chunk_tokens, plan_chunks
from kvshuttle.transfer.wire import (
    PeerInfo,
    StagingInfo,
    check_compatible,
    decode,
    encode,
    layout_difference,
)

GEO = Geo(kind="flash_attn", order="NHD", dtype="float16", num_layers=2, num_blocks=8, block_size=16,
          num_heads=4, head_size=32)


def info(geo: Geo) -> CacheGeometry:
    return make_cache(np.random.default_rng(0), geo).cache().geometry


@pytest.mark.parametrize("local_bs, remote_bs, staging_bs", [(16, 16, 16), (16, 32, 16), (32, 16, 32),
                                                             (8, 24, 8), (5, 3, 5)])
@pytest.mark.parametrize("num_tokens", [1, 47, 96, 200])
def test_chunks_cover_every_token_on_whole_blocks_of_both_sides(local_bs: int, remote_bs: int, staging_bs: int,
                                                                num_tokens: int) -> None:
    layout = StagingLayout(staging_bs, 2, TokenOrder.HND)
    planes, row = 4, 64
    per = chunk_tokens(local_bs, remote_bs, layout, planes, row, 24 << 10)
    assert per % math.lcm(local_bs, remote_bs, staging_bs) == 0
    chunks = plan_chunks(num_tokens, per, local_bs, remote_bs, layout, planes, row)
    assert sum(c.num_tokens for c in chunks) == num_tokens
    local_blocks: list[int] = []
    remote_blocks: list[int] = []
    for c in chunks:
        assert c.nbytes <= 24 << 10 and c.nbytes == layout.num_units(c.num_tokens) * planes * staging_bs * 2 * row
        assert c.token_start % local_bs == 0 and c.token_start % remote_bs == 0
        local_blocks += range(c.local.start, c.local.stop)
        remote_blocks += range(c.remote.start, c.remote.stop)
    assert local_blocks == list(range(-(-num_tokens // local_bs)))  # each block in exactly one chunk
    assert remote_blocks == list(range(-(-num_tokens // remote_bs)))


def test_chunk_too_small_for_one_aligned_unit() -> None:
    with pytest.raises(StagingError, match="raise staging_chunk_bytes"):
        chunk_tokens(16, 48, StagingLayout(16, 8), 2, 256, 64 << 10)


def test_wire_round_trip_and_protocol_errors() -> None:
    cache = make_cache(np.random.default_rng(0), GEO).cache()
    peer = PeerInfo("agent-x", b"\x00md", SideGeometry.from_cache(cache), info(GEO), "DRAM",
                    StagingInfo(1 << 20, 4))
    back = PeerInfo.from_wire(decode(encode(peer.to_wire())))
    assert back == peer
    with pytest.raises(ProtocolError, match="op"):
        decode(encode({"no": "op"}))  # type: ignore[dict-item]
    with pytest.raises(ProtocolError):
        decode(b"\xc1not msgpack")
    with pytest.raises(IncompatiblePeerError, match="protocol"):
        PeerInfo.from_wire({**peer.to_wire(), "protocol": 999})


def test_compatibility_and_layout_differences() -> None:
    base = info(GEO)
    check_compatible(base, info(replace(GEO, order="HND", block_size=32, num_heads=2, num_blocks=4)))
    assert layout_difference(base, base) is None
    assert layout_difference(base, info(replace(GEO, kind="flashinfer"))) is None  # same pieces, other strides
    diff = layout_difference(base, info(replace(GEO, order="HND", block_size=32)))
    assert diff is not None and "token order" in diff and "block size" in diff
    assert layout_difference(base, info(replace(GEO, order="HND", num_heads=1))) is not None
    with pytest.raises(IncompatiblePeerError) as err:
        check_compatible(base, info(replace(GEO, dtype="float32", head_size=64, num_layers=3)))
    message = str(err.value)
    assert "dtype" in message and "head size" in message and "layers" in message and "recompute" in message


def test_staging_pool_reserves_and_exhausts() -> None:
    pool = StagingPool(4096, 3)
    first = pool.reserve(2, "owner")
    second = pool.reserve(5, "owner")
    assert len(first) == 2 and len(second) == 1 and pool.free == 0
    assert {pool.address(s) - pool.base for s in first + second} == {0, 4096, 8192}
    with pytest.raises(StagingExhaustedError, match="all 3 staging chunks on the owner"):
        pool.reserve(1, "owner")
    pool.release(first + second)
    assert pool.free == 3
    assert pool.array(1, 100).nbytes == 100
    with pytest.raises(StagingError):
        StagingPool(0, 1)


def test_check_ids() -> None:
    assert check_ids([3, 1], 4, "local").tolist() == [3, 1]
    for bad, message in (([4], "outside"), ([1, 1], "more than once"), ([[1]], "1-D"), ([0.5], "integers")):
        with pytest.raises(BlockIdError, match=message):
            check_ids(bad, 4, "local")


def test_errors_name_invalid_blocks_and_types() -> None:
    err = BlockRangeError("bad ids", np.arange(20))
    assert err.invalid_block_ids == tuple(range(20)) and "20 in all" in str(err)
    assert isinstance(err, KVShuttleError) and isinstance(err, IndexError) and isinstance(err, TransferError)
    assert isinstance(TransferTimeoutError("late"), TimeoutError)
    assert isinstance(StagingTooSmallError("small"), StagingError)
    assert TransferError("plain").invalid_block_ids == ()


def test_pages_that_hold_rows_differently_are_a_layout_difference() -> None:
    """CPU_ATTN and FlashAttention 0.32 pages agree on order, block size and heads, but not on where rows sit:
    a direct (byte for byte) read between them would scramble K and V, so the engine must pick packed."""
    from kvshuttle import PagedKVCache
    from vllm_views import logical_byte_shape, numpy_byte_views

    shape = logical_byte_shape(2, 4, 8, 32, 64 * 4)
    buf = np.zeros(int(np.prod(shape)), dtype=np.uint8)
    views = [v.view(np.float32) for v in numpy_byte_views(buf, shape, "LBHNC")]
    cpu = PagedKVCache.from_vllm({f"l{i}": v for i, v in enumerate(views)}, "CPU_ATTN").geometry
    flash = PagedKVCache.from_vllm({f"l{i}": v for i, v in enumerate(views)}, "FLASH_ATTN").geometry
    assert layout_difference(cpu, cpu) is None
    difference = layout_difference(cpu, flash)
    assert difference is not None and "rows" in difference
