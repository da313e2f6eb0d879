"""Paged KV cache layouts as vLLM allocates them, and the geometry the native code needs.

Every supported layout (:mod:`kvshuttle.core.kinds`) is reduced to one canonical strided view per layer,
``[P, N, B, H, D]``: P planes (K and V, or the single MLA latent), N blocks, B tokens per block, H heads,
D elements per head. A (plane, block) *piece* is H x B rows of D contiguous elements at a per-cache
``token_stride`` and ``head_stride``: dense NHD (``[B][H][D]``) and HND (``[H][B][D]``) are special cases,
and the K and V planes of a layer may interleave row by row (vLLM 0.32's CPU_ATTN and FlashAttention
pages). Blocks, planes and layers may sit at any strides that keep every row apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from .._values import is_int
from ..errors import LayoutError, shown
from .arrays import ArrayView, allocation_of, describe
from .blocks import blocks_for_tokens
from .kinds import CacheKind, TokenOrder, cache_kind, canonical, token_order, vllm_kind
from .strides import evenly_spaced, extent, is_dense, merged_regions, nested_disjoint, normalised, token_orders

__all__ = ["CacheGeometry", "CacheKind", "PagedKVCache", "StagingLayout", "TokenOrder", "cache_kind", "token_order"]


@dataclass(frozen=True)
class CacheGeometry:
    """Shape, element type and byte strides shared by every layer of one paged cache.

    Row (plane p, block n, token j, head h) of a layer starts at ``layer base + p * plane_stride +
    n * block_stride + j * token_stride + h * head_stride`` and holds ``head_size`` contiguous elements.
    ``order`` is the order of the larger of token and head stride (tokens outer: NHD).
    """

    kind: CacheKind
    order: TokenOrder
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    dtype: str
    itemsize: int
    device: str
    block_stride: int  # bytes between consecutive blocks of one plane
    plane_stride: int  # bytes from the K plane to the V plane of one layer (0 for MLA)
    token_stride: int  # bytes between consecutive tokens of one head in a block
    head_stride: int  # bytes between consecutive heads of one token in a block

    @property
    def planes_per_layer(self) -> int:
        return self.kind.planes

    @property
    def num_planes(self) -> int:
        return self.num_layers * self.planes_per_layer

    @property
    def row_bytes(self) -> int:
        """Bytes of one head of one token."""
        return self.head_size * self.itemsize

    @property
    def piece_bytes(self) -> int:
        """Bytes of one block of one plane of one layer (the vLLM NIXL descriptor size at TP1)."""
        return self.block_size * self.num_heads * self.row_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers and planes."""
        return self.num_planes * self.num_heads * self.row_bytes

    @property
    def dense_pieces(self) -> bool:
        """Whether every piece is one dense run in ``order`` (then the identity staging layout copies each
        piece with one memcpy)."""
        return is_dense(self.order, self.block_size, self.num_heads, self.token_stride, self.head_stride,
                        self.row_bytes)

    @property
    def layer_dims(self) -> list[tuple[int, int]]:
        """(extent, byte stride) of planes, blocks, tokens and heads of one layer."""
        return [(self.planes_per_layer, self.plane_stride), (self.num_blocks, self.block_stride),
                (self.block_size, self.token_stride), (self.num_heads, self.head_stride)]

    @property
    def layer_span_bytes(self) -> int:
        """Bytes from a layer's first row to the end of its last."""
        return extent(self.layer_dims, self.row_bytes)

    def describe(self) -> str:
        return (
            f"{self.kind.value}/{self.order.value} {self.num_layers} layers x {self.num_blocks} blocks x "
            f"{self.block_size} tokens x {self.num_heads} heads x {self.head_size} {self.dtype}"
        )


