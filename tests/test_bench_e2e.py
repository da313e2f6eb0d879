"""``kvshuttle bench e2e`` without vLLM: CLI wiring, argument parsing, the clear failure when vLLM is missing,
the engine pairs it would start, and rows, summary and table built from synthetic turns."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from kvshuttle import cli
from kvshuttle.bench import schema
from kvshuttle.bench.e2e import bench
from kvshuttle.bench.e2e.conversation import Turn


def _args(*argv: str) -> argparse.Namespace:
    return cli._parser().parse_args(["bench", "e2e", *argv])


def test_cli_registers_e2e_with_its_options() -> None:
    args = _args("--lengths", "512,1024", "--reps", "2", "--configs", "nixl,kvshuttle", "--json")
    assert args.module is bench and args.json
    assert (args.lengths, args.reps, args.configs, args.ttl, args.edit_position) == ("512,1024", 2, "nixl,kvshuttle",
                                                                                     10.0, 100)
    assert schema.command_line("e2e", args, bench.add_arguments) == (
        "kvshuttle bench e2e --lengths 512,1024 --reps 2 --configs nixl,kvshuttle --json")


def test_fails_clearly_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="needs vLLM"):
        bench.run(_args())


def test_engine_pairs() -> None:
    assert bench._pairs(list(bench.DEFAULT_CONFIGS), "shared") == [("nixl", ["recompute", "nixl"]),
                                                                    ("kvshuttle", ["kvshuttle"])]
    assert bench._pairs(list(bench.CONFIGS), "own")[0] == ("recompute", ["recompute"])
    assert bench._pairs(["kvshuttle", "kvshuttle_tp"], "shared") == [("kvshuttle", ["kvshuttle"]),
                                                                     ("kvshuttle_tp", ["kvshuttle_tp"])]
    assert bench._pairs(["recompute"], "shared") == [("recompute", ["recompute"])]
    with pytest.raises(SystemExit, match="subset"):
        bench._parse_list("nixl,bogus", bench.CONFIGS, "configs")


def test_mla_picks_the_tiny_deepseek_and_refuses_what_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: object())
    assert _args("--mla").mla and not _args().mla
    with pytest.raises(SystemExit, match="pick one"):
        bench._model(_args("--mla", "--kv-heavy"))
    with pytest.raises(SystemExit, match="no floor"):
        bench.run(_args("--mla", "--configs", "kvshuttle,floor"))


def _turn(turn: int, ttft: float, reused: int, *, read: int | None = None, match: bool = True) -> Turn:
    answer = [7, 8, 9]
    params: dict[str, Any] = {"do_remote_prefill": True}
    if read is not None:
        params["kvshuttle_read_tokens"] = read
    prefill = {"ttft_s": ttft, "latency_s": ttft, "num_cached_tokens": reused, "kv_transfer_params": params}
    decode = {"token_ids": answer, "latency_s": 0.5, "num_cached_tokens": 0, "first_logprobs": {7: -0.1, 8: -2.0}}
    ref = {"token_ids": answer if match else [1, 2, 3], "first_logprobs": {7: -0.1, 8: -2.25}}
    return Turn(turn, list(range(512 + 80 * (turn - 1))), {}, prefill, decode, reference=ref)


def test_rows_summary_and_table_from_synthetic_turns() -> None:
    out = bench._Collector()
    for rep in range(3):
        out.add("recompute", "main", 512, [_turn(1, 1.0 + rep / 10, 0), _turn(2, 1.2, 0)])
        out.add("nixl", "main", 512, [_turn(1, 1.0, 0), _turn(2, 0.2, 527)])
        out.add("kvshuttle", "main", 512, [_turn(1, 1.0, 0, read=0), _turn(2, 0.205, 527, read=527)])
        out.add("nixl", "edited", 512, [_turn(2, 0.2, 527, match=rep > 0)])
        out.add("kvshuttle", "edited", 512, [_turn(2, 1.0, 96, read=96)])
    out.error("nixl", "expired", 512, 2, RuntimeError("turn 2: prefill returned no kv_transfer_params"), 3.0)
    results = bench._rows(out, list(bench.CONFIGS))
    assert [(r["case"], r["turn"], r["config"]) for r in results][:3] == [
        ("main", 1, "recompute"), ("main", 1, "nixl"), ("main", 1, "kvshuttle")]
    row = next(r for r in results if r["config"] == "recompute" and r["turn"] == 1)
    assert row["rounds"] == 3 and row["seconds"]["prefill_ttft"] == 1.1 and row["seconds"]["turn"] == 1.6
    edited = {r["config"]: r for r in results if r["case"] == "edited"}
    assert edited["nixl"]["matches_local_count"] == "2/3" and not edited["nixl"]["matches_local"]
    assert edited["kvshuttle"]["reused_tokens"] == 96 and edited["kvshuttle"]["kvshuttle_read_tokens"] == [96] * 3
    assert edited["kvshuttle"]["first_logprob_max_diff"] == 0.25
    summary = bench._summary(results, {"nixl": 90.0})
    main2 = next(x for x in summary["kvshuttle_over_nixl"] if x["case"] == "main" and x["turn"] == 2)
    assert main2["ttft"] == 1.025 and summary["target_met"] is True
    assert summary["reverse_read_speedup"][0]["kvshuttle_ttft_speedup"] == round(1.2 / 0.205, 2)
    result = {"results": results, "summary": summary, "note": "synthetic"}
    json.dumps(result)
    for row in results:  # what tests/test_bench_schema.py asks of committed results
        assert isinstance(row["seconds"], dict) and all(v > 0 for v in row["seconds"].values())
        assert isinstance(row["rounds"], int) and row["rounds"] >= 1 and not any("_vs_" in k for k in row)
    table = bench.format_table(result)
    assert "kvshuttle/nixl   512 turn 2: TTFT 1.025x" in table
    assert "target (<= 1.05x where reuse is equal): met" in table
    assert "error: RuntimeError: turn 2" in table and "2/3" in table


def test_tp_pair_sizes_and_rank_reads(tmp_path: Any) -> None:
    args = _args("--configs", "kvshuttle,kvshuttle_tp", "--tp", "1,2")
    assert bench._tp_sizes(args.tp) == (1, 2)
    for bad in ("2", "0,1", "a,b"):
        with pytest.raises(SystemExit, match="--tp"):
            bench._tp_sizes(bad)
    prefill, decode = bench._pair("kvshuttle_tp", args, "/model", tmp_path)
    assert "tensor_parallel_size" not in prefill.spec.llm_kwargs
    assert decode.spec.llm_kwargs == {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    assert bench._pair("kvshuttle", args, "/model", tmp_path)[1].spec.llm_kwargs == {}
    log = tmp_path / "decode.log"
    log.write_text(
        "(Worker_TP0 pid=7) INFO 12-01 [worker.py:256] kvshuttle: request 2-a read 527 tokens (8.5 MiB, "
        "12 descriptors, packed path) in 160.0 ms\n"
        "(Worker_TP1 pid=8) INFO 12-01 [worker.py:256] kvshuttle: request 2-a read 527 tokens (8.5 MiB, "
        "12 descriptors, direct+packed path) in 170.0 ms\n"
        "(Worker_TP1 pid=8) INFO 12-01 [worker.py:256] kvshuttle: request 3-b read 79 tokens (1.5 MiB, "
        "4 descriptors, packed path) in 30.0 ms\n"
        "(Worker_TP1 pid=8) INFO kvshuttle: request 4-c recomputes, because peer_lost: gone\n")
    ranks = bench.reads_by_rank(log)
    assert ranks["0"] == {"reads": 1, "mib": 8.5, "descriptors_per_read": 12, "mib_per_descriptor": round(8.5 / 12, 4),
                          "mean_ms": 160.0}
    assert ranks["1"]["reads"] == 2 and ranks["1"]["mib"] == 10.0 and ranks["1"]["descriptors_per_read"] == 8
    one = tmp_path / "tp1.log"
    one.write_text("(Worker pid=9) INFO kvshuttle: request 1-x read 511 tokens (16.0 MiB, 1 descriptors, direct path)"
                   " in 300.0 ms\n")
    assert list(bench.reads_by_rank(one)) == ["0"] and bench.reads_by_rank(tmp_path / "missing.log") == {}
    out = bench._Collector()
    out.add("kvshuttle", "main", 512, [_turn(1, 1.0, 0, read=0), _turn(2, 0.2, 527, read=527)])
    out.add("kvshuttle_tp", "main", 512, [_turn(1, 1.5, 0, read=0), _turn(2, 0.3, 527, read=527)])
    results = bench._rows(out, list(bench.CONFIGS))
    summary = bench._summary(results, {})
    tp2 = next(r for r in results if r["config"] == "kvshuttle_tp" and r["turn"] == 2)
    assert tp2["ttft_over_tp1"] == 1.5
    summary["reads_by_rank"] = {"kvshuttle_tp": {"decode": ranks}}
    table = bench.format_table({"results": results, "summary": summary, "note": "synthetic"})
    assert "kvshuttle_tp/kvshuttle main   512 turn 2: TTFT 1.500x" in table
    assert "kvshuttle_tp decode rank 1: 2 reads, 10.0 MiB, 8 descriptors per read" in table
