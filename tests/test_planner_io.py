"""The planner's inputs and outputs: traces, profiles, the command, JSON, plots, validation, reproduction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshuttle.cli import main
from kvshuttle.planner import (
    QWEN3_32B,
    CostProfile,
    ProfileError,
    SyntheticSpec,
    TraceError,
    example_trace_path,
    load_profile,
    load_trace,
    parse_trace,
    synthetic_trace,
    write_trace,
)
from kvshuttle.planner.published import PUBLISHED_TTFT_S, format_reproduction, h200_profile, reproduce
from kvshuttle.planner.validate import (
    default_e2e_path,
    default_transfer_paths,
    fit_measured_profile,
    load_e2e,
    validate,
)

GOOD = '{"conversation": "a", "prompt_tokens": 100, "new_tokens": 100, "output_tokens": 10, "gap_s": 0}'


def _parse_error(*lines: str) -> TraceError:
    with pytest.raises(TraceError) as info:
        parse_trace(list(lines), source="t.jsonl")
    return info.value


@pytest.mark.parametrize(("line", "field", "words"), [
    ('{"conversation": "a", "new_tokens": 1, "output_tokens": 1}', "prompt_tokens", "missing"),
    ('{"conversation": "a", "prompt_tokens": 10, "output_tokens": 1, "gap_s": -1}', "gap_s", ">= 0"),
    ('{"conversation": "a", "prompt_tokens": 10, "new_tokens": 11, "output_tokens": 1}', "new_tokens", "11 new"),
    ('{"conversation": "a", "prompt_tokens": 10.5, "output_tokens": 1}', "prompt_tokens", "integer"),
    ('{"conversation": "a", "prompt_tokens": 10, "output_tokens": 1, "colour": 3}', "colour", "unknown"),
    ('{"conversation": "", "prompt_tokens": 10, "output_tokens": 1}', "conversation", "non-empty"),
    ('{"conversation": "a", "prompt_tokens": 10, "new_tokens": 5, "output_tokens": 1, "edit_at": 6}', "edit_at",
     "past the history"),
    ('{"conversation": "a", "turn": 3, "prompt_tokens": 10, "output_tokens": 1}', "turn", "expects turn 2"),
])
def test_a_bad_trace_line_names_its_line_and_field(line: str, field: str, words: str) -> None:
    error = _parse_error("# a comment", GOOD, "", line)
    assert (error.line, error.field) == (4, field)
    assert str(error).startswith(f"t.jsonl:4: field {field!r}: ")
    assert words in str(error)


def test_unreadable_and_empty_traces_are_named(tmp_path: Path) -> None:
    assert _parse_error(GOOD, "{not json").line == 2
    assert "not valid JSON" in str(_parse_error(GOOD, "{not json"))
    assert "JSON object" in str(_parse_error("[1, 2]"))
    assert "no turns" in str(_parse_error("# only a comment"))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_traces_round_trip_and_synthetic_traces_are_seeded() -> None:
    spec = SyntheticSpec(conversations=5, edit_fraction=0.3, fresh_fraction=0.2, seed=3)
    trace = synthetic_trace(spec)
    assert parse_trace(write_trace(trace).splitlines(), source=trace.source) == trace
    assert synthetic_trace(spec) == trace
    assert synthetic_trace(SyntheticSpec(conversations=5, seed=4)) != trace
    assert SyntheticSpec.parse("conversations=5,edit_fraction=0.3,fresh_fraction=0.2,seed=3") == spec


def test_synthetic_gaps_mix_tool_calls_and_human_pauses() -> None:
    trace = synthetic_trace(SyntheticSpec(conversations=60, tool_gap_s=2.0, human_gap_s=600.0, human_fraction=0.3))
    gaps = sorted(t.gap_s for c in trace.conversations for t in c.turns[1:])
    assert gaps[len(gaps) // 4] < 10.0  # most are tool calls of seconds
    assert gaps[-1] > 300.0  # some are pauses of minutes


def test_bad_synthetic_specs_are_named() -> None:
    with pytest.raises(TraceError, match="human_fraction"):
        SyntheticSpec.parse("human_fraction=2")
    with pytest.raises(TraceError, match="not key=value"):
        SyntheticSpec.parse("colour=3")
    with pytest.raises(TraceError, match="not a number"):
        SyntheticSpec.parse("seed=x")


def test_the_bundled_example_trace_is_package_data() -> None:
    path = example_trace_path()
    assert path.is_file()
    assert str(path).endswith("kvshuttle/planner/data/agent_trace.jsonl")
    trace = load_trace(path)
    assert trace.num_turns > 100
    assert trace.summary()["edited_turns"] > 0


def test_profiles_by_name_file_and_model_shape(tmp_path: Path) -> None:
    assert QWEN3_32B.kv_bytes_per_token == 256 * 1024
    h200 = load_profile("h200-efa-qwen3-32b")
    assert (h200.kv_bytes_per_token, h200.bandwidth_bytes_per_s, h200.block_size) == (262144.0, 50e9 / 8, 16)
    assert (h200.tp_size, h200.kv_heads) == (8, 8)  # the published runs: TP8, 6.25 GB/s per rank
    assert load_profile("measured").block_size == 32
    data = {**h200.to_dict(), "name": "mine"}
    del data["kv_bytes_per_token"], data["attention_ratio"]
    data["model"] = {"layers": 64, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "q_heads": 64, "params": 32.8e9}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    mine = load_profile(str(path))
    assert mine.kv_bytes_per_token == 262144.0
    assert mine.attention_ratio == pytest.approx(QWEN3_32B.attention_ratio)
    assert mine.kv_heads == 8  # from the model shape (h200's to_dict gave it too; the shape's is the same)


@pytest.mark.parametrize(("changes", "words"), [
    ({"bandwidth_bytes_per_s": 0}, "'bandwidth_bytes_per_s': must be > 0"),
    ({"prefill_fixed_s": -1.0}, "'prefill_fixed_s': must be >= 0"),
    ({"block_size": 0}, "'block_size'"),
    ({"decode_s_per_token": float("nan")}, "finite"),
    ({"warp": 1}, "unknown profile field"),
])
def test_bad_profiles_name_the_field(changes: dict[str, object], words: str) -> None:
    data = {**h200_profile().to_dict(), **changes}
    with pytest.raises(ProfileError) as info:
        CostProfile.from_dict(data)
    assert words in str(info.value)


def test_missing_and_unknown_profiles(tmp_path: Path) -> None:
    data = h200_profile().to_dict()
    del data["prefill_tokens_per_s"]
    with pytest.raises(ProfileError, match="missing profile field"):
        CostProfile.from_dict(data)
    with pytest.raises(ProfileError, match="no profile"):
        load_profile("a100-somewhere")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not a readable JSON profile"):
        load_profile(str(bad))


def test_plan_json_has_every_setting_and_metric(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--synthetic", "conversations=4,turns_max=5,first_tokens=3000,seed=1", "--ttl", "30,300",
                 "--threshold", "64,cost", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("planner", "command", "profile", "trace", "assumptions", "options", "baselines", "settings",
                "break_even_tokens"):
        assert key in doc
    assert set(doc["baselines"]) == {"cache_miss", "local_cache"}
    assert [(s["ttl_s"], s["threshold"]) for s in doc["settings"]] == [(30.0, 64), (30.0, "cost"), (300.0, 64),
                                                                       (300.0, "cost")]
    metrics = doc["settings"][0]["reverse_read"]
    for key in ("ttft_s", "turn_s", "later_ttft_s", "hit_rate", "local_hit_rate", "tokens_recomputed",
                "tokens_fetched", "bytes_moved", "retained_peak_gib", "retained_gib_s", "reasons"):
        assert key in metrics
    assert set(metrics["ttft_s"]) == {"mean", "p50", "p99"}
    assert doc["baselines"]["cache_miss"]["retained_gib_s"] == 0.0


def test_plan_tables_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    code = main(["plan", "--synthetic", "conversations=3,turns_max=4,seed=2", "--write-trace", str(trace),
                 "--plots", str(tmp_path / "plots"), "--no-progress", "--ttl", "60,480"])
    out = capsys.readouterr().out
    assert code == 0
    assert "cache_miss" in out and "reverse_read+local_cache" in out and "break-even" in out
    for name in ("ttft_vs_prompt.png", "retained_vs_ttl.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5000
    assert load_trace(trace).num_turns >= 3


def test_plan_errors_exit_2_with_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD + "\n" + '{"conversation": "a", "prompt_tokens": -4, "output_tokens": 1}\n')
    assert main(["plan", "--trace", str(bad), "--no-progress"]) == 2
    assert f"{bad}:2: field 'prompt_tokens'" in capsys.readouterr().err
    assert main(["plan", "--ttl", "soon"]) == 2
    assert main(["plan", "--threshold", "many"]) == 2


def test_cases_show_where_reverse_reads_cannot_pay(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--cases", "--json"]) == 0
    rows = {r["case"]: r for r in json.loads(capsys.readouterr().out)["cases"]}
    assert rows["continuation"]["ttft_on_s"] < rows["continuation"]["ttft_off_s"]
    for case in ("no_reusable_context", "pauses_past_ttl", "edited_history"):
        assert rows[case]["ttft_on_s"] >= rows[case]["ttft_off_s"] * 0.95, case
    assert rows["pauses_past_ttl"]["hit_rate"] == 0.0
    assert rows["no_reusable_context"]["tokens_fetched"] == 0


def test_the_measured_profile_is_the_fit_of_the_committed_runs() -> None:
    path = default_e2e_path()
    fitted = fit_measured_profile(load_e2e(path), [str(p) for p in default_transfer_paths(path)])
    assert fitted.to_dict() == pytest.approx(load_profile("measured").to_dict())


def test_validation_against_the_real_end_to_end_runs() -> None:
    path = default_e2e_path()
    result = validate(load_e2e(path), [str(p) for p in default_transfer_paths(path)])
    predicted = [r for r in result["rows"] if r["kind"] == "predicted"]
    assert len(predicted) >= 20
    assert all(r["predicted_reused"] == r["measured_reused"] for r in predicted)  # the policy reuses the same
    reads = [r for r in predicted if r["config"] == "kvshuttle" and r["case"] == "main"]
    assert len(reads) == 6
    assert all(abs(r["ttft_error"]) <= 0.20 for r in reads), [round(r["ttft_error"], 3) for r in reads]
    fits = [r for r in result["rows"] if r["kind"] == "fit" and r["config"] == "kvshuttle"]
    assert all(abs(r["ttft_error"]) < 0.01 for r in fits)


def test_validate_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "vm2_e2e.json" in out and "predicted rows within" in out


def test_reproduction_of_the_published_h200_points() -> None:
    rows = {r["pfx"]: r for r in reproduce()}
    for pfx, (off, _on) in PUBLISHED_TTFT_S.items():
        assert rows[pfx]["off_s"] == pytest.approx(off, rel=1e-6)  # the fit
    ons = [rows[p]["on_s"] for p in sorted(rows)]
    assert ons == sorted(ons)  # grows with the prompt, more slowly than off
    assert all(r["on_s"] < r["off_s"] for r in rows.values())
    assert rows[24000]["read_s"] == pytest.approx(0.130, rel=0.15)  # published: about 130 ms at 24k


def test_the_reproduction_predicts_what_layered_loads_would_gain() -> None:
    rows = reproduce()
    assert all(r["layered_s"] <= r["on_s"] for r in rows)  # overlapping never costs more than the sum here
    assert all(r["layered_s"] >= r["on_s"] - r["read_s"] for r in rows)  # it cannot hide more than the read
    out = format_reproduction(rows, h200_profile())
    assert "layered" in out and "on/lay" in out


def test_validation_of_layered_rows_reuses_what_the_connector_read() -> None:
    """The layered rows: the planner cuts reads to whole blocks exactly as the connector did (and the floor rows
    reuse what a prefix cache holds); on that one-core run they are predicted without overlap."""
    path = default_e2e_path().parent / "vm2_e2e_layered.json"
    result = validate(load_e2e(path), [str(p) for p in default_transfer_paths(path)])
    layered = [x for x in result["rows"] if x["config"] == "kvshuttle_layered" and x["turn"] > 1]
    assert len(layered) == 6 and all(x["kind"] == "predicted" for x in layered)
    assert all(x["predicted_reused"] == x["measured_reused"] and x["measured_reused"] % 32 == 0 for x in layered)
    assert {"kvshuttle", "nixl", "kvshuttle_layered", "floor"} <= set(result["profiles"])
    assert all(result["profiles"][k]["num_layers"] == 8 for k in result["profiles"])


def test_the_glm5_fp8_profile_reads_the_mla_shapes_bytes_on_every_rank() -> None:
    """The seed's 3.3x case: GLM-5-FP8's cache as vLLM holds it (fp8_ds_mla cells and the DSA indexer, 788 B per
    token and layer, 78 layers), replicated on every TP rank; off fitted, on predicted near the published points."""
    glm = load_profile("h200-efa-glm5-fp8")
    assert glm.kv_bytes_per_token == 78 * (656 + 132) == 61_464 and glm.kv_heads == 1
    assert glm.rank_kv_bytes_per_token == glm.kv_bytes_per_token  # MLA: each of the 8 ranks reads all of it
    rows = {r["pfx"]: r for r in reproduce(glm)}
    assert set(rows) == {2000, 4000, 8000, 12000, 16000, 20000}
    for pfx, (off, on) in ((2000, (0.500, 0.358)), (20000, (2.334, 0.702))):
        assert rows[pfx]["off_s"] == pytest.approx(off, rel=1e-6)  # the fit
        assert rows[pfx]["on_s"] == pytest.approx(on, rel=0.15)  # the prediction: within 15 % of what was published
    assert rows[20000]["read_s"] == pytest.approx(0.110, rel=0.05) and rows[2000]["read_s"] == pytest.approx(0.029,
                                                                                                              rel=0.05)
    assert rows[20000]["off_s"] / rows[20000]["on_s"] > 3.0  # the published 3.3x, predicted
