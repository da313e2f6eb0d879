"""Retention tiers in the what-if planner (issue 35): a retention leaves the decode's HBM when its hot TTL ends and
moves down to host memory (and disk) instead of being freed, read back from there at that tier's speed.

A tier is a place a retention can live: how long it stays there (``ttl_s``, counted from when it arrived there),
how fast one TP rank reads from it (``bandwidth_bytes_per_s``, ``overhead_s`` per read) and what holding a GiB
there costs per hour (``price_per_gib_hour``). The hot tier is the decode's KV blocks: its TTL is the run's TTL and
its speed the profile's link. Lower tiers follow it in order: a retention is in the hot tier for
``[end, end + hot TTL)``, then in the first lower tier for its TTL, and so on; a turn that arrives then reads from
the tier the retention is in. Capacity is not a bound here but an output (peak GiB per tier), as for the hot tier.

Prices are assumptions to replace with your own (``--tier``): an H200's 141 GB of HBM at about $3.5 per GPU-hour is
$0.025 per GiB-hour; host DRAM about $0.001; NVMe about $0.0001. The read speeds of the default host tier are a
PCIe 5 x16 link's order of magnitude (a host tier read goes over the NIC from the decode's host memory: the same
network, one more copy), a disk tier's an NVMe's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import PlannerError

HOT = "hot"
HOT_PRICE_PER_GIB_HOUR = 0.025  # assumed: H200 HBM (see the module docstring)


@dataclass(frozen=True)
class Tier:
    """One lower tier (host memory, disk): see the module docstring."""

    name: str
    ttl_s: float
    bandwidth_bytes_per_s: float  # one rank's read rate from this tier
    overhead_s: float = 0.0  # per read (a disk read's first bytes, a staging copy's setup)
    price_per_gib_hour: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name and self.name != HOT and self.name.isidentifier()):
            raise PlannerError(f"a tier's name must be an identifier other than {HOT!r}, got {self.name!r}")
        for field, value, positive in (("ttl_s", self.ttl_s, False),
                                       ("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, True),
                                       ("overhead_s", self.overhead_s, False),
                                       ("price_per_gib_hour", self.price_per_gib_hour, False)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (positive and value == 0):
                raise PlannerError(f"tier {self.name!r}: {field} must be a finite number "
                                   f"{'> 0' if positive else '>= 0'}, got {value!r}")

    def read_s(self, rank_bytes: float) -> float:
        """Seconds one rank takes to read ``rank_bytes`` from this tier (the ranks read at once)."""
        return self.overhead_s + rank_bytes / self.bandwidth_bytes_per_s

    @classmethod
    def parse(cls, text: str) -> Tier:
        """``NAME:TTL_S:GBPS[:OVERHEAD_MS[:PRICE_PER_GIB_HOUR]]`` (``--tier``), e.g. ``host:1800:25:0.2:0.001``."""
        parts = text.split(":")
        if not 3 <= len(parts) <= 5:
            raise PlannerError(f"--tier takes NAME:TTL_S:GBPS[:OVERHEAD_MS[:PRICE_PER_GIB_HOUR]], got {text!r}")
        try:
            numbers = [float(p) for p in parts[1:]]
        except ValueError:
            raise PlannerError(f"--tier {text!r}: TTL, GB/s, overhead and price are numbers") from None
        overhead_ms = numbers[2] if len(numbers) > 2 else 0.0
        price = numbers[3] if len(numbers) > 3 else 0.0
        return cls(parts[0], numbers[0], numbers[1] * 1e9, overhead_ms / 1e3, price)


def check_tiers(tiers: Sequence[Tier]) -> tuple[Tier, ...]:
    tiers = tuple(tiers)
    if not all(isinstance(t, Tier) for t in tiers):
        raise PlannerError("tiers must be Tier values (planner.tiers)")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise PlannerError(f"tier names repeat: {names}")
    return tiers


def tier_at(age_s: float, hot_ttl_s: float, tiers: Sequence[Tier]) -> int:
    """Where a retention ``age_s`` seconds old lives: 0 the hot tier, k the k-th lower tier, -1 gone."""
    edge = hot_ttl_s
    if age_s < edge:
        return 0
    for k, tier in enumerate(tiers, start=1):
        edge += tier.ttl_s
        if age_s < edge:
            return k
    return -1


def split_hold(start: float, hold_s: float, hot_ttl_s: float, tiers: Sequence[Tier]) -> list[tuple[int, float, float]]:
    """A retention held ``hold_s`` seconds from ``start``, cut into ``(tier index, from, to)`` stretches."""
    out: list[tuple[int, float, float]] = []
    edge, stop = start, start + hold_s
    for k, ttl in enumerate([hot_ttl_s, *(t.ttl_s for t in tiers)]):
        if edge >= stop:
            break
        end = min(stop, edge + ttl)
        if end > edge:
            out.append((k, edge, end))
        edge = end
    return out
