"""``kvshuttle bench clients``' pure parts: trace conversion, counting reads, aiperf's exports, the table
(no vLLM, no aiperf, no redis-server)."""

from __future__ import annotations

import json
from typing import Any

from kvshuttle.bench import clients

TRACE = [
    {"session_id": "a", "input_length": 15818, "output_length": 154, "timestamp": 0, "extra": {"conversation_id": "a"}},
    {"session_id": "a", "input_length": 31, "output_length": 99, "delay": 3000, "extra": {"conversation_id": "a"}},
    {"session_id": "a", "input_length": 12739, "output_length": 5, "delay": 10000},
    {"session_id": "b", "input_length": 200, "output_length": 30, "timestamp": 0},
    {"session_id": "b", "input_length": 40, "output_length": 30, "delay": 1},
    {"session_id": "c", "input_length": 10, "output_length": 10, "timestamp": 0},
]


def _convert(key: str | None, **kw: Any) -> list[dict[str, Any]]:
    opts: dict[str, Any] = {"sessions": 2, "turns": 3, "first_tokens": 512, "turn_tokens": 96, "answer_tokens": 16,
                            "delay_ms": 300, "key": key, "keyed_turns": 1, "prefix": "row7"}
    opts.update(kw)
    return clients.convert(TRACE, **opts)


def test_convert_caps_lengths_and_keeps_the_first_sessions() -> None:
    rows = _convert("body")
    assert [r["session_id"] for r in rows] == ["row7-a"] * 3 + ["row7-b"] * 2  # session c left out
    assert [r["input_length"] for r in rows] == [512, 31, 96, 200, 40]
    assert [r["output_length"] for r in rows] == [16, 16, 5, 16, 16]
    assert rows[0]["timestamp"] == 0 and "delay" not in rows[0]
    assert rows[1]["delay"] == 300 and "timestamp" not in rows[1]  # the trace's seconds are not replayed
    assert all(r["extra"] == {"conversation_id": r["session_id"]} for r in rows)


def test_convert_keys_per_row() -> None:
    assert all("extra" not in r for r in _convert(None))
    some = _convert("some", keyed_turns=1)
    assert ["extra" in r for r in some] == [True, False, False, True, False]  # each session's first turn only
    assert len(_convert("body", turns=1)) == 2


def test_read_lines_counts_the_workers_reads_not_the_schedulers_decisions() -> None:
    log = ("INFO [scheduler.py:467] kvshuttle: request r-2 reads 512 tokens (fetch blocks [0, 16))\n"
           "INFO [worker.py:341] kvshuttle: request r-2 read 512 tokens (16.0 MiB, 128 descriptors) in 3 ms\n"
           "INFO [worker.py:346] kvshuttle: request r-3 recomputes, because peer_lost\n"
           "INFO [worker.py:341] kvshuttle: request r-4 read 576 tokens (18.0 MiB) in 4 ms\n")
    assert clients.read_lines(log) == [512, 576]


def _record(session: str, turn: int, chunks: list[str], start: int = 1_000_000) -> str:
    responses = [{"perf_ns": start + 2_000_000 * (i + 1),
                  "packets": [{"name": "data", "value": json.dumps({"choices": [{"delta": {"content": c}}]})}]}
                 for i, c in enumerate(chunks)]
    responses.append({"perf_ns": start + 99_000_000, "packets": [{"name": "data", "value": "[DONE]"}]})
    return json.dumps({"metadata": {"conversation_id": session, "turn_index": turn}, "start_perf_ns": start,
                       "status": 200, "responses": responses,
                       "payload": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}})


