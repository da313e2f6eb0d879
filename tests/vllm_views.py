"""vLLM 0.32's KV cache tensors, rebuilt for the tests: one flat allocation, one ``[B, H, N, C]`` view per layer.

``allocate_kv_cache`` (vllm/v1/worker/utils.py) makes one int8 buffer; ``create_kv_cache_views``
(vllm/v1/kv_cache_interface.py) views it as ``[L, B, H, N, C]`` bytes with strides from the ``KVCacheLayout``
stride order (``compute_layout_strides``), takes layer ``l`` and ``.view(dtype)``s it. C is ``2 * head_size``
elements. K and V sit in C differently per backend (the oracles below spell it out from vLLM's code):

* CPU_ATTN (cpu_attn.py): ``kv_cache.view(B, H, 2N, D).chunk(2, dim=2)``: per (block, head) N rows of K,
  then N rows of V;
* FLASH_ATTN (flash_attn.py) and FLASHINFER (flashinfer.py, not NVFP4):
  ``kv_cache.transpose(1, 2).split(D, dim=-1)``: per (block, head, token) D elements of K, then D of V.

Letters follow kvshuttle here: N blocks, B tokens per block (vLLM calls them B and N).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]

# KVCacheLayout: the physical order of the logical axes [L, B, H, N, C] (vllm/v1/kv_cache_layout.py).
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
# CPU_ATTN views each (block, head) as [2N, D]: tokens and content must be adjacent (vLLM itself supports only
# LBHNC on CPU; the others with N and C adjacent are as readable).
CPU_LAYOUTS = ("LBHNC", "LHBNC", "BLHNC", "BHLNC")
VLLM_KINDS = ("vllm_cpu_attn", "vllm_flash_attn", "vllm_flashinfer")

# Recorded from vLLM 0.32's create_kv_cache_views (fp32, 3 layers, 5 blocks, 8 heads, block 32, head 64):
# layout -> (byte offset of each layer's view, strides in elements). Shape [5, 8, 32, 128] everywhere.
RECORDED = {
    "LBHNC": ((0, 655360, 1310720), (32768, 4096, 128, 1)),
    "LBNHC": ((0, 655360, 1310720), (32768, 128, 1024, 1)),
    "LHBNC": ((0, 655360, 1310720), (4096, 20480, 128, 1)),
    "BLHNC": ((0, 131072, 262144), (98304, 4096, 128, 1)),
    "BLNHC": ((0, 131072, 262144), (98304, 128, 1024, 1)),
    "BHLNC": ((0, 16384, 32768), (98304, 12288, 128, 1)),
}


def token_order(layout: str) -> str:
    """The block order of a layout's views: heads outside tokens (H before N) is HND."""
    order = LAYOUTS[layout]
    return "HND" if order.index(2) < order.index(3) else "NHD"


def byte_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """compute_layout_strides: byte strides of logical [L, B, H, N, C-bytes] for a dense buffer."""
    strides = [0] * 5
    current = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = current
        current *= shape[dim]
    return tuple(strides)


def logical_byte_shape(num_layers: int, num_blocks: int, heads: int, block_size: int, row_bytes: int
                       ) -> tuple[int, ...]:
    return (num_layers, num_blocks, heads, block_size, 2 * row_bytes)


def numpy_byte_views(buf: Bytes, shape: tuple[int, ...], layout: str) -> list[Bytes]:
    """The per-layer uint8 views ``[B, H, N, C*itemsize]`` of ``buf`` (create_kv_cache_views before .view)."""
    view = np.lib.stride_tricks.as_strided(buf, shape=shape, strides=byte_strides(shape, layout))
    return [view[layer] for layer in range(shape[0])]


def torch_views(buf: Any, shape: tuple[int, ...], layout: str, dtype: Any) -> list[Any]:
    """The same in torch (CPU or CUDA uint8 ``buf``), exactly as vLLM builds them."""
    import torch

    view = torch.as_strided(buf, size=shape, stride=byte_strides(shape, layout))
    return [view[layer].view(dtype) for layer in range(shape[0])]


def cupy_views(buf: Any, shape: tuple[int, ...], layout: str, dtype: Any) -> list[Any]:
    """The same over a cupy uint8 ``buf`` (strided straight in ``dtype``: cupy views need contiguity)."""
    from cupy.lib.stride_tricks import as_strided

    itemsize = np.dtype(dtype).itemsize
    strides = (*byte_strides(shape, layout)[:4], itemsize)
    view = as_strided(buf.view(dtype), shape=(*shape[:4], shape[4] // itemsize), strides=strides)
    return [view[layer] for layer in range(shape[0])]


def canonical_planes(x: Bytes, kind: str, head_size: int, itemsize: int) -> Bytes:
    """``[2, N, B, H, D, itemsize]`` bytes of one layer's view ``x`` (uint8 ``[N, H, B, C*itemsize]``), a view
    (writes land in the cache), K and V located the way the backend's attention code finds them."""
    blocks, heads, tokens, content = x.shape
    row = head_size * itemsize
    assert content == 2 * row and x.strides[3] == 1
    if kind == "vllm_cpu_attn":
        # kv_cache.view(B, H, 2N, D): each (block, head) is 2N rows of D; chunk(2, dim=2): K rows, V rows.
        assert tokens == 1 or x.strides[2] == content, "CPU_ATTN needs each head's [N, C] contiguous"
        rows = np.lib.stride_tricks.as_strided(x, shape=(blocks, heads, 2 * tokens, row),
                                               strides=(x.strides[0], x.strides[1], row, 1))
        k, v = rows[:, :, :tokens], rows[:, :, tokens:]
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [N, B, H, row]
    else:
        # kv_cache.transpose(1, 2).split(D, dim=-1): per token, D elements of K then D of V.
        per_token = x.transpose(0, 2, 1, 3)  # [N, B, H, C]
        k, v = per_token[..., :row], per_token[..., row:]
    plane = v.ctypes.data - k.ctypes.data
    return np.lib.stride_tricks.as_strided(k, shape=(2, *k.shape[:3], head_size, itemsize),
                                           strides=(plane, *k.strides[:3], itemsize, 1))
