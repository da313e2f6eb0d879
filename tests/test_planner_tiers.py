"""Retention tiers in the planner (planner/tiers.py): a conversation that pauses past the hot TTL reads its history
back from the host tier instead of recomputing it, at that tier's speed, and each tier's memory and cost are
reported separately."""

from __future__ import annotations

import pytest

from kvshuttle.planner import load_profile
from kvshuttle.planner.errors import PlannerError
from kvshuttle.planner.simulate import PreparedTrace, simulate, summarize
from kvshuttle.planner.tiers import Tier, split_hold, tier_at
from kvshuttle.planner.trace import uniform_trace

HOST = Tier("host", ttl_s=1800.0, bandwidth_bytes_per_s=2e9, overhead_s=0.002, price_per_gib_hour=0.001)
DISK = Tier("disk", ttl_s=3600.0, bandwidth_bytes_per_s=0.5e9, overhead_s=0.01, price_per_gib_hour=0.0001)


def test_tiers_parse_and_refuse_what_cannot_be_right() -> None:
    assert Tier.parse("host:1800:25:0.2:0.001") == Tier("host", 1800.0, 25e9, 0.0002, 0.001)
    assert Tier.parse("disk:3600:2") == Tier("disk", 3600.0, 2e9)
    for bad in ("host:1800", "hot:1:1", "host:x:1", "host:10:0", "host:-1:1", "1host:1:1"):
        with pytest.raises(PlannerError):
            Tier.parse(bad)


def test_a_retention_moves_down_the_tiers_as_it_ages() -> None:
    assert [tier_at(age, 480.0, (HOST, DISK)) for age in (0, 479.9, 480, 2279.9, 2280, 5879.9, 5880)] == \
        [0, 0, 1, 1, 2, 2, -1]
    assert split_hold(100.0, 3000.0, 480.0, (HOST, DISK)) == [(0, 100.0, 580.0), (1, 580.0, 2380.0),
                                                               (2, 2380.0, 3100.0)]
    assert split_hold(100.0, 60.0, 480.0, (HOST,)) == [(0, 100.0, 160.0)]


def test_a_pause_past_the_hot_ttl_reads_from_the_host_tier_instead_of_recomputing() -> None:
    profile = load_profile("h200-efa-qwen3-32b")
    trace = uniform_trace(conversations=4, turns=3, first_tokens=8000, new_tokens=200, output_tokens=100,
                          gap_s=900.0)  # past the 480 s hot TTL, within the host tier's 1,800 s
    prepared = PreparedTrace(trace, profile.block_size)
    hot_only = summarize(simulate(prepared, profile, mode="reverse_read", ttl_s=480.0))
    tiered_run = simulate(prepared, profile, mode="reverse_read", ttl_s=480.0, tiers=(HOST,))
    tiered = summarize(tiered_run)
    recompute = summarize(simulate(prepared, profile, mode="cache_miss"))
    assert hot_only["hit_rate"] == 0.0 and hot_only["reasons"]["expired"] == 8
    assert tiered["hit_rate"] == 1.0 and tiered["tiers"]["host"]["reads"] == 8
    # the host tier's read is slower than a hot one would be, and still far faster than recomputing
    hot_read = summarize(simulate(PreparedTrace(uniform_trace(conversations=4, turns=3, first_tokens=8000,
                                                                new_tokens=200, output_tokens=100, gap_s=10.0),
                                                 profile.block_size), profile, mode="reverse_read", ttl_s=480.0))
    assert hot_read["later_ttft_s"]["mean"] < tiered["later_ttft_s"]["mean"] < recompute["ttft_s"]["p99"]
    # memory: the hot tier holds each retention its 480 s either way; the host tier the rest of each pause
    assert tiered["retained_gib_s"] == pytest.approx(hot_only["retained_gib_s"])
    assert tiered["tiers"]["host"]["retained_gib_s"] == pytest.approx(
        hot_only["retained_gib_s"] * (900.0 - 480.0) / 480.0 * 8 / 12 + hot_only["retained_gib_s"] * 4 / 12 * 1800.0
        / 480.0, rel=0.02)
    host = tiered["tiers"]["host"]
    assert host["cost"] == pytest.approx(host["retained_gib_s"] / 3600 * 0.001)


def test_a_pause_past_every_tier_recomputes() -> None:
    profile = load_profile("h200-efa-qwen3-32b")
    trace = uniform_trace(conversations=2, turns=2, first_tokens=4000, new_tokens=100, output_tokens=50,
                          gap_s=3000.0)
    run = summarize(simulate(PreparedTrace(trace, profile.block_size), profile, mode="reverse_read", ttl_s=480.0,
                             tiers=(HOST,)))
    assert run["hit_rate"] == 0.0 and run["reasons"]["expired"] == 2
