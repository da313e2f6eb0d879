"""The cost model's transfer inputs, read from ``kvshuttle bench transfer --json`` by the bench layer
(``kvshuttle.bench.cost_inputs``); the policy defines only the plain ``CostInputs``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.bench.cost_inputs import BenchFormatError, cost_inputs_from_bench
from kvshuttle.policy import PolicyConfig, PolicyError

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _row(blocks: int, gbps: dict[str, float], shape: str = "qwen3-32b-tp1", pattern: str = "scattered",
         seconds: bool = True) -> dict[str, Any]:
    """One result row as 'kvshuttle bench transfer' writes it for Qwen3-32B TP1 at 8 layers."""
    layers, piece = 8, 16 * 8 * 128 * 2
    nbytes = blocks * 2 * layers * piece
    row: dict[str, Any] = {"shape": shape, "pattern": pattern, "layers": layers, "layers_in_model": 64,
                           "blocks": blocks, "block_size": 16, "bytes": nbytes, "bytes_per_piece": piece,
                           "gbps": gbps}
    if seconds:  # schema 1; older output has gbps only
        row["seconds"] = {m: nbytes / (g * 1e9) for m, g in gbps.items()}
    return row


def _bench(*results: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "transfer", "results": list(results)}


@pytest.mark.parametrize("seconds", [True, False])
def test_cost_inputs_from_transfer_bench(seconds: bool) -> None:
    bench = _bench(_row(1536, {"direct": 5.5, "direct_prepped": 5.3, "packed": 4.5, "raw_per_block": 9.0},
                        seconds=seconds),
                   _row(1536, {"direct": 10.0, "packed": 4.6}, pattern="contiguous", seconds=seconds))
    inputs = cost_inputs_from_bench(bench)
    assert inputs == {"kv_bytes_per_token": 262144.0, "bandwidth_bytes_per_s": pytest.approx(5.5e9),
                      "transfer_overhead_s": 0.0}
    assert cost_inputs_from_bench(bench, pattern="contiguous")["bandwidth_bytes_per_s"] == pytest.approx(10e9)
    assert cost_inputs_from_bench(bench, method="packed")["bandwidth_bytes_per_s"] == pytest.approx(4.5e9)
    assert cost_inputs_from_bench(bench, transfer_overhead_s=0.002)["transfer_overhead_s"] == 0.002
    config = PolicyConfig(kind="cost", prefill_tokens_per_s=20_000.0, **inputs)
    assert config.kv_bytes_per_token == 64 * 2 * 8 * 128 * 2  # Qwen3-32B: layers x K/V x heads x dim x bf16


def test_cost_inputs_fit_overhead_from_two_sizes(tmp_path: Path) -> None:
    overhead, bandwidth = 0.004, 8e9
    results = []
    for blocks in (16, 1536):
        nbytes = _row(blocks, {})["bytes"]
        results.append(_row(blocks, {"direct": nbytes / (overhead + nbytes / bandwidth) / 1e9}))
    small, large = tmp_path / "small.json", tmp_path / "large.json"
    small.write_text(json.dumps(_bench(results[0])))
    large.write_text(json.dumps(_bench(results[1])))
    inputs = cost_inputs_from_bench([small, str(large)])
    assert inputs["transfer_overhead_s"] == pytest.approx(overhead)
    assert inputs["bandwidth_bytes_per_s"] == pytest.approx(bandwidth)


@pytest.mark.parametrize(("bench", "kwargs"), [
    ({"bench": "pack", "results": []}, {}),
    (_bench(_row(8, {"direct": 1.0}), _row(8, {"direct": 1.0}, shape="qwen3-32b-tp8")), {}),
    (_bench(_row(8, {"direct": 1.0})), {"shape": "llama"}),
    (_bench(_row(8, {"direct": 1.0})), {"method": "packed"}),
])
def test_cost_inputs_reject(bench: dict[str, Any], kwargs: dict[str, Any]) -> None:
    with pytest.raises(BenchFormatError) as info:
        cost_inputs_from_bench(bench, **kwargs)
    assert isinstance(info.value, PolicyError)  # what callers of the policy already catch


def test_cost_inputs_from_the_committed_transfer_results() -> None:
    files = [RESULTS / "history" / "vm2_transfer.json", RESULTS / "history" / "vm2_transfer_1536.json"]
    inputs = cost_inputs_from_bench(files, shape="qwen3-32b-tp1")
    assert inputs["kv_bytes_per_token"] == 64 * 2 * 8 * 128 * 2
    assert 1e8 < inputs["bandwidth_bytes_per_s"] < 1e12 and 0 <= inputs["transfer_overhead_s"] < 1.0
    PolicyConfig(kind="cost", prefill_tokens_per_s=20_000.0, **inputs)


def test_the_policy_parses_no_benchmark_output() -> None:
    code = """
import sys, kvshuttle.policy as p
assert not hasattr(p, "transfer_cost_inputs")
assert not [m for m in sys.modules if m.startswith("kvshuttle.bench")], "the policy imported the bench layer"
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
