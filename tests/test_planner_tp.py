"""The planner's TP size: the KV split over TP ranks by KV heads (as vLLM splits it), reads per rank, bytes over
all ranks, compute unchanged; the profile field, its validation and round trip, and ``kvshuttle plan --tp-size``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshuttle.cli import main
from kvshuttle.planner import (
    QWEN3_32B,
    CostProfile,
    ModelShape,
    PreparedTrace,
    ProfileError,
    load_profile,
    policy_config,
    published,
    simulate,
    summarize,
    uniform_trace,
)
from kvshuttle.planner.published import h200_profile

# 8 KV heads of 1 KiB per token each (all layers, K and V)
BASE = {"name": "tp", "kv_bytes_per_token": 8 * 1024.0, "block_size": 16, "bandwidth_bytes_per_s": 1e8,
        "transfer_overhead_s": 0.001, "prefill_fixed_s": 0.01, "prefill_tokens_per_s": 10_000.0,
        "attention_ratio": 0.0, "decode_fixed_s": 0.0, "decode_s_per_token": 0.01, "prefill_cache_gib": 1.0,
        "kv_heads": 8}


def _profile(**changes: object) -> CostProfile:
    return CostProfile.from_dict({**BASE, **changes})


@pytest.mark.parametrize(("changes", "words"), [
    ({"tp_size": 0}, "'tp_size': must be an int >= 1"),
    ({"tp_size": -2}, "'tp_size': must be an int >= 1"),
    ({"tp_size": 2.0}, "'tp_size': must be an int >= 1"),
    ({"tp_size": True}, "'tp_size': must be an int >= 1"),
    ({"tp_size": "2"}, "'tp_size': must be an int >= 1"),
    ({"kv_heads": -1}, "'kv_heads': must be an int >= 0"),
    ({"tp_size": 3}, "3 ranks cannot split 8 KV heads"),
    ({"tp_size": 12}, "12 ranks cannot split 8 KV heads"),
])
def test_tp_size_and_kv_heads_are_validated(changes: dict[str, object], words: str) -> None:
    with pytest.raises(ProfileError) as info:
        _profile(**changes)
    assert words in str(info.value)
    with pytest.raises(ProfileError, match=r"tp_size|kv_heads"):
        _profile().with_changes(**changes)


def test_tp_size_defaults_to_1_and_round_trips(tmp_path: Path) -> None:
    old = {k: v for k, v in BASE.items() if k != "kv_heads"}  # a profile file from before the TP fields
    legacy = CostProfile.from_dict(old)
    assert (legacy.tp_size, legacy.kv_heads) == (1, 0)
    assert legacy.rank_kv_bytes_per_token == legacy.kv_bytes_per_token
    measured = json.loads((Path(__file__).parents[1] / "python/kvshuttle/planner/data/measured.json").read_text())
    assert "tp_size" not in measured and load_profile("measured").tp_size == 1
    p = _profile(tp_size=4)
    assert p.to_dict()["tp_size"] == 4 and p.to_dict()["kv_heads"] == 8
    assert CostProfile.from_dict(p.to_dict()) == p
    path = tmp_path / "tp4.json"
    path.write_text(json.dumps(p.to_dict()))
    assert load_profile(str(path)) == p
    assert p.with_changes(tp_size=2).tp_size == 2 and p.with_changes(tp_size=2).kv_heads == 8
    assert h200_profile().with_changes(tp_size=1).to_dict()["tp_size"] == 1


def test_gqa_kv_splits_by_heads_and_replicates_past_them() -> None:
    full = 8 * 1024.0
    per_rank = {tp: _profile(tp_size=tp).rank_kv_bytes_per_token for tp in (1, 2, 4, 8, 16, 32)}
    assert per_rank == {1: full, 2: full / 2, 4: full / 4, 8: full / 8, 16: full / 8, 32: full / 8}
    held = {tp: _profile(tp_size=tp).held_kv_bytes_per_token for tp in (1, 2, 8, 16, 32)}
    assert held == {1: full, 2: full, 8: full, 16: 2 * full, 32: 4 * full}  # one head on 2 or 4 ranks each
    assert _profile(tp_size=16).block_bytes(3) == 3 * 16 * 2 * full
    assert _profile(tp_size=16).rank_block_bytes(3) == 3 * 16 * full / 8
    unknown = _profile(kv_heads=0, tp_size=16)  # no head count: an even split
    assert unknown.rank_kv_bytes_per_token == full / 16 and unknown.held_kv_bytes_per_token == full


def test_mla_is_replicated_on_every_rank() -> None:
    deepseek = ModelShape(layers=61, kv_heads=128, head_dim=512 + 64, dtype_bytes=1, mla=True)
    assert deepseek.kv_bytes_per_token == 61 * 576  # one latent per layer, no K/V pair, no heads
    assert deepseek.tp_heads == 1
    data = {k: v for k, v in BASE.items() if k not in ("kv_bytes_per_token", "kv_heads")}
    mla = CostProfile.from_dict({**data, "tp_size": 8, "model": {"layers": 61, "kv_heads": 128, "head_dim": 576,
                                                                 "dtype_bytes": 1, "mla": True}})
    assert mla.kv_heads == 1
    assert mla.rank_kv_bytes_per_token == mla.kv_bytes_per_token == 61 * 576
    assert mla.held_kv_bytes_per_token == 8 * 61 * 576
    one = mla.with_changes(tp_size=1)
    assert mla.transfer_s(10) == one.transfer_s(10)  # every rank reads the whole latent: no faster
    assert mla.block_bytes(10) == 8 * one.block_bytes(10)
    qwen = CostProfile.from_dict({**data, "tp_size": 8, "model": {"layers": 64, "kv_heads": 8, "head_dim": 128,
                                                                  "dtype_bytes": 2}})
    assert qwen.kv_heads == QWEN3_32B.kv_heads and qwen.rank_kv_bytes_per_token == 32 * 1024


def test_reads_get_faster_with_tp_for_the_same_total() -> None:
    blocks = 40
    total = blocks * 16 * 8 * 1024.0
    times = {tp: _profile(tp_size=tp).transfer_s(blocks) for tp in (1, 2, 8, 16)}
    assert times[1] == pytest.approx(0.001 + total / 1e8)
    assert times[2] == pytest.approx(0.001 + total / 2 / 1e8)
    assert times[8] == pytest.approx(0.001 + total / 8 / 1e8)
    assert times[16] == times[8]  # replicated past 8 ranks: each still reads one head
    assert times[1] > times[2] > times[8]
    assert {tp: _profile(tp_size=tp).block_bytes(blocks) for tp in (1, 2, 8)} == {1: total, 2: total, 8: total}
    assert _profile(tp_size=8).compute_s(1000, 500) == _profile().compute_s(1000, 500)  # compute unchanged


def test_break_even_follows_the_per_rank_read() -> None:
    # read per token at TP1: 8 KiB / 100 MB/s = 82 us, recompute 100 us; TP8: 10 us
    be = {tp: _profile(tp_size=tp).break_even_tokens() for tp in (1, 2, 8, 16)}
    assert None not in be.values()
    assert be[1] > be[2] > be[8] == be[16]  # type: ignore[operator]
    for tp, n in be.items():
        p = _profile(tp_size=tp)
        assert n is not None
        assert p.transfer_s(-(-n // 16)) < p.compute_s(n, 0) <= p.transfer_s(-(-(n - 1) // 16)) + p.compute_s(1, 0)
    slow = _profile(bandwidth_bytes_per_s=5e7)  # TP1: 164 us per token read, never beats 100 us of compute
    assert slow.break_even_tokens() is None
    assert slow.with_changes(tp_size=8).break_even_tokens() is not None


def test_replay_reads_per_rank_and_counts_bytes_over_all_ranks() -> None:
    trace = uniform_trace(conversations=2, turns=3, first_tokens=4000, new_tokens=64, output_tokens=64)
    runs = {}
    for tp in (1, 8, 16):
        p = _profile(tp_size=tp)
        prepared = PreparedTrace(trace, p.block_size)
        runs[tp] = (simulate(prepared, p, mode="reverse_read", ttl_s=60),
                    simulate(prepared, p, mode="cache_miss"))
    (on1, off1), (on8, off8), (on16, off16) = runs[1], runs[8], runs[16]
    assert on1.fetched == on8.fetched and sum(on1.fetched) > 0
    assert off1.ttft == off8.ttft == off16.ttft  # recompute is the profile's engine at any TP size
    assert all(a < b for a, b, n in zip(on8.ttft, on1.ttft, on1.fetched, strict=True) if n)
    assert on16.ttft == pytest.approx(on8.ttft)
    s1, s8, s16 = (summarize(r) for r in (on1, on8, on16))
    assert s8["bytes_moved"] == s1["bytes_moved"] and s16["bytes_moved"] == 2 * s1["bytes_moved"]
    assert s8["retained_peak_gib"] == pytest.approx(s1["retained_peak_gib"])
    assert s16["retained_gib_s"] == pytest.approx(2 * s1["retained_gib_s"])  # decode holds a copy per replica
    cost = policy_config("cost", _profile(tp_size=8), 5.0)
    assert cost.kv_bytes_per_token == 1024.0  # each rank's connector decides on its own shard


def test_plan_tp_size_reaches_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--synthetic", "conversations=3,turns_min=2,turns_max=3,first_tokens=3000,seed=4", "--ttl", "60",
            "--threshold", "64"]
    assert main([*args, "--json", "--tp-size", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"]["tp_size"] == 2 and doc["profile"]["kv_heads"] == 8
    assert doc["tensor_parallel"] == {"tp_size": 2, "rank_kv_bytes_per_token": 128 * 1024.0,
                                      "held_kv_bytes_per_token": 256 * 1024.0}
    assert main([*args, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["profile"]["tp_size"] == 8  # the published profile's own
    tp2, tp8 = doc["settings"][0]["reverse_read"], default["settings"][0]["reverse_read"]
    assert tp2["ttft_s"]["mean"] > tp8["ttft_s"]["mean"]  # 4 heads per rank read slower than 1
    assert tp2["bytes_moved"] == tp8["bytes_moved"]
    assert main([*args, "--no-progress", "--tp-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "TP16 (32 KiB/token per rank, 512 KiB/token over the ranks)" in out
    assert "summed over the TP ranks" in out
    assert main([*args, "--tp-size", "3"]) == 2
    assert "3 ranks cannot split 8 KV heads" in capsys.readouterr().err


def test_reproduce_uses_the_overridden_tp_size(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[CostProfile] = []

    def spy(profile: CostProfile | None = None) -> list[dict[str, object]]:
        assert profile is not None
        seen.append(profile)
        return []

    monkeypatch.setattr(published, "reproduce", spy)
    assert main(["plan", "--reproduce", "--tp-size", "4"]) == 0
    assert [p.tp_size for p in seen] == [4]
    assert "TP4: 6.25 GB/s per rank" in capsys.readouterr().out
    # the published profile at TP8 reads 24k tokens as the whole KV at 50 GB/s (its derivation); TP4: twice as long
    h200 = h200_profile()
    assert h200.transfer_s(1536) == pytest.approx(h200.transfer_overhead_s + 1536 * 16 * 262144 / 50e9)
    tp4 = h200.with_changes(tp_size=4)
    assert tp4.transfer_s(1536) - tp4.transfer_overhead_s == pytest.approx(2 * 1536 * 16 * 262144 / 50e9)
