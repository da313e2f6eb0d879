"""CPU seconds per byte of a direct and a packed NIXL read, and the packed/direct ratio that CPU budget allows.

Usage: python benchmarks/packed_cpu_budget.py [rounds, default 9] > result.json

Reads 256 contiguous Qwen3-32B TP1 blocks (8 of 64 layers, 128 MiB) between two processes, methods interleaved
round by round: one direct read, and packed reads in 2 MiB and 16 MiB chunks (pipeline depth 4). Around every
read it takes both processes' CPU time (user + system, every thread).

Where the transport is a CPU copy (UCX over CMA on one host), a read can go no faster than ``cores / (CPU seconds
per byte)``. So ``ceiling_vs_direct = cores / (cpu_per_byte(packed) * direct rate)`` is the best packed/direct
ratio any overlap could reach at the packed path's measured CPU cost, and ``cpu_s_per_gb_for_0.7x`` the CPU cost
per byte the packed path would need for 0.7x of direct even with perfect overlap. Prints one JSON object with the
command, commit and machine.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvshuttle.bench.schema import machine, source_commit
from kvshuttle.bench.transfer import SHAPES, _ids, owner_process
from packed_chunk_cost import _cpu, _owner_reporting_cpu

BLOCKS, SPARE, LAYERS = 256, 256, 8
CHUNKS_MIB = (2, 16)


def _engine(layers: list[np.ndarray], chunk_mib: int) -> Any:
    from kvshuttle.core.layout import CacheKind, PagedKVCache
    from kvshuttle.transfer import EngineConfig, TransferEngine

    config = EngineConfig(staging_chunk_bytes=chunk_mib << 20, staging_chunks=8, pipeline_depth=4)
    return TransferEngine(PagedKVCache.from_arrays(layers, CacheKind.FLASH_ATTN), config)


def main(argv: list[str]) -> None:
    rounds = int(argv[0]) if argv else 9
    shape = SHAPES["qwen3-32b-tp1"]
    total = BLOCKS + SPARE
    owner_config = {"staging_chunk_bytes": 16 << 20, "staging_chunks": 8, "pipeline_depth": 4}
    dims = (2, total, shape.block_size, shape.kv_heads, shape.head_size)
    layers = [np.ones(dims, dtype=np.uint16) for _ in range(LAYERS)]  # pages faulted in before timing
    pipes: list[Any] = []
    with owner_process(_owner_reporting_cpu, (shape, LAYERS, total, 0, owner_config), 120, pipes) as address:
        engines = {mib: _engine(layers, mib) for mib in CHUNKS_MIB}
        peers = {mib: engine.connect(address) for mib, engine in engines.items()}
        methods = {"direct": (16, "direct"), **{f"packed_{mib}mib": (mib, "packed") for mib in CHUNKS_MIB}}
        pipe = pipes[0]
        lids, rids = _ids("contiguous", BLOCKS, total, np.random.default_rng(1))
        names = list(methods)
        samples: dict[str, dict[str, list[float]]] = {
            name: {"wall_s": [], "reader_cpu_s": [], "owner_cpu_s": []} for name in names}
        nbytes = 0

        def read(name: str) -> Any:
            mib, path = methods[name]
            return engines[mib].read(peers[mib], lids, rids, path=path).wait(60)

        try:
            for name in names:  # warm-up
                read(name)
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
                    pipe.send("cpu")
                    owner0, reader0, wall0 = pipe.recv(), _cpu(), time.perf_counter()
                    tel = read(name)
                    wall, reader_cpu = time.perf_counter() - wall0, _cpu() - reader0
                    pipe.send("cpu")
                    s = samples[name]
                    s["owner_cpu_s"].append(pipe.recv() - owner0)
                    s["wall_s"].append(wall)
                    s["reader_cpu_s"].append(reader_cpu)
                    nbytes = tel.bytes
        finally:
            for engine in engines.values():
                engine.close()
    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {}
    direct_rate = nbytes / statistics.median(samples["direct"]["wall_s"])
    for name, s in samples.items():
        gb = nbytes * len(s["wall_s"]) / 1e9
        cpu = (sum(s["reader_cpu_s"]) + sum(s["owner_cpu_s"])) / gb
        out[name] = {
            "gbps": round(nbytes / statistics.median(s["wall_s"]) / 1e9, 2),
            "vs_direct": round(statistics.median(samples["direct"]["wall_s"]) / statistics.median(s["wall_s"]), 2),
            "cpu_s_per_gb": {"reader": round(sum(s["reader_cpu_s"]) / gb, 4),
                             "owner": round(sum(s["owner_cpu_s"]) / gb, 4), "total": round(cpu, 4)},
            "ceiling_vs_direct": round(cores / (cpu * 1e-9 * direct_rate), 2),
        }
    print(json.dumps({
        "command": " ".join(["python", "benchmarks/packed_cpu_budget.py", *argv]), "commit": source_commit(),
        "machine": machine(), "bytes": nbytes, "rounds": rounds, "cores": cores, "methods": out,
        "cpu_s_per_gb_for_0.7x": round(cores / (0.7 * direct_rate) * 1e9, 4),
    }, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
