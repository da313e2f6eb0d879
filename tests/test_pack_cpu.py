"""Native CPU pack/unpack against the numpy reference, byte for byte, over every whole destination buffer.

Destinations are poisoned (0xA5 or random bytes) first, so bytes that must stay untouched are checked too:
the staging tail after the used bytes, cache blocks outside the id list, heads outside a head slice, and
slots after ``num_tokens`` in the last block.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    DTYPES,
    KINDS,
    ORDERS,
    POISON,
    TRANSFORMS,
    Geo,
    assert_bytes_equal,
    assert_caches_equal,
    make_cache,
    oracle_unpack,
    poisoned,
    random_bytes,
    random_ids,
    staging_layout,
    transform,
)
from kvshuttle import StagingLayout, TokenOrder, pack, staging_nbytes, unpack
from pack_helpers import TAIL, check_both_directions, pack_both, tokens_of, unpack_both

KIND_ORDERS = [(k, o) for k in KINDS for o in ORDERS]
# ------------------------------------------------------------------------------- kinds, orders, dtypes
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_pack_matches_reference(rng, kind, order, dtype, partial):
    geo = Geo(kind, order, dtype, num_layers=2, num_blocks=10, block_size=16, num_heads=3, head_size=8)
    ids = random_ids(rng, geo.num_blocks, 6)
    tokens = 5 * 16 + 7 if partial else None
    pack_both(make_cache(rng, geo), ids, num_tokens=tokens)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_unpack_matches_reference(rng, kind, order, dtype, partial):
    geo = Geo(kind, order, dtype, num_layers=2, num_blocks=10, block_size=16, num_heads=3, head_size=8)
    ids = random_ids(rng, geo.num_blocks, 6)
    tokens = 5 * 16 + 1 if partial else None
    dest = make_cache(rng, geo)
    staging = random_bytes(rng, staging_nbytes(dest.cache(), tokens_of(geo, ids, tokens)))
    unpack_both(staging, dest, ids, num_tokens=tokens)


@pytest.mark.parametrize("head_size", [1, 3, 5, 7])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_odd_head_sizes(rng, kind, order, dtype, head_size):
    """Rows of 1..14 bytes: never a multiple of 16, so no vector-aligned fast path applies."""
    geo = Geo(kind, order, dtype, num_layers=2, num_blocks=7, block_size=4, num_heads=3, head_size=head_size)
    ids = random_ids(rng, 7, 5)
    check_both_directions(rng, geo, ids, num_tokens=4 * 4 + 3)
    other = "HND" if order == "NHD" else "NHD"
    layout = staging_layout(geo, block_size=3, order=other, num_heads=min(2, geo.heads))
    check_both_directions(rng, geo, ids, layout=layout, num_tokens=4 * 4 + 2,
                          head_offset=geo.heads - layout.num_heads)


@pytest.mark.parametrize("block_size", [1, 16, 32, 64])
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_block_sizes(rng, kind, order, block_size):
    geo = Geo(kind, order, "bf16", num_layers=2, num_blocks=6, block_size=block_size, num_heads=2,
              head_size=4)
    ids = random_ids(rng, 6, 4)
    check_both_directions(rng, geo, ids)
    check_both_directions(rng, geo, ids, num_tokens=3 * block_size + 1)
    check_both_directions(rng, geo, ids, layout=staging_layout(geo, block_size=24, order="HND"))


# ---------------------------------------------------------------------------------------- transforms
@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
@pytest.mark.parametrize("tokens", [None, 5 * 16 + 9, 4 * 16 + 1], ids=["full", "partial9", "partial1"])
def test_transforms(rng, kind, order, name, tokens):
    geo = Geo(kind, order, "float16", num_layers=2, num_blocks=8, block_size=16, num_heads=4, head_size=6)
    layout, offset = transform(geo, name)
    ids = random_ids(rng, 8, 6 if tokens != 4 * 16 + 1 else 5)
    check_both_directions(rng, geo, ids, layout=layout, num_tokens=tokens, head_offset=offset)


@pytest.mark.parametrize("init", ["poison", "random"])
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_unpack_leaves_the_rest_untouched(rng, kind, order, init):
    """Spelled out: blocks outside the ids, heads outside the slice and slots past num_tokens keep their
    bytes, and the copied ones hold the staging's."""
    geo = Geo(kind, order, "fp8", num_layers=2, num_blocks=9, block_size=8, num_heads=4, head_size=3)
    dest = make_cache(rng, geo, fill=POISON if init == "poison" else None)
    before = dest.clone()
    ids = random_ids(rng, 9, 4)
    tokens = 3 * 8 + 5
    layout, offset = transform(geo, "head_slice_bs24_flip")
    staging = random_bytes(rng, staging_nbytes(dest.cache(), tokens, layout))
    unpack_both(staging, dest, ids, layout=layout, num_tokens=tokens, head_offset=offset)
    want = before.clone()
    oracle_unpack(staging, want, ids, layout, tokens, offset)
    assert_caches_equal(dest.raws, want.raws, "cache vs direct indexing")
    heads = slice(offset, offset + layout.num_heads)
    others = np.setdiff1d(np.arange(9), ids)
    for layer in range(geo.num_layers):
        got, old = dest.canonical(layer), before.canonical(layer)
        assert_bytes_equal(got[:, others], old[:, others], "blocks outside the ids")
        assert_bytes_equal(got[:, ids[-1], 5:], old[:, ids[-1], 5:], "slots past num_tokens")
        if geo.kind != "mla":
            outside = np.r_[0:offset, offset + layout.num_heads:geo.heads]
            assert_bytes_equal(got[:, ids][:, :, :, outside], old[:, ids][:, :, :, outside], "other heads")
        changed = got[:, ids[0], :, heads] != old[:, ids[0], :, heads]
        assert changed.mean() > 0.9  # the copied bytes are random staging bytes, not the old ones


