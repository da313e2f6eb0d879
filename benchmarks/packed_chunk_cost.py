"""CPU time one packed-read chunk costs, in the reader and in the owner, with chunks too small to carry data.

Usage: python benchmarks/packed_chunk_cost.py [chunk KiB, default 64] [reads, default 10] > result.json

Reads 256 TP8-shaped blocks (16 MiB) with the packed path in chunks of ``chunk KiB`` (256 chunks at 64 KiB) and
prints one JSON object: the wall time per chunk and each process's CPU time per chunk (user + system, every
thread), with the command and the machine (``kvshuttle.bench.schema.machine``). With 64 KiB
chunks the copies take a few microseconds, so what is left is the per-chunk protocol: side-channel messages,
NIXL transfer creation and post, the hand-off to the unpack worker, each call's validation. That is what a chunk small
enough to stay in cache would have to pay (benchmarks/HISTORY.md, "Unpacks on a native worker").
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

import numpy as np

from kvshuttle.bench.schema import machine, source_commit
from kvshuttle.bench.transfer import SHAPES, _ids, _owner, _Reader, owner_process


def _owner_reporting_cpu(conn: Any, *args: Any) -> None:
    """The bench's owner, answering "cpu" on its pipe with its own CPU seconds (between reads)."""

    class Pipe:  # the owner polls its pipe for "stop"; answer "cpu" requests on the way
        def send(self, value: Any) -> None:
            conn.send(value)

        def poll(self, timeout: float) -> bool:
            if not conn.poll(timeout):
                return False
            if conn.recv() == "cpu":
                conn.send(_cpu())
                return False
            return True

    _owner(Pipe(), *args)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> None:
    chunk_kib = int(argv[0]) if argv else 64
    reads = int(argv[1]) if len(argv) > 1 else 10
    shape, blocks, spare, layers = SHAPES["qwen3-32b-tp8"], 256, 256, 8
    args = argparse.Namespace(layers=layers, blocks=blocks, spare_blocks=spare, seed=0)
    config = {"staging_chunk_bytes": chunk_kib << 10, "staging_chunks": 8, "pipeline_depth": 4}
    pipes: list[Any] = []
    with owner_process(_owner_reporting_cpu, (shape, layers, blocks + spare, 0, config), 120, pipes) as address:
        reader = _Reader(shape, args, blocks + spare, config, address)
        try:
            lids, rids = _ids("scattered", blocks, blocks + spare, np.random.default_rng(1))
            reader.direct.read(reader.peer, lids, rids, path="packed").wait(60)  # warm-up
            pipe = pipes[0]
            pipe.send("cpu")
            owner0, reader0, wall0 = pipe.recv(), _cpu(), time.perf_counter()
            chunks = 0
            for _ in range(reads):
                chunks += reader.direct.read(reader.peer, lids, rids, path="packed").wait(60).chunks
            wall, reader_cpu = time.perf_counter() - wall0, _cpu() - reader0
            pipe.send("cpu")
            owner_cpu = pipe.recv() - owner0
        finally:
            reader.close()
    print(json.dumps({
        "command": " ".join(["python", "benchmarks/packed_chunk_cost.py", *argv]), "commit": source_commit(),
        "machine": machine(), "chunk_bytes": chunk_kib << 10, "reads": reads, "chunks": chunks,
        "wall_us_per_chunk": round(wall / chunks * 1e6, 1),
        "cpu_us_per_chunk": {"reader": round(reader_cpu / chunks * 1e6, 1),
                             "owner": round(owner_cpu / chunks * 1e6, 1)},
    }, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
