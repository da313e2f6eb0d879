"""vLLM 0.32 caches in the layout model: geometry read from the ``[N, H, B, 2D]`` views of every KVCacheLayout,
``PagedKVCache.from_vllm``, the shared allocation (one region, layers interleaved per block), named errors."""

from __future__ import annotations

import numpy as np
import pytest

import vllm_views
from conftest import VLLM_CASES, Geo, make_cache, random_bytes
from kvshuttle import CacheKind, LayoutError, PagedKVCache, StagingLayout, TokenOrder
from kvshuttle.core.kinds import VLLM_BACKENDS, vllm_kind

CASE_IDS = [f"{k.removeprefix('vllm_')}-{lay}" for k, lay in VLLM_CASES]
CPU_SHAPE = Geo("vllm_cpu_attn", dtype="float32", num_layers=3, num_blocks=5, block_size=32, num_heads=8,
                head_size=64, layout="LBHNC")


@pytest.mark.parametrize("layout", list(vllm_views.LAYOUTS))
def test_views_are_vllms(rng, layout):
    """The test caches' views have the offsets and strides vLLM 0.32's create_kv_cache_views produced."""
    host = make_cache(rng, CPU_SHAPE.with_(kind="vllm_flash_attn", layout=layout))
    offsets, strides = vllm_views.RECORDED[layout]
    base = host.raws[0].ctypes.data
    assert tuple(x.ctypes.data - base for x in host.layers) == offsets
    assert all(x.shape == (5, 8, 32, 128) and x.strides == tuple(4 * s for s in strides) for x in host.layers)


def test_observed_cpu_geometry(rng):
    """fp32, 8 KV heads, head 64, block 32, LBHNC: strides [32768, 4096, 128, 1], 128 KiB per block per layer."""
    host = make_cache(rng, CPU_SHAPE)
    assert host.layers[0].strides == (4 * 32768, 4 * 4096, 4 * 128, 4)
    g = host.cache().geometry
    assert (g.kind, g.order, g.num_layers, g.num_blocks, g.block_size, g.num_heads, g.head_size) == (
        CacheKind.VLLM_CPU_ATTN, TokenOrder.HND, 3, 5, 32, 8, 64)
    assert (g.block_stride, g.plane_stride, g.token_stride, g.head_stride) == (128 << 10, 32 * 256, 256, 64 << 8)
    assert g.piece_bytes == 64 << 10 and not g.dense_pieces
    assert StagingLayout.like(g) == StagingLayout(32, 8, TokenOrder.HND)


@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=CASE_IDS)
def test_geometry(rng, kind, layout):
    geo = Geo(kind, dtype="bf16", num_layers=3, num_blocks=5, block_size=4, num_heads=3, head_size=6,
              layout=layout)
    host = make_cache(rng, geo)
    cache = host.cache(order=None)
    g, row, item = cache.geometry, 12, 2
    strides = vllm_views.byte_strides(geo.vllm_byte_shape, layout)  # [L, N, H, B, C] bytes
    assert g.kind is CacheKind(kind) and g.order is TokenOrder(vllm_views.token_order(layout))
    assert (g.num_layers, g.num_blocks, g.block_size, g.num_heads, g.head_size) == (3, 5, 4, 3, 6)
    assert (g.dtype, g.itemsize, g.row_bytes) == ("bfloat16", item, row)
    assert (g.block_stride, g.head_stride) == (strides[1], strides[2])
    if kind == "vllm_cpu_attn":  # K rows then V rows of each head: token stride one row, V after B rows
        assert (g.token_stride, g.plane_stride) == (row, 4 * row)
    else:  # K then V inside each token's content
        assert (g.token_stride, g.plane_stride) == (strides[3], row)
    assert not g.dense_pieces
    base = host.raws[0].ctypes.data
    assert cache.regions() == [(base, host.raws[0].nbytes)]  # one allocation, registered once
    want = [x.ctypes.data + p * g.plane_stride for x in host.layers for p in range(2)]
    assert cache.plane_bases.tolist() == want


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "flash_attn", "vllm_cpu_attn",
                                     CacheKind.VLLM_FLASHINFER])
def test_from_vllm(rng, backend):
    kind = vllm_kind(backend)
    host = make_cache(rng, Geo(kind.value, num_layers=3, layout="LBHNC"))
    kv_caches = {f"model.layers.{i}.self_attn.attn": x for i, x in enumerate(host.layers)}
    cache = PagedKVCache.from_vllm(kv_caches, backend)
    assert cache.geometry == host.cache().geometry and cache.geometry.kind is kind
    assert cache.plane_bases.tolist() == host.cache().plane_bases.tolist()


def test_from_vllm_torch_and_shared_layers(rng):
    """Torch views as vLLM hands them over; a layer sharing another's KV (the same tensor) is kept once."""
    pytest.importorskip("torch")
    host = make_cache(rng, Geo("vllm_flash_attn", "NHD", "bf16", num_layers=3, layout="BLNHC"),
                      framework="torch")
    kv_caches = {"l0": host.layers[0], "l1": host.layers[1], "l2": host.layers[2], "l3": host.layers[1]}
    cache = PagedKVCache.from_vllm(kv_caches, "FLASH_ATTN")
    assert cache.geometry.num_layers == 3 and cache.geometry.order is TokenOrder.NHD
    assert cache.regions() == [(host.raws[0].ctypes.data, host.raws[0].nbytes)]


