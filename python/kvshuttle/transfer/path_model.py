"""The ``auto`` path's model of one peer: which of direct and packed moved bytes faster, for reads like this one.

A fixed threshold on descriptor size cannot be right everywhere: where UCX handles small descriptors well
(or memory is fast and the two cores are busy), packing 4 KiB pieces loses to reading them direct, and
elsewhere it wins by 3x. So each peer keeps the effective bytes/s (bytes / wall time from ``read()`` to the data
in the cache) of the last ``WINDOW`` finished reads, per path and per *bucket*, and compares their medians. A
bucket holds reads alike in bytes per descriptor after coalescing (what a direct read pays per descriptor) and in
total bytes (what a packed read's pipeline fills), each bucket a power of two of both. Small reads are recorded
too: their fixed costs are what decides them (a packed read of 256 KiB took 3x a direct one, its pack request
and thread hand-offs, when the prior sent it packed).

Choosing, for a bucket:

* with no measurement of either path: the prior (the configured threshold, ``packed_threshold_bytes``);
* with one path measured only: the other one once, to measure it (exploration);
* with both: the one with the higher median; every ``explore_every``-th read of a bucket tries the slower one
  again, so a model that went stale (another job started, the peer moved) corrects itself.

Every read feeds the model, whichever path it asked for, so forced reads calibrate ``auto`` too. Decisions are
deterministic (counters, no randomness); ``reason`` says which path and why, and ends up in the telemetry.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

DIRECT, PACKED = "direct", "packed"
# Reads per path and bucket whose rates are kept: the median of 7 follows a changed machine after 4 reads, and
# up to 3 outliers (a shared VM's slow spells) do not move it. An EWMA (weight 0.3) flipped to the slower path
# after two slow reads in a row: auto 0.80x the faster path on a 1,536-block run.
WINDOW = 7


def bucket_of(bytes_per_descriptor: float, total_bytes: int) -> tuple[int, int]:
    """(log2 of bytes per descriptor, log2 of total bytes), both rounded down (at least 0)."""
    return (max(0, int(math.log2(max(1.0, bytes_per_descriptor)))), max(0, int(total_bytes).bit_length() - 1))


def _describe(bucket: tuple[int, int]) -> str:
    return f"~{_size(1 << bucket[0])} per descriptor, ~{_size(1 << bucket[1])} per read"


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


@dataclass
class _Bucket:
    rates: dict[str, deque[float]] = field(default_factory=dict)  # path -> bytes/s of its last WINDOW reads
    reads: dict[str, int] = field(default_factory=dict)  # path -> reads measured
    decisions: int = 0  # auto decisions made in this bucket


def _median(bucket: _Bucket, path: str) -> float | None:
    rates = bucket.rates.get(path)
    return statistics.median(rates) if rates else None


@dataclass(frozen=True)
class PathChoice:
    path: str
    reason: str
    bucket: tuple[int, int]
    direct_gbps: float | None  # the model's estimates when it decided (None: not measured yet)
    packed_gbps: float | None


class PathModel:
    """Per-peer measurements of both read paths; thread-safe (reads finish on pipeline threads)."""

    def __init__(self, threshold_bytes: int, explore_every: int = 16) -> None:
        self.threshold_bytes = threshold_bytes
        self.explore_every = explore_every  # 0: never re-explore once both paths are measured
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._lock = threading.Lock()

    def record(self, path: str, bytes_per_descriptor: float, total_bytes: int, seconds: float) -> None:
        """Fold one finished read into its bucket (ignored when empty or timed at zero)."""
        if path not in (DIRECT, PACKED) or seconds <= 0 or total_bytes <= 0:
            return
        with self._lock:
            b = self._buckets.setdefault(bucket_of(bytes_per_descriptor, total_bytes), _Bucket())
            b.rates.setdefault(path, deque(maxlen=WINDOW)).append(total_bytes / seconds)
            b.reads[path] = b.reads.get(path, 0) + 1

    def estimate(self, path: str, bytes_per_descriptor: float, total_bytes: int) -> float | None:
        """The median bytes/s of ``path``'s last reads in the bucket, or None when not measured."""
        with self._lock:
            b = self._buckets.get(bucket_of(bytes_per_descriptor, total_bytes))
            return None if b is None else _median(b, path)

    def choose(self, bytes_per_descriptor: float, total_bytes: int) -> PathChoice:
        """The path for the next ``auto`` read of this shape, and why (counts as one decision of its bucket)."""
        key = bucket_of(bytes_per_descriptor, total_bytes)
        with self._lock:
            b = self._buckets.setdefault(key, _Bucket())
            b.decisions += 1
            direct, packed = _median(b, DIRECT), _median(b, PACKED)
            decision = b.decisions
        where = _describe(key)
        prior = DIRECT if bytes_per_descriptor >= self.threshold_bytes else PACKED
        if direct is None and packed is None:
            path, reason = prior, (f"not measured yet at {where}: prior, {bytes_per_descriptor:.0f} B per "
                                   f"descriptor {'>=' if prior == DIRECT else '<'} threshold "
                                   f"{self.threshold_bytes} B")
        elif direct is None or packed is None:
            path = DIRECT if direct is None else PACKED
            known = packed if direct is None else direct
            assert known is not None
            reason = (f"exploring: {path} not measured yet at {where} "
                      f"({PACKED if path == DIRECT else DIRECT} {known / 1e9:.2f} GB/s)")
        else:
            faster, slower = (DIRECT, PACKED) if direct >= packed else (PACKED, DIRECT)
            rates = f"direct {direct / 1e9:.2f} GB/s, packed {packed / 1e9:.2f} GB/s at {where}"
            if self.explore_every > 0 and decision % self.explore_every == 0:
                path, reason = slower, f"exploring (every {self.explore_every}th read): measured {rates}"
            else:
                path, reason = faster, f"measured faster: {rates}"
        return PathChoice(path, reason, key, None if direct is None else direct / 1e9,
                          None if packed is None else packed / 1e9)
