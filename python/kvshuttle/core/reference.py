"""Plain numpy pack/unpack: the oracle of the tests and the fallback for host memory.

Written for obviousness, not speed: fancy indexing per layer and a loop over staging units.
Staging format: see :class:`kvshuttle.layout.StagingLayout`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .arrays import host_bytes
from .layout import PagedKVCache, StagingLayout, TokenOrder

Bytes = npt.NDArray[np.uint8]


def layer_pages(cache: PagedKVCache, layer: int) -> Bytes:
    """Layer ``layer`` of a host cache as a writable uint8 view ``[P, N, B, H, row_bytes]`` (its strides)."""
    g = cache.geometry
    start, nbytes = cache.layer_span(layer)
    return np.lib.stride_tricks.as_strided(
        host_bytes(start, nbytes),
        shape=(g.planes_per_layer, g.num_blocks, g.block_size, g.num_heads, g.row_bytes),
        strides=(g.plane_stride, g.block_stride, g.token_stride, g.head_stride, 1),
    )


def staging_units(staging: Bytes, cache: PagedKVCache, layout: StagingLayout, num_tokens: int) -> Bytes:
    """The staging bytes as ``[unit, layer, plane, token, head, row_bytes]`` (a view, any order)."""
    g = cache.geometry
    units = layout.num_units(num_tokens)
    shape = (units, g.num_layers, g.planes_per_layer)
    used = staging[: layout.nbytes(g, num_tokens)]
    if layout.order is TokenOrder.NHD:
        return used.reshape(*shape, layout.block_size, layout.num_heads, g.row_bytes)
    return used.reshape(*shape, layout.num_heads, layout.block_size, g.row_bytes).transpose(0, 1, 2, 4, 3, 5)


def pack(
    cache: PagedKVCache, block_ids: npt.NDArray[np.int64], staging: Bytes, layout: StagingLayout,
    num_tokens: int, head_offset: int,
) -> None:
    """Gather ``num_tokens`` tokens from blocks ``block_ids`` (in order) into ``staging``."""
    g = cache.geometry
    units = staging_units(staging, cache, layout, num_tokens)
    heads = slice(head_offset, head_offset + layout.num_heads)
    for layer in range(g.num_layers):
        pages = layer_pages(cache, layer)[:, block_ids]  # [P, n, B, H, R]
        tokens = pages.reshape(g.planes_per_layer, -1, g.num_heads, g.row_bytes)[:, :num_tokens, heads]
        for unit in range(units.shape[0]):
            lo = unit * layout.block_size
            hi = min(lo + layout.block_size, num_tokens)
            units[unit, layer, :, : hi - lo] = tokens[:, lo:hi]


def unpack(
    staging: Bytes, cache: PagedKVCache, block_ids: npt.NDArray[np.int64], layout: StagingLayout,
    num_tokens: int, head_offset: int,
) -> None:
    """Scatter ``num_tokens`` tokens from ``staging`` into blocks ``block_ids`` (in order)."""
    g = cache.geometry
    units = staging_units(staging, cache, layout, num_tokens)
    heads = slice(head_offset, head_offset + layout.num_heads)
    for layer in range(g.num_layers):
        tokens = np.empty((g.planes_per_layer, num_tokens, layout.num_heads, g.row_bytes), dtype=np.uint8)
        for unit in range(units.shape[0]):
            lo = unit * layout.block_size
            hi = min(lo + layout.block_size, num_tokens)
            tokens[:, lo:hi] = units[unit, layer, :, : hi - lo]
        pages = layer_pages(cache, layer)
        for i, block in enumerate(block_ids):
            lo = i * g.block_size
            hi = min(lo + g.block_size, num_tokens)
            pages[:, block, : hi - lo, heads] = tokens[:, lo:hi]


def plan_read(
    walk_groups: npt.NDArray[np.int64], piece_bytes: int,
    local_bases: npt.NDArray[np.uint64], local_ids: npt.NDArray[np.int64], local_stride: int,
    local_device: int,
    remote_bases: npt.NDArray[np.uint64], remote_ids: npt.NDArray[np.int64], remote_stride: int,
    remote_device: int,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """NIXL (addr, len, dev) rows for both sides of a read; see :func:`kvshuttle.plan.plan_read`.

    Pieces are enumerated ``for group in walk_groups: for i in ids: for column in group`` and a piece joins
    the previous descriptor when it starts exactly where that descriptor ends on both sides.
    """
    planes, ids = walk_groups[:, None, :], (slice(None), None)
    local_addr = local_bases[planes] + local_ids.astype(np.uint64)[ids] * np.uint64(local_stride)
    remote_addr = remote_bases[planes] + remote_ids.astype(np.uint64)[ids] * np.uint64(remote_stride)
    local_addr, remote_addr = local_addr.reshape(-1), remote_addr.reshape(-1)
    piece = np.uint64(piece_bytes)
    joins = (local_addr[1:] == local_addr[:-1] + piece) & (remote_addr[1:] == remote_addr[:-1] + piece)
    starts = np.flatnonzero(np.concatenate([[True], ~joins])) if local_addr.size else np.zeros(0, np.int64)
    lengths = np.diff(np.append(starts, local_addr.size)).astype(np.uint64) * piece

    def rows(addr: npt.NDArray[np.uint64], device: int) -> npt.NDArray[np.uint64]:
        out = np.empty((starts.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addr[starts], lengths, device
        return out

    return rows(local_addr, local_device), rows(remote_addr, remote_device)
