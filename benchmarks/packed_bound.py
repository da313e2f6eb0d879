"""How fast a packed read's three copies could go with no protocol at all: the bound a native per-chunk loop chases.

Usage: python benchmarks/packed_bound.py [rounds, default 9] > result.json

One process, two threads, the engine's own native copies with their plans made up front: an "owner" thread
packs 256 scattered Qwen3-32B TP1 blocks (8 of 64 layers, 128 MiB) chunk by chunk into a ring of 2 staging slots,
the main thread copies each packed chunk into its own ring of 2 (``parallel_memcpy``: what the transport does)
and unpacks it into 256 scattered blocks of a second cache. A queue between the threads is the only per-chunk
cost besides the copies. Chunk sizes from 0.5 to 16 MiB, the unpack streamed (the default: non-temporal
stores) or cached, against one ``parallel_memcpy`` of the same bytes (the direct contiguous read's analogue),
methods interleaved. The destination is checked byte for byte once per method.

Prints one JSON object: per method the median GB/s and the median of per-round ratios to the memcpy, with the
command, commit and machine (``kvshuttle.bench.schema.machine``).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvshuttle import _native
from kvshuttle.bench.schema import machine, source_commit
from kvshuttle.bench.timing import interleaved_rounds
from kvshuttle.core import ops
from kvshuttle.core.layout import CacheKind, PagedKVCache

LAYERS, TOTAL, BLOCKS, HEADS, HEAD, BLOCK = 8, 512, 256, 8, 128, 16
BLOCK_BYTES = 2 * LAYERS * BLOCK * HEADS * HEAD * 2  # every plane of every layer of one block, bf16
CHUNK_BLOCKS = (1, 2, 4, 8, 32)  # 0.5, 1, 2, 4, 16 MiB
SLOTS = 2  # per side


def _cache(rng: np.random.Generator) -> tuple[list[np.ndarray], PagedKVCache]:
    layers = [rng.integers(0, 2**16, size=(2, TOTAL, BLOCK, HEADS, HEAD), dtype=np.uint16) for _ in range(LAYERS)]
    return layers, PagedKVCache.from_arrays(layers, CacheKind.FLASH_ATTN)


class Pipeline:
    """The three copies of one packed read, chunk by chunk, with every plan made before timing."""

    def __init__(self, src: PagedKVCache, dst: PagedKVCache, src_ids: np.ndarray, dst_ids: np.ndarray,
                 chunk_blocks: int) -> None:
        self.src, self.dst, self.chunk_bytes = src, dst, chunk_blocks * BLOCK_BYTES
        self.owner_slots = [np.empty(self.chunk_bytes, np.uint8) for _ in range(SLOTS)]
        self.reader_slots = [np.empty(self.chunk_bytes, np.uint8) for _ in range(SLOTS)]
        spans = [slice(c, c + chunk_blocks) for c in range(0, BLOCKS, chunk_blocks)]
        self.src_ids = [np.ascontiguousarray(src_ids[s]) for s in spans]
        self.dst_ids = [np.ascontiguousarray(dst_ids[s]) for s in spans]
        self.packs = [[ops.plan_copy(src, ids, slot, staging_written=True).native_spec()
                       for slot in self.owner_slots] for ids in self.src_ids]
        self.unpacks = [[ops.plan_copy(dst, ids, slot, staging_written=False).native_spec()
                         for slot in self.reader_slots] for ids in self.dst_ids]

    def _owner(self, ready: queue.SimpleQueue[tuple[int, int]], free: queue.SimpleQueue[int]) -> None:
        for c, ids in enumerate(self.src_ids):
            slot = free.get()
            _native.paged_copy_cpu(self.packs[c][slot], self.src.plane_bases, ids, _native.Direction.PACK)
            ready.put((c, slot))

    def __call__(self) -> None:
        ready: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(SLOTS):
            free.put(slot)
        owner = threading.Thread(target=self._owner, args=(ready, free))
        owner.start()
        for k in range(len(self.src_ids)):
            c, slot = ready.get()
            mine = k % SLOTS
            _native.parallel_memcpy(self.reader_slots[mine].ctypes.data, self.owner_slots[slot].ctypes.data,
                                    self.chunk_bytes)
            free.put(slot)
            _native.paged_copy_cpu(self.unpacks[c][mine], self.dst.plane_bases, self.dst_ids[c],
                                   _native.Direction.UNPACK)
        owner.join()


def _unpack_threshold(nbytes: int, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        _native.set_streaming_min_bytes(nbytes, _native.Direction.UNPACK)
        try:
            fn()
        finally:
            _native.set_streaming_min_bytes(-1, _native.Direction.UNPACK)
    return run


def main(argv: list[str]) -> None:
    rounds = int(argv[0]) if argv else 9
    rng = np.random.default_rng(0)
    (src_layers, src), (dst_layers, dst) = _cache(rng), _cache(rng)
    src_ids, dst_ids = rng.permutation(TOTAL)[:BLOCKS], rng.permutation(TOTAL)[:BLOCKS]
    nbytes = BLOCKS * BLOCK_BYTES
    one_a, one_b = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    methods: dict[str, Callable[[], None]] = {
        "memcpy": lambda: _native.parallel_memcpy(one_b.ctypes.data, one_a.ctypes.data, nbytes)}
    for blocks in CHUNK_BLOCKS:
        pipeline = Pipeline(src, dst, src_ids, dst_ids, blocks)
        kib = blocks * BLOCK_BYTES >> 10
        methods[f"pipeline_{kib}k_streamed"] = pipeline
        methods[f"pipeline_{kib}k_cached"] = _unpack_threshold(1 << 62, pipeline)
    verified = []
    for name, fn in methods.items():
        if name == "memcpy":
            continue
        for layer in dst_layers:
            layer.fill(0x5A5A)  # poison
        fn()
        for s, d in zip(src_layers, dst_layers, strict=True):
            if not np.array_equal(s[:, src_ids], d[:, dst_ids]):
                raise AssertionError(f"{name} moved the wrong bytes")
        verified.append(name)
    samples = interleaved_rounds(methods, rounds)
    memcpy = np.array(samples["memcpy"])
    rows: dict[str, Any] = {}
    for name, seconds in samples.items():
        per_round = memcpy / np.array(seconds)
        rows[name] = {"gbps": round(nbytes / float(np.median(seconds)) / 1e9, 2),
                      "vs_memcpy": round(float(np.median(per_round)), 2),
                      "vs_memcpy_range": [round(float(per_round.min()), 2), round(float(per_round.max()), 2)]}
    print(json.dumps({
        "command": " ".join(["python", "benchmarks/packed_bound.py", *argv]), "commit": source_commit(),
        "machine": machine(), "bytes": nbytes, "rounds": rounds, "slots_per_side": SLOTS,
        "verified": verified, "methods": rows,
    }, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
