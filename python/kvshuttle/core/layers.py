"""A read plan split by layer: what a layer-pipelined load posts, one NIXL request per group of layers.

A layer-pipelined reverse read (issue 17: the prefill computes layer i while layer i+1's KV is still arriving)
needs every layer's bytes in requests of their own, so that waiting for layer i waits for nothing else.
:func:`~kvshuttle.core.plan.plan_read` coalesces across layers where the cache allows it (the last block of
layer l and block 0 of layer l + 1 are adjacent in one vLLM 0.32 allocation), so its descriptors are cut at the
local side's layer boundaries here, both sides at the same offsets (row k of ``local`` still pairs with row k of
``remote``, byte for byte). A cache whose layers interleave in memory (block-major layouts: every layer's page
of block n sits in block n's stretch) cannot be split by layer: :class:`LayoutError`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._values import is_int
from ..errors import LayoutError, shown
from .plan import ReadPlan, SideGeometry


def layer_spans(side: SideGeometry) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """``(starts, ends)`` per layer: the addresses its pieces occupy. LayoutError when two layers' spans overlap."""
    bases = side.plane_bases.reshape(-1, side.planes_per_layer)
    starts = bases.min(axis=1)
    ends = bases.max(axis=1) + np.uint64((side.num_blocks - 1) * side.block_stride + side.piece_bytes)
    order = np.argsort(starts, kind="stable")
    if np.any(starts[order][1:] < ends[order][:-1]):
        raise LayoutError("the cache's layers interleave in memory (a block-major layout): a read cannot be split "
                          "by layer; use one request for the whole read")
    return starts, ends


def split_by_layer(plan: ReadPlan, side: SideGeometry, groups: int) -> list[tuple[range, ReadPlan]]:
    """``plan`` (whose ``local`` rows address ``side``) as one plan per group of consecutive layers: ``groups``
    groups of (nearly) equal size, each ``(its layers, its plan)``, in layer order; groups without a row are
    left out. Every byte of ``plan`` is in exactly one group's plan, paired with the same remote byte."""
    num_layers = side.plane_bases.size // side.planes_per_layer
    if not (is_int(groups) and 1 <= groups <= num_layers):
        raise LayoutError(f"groups must be an int in 1..{num_layers} (the layers), got {shown(groups)}")
    starts, ends = layer_spans(side)
    local, remote = _cut(plan.local, plan.remote, starts, ends)
    order = np.argsort(starts, kind="stable")
    position = np.searchsorted(starts[order], local[:, 0], side="right") - 1
    layer_of = order[position]  # each row's layer (rows were cut, so each lies inside one layer)
    bounds = [round(g * num_layers / groups) for g in range(groups + 1)]
    out = []
    for g in range(groups):
        layers = range(bounds[g], bounds[g + 1])
        rows = np.flatnonzero((layer_of >= layers.start) & (layer_of < layers.stop))
        if rows.size:
            pieces = plan.num_pieces * len(layers) // num_layers
            out.append((layers, ReadPlan(local[rows], remote[rows], pieces)))
    return out


def _cut(local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64], starts: npt.NDArray[np.uint64],
         ends: npt.NDArray[np.uint64]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """The rows, each cut where it crosses the end of a local layer span (both sides at the same offset)."""
    order = np.argsort(starts, kind="stable")
    sorted_starts, sorted_ends = starts[order], ends[order]
    first = np.searchsorted(sorted_starts, local[:, 0], side="right") - 1
    if np.any(first < 0) or np.any(local[:, 0] >= sorted_ends[np.maximum(first, 0)]):
        raise LayoutError("a descriptor starts outside every layer of the local cache")
    crossing = np.flatnonzero(local[:, 0] + local[:, 1] > sorted_ends[first])
    if crossing.size == 0:
        return local, remote
    out_local, out_remote, done = [], [], 0
    for row in crossing.tolist():  # few: only where contiguous runs join two layers
        out_local.append(local[done:row])
        out_remote.append(remote[done:row])
        addr, length, dev = (int(x) for x in local[row])
        raddr, _, rdev = (int(x) for x in remote[row])
        offset, layer = 0, int(first[row])
        while offset < length:
            if layer >= len(sorted_ends) or addr + offset < int(sorted_starts[layer]):
                raise LayoutError("a descriptor runs past the local cache's layers")
            piece = min(length - offset, int(sorted_ends[layer]) - addr - offset)
            out_local.append(np.array([[addr + offset, piece, dev]], dtype=np.uint64))
            out_remote.append(np.array([[raddr + offset, piece, rdev]], dtype=np.uint64))
            offset += piece
            layer += 1
        done = row + 1
    out_local.append(local[done:])
    out_remote.append(remote[done:])
    return np.concatenate(out_local), np.concatenate(out_remote)
