"""Cache kinds: how one attention backend's per-layer tensor maps onto the canonical strided form.

Every kind reduces a layer to a shape ``[P, N, B, H, D]`` (planes, blocks, tokens per block, heads, head size)
and byte strides: plane ``p``, block ``n``, token ``j``, head ``h`` is a *row* of ``D`` contiguous elements at
``base + p * plane_stride + n * block_stride + j * token_stride + h * head_stride``.

=================== ======================== =============================================================
kind                per-layer tensor         K and V
=================== ======================== =============================================================
``flash_attn``      ``[2, N, B, H, D]``      two regions (vLLM before 0.32)
``flashinfer``      ``[N, 2, B, H, D]``      K piece then V piece inside each block (vLLM before 0.32)
``mla``             ``[N, B, D]``            one latent plane, no heads (vLLM 0.32: ``[N, 1, B, D]``, CPU_MLA)
``vllm_cpu_attn``   ``[N, H, B, 2D]``        vLLM 0.32 CPU_ATTN: per (block, head), a K region then a V region
``vllm_flash_attn`` ``[N, H, B, 2D]``        vLLM 0.32 FLASH_ATTN: per (block, head, token), D of K, D of V
``vllm_flashinfer`` ``[N, H, B, 2D]``        vLLM 0.32 FLASHINFER (not NVFP4): the same bytes as FLASH_ATTN
=================== ======================== =============================================================

CPU_ATTN's K region is column-major (``[D, B]``: vLLM's CPU kernels write K transposed for their vector
loads) while V is row-major: the canonical rows below describe where each region lies, not what a K row holds,
so such caches only move as whole blocks of one size between CPU_ATTN caches (``CacheKind.whole_blocks_only``).

vLLM 0.32 names the per-layer view ``[B, H, N, C]`` (blocks, heads, tokens, content); its strides follow the
``KVCacheLayout`` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC), and the token order is read from them. An MLA
layer's view has one head slot and C is the latent (``kv_lora_rank + qk_rope_head_dim``: 512 + 64 for
DeepSeek), which the attention layer binds as ``squeeze(1)``: kind ``mla`` takes either shape.
"""

from __future__ import annotations

import enum

from ..errors import LayoutError, shown
from .arrays import ArrayView

Shape = tuple[int, ...]
Strides = tuple[int, ...]


class CacheKind(str, enum.Enum):
    """Which attention backend's tensor shape the per-layer arrays have (see the module table)."""

    FLASH_ATTN = "flash_attn"  # [2, num_blocks, block_size, num_kv_heads, head_size]
    FLASHINFER = "flashinfer"  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    MLA = "mla"  # [num_blocks, block_size, latent], or vLLM 0.32's [num_blocks, 1, block_size, latent]
    VLLM_CPU_ATTN = "vllm_cpu_attn"  # vLLM 0.32 [num_blocks, num_kv_heads, block_size, 2 * head_size]
    VLLM_FLASH_ATTN = "vllm_flash_attn"  # vLLM 0.32 [num_blocks, num_kv_heads, block_size, 2 * head_size]
    VLLM_FLASHINFER = "vllm_flashinfer"  # vLLM 0.32, as vllm_flash_attn

    @property
    def planes(self) -> int:
        """Planes per layer: K and V, or the one MLA latent."""
        return 1 if self is CacheKind.MLA else 2

    @property
    def whole_blocks_only(self) -> bool:
        """Whether a block's bytes are opaque per (block, head): vLLM's CPU attention stores K column-major
        inside a block ([head_size, block_size], ISA-specific), so token rows are not K rows. Such caches move
        byte-exactly only as whole blocks of the same size between caches of the same kind."""
        return self is CacheKind.VLLM_CPU_ATTN

    @property
    def is_vllm_view(self) -> bool:
        """Whether layers are vLLM 0.32's ``[B, H, N, C]`` views (K and V packed in the content dim C)."""
        return self in _VLLM_KINDS


class TokenOrder(str, enum.Enum):
    """Order inside a block: tokens then heads (NHD) or heads then tokens (HND).

    For a cache it is the order of the larger stride (tokens outer: NHD); rows need not be adjacent.
    """

    NHD = "NHD"
    HND = "HND"


_VLLM_KINDS = (CacheKind.VLLM_CPU_ATTN, CacheKind.VLLM_FLASH_ATTN, CacheKind.VLLM_FLASHINFER)

# vLLM 0.32 attention backend names (AttentionBackend.get_name()) -> kind: only backends whose cache bytes were read
# from vLLM's code. Every MLA backend below shares one cache: the common MLA layer binds the [N, 1, B, D] view as
# [N, B, D] and its update writes token slot s's latent (or FlashMLA's 656-byte fp8_ds_mla cell) at row s
# (concat_and_cache_mla on GPUs; CPU_MLA's own copy). vllm-cpu's AMX_MLA writes with a kernel of its own
# (amx_mla_concat_and_cache) whose bytes were not read: refused, as the sparse MLA backends and their indexers.
VLLM_BACKENDS = {
    "CPU_ATTN": CacheKind.VLLM_CPU_ATTN,
    "FLASH_ATTN": CacheKind.VLLM_FLASH_ATTN,
    "FLASHINFER": CacheKind.VLLM_FLASHINFER,
    "CPU_MLA": CacheKind.MLA,
    **dict.fromkeys(("FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASH_ATTN_MLA"), CacheKind.MLA),
}

