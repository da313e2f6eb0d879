"""What a direct read moves per block: the contiguous *pieces* of one layer's block, and what they hold.

A direct read copies bytes as they lie, so its descriptors are built from runs that are contiguous in both
caches. For every dense layout those runs are the (plane, block) pieces. When a layer's planes interleave row
by row inside a block (vLLM 0.32: CPU_ATTN keeps each head's K rows then its V rows, FlashAttention and
FlashInfer keep each token's K then V), a plane's piece is not contiguous but the layer's whole *page* (all
its planes in one block) is, and the page is the piece. Where even the page is split (vLLM's LHBNC and BHLNC
put other blocks or layers between a layer's heads), each contiguous run of it is a piece.

:func:`direct_pieces` returns those pieces as offsets from the layer's base, and a digest of the *piece
format* (which row of which plane, head and token sits where in which piece): two caches can read each other
directly exactly when their formats are equal.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .layout import CacheGeometry


@dataclass(frozen=True)
class DirectPieces:
    """The pieces of one layer's block: ``offsets[k]`` bytes from the layer base, ``nbytes`` each."""

    offsets: tuple[int, ...]
    nbytes: int
    format: str  # digest of the row map; equal formats move the same rows to the same places


def direct_pieces(g: CacheGeometry) -> DirectPieces:
    """The contiguous pieces a direct read moves for each block of each layer of a cache of geometry ``g``."""
    row = g.row_bytes
    planes = np.arange(g.planes_per_layer, dtype=np.int64)[:, None, None] * g.plane_stride
    heads = np.arange(g.num_heads, dtype=np.int64)[None, :, None] * g.head_stride
    tokens = np.arange(g.block_size, dtype=np.int64)[None, None, :] * g.token_stride
    rows = (planes + heads + tokens).reshape(-1)  # every row of one block, in (plane, head, token) order
    if g.dense_pieces:
        starts = np.arange(g.planes_per_layer, dtype=np.int64) * g.plane_stride
        nbytes = g.piece_bytes
    else:
        ordered = np.sort(rows)
        breaks = np.flatnonzero(ordered[1:] != ordered[:-1] + row) + 1
        run_starts = ordered[np.concatenate([[0], breaks])]
        lengths = np.diff(np.concatenate([[0], breaks, [ordered.size]])) * row
        # Equal runs are the pieces (the page, or each head's part of it); uneven ones fall back to rows.
        starts, nbytes = (run_starts, int(lengths[0])) if np.all(lengths == lengths[0]) else (ordered, row)
    piece = np.searchsorted(starts, rows, side="right") - 1
    header = np.array([nbytes, row, g.planes_per_layer, g.num_heads, g.block_size, starts.size], dtype="<i8")
    digest = hashlib.blake2b(digest_size=12)
    for part in (header, piece.astype("<i8"), (rows - starts[piece]).astype("<i8")):
        digest.update(part.tobytes())
    return DirectPieces(tuple(int(s) for s in starts), int(nbytes), digest.hexdigest())


def direct_difference(local: CacheGeometry, remote: CacheGeometry) -> str | None:
    """Why blocks of ``remote`` cannot be copied byte for byte into ``local`` (their pieces hold rows in other
    places: another kind of page, token order, vLLM layout, block size or head count), or None."""
    mine, theirs = direct_pieces(local), direct_pieces(remote)
    if (len(mine.offsets), mine.nbytes, mine.format) == (len(theirs.offsets), theirs.nbytes, theirs.format):
        return None
    return (f"pages {remote.kind.value}/{remote.order.value} -> {local.kind.value}/{local.order.value} "
            "hold their rows differently")
