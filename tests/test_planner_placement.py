"""The planner's placement model (the router's settings): affinity keeps a conversation on one prefill worker,
pre-warming puts prompt and answer into its cache in the gap, decode-local turns compute on the decode from what
it retained. Exact token counts on uniform traces, and ``kvshuttle plan --affinity --prewarm --decode-local``."""

from __future__ import annotations

import json

import pytest

from kvshuttle.cli import main
from kvshuttle.planner import CostProfile, Placement, PlannerError, PreparedTrace, simulate, uniform_trace

PROFILE = CostProfile.from_dict({
    "name": "placement", "kv_bytes_per_token": 1024.0, "block_size": 16, "bandwidth_bytes_per_s": 1e9,
    "transfer_overhead_s": 0.001, "prefill_fixed_s": 0.01, "prefill_tokens_per_s": 10_000.0,
    "attention_ratio": 0.0, "decode_fixed_s": 0.0, "decode_s_per_token": 0.001, "prefill_cache_gib": 1.0})
# 6 conversations of 4 turns: 512 tokens, then 64 new tokens per turn, 48-token answers, 2 s between turns
TRACE = uniform_trace(conversations=6, turns=4, first_tokens=512, new_tokens=64, output_tokens=48, gap_s=2.0)


def _later(run: object, field: str) -> list[int]:
    return [v for v, later in zip(getattr(run, field), run.later, strict=True) if later]  # type: ignore[attr-defined]


def test_affinity_keeps_every_later_turn_on_the_worker_whose_cache_holds_its_prompt() -> None:
    prepared = PreparedTrace(TRACE, 16)
    spread = simulate(prepared, PROFILE, mode="local_cache", prefill_workers=3)
    home = simulate(prepared, PROFILE, mode="local_cache", prefill_workers=3, placement=Placement(affinity=True))
    for run in (spread, home):
        assert len(run.local) == TRACE.num_turns
    # at home every later turn hits its previous prompt (whole blocks), never the answer the decode generated
    prompts = [p for p, later in zip(home.prompt, home.later, strict=True) if later]
    previous = [p - 64 - 48 for p in prompts]
    assert _later(home, "local") == [q // 16 * 16 for q in previous]
    assert sum(_later(spread, "local")) < sum(_later(home, "local"))  # random workers miss (seeded: some do)


def test_prewarming_puts_the_answer_in_the_cache_when_the_gap_allows() -> None:
    prepared = PreparedTrace(TRACE, 16)
    cold = simulate(prepared, PROFILE, mode="local_cache", placement=Placement(affinity=True))
    warm = simulate(prepared, PROFILE, mode="local_cache", placement=Placement(affinity=True, prewarm=True))
    prompts = [p for p, later in zip(warm.prompt, warm.later, strict=True) if later]
    assert _later(warm, "local") == [(p - 64) // 16 * 16 for p in prompts]  # prompt and answer: only the new
    assert sum(_later(warm, "recomputed")) < sum(_later(cold, "recomputed"))
    no_gap = uniform_trace(conversations=2, turns=3, first_tokens=512, new_tokens=64, output_tokens=48, gap_s=0.0)
    p2 = PreparedTrace(no_gap, 16)
    assert simulate(p2, PROFILE, mode="local_cache", placement=Placement(True, True)).local == \
        simulate(p2, PROFILE, mode="local_cache", placement=Placement(True)).local  # no time to warm


def test_decode_local_turns_compute_on_the_decode_without_a_read() -> None:
    prepared = PreparedTrace(TRACE, 16)
    # the answers (48 tokens) are under the threshold beyond a local hit: compare with reads of the whole history
    read = simulate(prepared, PROFILE, mode="reverse_read", placement=Placement(affinity=True))
    local = simulate(prepared, PROFILE, mode="reverse_read",
                     placement=Placement(affinity=True, decode_local_tokens=128))
    assert local.reasons["decode_local"] == 18 and sum(_later(local, "fetched")) == 0
    assert sum(_later(read, "fetched")) > 0
    # the decode reuses what it retained, prompt + answer but the last sampled token (whole blocks), computes the rest
    prompts = [p for p, later in zip(local.prompt, local.later, strict=True) if later]
    assert _later(local, "local") == [(p - 64 - 1) // 16 * 16 for p in prompts]
    assert _later(local, "ttft") < _later(read, "ttft")  # type: ignore[operator]
    tight = simulate(prepared, PROFILE, mode="reverse_read", placement=Placement(decode_local_tokens=16))
    assert tight.reasons["decode_local"] == 0  # 64 new tokens are more than 16: through a prefill
    off = simulate(prepared, PROFILE, mode="local_cache", placement=Placement(affinity=True, decode_local_tokens=128))
    assert off.reasons["decode_local"] == 0  # no handle, no decode to send it to


def test_prewarming_needs_affinity_and_a_local_cache() -> None:
    prepared = PreparedTrace(TRACE, 16)
    with pytest.raises(PlannerError, match="pre-warming needs affinity"):
        simulate(prepared, PROFILE, mode="local_cache", placement=Placement(prewarm=True))
    with pytest.raises(PlannerError, match="pre-warming needs affinity"):
        simulate(prepared, PROFILE, mode="cache_miss", placement=Placement(affinity=True, prewarm=True))


def test_plan_command_takes_the_placement_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--synthetic", "conversations=6", "--prefill-workers", "2", "--affinity", "--prewarm",
                 "--decode-local", "64", "--ttl", "480", "--threshold", "64", "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["options"]["placement"] == {"affinity": True, "prewarm": True, "decode_local_tokens": 64,
                                           "round_robin": False, "homes": []}
    assert main(["plan", "--synthetic", "conversations=2", "--prewarm", "--json", "--no-progress"]) != 0
    assert "--prewarm needs --affinity" in capsys.readouterr().err