_LOGICAL_NDIM = {CacheKind.FLASH_ATTN: (5,), CacheKind.FLASHINFER: (5,), CacheKind.MLA: (3, 4),
                 **dict.fromkeys(_VLLM_KINDS, (4,))}
_SHAPES = {CacheKind.FLASH_ATTN: "[2, N, B, H, D]", CacheKind.FLASHINFER: "[N, 2, B, H, D]",
           CacheKind.MLA: "[N, B, D] (or vLLM 0.32's view [N, 1, B, D])",
           **dict.fromkeys(_VLLM_KINDS, "vLLM 0.32's per-layer view [B, H, N, C]")}


def cache_kind(value: CacheKind | str) -> CacheKind:
    try:
        return CacheKind(value)
    except (ValueError, TypeError):
        raise LayoutError(f"unknown cache kind {shown(value)}; use one of {[k.value for k in CacheKind]}") from None


def token_order(value: TokenOrder | str) -> TokenOrder:
    try:
        return TokenOrder(value)
    except (ValueError, TypeError):
        raise LayoutError(f"unknown token order {shown(value)}; use 'NHD' or 'HND'") from None


def vllm_kind(backend: CacheKind | str) -> CacheKind:
    """The kind of vLLM 0.32 views for an attention backend name (``"CPU_ATTN"``...) or one of those kinds."""
    if isinstance(backend, str) and backend.upper() in VLLM_BACKENDS:
        return VLLM_BACKENDS[backend.upper()]
    try:
        kind = CacheKind(backend)
    except (ValueError, TypeError):
        kind = None
    if kind is None or kind not in VLLM_BACKENDS.values():
        raise LayoutError(f"unknown vLLM attention backend {shown(backend)}: kvshuttle does not know how its KV "
                          f"cache lies in memory, so it cannot move it; supported: {list(VLLM_BACKENDS)} (select "
                          "one with vLLM's --attention-backend, or serve this model without kvshuttle)")
    return kind


def canonical(view: ArrayView, kind: CacheKind) -> tuple[Shape, Strides]:
    """Shape ``[P, N, B, H, D]`` and byte strides of one layer; LayoutError when the view is not ``kind``."""
    shape, strides, item = view.shape, view.strides, view.itemsize
    if len(shape) not in _LOGICAL_NDIM[kind]:
        ndims = " or ".join(map(str, _LOGICAL_NDIM[kind]))
        raise LayoutError(f"a {kind.value} layer is {_SHAPES[kind]}: it must have {ndims} dimensions, got shape "
                          f"{shape}")
    if kind is CacheKind.FLASH_ATTN:
        if shape[0] != 2:
            raise LayoutError(f"a flash_attn layer is [2, N, B, H, D]; got shape {shape}")
        return shape, strides
    if kind is CacheKind.FLASHINFER:
        if shape[1] != 2:
            raise LayoutError(f"a flashinfer layer is [N, 2, B, H, D]; got shape {shape}")
        order = (1, 0, 2, 3, 4)
        return tuple(shape[i] for i in order), tuple(strides[i] for i in order)
    if kind is CacheKind.MLA:
        if len(shape) == 4:  # vLLM 0.32's [B, H, N, C] view of an MLA layer: one head slot, C the latent
            if shape[1] != 1:
                raise LayoutError(f"an mla layer viewed as [N, 1, B, D] has one head slot (the latent is shared by "
                                  f"every head); got shape {shape}")
            shape, strides = (shape[0], shape[2], shape[3]), (strides[0], strides[2], strides[3])
        n, b, d = shape
        return (1, n, b, 1, d), (0, strides[0], strides[1], d * item, strides[2])
    return _vllm_canonical(view, kind)


def _vllm_canonical(view: ArrayView, kind: CacheKind) -> tuple[Shape, Strides]:
    """vLLM 0.32 ``[B, H, N, C]`` with ``C = 2 * D``: K and V planes as strided rows of one page."""
    (blocks, heads, tokens, content), (s_block, s_head, s_token, s_content) = view.shape, view.strides
    item = view.itemsize
    if content % 2 or content == 0:
        raise LayoutError(f"a {kind.value} layer's content dim C packs K and V (C = 2 * head_size), so it must "
                          f"be even and positive; got shape {view.shape}")
    head_size = content // 2
    if s_content != item:
        raise LayoutError(f"a {kind.value} layer's content dim C must be contiguous (stride {item} bytes), got "
                          f"byte strides {view.strides}; pass the views vLLM gave register_kv_caches")
    shape = (2, blocks, tokens, heads, head_size)
    if kind is CacheKind.VLLM_CPU_ATTN:
        # cpu_attn views [B, H, N, 2D] as [B, H, 2N, D] and chunks dim 2: each head's [N, C] must be one run.
        if tokens > 1 and s_token != content * item:
            raise LayoutError(
                f"CPU_ATTN reads each (block, head) as [2N, D], so tokens and content must be contiguous "
                f"(KVCacheLayout LBHNC, LHBNC, BLHNC or BHLNC); got byte strides {view.strides} for shape "
                f"{view.shape}"
            )
        return shape, (tokens * head_size * item, s_block, head_size * item, s_head, item)
    # FLASH_ATTN / FLASHINFER: (B, H, N, 2D) -> transpose(1, 2).split(D, dim=-1): K then V inside C.
    return shape, (head_size * item, s_block, s_token, s_head, item)
