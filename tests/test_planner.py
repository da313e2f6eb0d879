"""The planner's simulation: every behaviour it claims, on small traces (no timing)."""

from __future__ import annotations

import importlib
import math

import pytest

from kvshuttle.planner import (
    CostProfile,
    PreparedTrace,
    SyntheticSpec,
    load_profile,
    retained_stats,
    simulate,
    summarize,
    synthetic_trace,
    uniform_trace,
)
from kvshuttle.planner.errors import PlannerError
from kvshuttle.planner.profile import GIB
from kvshuttle.policy import decide as real_decide


def _profile(**changes: float | int | str) -> CostProfile:
    base = {"name": "test", "kv_bytes_per_token": 1024.0, "block_size": 16, "bandwidth_bytes_per_s": 1e9,
            "transfer_overhead_s": 0.001, "prefill_fixed_s": 0.01, "prefill_tokens_per_s": 10_000.0,
            "attention_ratio": 1e-5, "decode_fixed_s": 0.0, "decode_s_per_token": 0.01, "prefill_cache_gib": 1.0}
    return CostProfile(**{**base, **changes})  # type: ignore[arg-type]


PROFILE = _profile()
sim_module = importlib.import_module("kvshuttle.planner.simulate")  # the module, not the re-exported function


def _run(trace, mode="reverse_read", profile=PROFILE, **kw):  # type: ignore[no-untyped-def]
    return simulate(PreparedTrace(trace, profile.block_size), profile, mode=mode, **kw)


def test_a_continuation_reads_the_previous_prompt_and_answer() -> None:
    trace = uniform_trace(conversations=1, turns=3, first_tokens=1000, new_tokens=50, output_tokens=20)
    run = _run(trace, ttl_s=60)
    # turn 2: prompt 1070, decode holds 1000 + 20 - 1 = 1019 tokens; all verified, all fetched
    assert run.fetched == [0, 1019, 1089]
    assert run.recomputed == [1000, 1070 - 1019, 1140 - 1089]
    assert run.reasons["fetch"] == 2
    off = _run(trace, mode="cache_miss")
    assert all(on < base for on, base in zip(run.ttft[1:], off.ttft[1:], strict=True))


def test_zero_reusable_context_gives_the_baseline_ttft_exactly() -> None:
    trace = uniform_trace(conversations=3, turns=4, first_tokens=3000, new_tokens=100, output_tokens=50, fresh=True,
                          gap_s=1.0)
    on, off = _run(trace, ttl_s=480), _run(trace, mode="cache_miss")
    assert on.ttft == off.ttft
    assert sum(on.fetched) == 0
    assert on.reasons["nothing_verified"] == 9


def test_a_gap_past_the_ttl_is_a_miss_and_costs_a_recompute() -> None:
    ttl, margin = 100.0, 5.0
    late = uniform_trace(conversations=1, turns=2, first_tokens=2000, new_tokens=10, output_tokens=10,
                         gap_s=ttl - margin)
    early = uniform_trace(conversations=1, turns=2, first_tokens=2000, new_tokens=10, output_tokens=10,
                          gap_s=ttl - margin - 0.5)
    missed = _run(late, ttl_s=ttl, expiry_margin_s=margin)
    hit = _run(early, ttl_s=ttl, expiry_margin_s=margin)
    assert missed.fetched[1] == 0
    assert missed.reasons["expired"] == 1
    assert missed.ttft[1] == _run(late, mode="cache_miss").ttft[1]
    assert hit.fetched[1] > 0


def test_edited_history_reuses_only_the_shared_prefix() -> None:
    trace = uniform_trace(conversations=1, turns=2, first_tokens=2000, new_tokens=64, output_tokens=16, edit_at=100)
    run = _run(trace, ttl_s=60)
    assert run.fetched[1] == 96  # 6 whole 16-token blocks before the edit at token 100
    assert run.recomputed[1] == 2080 - 96


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_longer_ttl_never_lowers_hit_rate_or_retained_memory(seed: int) -> None:
    spec = SyntheticSpec(conversations=12, turns_min=3, turns_max=8, first_tokens=1500, new_tokens=200,
                         output_tokens=80, tool_gap_s=5.0, human_gap_s=200.0, human_fraction=0.5, seed=seed)
    prepared = PreparedTrace(synthetic_trace(spec), PROFILE.block_size)
    previous = None
    for ttl in (0.0, 10.0, 30.0, 60.0, 120.0, 240.0, 480.0, 3600.0):
        m = summarize(simulate(prepared, PROFILE, mode="reverse_read", ttl_s=ttl))
        if previous is not None:
            assert m["hit_rate"] >= previous["hit_rate"]
            assert m["retained_gib_s"] >= previous["retained_gib_s"] - 1e-12
            assert m["retained_peak_gib"] >= previous["retained_peak_gib"] - 1e-12
        previous = m
    assert previous is not None and previous["hit_rate"] > 0


