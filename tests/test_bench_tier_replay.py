"""``kvshuttle bench tier-replay``'s pure parts: the shortened trace, the gauges, peaks, the planner's prediction
and the comparison (no vLLM, no aiperf, no redis-server)."""

from __future__ import annotations

import json
from typing import Any

from kvshuttle.bench import tier_replay
from kvshuttle.planner import parse_trace

TRACE = [
    {"session_id": "a", "input_length": 15818, "output_length": 154, "timestamp": 0},
    {"session_id": "a", "input_length": 31, "output_length": 9, "delay": 3000},
    {"session_id": "a", "input_length": 12739, "output_length": 50, "delay": 40000},
    {"session_id": "b", "input_length": 200, "output_length": 30, "timestamp": 0},
    {"session_id": "b", "input_length": 40, "output_length": 30, "delay": 1000},
    {"session_id": "c", "input_length": 10, "output_length": 10, "timestamp": 0},
]


def _shorten(**kw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    opts: dict[str, Any] = {"sessions": 2, "turns": 3, "first_tokens": 512, "turn_tokens": 96, "answer_tokens": 16,
                            "time_scale": 0.5, "max_gap_s": 8.0, "stagger_s": 2.0, "prefix": "r"}
    opts.update(kw)
    return tier_replay.shorten(TRACE, **opts)


def test_shorten_caps_lengths_and_scales_gaps() -> None:
    live, _ = _shorten()
    assert [r["session_id"] for r in live] == ["r-a"] * 3 + ["r-b"] * 2  # session c left out
    assert [r["input_length"] for r in live] == [512, 31, 96, 200, 40]
    assert [r["output_length"] for r in live] == [16, 9, 16, 16, 16]
    assert [r.get("timestamp") for r in live] == [0, None, None, 2000, None]  # sessions start 2 s apart
    assert [r.get("delay") for r in live] == [None, 1500, 8000, None, 500]  # x 0.5, 20 s capped at 8
    assert all(r["extra"] == {"conversation_id": r["session_id"]} for r in live)


def test_shorten_writes_the_same_turns_for_the_planner() -> None:
    _, plan = _shorten()
    a = [r for r in plan if r["conversation"] == "r-a"]
    assert [r["prompt_tokens"] for r in a] == [512, 512 + 16 + 31, 512 + 16 + 31 + 9 + 96]  # history + answers
    assert [r["new_tokens"] for r in a] == [512, 31, 96]
    assert [r["gap_s"] for r in plan] == [0.0, 1.5, 8.0, 2.0, 0.5]
    trace = parse_trace([json.dumps(r) for r in plan])
    assert [len(c.turns) for c in trace.conversations] == [3, 2]


def test_gauges_peaks_and_comparison() -> None:
    text = "\n".join(['# HELP vllm:kvshuttle_retained_blocks Blocks kept for readers',
                      'vllm:kvshuttle_retained_blocks{engine="0",model_name="tiny"} 12.0',
                      'vllm:kvshuttle_retained_blocks_other 99.0',
                      'vllm:kvshuttle_tier_blocks{engine="0",tier="host"} 7.0'])
    assert tier_replay.gauges(text) == (12.0, 7.0)
    assert tier_replay.gauges("") == (0.0, 0.0)
    assert tier_replay.peaks([(0.0, 4.0, 0.0), (0.2, 10.0, 3.0), (0.4, 1.0, 9.0)]) == {
        "hot_peak_blocks": 10.0, "tier_peak_blocks": 9.0, "hot_mean_blocks": 5.0}
    results = [{"row": "single", "hot_peak_blocks": 40.0, "hit_rate": 1.0,
                "predicted": {"hot_peak_blocks": 50.0, "hit_rate": 1.0}},
               {"row": "tiered", "hot_peak_blocks": 10.0, "hit_rate": 0.9,
                "predicted": {"hot_peak_blocks": 15.0, "hit_rate": 1.0}}]
    assert tier_replay.compare(results) == {"measured_hot_peak_ratio": 0.25, "predicted_hot_peak_ratio": 0.3,
                                            "measured_hit_rate": {"single": 1.0, "tiered": 0.9},
                                            "predicted_hit_rate": {"single": 1.0, "tiered": 1.0}}
    assert tier_replay.compare(results[:1]) == {}


def test_the_planner_predicts_a_lower_hot_peak_with_a_short_ttl_and_a_tier() -> None:
    _, plan = _shorten()
    single = tier_replay.predict(plan, "measured", ttl_s=600.0, tier_ttl_s=None)
    tiered = tier_replay.predict(plan, "measured", ttl_s=0.2, tier_ttl_s=1800.0)
    assert single["hit_rate"] == tiered["hit_rate"] == 1.0  # every later turn reads, hot or from the tier
    assert tiered["hot_peak_blocks"] < single["hot_peak_blocks"] and tiered["tier_reads"] > 0
    assert single["tier_peak_blocks"] == 0