@pytest.mark.parametrize(("args", "fragment"), [
    (("TRITON_ATTN",), "unknown vLLM attention backend"),
    (("AMX_MLA",), "unknown vLLM attention backend"),
    (("flash_attn_diffkv",), "unknown vLLM attention backend"),
    ((3,), "unknown vLLM attention backend"),
])
def test_from_vllm_bad_backend(rng, args, fragment):
    host = make_cache(rng, Geo("vllm_cpu_attn"))
    with pytest.raises(LayoutError, match=fragment):
        PagedKVCache.from_vllm(dict(enumerate(host.layers)), *args)  # type: ignore[arg-type]


def test_from_vllm_needs_the_dict(rng):
    host = make_cache(rng, Geo("vllm_cpu_attn"))
    with pytest.raises(LayoutError, match="dict"):
        PagedKVCache.from_vllm(host.layers, "CPU_ATTN")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="at least one layer"):
        PagedKVCache.from_vllm({}, "CPU_ATTN")


def test_backend_names():
    mla = ("CPU_MLA", "FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASH_ATTN_MLA")
    expected = {"CPU_ATTN": CacheKind.VLLM_CPU_ATTN, "FLASH_ATTN": CacheKind.VLLM_FLASH_ATTN,
                "FLASHINFER": CacheKind.VLLM_FLASHINFER, **dict.fromkeys(mla, CacheKind.MLA)}
    assert expected == VLLM_BACKENDS
    assert all(k.is_vllm_view and k.planes == 2 for k in VLLM_BACKENDS.values() if k is not CacheKind.MLA)


# ---------------------------------------------------------------------------------------------- errors
def _buffer_views(rng, shape, strides, dtype=np.float16, count=1, step=0):
    buf = random_bytes(rng, 1 << 16).view(dtype)
    return [np.lib.stride_tricks.as_strided(buf[i * step:], shape=shape, strides=strides) for i in range(count)]


@pytest.mark.parametrize("kind", ["vllm_cpu_attn", "vllm_flash_attn", "vllm_flashinfer"])
def test_bad_views_are_named_errors(rng, kind):
    with pytest.raises(LayoutError, match=r"\[B, H, N, C\]"):
        PagedKVCache.from_arrays([np.ones((2, 4, 4, 2, 8), np.float16)], kind)
    with pytest.raises(LayoutError, match="even"):
        PagedKVCache.from_arrays([np.ones((4, 2, 4, 7), np.float16)], kind)
    with pytest.raises(LayoutError, match="contiguous"):  # a step over C
        PagedKVCache.from_arrays([np.ones((4, 2, 4, 16), np.float16)[..., ::2]], kind)
    with pytest.raises(LayoutError, match="overlap"):  # blocks on top of each other
        PagedKVCache.from_arrays(_buffer_views(rng, (4, 2, 4, 16), (64, 128, 32, 2)), kind)


def test_cpu_attn_needs_tokens_and_content_together(rng):
    """CPU_ATTN reads each (block, head) as [2N, D]: LBNHC views (heads between tokens) are not CPU caches."""
    host = make_cache(rng, Geo("vllm_flash_attn", layout="LBNHC"))
    with pytest.raises(LayoutError, match="CPU_ATTN"):
        PagedKVCache.from_arrays(host.layers, "vllm_cpu_attn")
    PagedKVCache.from_arrays(host.layers, "vllm_flash_attn")


@pytest.mark.parametrize("layout", ["BLHNC", "BHLNC"])
def test_layers_interleaved_per_block_share_no_row(rng, layout):
    """Block-major layouts: layer spans overlap, rows do not; a view shifted into another layer's rows does."""
    geo = Geo("vllm_flash_attn", num_layers=3, layout=layout)
    host = make_cache(rng, geo)
    PagedKVCache.from_arrays(host.layers, geo.kind)
    with pytest.raises(LayoutError, match="share memory"):
        PagedKVCache.from_arrays([host.layers[0], host.layers[1], host.layers[1]], geo.kind)
    row = geo.row_bytes
    shifted = np.lib.stride_tricks.as_strided(host.raws[0][row:].view(geo.np_dtype), host.layers[0].shape,
                                              host.layers[0].strides)
    with pytest.raises(LayoutError, match="share memory"):
        PagedKVCache.from_arrays([host.layers[0], shifted], geo.kind)


def test_uneven_interleaved_layers_are_refused(rng):
    """Layers whose spans overlap must be evenly spaced views of one pattern to be checked row by row: every
    other layer of a BLHNC cache is, layers 0, 1 and 3 are not (a conservative refusal, never a vLLM case)."""
    host = make_cache(rng, Geo("vllm_flash_attn", num_layers=4, layout="BLHNC"))
    layers = host.layers
    PagedKVCache.from_arrays([layers[0], layers[2]], "vllm_flash_attn")
    with pytest.raises(LayoutError, match="share memory"):
        PagedKVCache.from_arrays([layers[0], layers[1], layers[3]], "vllm_flash_attn")
