"""Pack/unpack of vLLM 0.32 caches (one allocation, ``[N, H, B, 2D]`` views per layer, every KVCacheLayout):
native against the numpy reference and both against direct indexing of the views the way vLLM's attention
code reads them, byte for byte over poisoned and random destinations, with every transform."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    DTYPES,
    POISON,
    TRANSFORMS,
    VLLM_CASES,
    Geo,
    assert_bytes_equal,
    make_cache,
    random_ids,
    staging_layout,
    transform,
)
from kvshuttle import StagingLayout, TokenOrder, pack, staging_nbytes, unpack
from pack_helpers import check_against_oracle, pack_both, unpack_both

CASE_IDS = [f"{k.removeprefix('vllm_')}-{lay}" for k, lay in VLLM_CASES]


def vgeo(kind: str, layout: str, dtype: str = "bf16", **sizes: int) -> Geo:
    base = {"num_layers": 3, "num_blocks": 9, "block_size": 8, "num_heads": 4, "head_size": 6}
    return Geo(kind, "NHD", dtype, layout=layout, **{**base, **sizes})


@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=CASE_IDS)
def test_identity_matches_direct_indexing(rng, kind, layout, dtype, partial):
    geo = vgeo(kind, layout, dtype)
    ids = random_ids(rng, geo.num_blocks, 6)
    check_against_oracle(rng, geo, ids, num_tokens=5 * 8 + 3 if partial else None)


@pytest.mark.parametrize("tokens", [None, 5 * 16 + 9, 4 * 16 + 1], ids=["full", "partial9", "partial1"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=CASE_IDS)
def test_transforms(rng, kind, layout, name, tokens):
    """Block-size re-chunking, NHD/HND staging, head slices, partial last blocks."""
    geo = vgeo(kind, layout, "float16", num_layers=2, num_blocks=8, block_size=16)
    layout_, offset = transform(geo, name)
    ids = random_ids(rng, 8, 5 if tokens == 4 * 16 + 1 else 6)
    check_against_oracle(rng, geo, ids, layout=layout_, num_tokens=tokens, head_offset=offset)


@pytest.mark.parametrize("staging_order", ["NHD", "HND"])
@pytest.mark.parametrize("head_size", [1, 3, 64])
@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=CASE_IDS)
def test_staging_orders_and_head_sizes(rng, kind, layout, head_size, staging_order):
    geo = vgeo(kind, layout, "fp8", num_layers=2, num_blocks=6, block_size=4, num_heads=3, head_size=head_size)
    ids = random_ids(rng, 6, 4)
    check_against_oracle(rng, geo, ids, layout=staging_layout(geo, order=staging_order), num_tokens=3 * 4 + 2)


@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=CASE_IDS)
def test_spelled_out_for_one_token(rng, kind, layout):
    """Staging row of (layer, plane, token t) holds K or V of t exactly where vLLM's kernels find them."""
    geo = vgeo(kind, layout, "float32", head_size=4)
    host = make_cache(rng, geo)
    ids = random_ids(rng, geo.num_blocks, 4)
    got = np.full(staging_nbytes(host.cache(), 30), POISON, np.uint8)
    pack(host.cache(), ids, got, num_tokens=30, backend="native")
    d, piece = geo.head_size, geo.block_size * geo.num_heads * geo.row_bytes
    for t in (0, 13, 29):
        block, slot = ids[t // geo.block_size], t % geo.block_size
        for layer, view in enumerate(host.layers):  # [N, H, B, 2D] float32, as vLLM hands them over
            for head in range(geo.num_heads):
                if kind == "vllm_cpu_attn":  # view(N, H, 2B, D).chunk(2, dim=2)
                    rows = view[block, head].reshape(2 * geo.block_size, d)
                    k, v = rows[slot], rows[geo.block_size + slot]
                else:  # transpose(1, 2).split(D, dim=-1)
                    k, v = view[block, head, slot, :d], view[block, head, slot, d:]
                for plane, want in enumerate((k, v)):
                    row = slot * geo.num_heads + head if geo.order == "NHD" else head * geo.block_size + slot
                    unit = t // geo.block_size
                    start = ((unit * geo.num_layers + layer) * 2 + plane) * piece + row * geo.row_bytes
                    assert got[start: start + geo.row_bytes].tobytes() == want.tobytes(), (t, layer, head, plane)


@pytest.mark.parametrize(("kind", "layout"), [("vllm_cpu_attn", "LBHNC"), ("vllm_flash_attn", "BLNHC")])
def test_torch_views_like_vllm(rng, kind, layout):
    """torch.as_strided over one int8-like buffer, then .view(dtype): what register_kv_caches receives."""
    pytest.importorskip("torch")
    for dtype in ("float32", "bf16", "fp8"):
        geo = vgeo(kind, layout, dtype)
        host = make_cache(rng, geo, framework="torch")
        cache = host.cache()
        assert cache.regions() == [(host.raws[0].ctypes.data, host.raws[0].nbytes)]
        ids = random_ids(rng, geo.num_blocks, 5)
        check_against_oracle(rng, geo, ids, num_tokens=4 * 8 + 1)
        staging = pack_both(host, ids, num_tokens=4 * 8 + 1)
        unpack_both(staging, make_cache(rng, geo, framework="torch"), ids, num_tokens=4 * 8 + 1)


def test_vllm_cpu_shape_large_copy(rng):
    """The observed CPU geometry (fp32, 8 heads, head 64, block 32, LBHNC) past 16 MiB: streaming stores."""
    geo = vgeo("vllm_cpu_attn", "LBHNC", "float32", num_layers=4, num_blocks=40, block_size=32, num_heads=8,
               head_size=64)
    ids = random_ids(rng, 40, 40)
    assert 40 * 32 * 8 * 64 * 4 * 2 * 4 > 16 << 20
    check_against_oracle(rng, geo, ids, num_tokens=39 * 32 + 5)
    check_against_oracle(rng, geo, ids[:20], layout=staging_layout(geo, block_size=16, order="NHD",
                                                                   num_heads=4), head_offset=2)


@pytest.mark.parametrize("src", ["vllm_cpu_attn-LBHNC", "vllm_flash_attn-LBNHC", "vllm_flashinfer-BHLNC"])
@pytest.mark.parametrize("dst", ["flash_attn-NHD", "flashinfer-HND", "vllm_cpu_attn-BLHNC",
                                 "vllm_flash_attn-LHBNC"])
def test_round_trip_across_kinds(rng, src, dst):
    """Pack one kind into staging HND/32 and unpack it into another with block 16: the same tokens."""
    def geo_of(spec: str, block: int, blocks: int) -> Geo:
        kind, how = spec.split("-")
        extra = {"layout": how} if kind.startswith("vllm") else {}
        return Geo(kind, how if not extra else "NHD", "bf16", num_layers=2, num_blocks=blocks, block_size=block,
                   num_heads=4, head_size=8, **extra)
    src_geo, dst_geo = geo_of(src, 32, 6), geo_of(dst, 16, 11)
    source, dest = make_cache(rng, src_geo), make_cache(None, dst_geo, fill=POISON)
    tokens = 3 * 32 + 7
    src_ids, dst_ids = random_ids(rng, 6, 4), random_ids(rng, 11, 7)
    layout = StagingLayout(32, 4, TokenOrder.HND)
    staging = pack_both(source, src_ids, layout=layout, num_tokens=tokens)
    unpack_both(staging, dest, dst_ids, layout=layout, num_tokens=tokens)
    t = np.arange(tokens)
    for layer in range(2):
        s = source.canonical(layer)[:, src_ids[t // 32], t % 32]
        d = dest.canonical(layer)[:, dst_ids[t // 16], t % 16]
        assert_bytes_equal(d, s, "tokens after the round trip")


@pytest.mark.parametrize(("kind", "layout"), [("vllm_cpu_attn", "LBHNC"), ("vllm_flash_attn", "BLHNC")])
def test_unpack_touches_only_the_copied_rows(rng, kind, layout):
    """Interleaved planes: V rows sit between K rows, heads and blocks of other layers nearby."""
    geo = vgeo(kind, layout, "fp8", num_heads=4, head_size=5)
    dest = make_cache(None, geo, fill=POISON)
    before = dest.clone()
    ids = random_ids(rng, geo.num_blocks, 3)
    layout_, offset = transform(geo, "head_slice_bs24_flip")
    staging = np.random.default_rng(1).integers(1, 256, staging_nbytes(dest.cache(), 21, layout_), np.uint8)
    unpack(staging, dest.cache(), ids, num_tokens=21, layout=layout_, head_offset=offset)
    heads = slice(offset, offset + layout_.num_heads)
    changed = np.zeros(dest.raws[0].size, bool)
    changed[dest.raws[0] != before.raws[0]] = True
    moved = geo.num_layers * 2 * 21 * layout_.num_heads * geo.row_bytes
    assert changed.sum() <= moved and changed.sum() > 0.9 * moved
    for layer in range(geo.num_layers):
        got = dest.canonical(layer)
        assert (got[:, ids[-1], 5:] == POISON).all() and (got[:, :, :, :offset] == POISON).all()
        assert not (got[:, ids[0], :, heads] == POISON).all()


@st.composite
def vllm_copies(draw):
    kind, layout = draw(st.sampled_from(VLLM_CASES))
    geo = Geo(kind, "NHD", draw(st.sampled_from(list(DTYPES))), layout=layout,
              num_layers=draw(st.integers(1, 3)), num_blocks=draw(st.integers(1, 8)),
              block_size=draw(st.integers(1, 12)), num_heads=draw(st.integers(1, 4)),
              head_size=draw(st.integers(1, 6)))
    heads = draw(st.integers(1, geo.heads))
    head_offset = draw(st.integers(0, geo.heads - heads))
    layout_ = StagingLayout(draw(st.integers(1, 30)), heads, TokenOrder(draw(st.sampled_from(["NHD", "HND"]))))
    ids = draw(st.permutations(range(geo.num_blocks)))[: draw(st.integers(0, geo.num_blocks))]
    tokens = draw(st.integers((len(ids) - 1) * geo.block_size + 1, len(ids) * geo.block_size)) if ids else 0
    return geo, np.array(ids, dtype=np.int64), layout_, head_offset, tokens, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=vllm_copies())
def test_property_native_reference_and_oracle_agree(case):
    geo, ids, layout, head_offset, tokens, seed = case
    check_against_oracle(np.random.default_rng(seed), geo, ids, layout=layout, num_tokens=tokens,
                         head_offset=head_offset)