@dataclass(frozen=True)
class StagingLayout:
    """How tokens sit in a staging buffer: units of ``block_size`` tokens, ``num_heads`` heads, an order.

    Staging is block-major: ``[unit][layer][plane][piece]`` with each piece ``[block_size][num_heads][D]``
    (NHD) or ``[num_heads][block_size][D]`` (HND), dense whatever the cache's strides. Token t is in unit
    ``t // block_size``.
    """

    block_size: int
    num_heads: int
    order: TokenOrder = TokenOrder.NHD

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", token_order(self.order))
        for name in ("block_size", "num_heads"):
            value = getattr(self, name)
            # 2**31: the native copy's per-piece index math is 32-bit; nothing real comes near it.
            if not (is_int(value) and 0 < value < 2**31):
                raise LayoutError(f"a staging layout needs an integer {name} in [1, 2**31), got {shown(value)}")
            object.__setattr__(self, name, int(value))

    @classmethod
    def like(cls, geometry: CacheGeometry, num_heads: int | None = None) -> StagingLayout:
        """The identity layout of a cache (optionally a head slice of it): one memcpy per piece when the
        cache's pieces are dense, else the staging order closest to the cache's (its ``order``)."""
        return cls(geometry.block_size, num_heads or geometry.num_heads, geometry.order)

    def num_units(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def nbytes(self, geometry: CacheGeometry, num_tokens: int) -> int:
        """Staging bytes needed for ``num_tokens`` tokens of a cache with this geometry."""
        piece = self.block_size * self.num_heads * geometry.row_bytes
        return self.num_units(num_tokens) * geometry.num_planes * piece


def _geometry(kind: CacheKind, first: ArrayView, num_layers: int, order: TokenOrder | str | None) -> CacheGeometry:
    """The geometry of layers like ``first``; LayoutError when its rows are not contiguous or overlap."""
    shape, strides = canonical(first, kind)
    if min(shape[1:]) <= 0:
        raise LayoutError(f"empty cache dimension in shape {first.shape}")
    planes, num_blocks, block_size, num_heads, head_size = shape
    row = head_size * first.itemsize
    if head_size > 1 and strides[4] != first.itemsize:
        raise LayoutError(
            f"the elements of one head must be contiguous; got byte strides {strides} for shape {shape} "
            "(a view with a step over the head dim? pass the tensor vLLM allocated)"
        )
    orders = token_orders(block_size, num_heads, strides[2], strides[3])
    piece_order = orders[0] if order is None else token_order(order)
    if piece_order not in orders:
        raise LayoutError(f"the strides say {orders[0].value}, but order={piece_order.value}")
    token_stride, head_stride = normalised(piece_order, block_size, num_heads, strides[2], strides[3], row)
    geometry = CacheGeometry(
        kind=kind, order=piece_order, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
        num_heads=num_heads, head_size=head_size, dtype=first.dtype, itemsize=first.itemsize,
        device=first.device, block_stride=strides[1], plane_stride=strides[0] if planes > 1 else 0,
        token_stride=token_stride, head_stride=head_stride,
    )
    if not nested_disjoint(geometry.layer_dims, row):
        raise LayoutError(f"blocks, planes or rows overlap: byte strides {strides} (planes, blocks, tokens, "
                          f"heads, elements) for shape {shape}; reversed or overlapping views are not caches")
    return geometry


def _check_layers_apart(geometry: CacheGeometry, views: Sequence[ArrayView]) -> None:
    """LayoutError when two layers share a byte. Layers whose spans interleave (vLLM's block-major layouts,
    BLHNC: every layer's page of block n sits in block n's stretch) must be evenly spaced views of one
    pattern whose rows stay apart."""
    size = geometry.layer_span_bytes
    spans = sorted((v.address, v.address + size) for v in views)
    if all(end <= start for (_, end), (start, _) in pairwise(spans)):
        return
    step = evenly_spaced([v.address for v in views])
    dims = [*geometry.layer_dims, (len(views), step or 0)]
    if step is None or not nested_disjoint(dims, geometry.row_bytes):
        raise LayoutError("two layers share memory; pass each layer's own cache tensor once (vLLM: the "
                          "per-layer views register_kv_caches received)")


@dataclass(frozen=True)
class PagedKVCache:
    """The per-layer caches of one worker, validated, with their plane base addresses.

    Build it once (caches are allocated once) with :meth:`from_arrays` (or :meth:`from_vllm`); pack/unpack
    take it.
    """

    geometry: CacheGeometry
    plane_bases: npt.NDArray[np.uint64]  # [num_layers * planes_per_layer], plane-major within a layer
    layers: tuple[ArrayView, ...]

    @classmethod
    def from_arrays(
        cls, layers: Sequence[Any], kind: CacheKind | str, order: TokenOrder | str | None = None
    ) -> PagedKVCache:
        """Validate per-layer arrays (numpy, torch CPU/CUDA, cupy) of one kind; derive the geometry.

        ``order`` is read from the strides (vLLM's HND caches are permuted views); pass it to assert it.
        """
        kind = cache_kind(kind)
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise LayoutError(f"layers must be a sequence of per-layer arrays, got {type(layers).__name__}")
        layers = list(layers)
        if len(layers) == 0:
            raise LayoutError("need at least one layer")
        views = [describe(x) for x in layers]
        first = views[0]
        geometry = _geometry(kind, first, len(views), order)
        for index, view in enumerate(views[1:], start=1):
            got = (view.shape, view.strides, view.dtype, view.device)
            want = (first.shape, first.strides, first.dtype, first.device)
            if got != want:
                raise LayoutError(
                    f"layer {index} differs from layer 0: shape/strides/dtype/device {got} vs {want}"
                )
        _check_layers_apart(geometry, views)
        offsets = np.arange(geometry.planes_per_layer, dtype=np.uint64) * np.uint64(geometry.plane_stride)
        bases = (np.array([v.address for v in views], dtype=np.uint64)[:, None] + offsets).reshape(-1)
        return cls(geometry=geometry, plane_bases=bases, layers=tuple(views))

    @classmethod
    def from_vllm(cls, kv_caches: Mapping[str, Any], backend: CacheKind | str,
                  order: TokenOrder | str | None = None) -> PagedKVCache:
        """The cache vLLM 0.32 hands ``register_kv_caches``: ``{layer name: [B, H, N, C] view}`` in layer order.

        ``backend`` is the attention backend's name (``"CPU_ATTN"``, ``"FLASH_ATTN"``, ``"FLASHINFER"``) or a
        ``vllm_*`` kind. Layers that share one tensor (vLLM's cross-layer KV sharing) are kept once.
        """
        kind = vllm_kind(backend)
        if not isinstance(kv_caches, Mapping):
            raise LayoutError(f"kv_caches must be vLLM's dict of layer name -> per-layer view, got "
                              f"{type(kv_caches).__name__}")
        index = vllm_layer_index(kv_caches)
        first = {k: name for name, k in reversed(index.items())}  # each layer's first name
        return cls.from_arrays([kv_caches[first[k]] for k in range(len(first))], kind, order)

    @property
    def is_cuda(self) -> bool:
        return self.geometry.device.startswith("cuda")

    def layer_span(self, layer: int) -> tuple[int, int]:
        """(address, bytes) from layer ``layer``'s first row to the end of its last."""
        return self.layers[layer].address, self.geometry.layer_span_bytes

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of the memory to register with a transfer engine, without overlap: each layer's
        span, merged where spans overlap (layers interleaved per block) or touch inside one allocation."""
        size = self.geometry.layer_span_bytes
        return merged_regions([(v.address, v.address + size, allocation_of(v.owner)) for v in self.layers])


def vllm_layer_index(kv_caches: Mapping[str, Any]) -> dict[str, int]:
    """Each of vLLM's layer names -> its layer's index in :meth:`PagedKVCache.from_vllm` (names whose views are one
    tensor, vLLM's cross-layer KV sharing, share an index). What ``wait_for_layer_load(layer_name)`` waits on."""
    index: dict[str, int] = {}
    layers: dict[tuple[Any, ...], int] = {}
    for name, tensor in kv_caches.items():
        view = describe(tensor)
        index[name] = layers.setdefault((view.address, view.shape, view.strides, view.dtype), len(layers))
    return index
