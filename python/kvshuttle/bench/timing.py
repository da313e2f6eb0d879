"""Shared timing helpers for the benchmarks: methods interleaved round by round, medians, per-round ratios and
their spread, GB/s."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence


def interleaved_rounds(fns: Mapping[str, Callable[[], object]], rounds: int, *, warmup: int = 1, number: int = 1,
                       sync: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each function in each of ``rounds`` rounds.

    A round runs every function once (``number`` calls back to back, then ``sync``), one after another, the
    order rotated from round to round: a slow spell on a shared machine hits all methods alike, so the ratio
    of two methods within a round is steadier than the ratio of medians taken in separate blocks.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            for _ in range(number):
                fns[name]()
            if sync:
                sync()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(number):
                fn()
            if sync:
                sync()
            samples[name].append((time.perf_counter() - start) / number)
    return samples


def medians(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    """``min``, ``q1``, ``median``, ``q3``, ``max`` of ``values`` (quartiles: inclusive method)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    q1, q2, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return {k: round(v, digits) for k, v in
            (("min", ordered[0]), ("q1", q1), ("median", q2), ("q3", q3), ("max", ordered[-1]))}


def round_ratios(samples: Mapping[str, Sequence[float]], subject: str, peer: str) -> list[float]:
    """Per-round ``peer / subject`` times: how many times faster ``subject`` was in each round."""
    return [p / s for s, p in zip(samples[subject], samples[peer], strict=True) if s > 0]


def speedups(samples: Mapping[str, Sequence[float]], pairs: Mapping[str, tuple[str, str]],
             ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """For each ``name: (subject, peer)``: the median per-round ratio and its spread (see :func:`spread`)."""
    spreads = {name: spread(round_ratios(samples, subject, peer)) for name, (subject, peer) in pairs.items()}
    return {name: s["median"] for name, s in spreads.items()}, spreads


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
