"""The planner against ``kvshuttle bench placement``: round-robin routing, measured homes, a one-at-a-time client
and re-tokenized answers in the simulator (exact token counts on small traces), the validation on a synthetic
placement output with known answers, and ``kvshuttle plan --validate-placement`` on the committed rows."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.bench.cost_inputs import cost_inputs_from_bench
from kvshuttle.cli import main
from kvshuttle.planner import CostProfile, Placement, PlannerError, PreparedTrace, simulate, uniform_trace
from kvshuttle.planner.simulate import ModeRun
from kvshuttle.planner.validate import TINY_KV_BYTES_PER_TOKEN, default_transfer_paths
from kvshuttle.planner.validate_placement import (
    default_placement_path,
    format_placement_validation,
    load_placement,
    measured_homes,
    measured_trace,
    validate_placement,
)

PROFILE = CostProfile.from_dict({
    "name": "rr", "kv_bytes_per_token": 1024.0, "block_size": 32, "bandwidth_bytes_per_s": 1e9,
    "transfer_overhead_s": 0.001, "prefill_fixed_s": 0.01, "prefill_tokens_per_s": 10_000.0,
    "attention_ratio": 0.0, "decode_fixed_s": 0.0, "decode_s_per_token": 0.001, "prefill_cache_gib": 1.0})
# 3 conversations of 3 turns: prompts 100, 208, 316 (previous prompt + 48-token answer + 60 new tokens)
TRACE = uniform_trace(conversations=3, turns=3, first_tokens=100, new_tokens=60, output_tokens=48, gap_s=1.5)


def _later(run: ModeRun, field: str) -> list[int]:
    return [v for v, later in zip(getattr(run, field), run.later, strict=True) if later]


def test_round_robin_takes_the_workers_in_turn_by_arrival() -> None:
    prepared = PreparedTrace(TRACE, 32)
    run = simulate(prepared, PROFILE, mode="local_cache", prefill_workers=2, one_at_a_time=True,
                   placement=Placement(round_robin=True))
    # arrivals c0 c1 c2 | c0 c1 c2 | ... on workers 0 1 0 | 1 0 1 | 0 1 0: every turn 2 lands on the other
    # worker (nothing cached), every turn 3 back where turn 1 ran (its prompt's 3 whole blocks)
    assert _later(run, "local") == [0, 0, 0, 96, 96, 96]
    assert run.turn_keys == [(c, k) for k in range(3) for c in range(3)]
    home = simulate(prepared, PROFILE, mode="local_cache", prefill_workers=2, one_at_a_time=True,
                    placement=Placement(affinity=True, homes=(1, 1, 0)))
    assert _later(home, "local") == [96, 96, 96, 192, 192, 192]  # at home: the previous prompt's whole blocks


def test_homes_must_name_a_worker_for_every_conversation() -> None:
    prepared = PreparedTrace(TRACE, 32)
    for homes in ((0, 1), (0, 1, 2)):
        with pytest.raises(PlannerError, match="homes"):
            simulate(prepared, PROFILE, mode="local_cache", prefill_workers=2,
                     placement=Placement(affinity=True, homes=homes))


def test_one_client_sends_each_turn_after_the_previous_answer() -> None:
    run = simulate(PreparedTrace(TRACE, 32), PROFILE, mode="reverse_read", one_at_a_time=True)
    ends = [start for start, _, _ in run.retained]  # a handle is retained from its turn's end
    busy = [t + d for t, d in zip(run.ttft, run.decode, strict=True)]
    assert all(b - a >= busy[i + 1] - 1e-9 for i, (a, b) in enumerate(itertools.pairwise(ends)))
    together = simulate(PreparedTrace(TRACE, 32), PROFILE, mode="reverse_read")
    assert max(s for s, _, _ in together.retained) < max(ends)  # concurrent conversations finish sooner


@pytest.mark.parametrize(("kept", "turn2", "turn3"), [
    (None, 147, 255),  # all of it: the whole handle (prompt + answer - 1), its verified partial tail block too
    (0, 96, 192),  # none: the previous prompt's whole blocks (its partial block differs after the prompt)
    (16, 96, 224),  # 100 + 16 ends inside block 3; 208 + 16 = 224 is a block boundary
    (28, 128, 224)])
def test_a_reverse_read_gets_only_the_answer_tokens_that_survive_re_tokenization(
        kept: int | None, turn2: int, turn3: int) -> None:
    # the next prompt matches the handle on the previous prompt and ``kept`` answer tokens, read by verified blocks
    run = simulate(PreparedTrace(TRACE, 32, answer_kept_tokens=kept), PROFILE, mode="reverse_read")
    assert _later(run, "fetched") == [turn2] * 3 + [turn3] * 3  # in arrival order: turn 2s, then turn 3s


def test_a_pre_warmed_prefill_holds_the_re_rendered_answer() -> None:
    prepared = PreparedTrace(TRACE, 32, answer_kept_tokens=0)
    cold = simulate(prepared, PROFILE, mode="reverse_read+local_cache", placement=Placement(affinity=True))
    warm = simulate(prepared, PROFILE, mode="reverse_read+local_cache",
                    placement=Placement(affinity=True, prewarm=True))
    assert _later(cold, "local") == [96] * 3 + [192] * 3 and sum(cold.fetched) == 0  # the decode has nothing more
    assert _later(warm, "local") == [128] * 3 + [256] * 3  # prompt + 48 re-rendered answer tokens, whole blocks


def test_decode_local_decides_on_the_new_tokens_and_reuses_the_previous_prompt() -> None:
    prepared = PreparedTrace(TRACE, 32, answer_kept_tokens=0)
    local = simulate(prepared, PROFILE, mode="reverse_read", placement=Placement(decode_local_tokens=60))
    assert local.reasons["decode_local"] == 6
    assert _later(local, "local") == [96] * 3 + [192] * 3
    assert _later(local, "recomputed") == [112] * 3 + [124] * 3
    tight = simulate(prepared, PROFILE, mode="reverse_read", placement=Placement(decode_local_tokens=59))
    assert tight.reasons["decode_local"] == 0


def test_negative_answer_kept_tokens_is_refused() -> None:
    with pytest.raises(PlannerError, match="answer_kept_tokens"):
        PreparedTrace(TRACE, 32, answer_kept_tokens=-1)


# ------------------------------------------------------------------------------------ a synthetic placement
PROMPTS = (100, 208, 316)
TRANSFER = [str(p) for p in default_transfer_paths(default_placement_path())]


def _read_s(tokens: int) -> float:
    if not tokens:
        return 0.0
    inputs = cost_inputs_from_bench(TRANSFER, shape="qwen3-32b-tp1", pattern="contiguous")
    return inputs["transfer_overhead_s"] + tokens * TINY_KV_BYTES_PER_TOKEN / inputs["bandwidth_bytes_per_s"]


def _turn(conv: int, turn: int, prefill: int | None, local: int, read: int, slow: float = 1.0,
          placement: str = "recompute") -> dict[str, Any]:
    computed = PROMPTS[turn - 1] - local - read
    ttft = (0.5 + computed / 1000 + _read_s(read)) * slow  # 0.5 s + 1000 tokens/s, the tiny model's reads
    return {"conversation": conv, "turn": turn, "ttft_s": ttft, "latency_s": ttft + 48 * 0.05,
            "placement": placement, "prefill": prefill, "prompt_tokens": PROMPTS[turn - 1], "local_tokens": local,
            "read_tokens": read, "computed_tokens": computed, "decode_local_tokens": 0, "matches_recompute": True}


def synthetic_placement() -> dict[str, Any]:
    """Exact token counts of each configuration (hand-computed) and TTFTs from a known cost model."""
    homes = (0, 1, 0)
    affinity = [_turn(c, 1, homes[c], 0, 0) for c in range(3)] + [
        _turn(c, k, homes[c], (96, 192)[k - 2], 0) for k in (2, 3) for c in range(3)]
    floor = [_turn(c, 1, 1, 0, 0) for c in range(3)] + [
        _turn(c, k, 1, (128, 256)[k - 2], 0) for k in (2, 3) for c in range(3)]
    slow = [dict(t, ttft_s=t["ttft_s"] * (1.5 if t["turn"] > 1 else 1.0)) for t in affinity]
    # round robin by arrival: 0 1 0 | 1 0 1 | 0 1 0; turn 2 reads the previous prompt, turn 3 finds turn 1's
    spread = [_turn(c, 1, c % 2, 0, 0) for c in range(3)] + [_turn(c, 2, (c + 1) % 2, 0, 96) for c in range(3)] + [
        _turn(c, 3, c % 2, 96, 96) for c in range(3)]
    results = [{"config": name, "turns": turns} for name, turns in (
        ("floor", floor), ("local_cache", affinity), ("reverse_reads", slow), ("spread_reverse", spread),
        ("later_idea", affinity))]
    return {"bench": "placement", "config": {"answer_tokens": 48, "gap_s": 1.5, "decode_local": 256},
            "results": results}


def test_the_validation_recovers_a_known_cost_model_and_flags_the_slow_configuration() -> None:
    result = validate_placement(synthetic_placement(), TRANSFER)
    assert result["profile"]["prefill_fixed_s"] == pytest.approx(0.5, rel=1e-6)
    assert result["profile"]["prefill_tokens_per_s"] == pytest.approx(1000, rel=1e-6)
    rows = {x["config"]: x for x in result["rows"]}
    assert list(rows) == ["floor", "local_cache", "reverse_reads", "spread_reverse"]
    assert result["not_modelled"] == ["later_idea"]
    assert rows["floor"]["kind"] == "fit" and not rows["floor"]["miss"]
    for name in ("local_cache", "spread_reverse"):
        assert rows[name]["ttft_error"] == pytest.approx(0, abs=1e-6) and not rows[name]["miss"]
        assert rows[name]["tokens_match"] and rows[name]["per_turn_within"] == 6
    assert rows["spread_reverse"]["predicted"]["read"] == 6 * 96
    assert rows["local_cache"]["predicted"]["ttft_s"] == pytest.approx(0.618)  # median of 0.612 x3, 0.624 x3
    assert rows["local_cache"]["predicted_over_floor"] == pytest.approx(0.618 / 0.57)
    slow = rows["reverse_reads"]
    assert slow["miss"] and slow["ttft_error"] == pytest.approx(1 / 1.5 - 1) and slow["tokens_match"]
    assert "per turn 0 of 6" in slow["reasons"][0]
    assert "prefill 0 -33% (4 turns), prefill 1 -33% (2 turns)" in slow["reasons"][1]  # homes 0, 1, 0
    assert result["summary"]["within_target"] == 2 and result["summary"]["predicted_configs"] == 3
    text = format_placement_validation(result)
    assert "MISS reverse_reads:" in text and "not modelled: later_idea" in text
    assert "2 of 3 predicted configurations within +-20%" in text


def test_a_decode_local_miss_names_the_router_s_estimate() -> None:
    data = synthetic_placement()
    turns = [dict(t, prefill=None, placement="decode_local") if t["turn"] > 1 else t
             for t in data["results"][1]["turns"]]  # measured: every later turn on the decode
    data["results"].append({"config": "decode_local", "turns": turns})
    data["config"]["decode_local"] = 50  # the planner: 60 new tokens are more than 50, through the prefill
    row = next(x for x in validate_placement(data, TRANSFER)["rows"] if x["config"] == "decode_local")
    assert row["predicted"]["decode_local_turns"] == 0 and row["measured"]["decode_local_turns"] == 6
    data["config"]["decode_local"] = 60
    row = next(x for x in validate_placement(data, TRANSFER)["rows"] if x["config"] == "decode_local")
    assert row["predicted"]["decode_local_turns"] == 6 and row["tokens_match"]


def test_bad_placement_outputs_get_named_errors(tmp_path: Path) -> None:
    good = synthetic_placement()
    no_floor = copy.deepcopy(good)
    no_floor["results"] = no_floor["results"][1:]
    missing = copy.deepcopy(good)
    del missing["results"][1]["turns"][0]["ttft_s"]
    short = copy.deepcopy(good)
    short["results"][1]["turns"][3]["prompt_tokens"] = 120  # shorter than 100 + a 48-token answer
    for data, words in (({"bench": "e2e", "results": []}, "expected the output"), (no_floor, "no 'floor'"),
                        (missing, "lacks ttft_s"), (short, "shorter than the previous prompt")):
        with pytest.raises(PlannerError, match=words):
            validate_placement(data, TRANSFER)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", "utf-8")
    with pytest.raises(PlannerError, match="not a readable"):
        load_placement(bad)


def test_measured_trace_and_homes_follow_the_rows() -> None:
    turns = synthetic_placement()["results"][1]["turns"]
    trace = measured_trace(turns, answer_tokens=48, gap_s=1.5)
    first = trace.conversations[0].turns
    assert [(t.prompt_tokens, t.new_tokens, t.gap_s) for t in first] == [(100, 100, 0.0), (208, 60, 1.5),
                                                                          (316, 60, 1.5)]
    assert measured_homes(turns) == (0, 1, 0)


# ------------------------------------------------------------------------------------ the committed rows
def test_the_command_validates_the_committed_placement_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--validate-placement"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("vm2_placement.json")
    for name in ("floor", "local_cache", "reverse_reads", "spread_local", "spread_reverse", "prewarm",
                 "decode_local"):
        assert any(line.startswith(name + " ") for line in out.splitlines())
    assert "predicted configurations within +-20%" in out
    assert main(["plan", "--validate-placement", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["rows"]) == 7 and doc["summary"]["predicted_configs"] == 6
    for row in doc["rows"]:  # every miss comes with its reasons
        assert bool(row["reasons"]) == row["miss"]


def test_the_command_names_an_unreadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--validate-placement", str(tmp_path / "none.json")]) == 2
    assert "not a readable" in capsys.readouterr().err


def test_round_robin_is_an_option_of_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--synthetic", "conversations=4", "--prefill-workers", "2", "--round-robin", "--ttl",
                 "480", "--threshold", "64", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["options"]["placement"]["round_robin"] is True
    assert main(["plan", "--synthetic", "conversations=2", "--round-robin", "--affinity", "--json"]) == 2
    assert "--round-robin" in capsys.readouterr().err