# ---------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("tokens", [None, 4 * 16 + 3], ids=["full", "partial"])
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_round_trip_to_other_blocks(rng, kind, order, tokens):
    geo = Geo(kind, order, "bf16", num_layers=3, num_blocks=12, block_size=16, num_heads=2, head_size=8)
    src, dst = make_cache(rng, geo), make_cache(None, geo, fill=POISON)
    src_ids, dst_ids = random_ids(rng, 12, 5), random_ids(rng, 12, 5)
    staging = pack_both(src, src_ids, num_tokens=tokens)
    unpack_both(staging, dst, dst_ids, num_tokens=tokens)
    count = 16 if tokens is None else 3
    for layer in range(3):
        s, d = src.canonical(layer), dst.canonical(layer)
        assert_bytes_equal(d[:, dst_ids[:4]], s[:, src_ids[:4]], "full blocks")
        assert_bytes_equal(d[:, dst_ids[4], :count], s[:, src_ids[4], :count], "last block")
        assert (d[:, dst_ids[4], count:] == POISON).all()
        assert (d[:, np.setdiff1d(np.arange(12), dst_ids)] == POISON).all()


@pytest.mark.parametrize(("src_kind", "dst_kind"), [
    ("flash_attn", "flashinfer"), ("flashinfer", "flash_attn"), ("flash_attn", "flash_attn")])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_round_trip_across_layouts(rng, src_kind, dst_kind, dtype):
    """Prefill side: HND block 32; decode side: NHD block 16. Staging HND/32 carries the tokens across."""
    src_geo = Geo(src_kind, "HND", dtype, num_layers=2, num_blocks=6, block_size=32, num_heads=4, head_size=6)
    dst_geo = src_geo.with_(kind=dst_kind, order="NHD", num_blocks=11, block_size=16)
    src, dst = make_cache(rng, src_geo), make_cache(rng, dst_geo)
    tokens = 3 * 32 + 7
    src_ids, dst_ids = random_ids(rng, 6, 4), random_ids(rng, 11, 7)
    layout = StagingLayout(32, 4, TokenOrder.HND)
    staging = pack_both(src, src_ids, layout=layout, num_tokens=tokens)
    unpack_both(staging, dst, dst_ids, layout=layout, num_tokens=tokens)
    t = np.arange(tokens)
    for layer in range(2):
        s = src.canonical(layer)[:, src_ids[t // 32], t % 32]
        d = dst.canonical(layer)[:, dst_ids[t // 16], t % 16]
        assert_bytes_equal(d, s, "tokens after the round trip")


# -------------------------------------------------------------------------------------- special cases
@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
@pytest.mark.parametrize("ids", [[], np.zeros(0, np.int64), np.zeros(0, np.int32)],
                         ids=["list", "i64", "i32"])
def test_empty_ids_are_a_no_op(rng, kind, order, backend, ids):
    host = make_cache(rng, Geo(kind, order))
    before = host.snapshot()
    staging = random_bytes(rng, 256)
    old = staging.copy()
    for tokens in (None, 0):
        pack(host.cache(), ids, staging, num_tokens=tokens, backend=backend)
        assert_bytes_equal(staging, old, "staging")
        unpack(staging, host.cache(), ids, num_tokens=tokens, backend=backend)
        assert_caches_equal(host.raws, before)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("name", ["identity", "head_slice_bs24_flip"])
def test_thread_counts(rng, native_threads, threads, name):
    geo = Geo("flashinfer", "HND", "float16", num_layers=3, num_blocks=9, block_size=16, num_heads=4,
              head_size=8)
    native = pytest.importorskip("kvshuttle._native")
    native_threads(threads)
    assert native.num_threads() == threads
    layout, offset = transform(geo, name)
    for count in (1, 2, 9):  # fewer work items than threads, too
        ids = random_ids(rng, 9, count)
        check_both_directions(rng, geo, ids, layout=layout, num_tokens=count * 16 - 3, head_offset=offset)


@pytest.mark.parametrize("offset", [1, 3, 8, 15])
@pytest.mark.parametrize("name", ["identity", "flip_order", "head_slice"])
def test_misaligned_staging(rng, offset, name):
    geo = Geo("flash_attn", "NHD", "bf16", num_layers=2, num_blocks=6, block_size=16, num_heads=4,
              head_size=32)
    host = make_cache(rng, geo)
    layout, head_offset = transform(geo, name)
    ids = random_ids(rng, 6, 4)
    staging = pack_both(host, ids, layout=layout, num_tokens=59, head_offset=head_offset, offset=offset)
    buf = random_bytes(rng, staging.size + offset)
    buf[offset:] = staging
    unpack_both(buf[offset:], make_cache(rng, geo), ids, layout=layout, num_tokens=59,
                head_offset=head_offset)


def test_staging_of_any_dtype_and_shape(rng):
    """Staging is raw bytes: a C-contiguous float32 matrix large enough works like a uint8 vector."""
    geo = Geo("flash_attn", "HND", "fp8", num_layers=2, num_blocks=6, block_size=16, num_heads=4, head_size=8)
    host = make_cache(rng, geo)
    ids = random_ids(rng, 6, 3)
    flat = pack_both(host, ids)
    matrix = np.zeros((flat.size // 64 + 1, 16), np.float32)
    pack(host.cache(), ids, matrix, backend="native")
    assert_bytes_equal(matrix.view(np.uint8).reshape(-1)[: flat.size], flat)
    dest = make_cache(rng, geo)
    want = dest.clone()
    unpack(matrix, dest.cache(), ids)
    unpack_both(flat, want, ids)
    assert_caches_equal(dest.raws, want.raws)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_torch_cpu_caches(rng, kind, order, dtype):
    torch = pytest.importorskip("torch")
    geo = Geo(kind, order, dtype, num_layers=2, num_blocks=8, block_size=16, num_heads=4, head_size=6)
    src = make_cache(rng, geo, framework="torch")
    layout, offset = transform(geo, "head_slice_bs24_flip")
    ids = random_ids(rng, 8, 5)
    staging = pack_both(src, ids, layout=layout, num_tokens=71, head_offset=offset)
    as_tensor = torch.full((staging.size + TAIL,), POISON, dtype=torch.uint8)
    pack(src.cache(), ids, as_tensor, layout=layout, num_tokens=71, head_offset=offset)
    assert_bytes_equal(as_tensor.numpy()[: staging.size], staging)
    dest = make_cache(rng, geo, framework="torch")
    unpack_both(staging, dest, ids, layout=layout, num_tokens=71, head_offset=offset)


# -------------------------------------------------------------- large: the non-temporal store path
LARGE = Geo("flash_attn", "NHD", "float16", num_layers=4, num_blocks=96, block_size=16, num_heads=8,
            head_size=128)


@pytest.mark.parametrize(("kind", "order", "name", "offset"), [
    ("flash_attn", "NHD", "identity", 3),
    ("flash_attn", "NHD", "head_slice6", 0),
    ("flashinfer", "HND", "flip_order_bs24", 5),
    ("flashinfer", "HND", "identity", 0),
    ("flash_attn", "HND", "bs24", 1),
])
def test_large_copies(rng, kind, order, name, offset):
    """Over 16 MiB copied: the CPU path streams with non-temporal stores (and aligns odd addresses)."""
    geo = LARGE.with_(kind=kind, order=order)
    layout = {"identity": staging_layout(geo), "head_slice6": staging_layout(geo, num_heads=6),
              "flip_order_bs24": staging_layout(geo, block_size=24, order="NHD"),
              "bs24": staging_layout(geo, block_size=24)}[name]
    head_offset = 1 if name == "head_slice6" else 0
    ids = random_ids(rng, geo.num_blocks, geo.num_blocks)
    tokens = 95 * 16 + 9
    copied = tokens * layout.num_heads * geo.row_bytes * geo.planes * geo.num_layers
    assert copied >= 16 << 20
    host = make_cache(rng, geo)
    staging = pack_both(host, ids, layout=layout, num_tokens=tokens, head_offset=head_offset, offset=offset)
    dest = make_cache(None, geo, fill=POISON)
    buf = poisoned(staging.size + offset)
    buf[offset:] = staging
    unpack_both(buf[offset:], dest, ids, layout=layout, num_tokens=tokens, head_offset=head_offset)


# ------------------------------------------------------------------------------------ property test
@st.composite
def copy_cases(draw):
    kind = draw(st.sampled_from(KINDS))
    geo = Geo(kind, draw(st.sampled_from(ORDERS)), draw(st.sampled_from(list(DTYPES))),
              num_layers=draw(st.integers(1, 3)), num_blocks=draw(st.integers(1, 10)),
              block_size=draw(st.integers(1, 20)), num_heads=draw(st.integers(1, 5)),
              head_size=draw(st.integers(1, 9)))
    heads = draw(st.integers(1, geo.heads))
    head_offset = draw(st.integers(0, geo.heads - heads))
    layout = StagingLayout(draw(st.integers(1, 40)), heads, TokenOrder(draw(st.sampled_from(ORDERS))))
    ids = draw(st.permutations(range(geo.num_blocks)))[: draw(st.integers(0, geo.num_blocks))]
    tokens = draw(st.integers((len(ids) - 1) * geo.block_size + 1, len(ids) * geo.block_size)) if ids else 0
    explicit_tokens = draw(st.booleans()) or tokens != len(ids) * geo.block_size
    return (geo, np.array(ids, dtype=np.int64), layout, head_offset, tokens if explicit_tokens else None,
            draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=copy_cases())
def test_property_native_equals_reference(case):
    geo, ids, layout, head_offset, tokens, seed = case
    check_both_directions(np.random.default_rng(seed), geo, ids, layout=layout, num_tokens=tokens,
                          head_offset=head_offset)