def test_retention_ends_at_the_next_request_or_the_ttl() -> None:
    trace = uniform_trace(conversations=1, turns=2, first_tokens=160, new_tokens=16, output_tokens=17, gap_s=30.0)
    run = _run(trace, ttl_s=100.0)
    # turn 1's handle: 176 tokens = 11 blocks, held 30 s (until turn 2 arrives); turn 2's: until its TTL
    (s1, e1, b1), (s2, e2, b2) = run.retained
    assert (e1 - s1, b1) == (30.0, 11 * 16 * 1024.0)
    assert e2 - s2 == 100.0
    assert retained_stats(run.retained)[1] == pytest.approx((30.0 * b1 + 100.0 * b2) / GIB)
    assert _run(trace, mode="cache_miss").retained == []


def test_retained_stats_peak_and_gib_seconds() -> None:
    peak, gib_s = retained_stats([(0.0, 10.0, GIB), (5.0, 20.0, 2 * GIB), (10.0, 12.0, GIB)])
    assert peak == 3.0  # [5, 10): 1 + 2; at 10 the first leaves before the third arrives
    assert gib_s == pytest.approx(10 + 30 + 2)
    assert retained_stats([]) == (0.0, 0.0)


def test_the_break_even_threshold_is_where_the_costs_cross() -> None:
    profile = _profile(transfer_overhead_s=0.02, bandwidth_bytes_per_s=1e12, attention_ratio=0.0)
    n = profile.break_even_tokens()
    assert n is not None and n > 1

    def read(k: int) -> float:
        return profile.transfer_s(-(-k // profile.block_size))

    assert read(n) < profile.compute_s(n, 0)
    assert read(n - 1) >= profile.compute_s(n - 1, 0)
    assert 0.02 * 10_000 <= n <= 0.02 * 10_000 + 16  # overhead x throughput, within a block
    slow_link = _profile(bandwidth_bytes_per_s=1e3, attention_ratio=0.0)
    assert slow_link.break_even_tokens() is None


def test_thresholds_follow_the_policy_and_cost_mode_declines_where_reads_lose() -> None:
    trace = uniform_trace(conversations=1, turns=2, first_tokens=100, new_tokens=10, output_tokens=10)
    assert _run(trace, ttl_s=60, threshold=64).fetched[1] == 109
    below = _run(trace, ttl_s=60, threshold=256)
    assert below.fetched[1] == 0
    assert below.reasons["below_threshold"] == 1
    costly = _profile(transfer_overhead_s=1.0)
    assert _run(trace, profile=costly, ttl_s=60, threshold="cost").reasons["recompute_cheaper"] == 1


def test_every_read_is_decided_by_the_policy_module(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs["local_hit_tokens"])
        return real_decide(*args, **kwargs)

    monkeypatch.setattr(sim_module, "decide", spy)
    trace = uniform_trace(conversations=2, turns=3, first_tokens=500, new_tokens=20, output_tokens=20)
    _run(trace, ttl_s=60)
    assert len(calls) == 4  # the later turns of two conversations


def test_local_prefix_cache_hits_the_previous_prompt_only_and_evicts_lru() -> None:
    trace = uniform_trace(conversations=1, turns=2, first_tokens=1000, new_tokens=50, output_tokens=30)
    run = _run(trace, mode="local_cache")
    assert run.local == [0, 992]  # whole blocks of turn 1's prompt; the answer was never on prefill
    both = _run(trace, mode="reverse_read+local_cache", ttl_s=60)
    assert (both.local[1], both.fetched[1]) == (992, 0)  # 1029 - 992 = 37 more tokens: below the threshold
    longer = uniform_trace(conversations=1, turns=2, first_tokens=1000, new_tokens=50, output_tokens=100)
    both = _run(longer, mode="reverse_read+local_cache", ttl_s=60)
    assert (both.local[1], both.fetched[1]) == (992, 1099 - 992)  # the read starts after the local hit
    tiny = _profile(prefill_cache_gib=992 * 1024 / GIB)  # 62 blocks: less than two 50-block prompts
    two = uniform_trace(conversations=2, turns=2, first_tokens=800, new_tokens=20, output_tokens=10, gap_s=5.0)
    # conversation 1's prompt evicts the tail of conversation 0's (LRU), then the other way round
    assert _run(two, mode="local_cache", profile=tiny).local == [0, 0, 992 - 800, 992 - 816]
    assert _run(two, mode="local_cache").local == [0, 0, 800, 800]


def test_queueing_only_adds_waiting() -> None:
    trace = uniform_trace(conversations=6, turns=3, first_tokens=2000, new_tokens=100, output_tokens=10)
    free, queued = _run(trace, mode="cache_miss"), _run(trace, mode="cache_miss", queue=True)
    assert sum(queued.ttft) > sum(free.ttft)
    assert all(q >= f - 1e-12 for q, f in zip(sorted(queued.ttft), sorted(free.ttft), strict=True))


def test_turn_latency_is_ttft_plus_decode() -> None:
    trace = uniform_trace(conversations=1, turns=2, first_tokens=300, new_tokens=10, output_tokens=40)
    m = summarize(_run(trace, ttl_s=60))
    run = _run(trace, ttl_s=60)
    assert m["turn_s"]["mean"] == pytest.approx(sum(run.ttft) / 2 + 40 * 0.01)


def test_bad_simulation_arguments_are_named() -> None:
    prepared = PreparedTrace(uniform_trace(conversations=1, turns=1, first_tokens=10, new_tokens=0,
                                           output_tokens=1), 16)
    with pytest.raises(PlannerError, match="mode"):
        simulate(prepared, PROFILE, mode="warp")  # type: ignore[arg-type]
    with pytest.raises(PlannerError, match="TTL"):
        simulate(prepared, PROFILE, mode="cache_miss", ttl_s=math.inf)
    with pytest.raises(PlannerError, match="block size"):
        simulate(prepared, load_profile("measured"), mode="cache_miss")


def test_a_layered_read_costs_the_longer_of_read_and_compute_plus_one_layer_of_the_other() -> None:
    p = _profile(num_layers=4, layer_overhead_s=0.0001, transfer_overhead_s=0.001)
    blocks, new, context = 100, 500.0, 1600.0
    read = p.rank_block_bytes(blocks) / p.bandwidth_bytes_per_s
    compute = p.compute_s(new, context)
    assert p.layered_s(blocks, new, context) == pytest.approx(
        0.001 + max(read + compute / 4, read / 4 + compute) + 4 * 0.0001)
    # never worse than reading then computing, unless the per-layer overhead eats the overlap
    assert p.layered_s(blocks, new, context) < p.transfer_s(blocks) + compute
    # read-bound: the read, plus one layer's compute; compute-bound: the compute, plus one layer's read
    heavy = p.with_changes(bandwidth_bytes_per_s=1e6, layer_overhead_s=0.0)
    heavy_read = heavy.rank_block_bytes(blocks) / 1e6
    assert heavy.layered_s(blocks, new, context) == pytest.approx(0.001 + heavy_read + compute / 4)
    light = p.with_changes(bandwidth_bytes_per_s=1e12, layer_overhead_s=0.0)
    assert light.layered_s(blocks, new, context) == pytest.approx(0.001 + light.rank_block_bytes(blocks) / 1e12 / 4
                                                                  + compute)
    # nothing to overlap: one layer, or no read
    assert p.with_changes(num_layers=1).layered_s(blocks, new, context) == pytest.approx(p.transfer_s(blocks)
                                                                                         + compute)
    assert p.layered_s(0, new, context) == pytest.approx(compute)


def test_layered_simulation_reads_whole_blocks_and_is_faster_where_reads_overlap_compute() -> None:
    trace = uniform_trace(conversations=1, turns=3, first_tokens=1000, new_tokens=50, output_tokens=20)
    p = _profile(num_layers=8, bandwidth_bytes_per_s=1e8)  # reads of ~10 ms: worth overlapping
    on, layered = _run(trace, profile=p, ttl_s=60), _run(trace, profile=p, ttl_s=60, layered=True)
    assert on.fetched == [0, 1019, 1089] and layered.fetched == [0, 1008, 1088]  # cut to 16-token blocks
    assert all(lay < a for lay, a in zip(layered.ttft[1:], on.ttft[1:], strict=True))
    assert layered.ttft[0] == on.ttft[0]  # nothing read: nothing changes
    # fewer than one whole block verified: read the asynchronous way, as the connector does
    short = uniform_trace(conversations=1, turns=2, first_tokens=10, new_tokens=5, output_tokens=2)
    assert _run(short, profile=p, threshold=1, layered=True).fetched == _run(short, profile=p, threshold=1).fetched


def test_profiles_check_the_layer_fields() -> None:
    with pytest.raises(Exception, match="num_layers"):
        _profile(num_layers=-1)
    with pytest.raises(Exception, match="layer_overhead_s"):
        _profile(layer_overhead_s=-1.0)
