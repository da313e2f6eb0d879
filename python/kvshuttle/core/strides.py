"""Byte-stride arithmetic of strided caches: token order, overlap checks, memory spans and regions.

A strided set is described by ``dims``, pairs ``(extent, stride)`` in bytes, plus the length of its rows:
element ``(i_0, i_1, ...)`` is the row at ``base + sum(i_k * stride_k)``. Nothing here touches memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from .kinds import TokenOrder

Dims = Sequence[tuple[int, int]]


def extent(dims: Dims, row: int) -> int:
    """Bytes from the first byte of a strided set (non-negative strides) to just past its last byte."""
    return sum((n - 1) * s for n, s in dims) + row


def nested_disjoint(dims: Dims, row: int) -> bool:
    """Whether no two rows of the set overlap, by the nesting rule: sorted by stride, every dimension steps
    past everything the smaller ones span. A sufficient test, exact for every permutation of a dense array
    (every vLLM layout); a negative stride fails it."""
    span = row
    for n, s in sorted((d for d in dims if d[0] > 1), key=lambda d: d[1]):
        if s < span:
            return False
        span += (n - 1) * s
    return True


def token_orders(blocks: int, heads: int, token_stride: int, head_stride: int) -> list[TokenOrder]:
    """The orders a block is consistent with: the larger stride is the outer dimension; with one head or one
    token per block both orders describe the same bytes (NHD first)."""
    if blocks > 1 and heads > 1:
        return [TokenOrder.NHD if token_stride > head_stride else TokenOrder.HND]
    return [TokenOrder.NHD, TokenOrder.HND]


def normalised(order: TokenOrder, tokens: int, heads: int, token_stride: int, head_stride: int,
               row: int) -> tuple[int, int]:
    """(token_stride, head_stride) with the stride of a length-1 dimension (meaningless, often arbitrary in
    torch) replaced by its dense value in ``order``, so a dense block reads as dense."""
    if order is TokenOrder.NHD:
        head_stride = row if heads == 1 else head_stride
        token_stride = heads * head_stride if tokens == 1 else token_stride
    else:
        token_stride = row if tokens == 1 else token_stride
        head_stride = tokens * token_stride if heads == 1 else head_stride
    return token_stride, head_stride


def is_dense(order: TokenOrder, tokens: int, heads: int, token_stride: int, head_stride: int, row: int) -> bool:
    """Whether a block of normalised strides is one dense ``[B][H][row]`` (NHD) or ``[H][B][row]`` (HND) piece."""
    if order is TokenOrder.NHD:
        return head_stride == row and token_stride == heads * row
    return token_stride == row and head_stride == tokens * row


def evenly_spaced(addresses: Sequence[int]) -> int | None:
    """The common positive step of sorted ``addresses`` (any step for fewer than two), else None."""
    ordered = sorted(addresses)
    steps = {b - a for a, b in pairwise(ordered)}
    if not steps:
        return 0
    step = steps.pop()
    return step if not steps and step > 0 else None


def merged_regions(spans: Sequence[tuple[int, int, object]]) -> list[tuple[int, int]]:
    """(address, bytes) regions covering ``spans`` ``(start, end, allocation)`` without overlap.

    Overlapping spans merge (NIXL takes overlapping registrations, but a descriptor must lie inside one), and
    so do touching spans of one allocation (a descriptor coalesced across them stays inside one region);
    touching spans of different allocations stay apart (one registration must not cover two allocations).
    Regions come in the order of their first span.
    """
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    groups: list[list[int]] = []
    end, allocation = 0, None
    for i in order:
        start, stop, alloc = spans[i]
        if groups and (start < end or (start == end and alloc is not None and alloc == allocation)):
            groups[-1].append(i)
            if stop > end:
                end, allocation = stop, alloc
        else:
            groups.append([i])
            end, allocation = stop, alloc
    groups.sort(key=min)
    regions = []
    for group in groups:
        start = min(spans[i][0] for i in group)
        regions.append((start, max(spans[i][1] for i in group) - start))
    return regions
