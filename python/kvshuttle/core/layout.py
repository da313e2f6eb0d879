"""Paged KV cache layouts as vLLM allocates them, and the geometry the native code needs.

Every supported layout is reduced to one canonical strided view per layer, ``[P, N, B, H, D]``:
P planes (K and V, or the single MLA latent), N blocks, B tokens per block, H heads, D elements per head.
Inside one (plane, block) *piece* the bytes must be dense, in NHD (``[B][H][D]``) or HND (``[H][B][D]``)
order; blocks and planes may sit at any non-overlapping stride (FlashAttention keeps K and V in separate
regions, FlashInfer interleaves them per block).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._values import is_int
from ..errors import LayoutError, shown
from .arrays import ArrayView, describe
from .blocks import blocks_for_tokens


class CacheKind(str, enum.Enum):
    """Which attention backend's tensor shape the per-layer arrays have."""

    FLASH_ATTN = "flash_attn"  # [2, num_blocks, block_size, num_kv_heads, head_size]
    FLASHINFER = "flashinfer"  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    MLA = "mla"  # [num_blocks, block_size, head_size]


class TokenOrder(str, enum.Enum):
    """Physical order inside a block: tokens then heads (NHD) or heads then tokens (HND)."""

    NHD = "NHD"
    HND = "HND"


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


_LOGICAL_NDIM = {CacheKind.FLASH_ATTN: 5, CacheKind.FLASHINFER: 5, CacheKind.MLA: 3}


@dataclass(frozen=True)
class CacheGeometry:
    """Shape, element type and strides shared by every layer of one paged cache."""

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

    @property
    def planes_per_layer(self) -> int:
        return 1 if self.kind is CacheKind.MLA else 2

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

    def describe(self) -> str:
        return (
            f"{self.kind.value}/{self.order.value} {self.num_layers} layers x {self.num_blocks} blocks x "
            f"{self.block_size} tokens x {self.num_heads} heads x {self.head_size} {self.dtype}"
        )


@dataclass(frozen=True)
class StagingLayout:
    """How tokens sit in a staging buffer: units of ``block_size`` tokens, ``num_heads`` heads, an order.

    Staging is block-major: ``[unit][layer][plane][piece]`` with each piece ``[block_size][num_heads][D]``
    (NHD) or ``[num_heads][block_size][D]`` (HND). Token t is in unit ``t // block_size``.
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
        """The identity layout of a cache (optionally a head slice of it): one memcpy per piece."""
        return cls(geometry.block_size, num_heads or geometry.num_heads, geometry.order)

    def num_units(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def nbytes(self, geometry: CacheGeometry, num_tokens: int) -> int:
        """Staging bytes needed for ``num_tokens`` tokens of a cache with this geometry."""
        piece = self.block_size * self.num_heads * geometry.row_bytes
        return self.num_units(num_tokens) * geometry.num_planes * piece


def _canonical(view: ArrayView, kind: CacheKind) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and byte strides of one layer as [P, N, B, H, D]."""
    if len(view.shape) != _LOGICAL_NDIM[kind]:
        raise LayoutError(
            f"a {kind.value} layer must have {_LOGICAL_NDIM[kind]} dimensions, got shape {view.shape}"
        )
    shape, strides = view.shape, view.strides
    if kind is CacheKind.FLASH_ATTN:
        if shape[0] != 2:
            raise LayoutError(f"a flash_attn layer is [2, N, B, H, D]; got shape {shape}")
        return shape, strides
    if kind is CacheKind.FLASHINFER:
        if shape[1] != 2:
            raise LayoutError(f"a flashinfer layer is [N, 2, B, H, D]; got shape {shape}")
        order = (1, 0, 2, 3, 4)
        return tuple(shape[i] for i in order), tuple(strides[i] for i in order)
    n, b, d = shape
    return (1, n, b, 1, d), (0, strides[0], strides[1], d * view.itemsize, strides[2])