def test_raw_turns_ttft_answers_and_samples() -> None:
    lines = [_record("s1", 0, ["", " a", " b"]), _record("s1", 1, [" c"]), _record("s2", 0, [" d"]), "not json"]
    turns = clients.raw_turns(lines)
    assert [(t["session"], t["turn"], t["answer"]) for t in turns] == [("s1", 0, " a b"), ("s1", 1, " c"),
                                                                      ("s2", 0, " d")]
    assert turns[0]["ttft_ms"] == 4.0  # the empty role chunk does not count as the first token
    assert turns[0]["max_tokens"] == 4
    assert clients.later_ttft_p50_ms(turns) == 2.0
    assert sorted((t["session"], t["turn"]) for t in clients.last_turns(turns)) == [("s1", 1), ("s2", 0)]


def test_ttft_from_aiperf_summary() -> None:
    assert clients.ttft_p50_ms({"time_to_first_token": {"unit": "ms", "p50": 979.899}}) == 979.9
    assert clients.ttft_p50_ms({"time_to_first_token": {"unit": "ns", "p50": 2.5e6}}) == 2.5
    assert clients.ttft_p50_ms({}) is None


def _row(name: str, reused: int, ttft: float) -> dict[str, Any]:
    return {"row": name, "turns": 12, "later_turns": 9, "reused_turns": reused, "read_tokens": 100 * reused,
            "ttft_p50_ms": ttft, "later_ttft_p50_ms": ttft, "answers_checked": 3, "answers_equal": 3}


def test_summary_ratios_and_table() -> None:
    results = [_row("body", 9, 500.0), _row("none", 9, 550.0), _row("dropped", 6, 600.0), _row("recompute", 0, 1000.0)]
    clients.summarise(results)
    assert [r["reused_over_body"] for r in results] == [1.0, 1.0, 0.667, 0.0]
    assert [r["ttft_over_recompute"] for r in results] == [0.5, 0.55, 0.6, 1.0]
    assert results[0]["seconds"] == {"ttft_median": 0.5} and results[0]["rounds"] == 9  # the schema's fields
    table = clients.format_table({"results": results})
    assert table.splitlines()[2].split()[:4] == ["none", "12", "9", "9"]
    assert "3/3" in table


def test_summary_without_a_body_or_recompute_row() -> None:
    results = [_row("none", 3, 400.0)]
    clients.summarise(results)
    assert results[0]["reused_over_body"] is None and results[0]["ttft_over_recompute"] is None


def test_tier_counts_sum_the_decodes_tier_counters_and_ignore_the_rest() -> None:
    text = "\n".join([
        '# HELP vllm:kvshuttle_tier_reads Reads served from a tier',
        'vllm:kvshuttle_tier_reads_total{engine="0",model_name="tiny",tier="host"} 3.0',
        'vllm:kvshuttle_tier_reads_created{engine="0",model_name="tiny",tier="host"} 1.7e9',
        'vllm:kvshuttle_tier_demotions_total{engine="0",tier="host"} 4.0',
        'vllm:kvshuttle_tier_demotions_total{engine="1",tier="host"} 1.0',
        'vllm:kvshuttle_tier_blocks{engine="0",tier="host"} 9.0',
        'vllm:num_requests_running{engine="0"} 2.0',
    ])
    text += '\nvllm:kvshuttle_tier_reads_total{engine="0",tier="disk"} 2.0'
    assert clients.tier_counts(text) == {"reads": 5.0, "demotions": 5.0, "misses": 0.0, "host_reads": 3.0,
                                         "disk_reads": 2.0, "host_demotions": 5.0}
    assert clients.tier_counts("") == {"reads": 0.0, "demotions": 0.0, "misses": 0.0}


def test_the_tier_row_is_the_body_row_paused_past_the_hot_ttl() -> None:
    tier, disk, body = clients.ROWS["tier"], clients.ROWS["disk"], clients.ROWS["body"]
    assert tier["paused"] == "tier" and disk["paused"] == "disk" and not body.get("paused")
    assert tier["key"] == disk["key"] == body["key"] and tier["router"] == disk["router"] == body["router"] == []
    rows = _convert("body", delay_ms=9000)
    assert [r.get("delay") for r in rows] == [None, 9000, 9000, None, 9000]
