"""Staging: a registered pool of fixed-size *slots*, and how a packed read is cut into *chunks*.

Words: a *slot* is one fixed-size place in the registered pool (``staging_chunk_bytes`` each); a *chunk* is
the part of one packed read that occupies one slot; a *staging unit* is ``StagingLayout.block_size``
tokens inside a chunk. A chunk holds whole staging units and whole blocks on *both* sides, so each chunk is
packed on the owner and unpacked on the reader on its own (pack/unpack of a sub-range of the block ids).
Chunk boundaries fall on multiples of a *granule*: ``lcm(owner block size, reader block size, staging block
size)`` tokens.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.arrays import describe
from ..core.layout import StagingLayout, TokenOrder
from ..errors import StagingError
from .errors import StagingExhaustedError


class StagingPool:
    """``slots`` chunks of ``slot_bytes`` in one buffer (registered once with NIXL by the engine)."""

    def __init__(self, slot_bytes: int, slots: int, buffer: Any = None) -> None:
        if slot_bytes <= 0 or slots < 0:
            raise StagingError(f"staging needs chunk bytes > 0 and chunks >= 0, got {slot_bytes}, {slots}")
        self.slot_bytes, self.slots = int(slot_bytes), int(slots)
        if buffer is None:
            buffer = np.zeros(max(1, self.slot_bytes * self.slots), dtype=np.uint8)
            buffer.fill(0)  # fault the pages in now, not during the first transfer
        view = describe(buffer)
        if not view.is_c_contiguous() or view.nbytes < self.slot_bytes * self.slots:
            raise StagingError(
                f"the staging buffer must be C-contiguous with >= {self.slot_bytes * self.slots} bytes")
        self.buffer = buffer
        self.view = view
        self._free = list(range(self.slots - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def base(self) -> int:
        return self.view.address

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def address(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def array(self, slot: int, nbytes: int) -> Any:
        """The first ``nbytes`` of ``slot`` as an array pack/unpack accept (same framework as the buffer)."""
        start = slot * self.slot_bytes
        return self.buffer.reshape(-1).view(np.uint8)[start:start + nbytes] if isinstance(
            self.buffer, np.ndarray) else self.buffer.reshape(-1)[start:start + nbytes]

    def reserve(self, want: int, side: str) -> list[int]:
        """Up to ``want`` free slots (at least one); StagingExhaustedError when none is free."""
        with self._lock:
            if not self._free:
                raise StagingExhaustedError(
                    f"all {self.slots} staging chunks on the {side} are in use; retry later, give the {side} "
                    "more staging (staging_chunks), or read with path='direct'")
            got = [self._free.pop() for _ in range(min(want, len(self._free)))]
        return got

    def release(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)


@dataclass(frozen=True)
class Chunk:
    index: int
    token_start: int
    num_tokens: int
    local: slice  # into the local block ids
    remote: slice  # into the remote block ids
    nbytes: int  # staging bytes


def chunk_tokens(local_bs: int, remote_bs: int, layout: StagingLayout, planes: int, row_bytes: int,
                 slot_bytes: int) -> int:
    """Tokens per chunk: the most whole granules (``lcm`` of the three block sizes) that fit in one slot."""
    granule = math.lcm(local_bs, remote_bs, layout.block_size)
    granule_bytes = (granule // layout.block_size) * planes * layout.block_size * layout.num_heads * row_bytes
    if granule_bytes > slot_bytes:
        raise StagingError(
            f"a staging chunk of {slot_bytes} bytes cannot hold one granule of {granule} tokens (whole blocks on "
            f"both sides, {granule_bytes} bytes); raise staging_chunk_bytes on both sides")
    return (slot_bytes // granule_bytes) * granule


def plan_chunks(num_tokens: int, tokens_per_chunk: int, local_bs: int, remote_bs: int,
                layout: StagingLayout, planes: int, row_bytes: int) -> list[Chunk]:
    chunks = []
    for index, start in enumerate(range(0, num_tokens, tokens_per_chunk)):
        count = min(tokens_per_chunk, num_tokens - start)
        stop = start + count
        nbytes = layout.num_units(count) * planes * layout.block_size * layout.num_heads * row_bytes
        chunks.append(Chunk(index, start, count, slice(start // local_bs, -(-stop // local_bs)),
                            slice(start // remote_bs, -(-stop // remote_bs)), nbytes))
    return chunks


def layout_to_wire(layout: StagingLayout) -> dict[str, Any]:
    return {"block_size": layout.block_size, "num_heads": layout.num_heads, "order": layout.order.value}


def layout_from_wire(d: dict[str, Any]) -> StagingLayout:
    return StagingLayout(int(d["block_size"]), int(d["num_heads"]), TokenOrder(d["order"]))