def _piece_orders(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> list[TokenOrder]:
    """The orders (NHD, HND) a dense piece is consistent with; LayoutError when it is not dense.

    With one head or one token per block both orders describe the same bytes.
    """
    _, _, b, h, d = shape
    row = d * itemsize
    orders = []
    if strides[4] == itemsize or d == 1:
        if (strides[3] == row or h == 1) and (strides[2] == h * row or b == 1):
            orders.append(TokenOrder.NHD)
        if (strides[2] == row or b == 1) and (strides[3] == b * row or h == 1):
            orders.append(TokenOrder.HND)
    if not orders:
        raise LayoutError(
            f"blocks must be dense in NHD or HND order; got byte strides {strides} for shape {shape} "
            "(a sliced or transposed view? pass the tensor vLLM allocated)"
        )
    return orders


def _pieces_overlap(shape: tuple[int, ...], strides: tuple[int, ...], piece: int) -> bool:
    planes, blocks = shape[0], shape[1]
    plane_stride, block_stride = strides[0], strides[1]
    if block_stride < 0 or plane_stride < 0:
        return True
    if planes == 1:
        return blocks > 1 and block_stride < piece
    blocks_then_planes = block_stride >= piece and plane_stride >= blocks * block_stride
    planes_inside_blocks = plane_stride >= piece and block_stride >= planes * plane_stride
    return not (blocks_then_planes or planes_inside_blocks)


def _span(base: int, shape: tuple[int, ...], strides: tuple[int, ...], piece: int) -> tuple[int, int]:
    last = base + (shape[0] - 1) * strides[0] + (shape[1] - 1) * strides[1]
    return base, last + piece


@dataclass(frozen=True)
class PagedKVCache:
    """The per-layer caches of one worker, validated, with their plane base addresses.

    Build it once (caches are allocated once) with :meth:`from_arrays`; pack/unpack take it.
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
        shape, strides = _canonical(first, kind)
        orders = _piece_orders(shape, strides, first.itemsize)
        piece_order = orders[0] if order is None else token_order(order)
        if piece_order not in orders:
            raise LayoutError(f"the strides say {orders[0].value}, but order={piece_order.value}")
        _, num_blocks, block_size, num_heads, head_size = shape
        if min(shape[1:]) <= 0:
            raise LayoutError(f"empty cache dimension in shape {first.shape}")
        geometry = CacheGeometry(
            kind=kind,
            order=piece_order,
            num_layers=len(views),
            num_blocks=num_blocks,
            block_size=block_size,
            num_heads=num_heads,
            head_size=head_size,
            dtype=first.dtype,
            itemsize=first.itemsize,
            device=first.device,
            block_stride=strides[1],
            plane_stride=strides[0],
        )
        if _pieces_overlap(shape, strides, geometry.piece_bytes):
            raise LayoutError(f"blocks or planes overlap: byte strides {strides} for pieces of "
                              f"{geometry.piece_bytes} bytes")
        for index, view in enumerate(views[1:], start=1):
            got = (view.shape, view.strides, view.dtype, view.device)
            want = (first.shape, first.strides, first.dtype, first.device)
            if got != want:
                raise LayoutError(
                    f"layer {index} differs from layer 0: shape/strides/dtype/device {got} vs {want}"
                )
        spans = sorted(_span(v.address, shape, strides, geometry.piece_bytes) for v in views)
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise LayoutError("two layers share memory; pass each layer's own cache tensor once")
        offsets = np.arange(geometry.planes_per_layer, dtype=np.uint64) * np.uint64(max(strides[0], 0))
        bases = (np.array([v.address for v in views], dtype=np.uint64)[:, None] + offsets).reshape(-1)
        return cls(geometry=geometry, plane_bases=bases, layers=tuple(views))

    @property
    def is_cuda(self) -> bool:
        return self.geometry.device.startswith("cuda")

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of each layer's memory span: what a transfer engine registers."""
        shape = (self.geometry.planes_per_layer, self.geometry.num_blocks)
        strides = (self.geometry.plane_stride, self.geometry.block_stride)
        spans = [_span(v.address, shape, strides, self.geometry.piece_bytes) for v in self.layers]
        return [(start, end - start) for start, end in spans]
