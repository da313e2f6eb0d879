"""Shared timing helpers for the benchmarks: median of repeats, GB/s, ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 1,
                   sync: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs after ``warmup`` runs (``sync`` ends each run)."""
    for _ in range(warmup):
        fn()
        if sync:
            sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b > 0 else float("inf")


def batched_seconds(fn: Callable[[], object], repeat: int, sync: Callable[[], object], batches: int = 3) -> float:
    """Seconds per call with ``repeat`` calls enqueued back to back before one ``sync`` (GPU throughput).

    The median over ``batches`` batches, after a warm-up batch.
    """
    def one_batch() -> None:
        for _ in range(repeat):
            fn()

    return median_seconds(one_batch, batches, warmup=1, sync=sync) / repeat
