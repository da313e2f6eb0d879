"""Every ``kvshuttle bench <x> --json`` prints the same envelope (``kvshuttle.bench.schema``) and names the same
things alike in its results; the committed results in benchmarks/results (and results/history) follow it too.
benchmarks/README.md's tables are generated from them: tests/test_bench_report.py checks those."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.bench import schema
from kvshuttle.bench.timing import interleaved_rounds, speedups, spread

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
TINY = {
    "pack": ["--layers", "2", "--blocks", "32", "--spare-blocks", "8", "--repeat", "3"],
    "plan": ["--layers", "4", "--blocks", "64", "--repeat", "3"],
    "policy": ["--blocks", "64", "--repeat", "3", "--number", "2"],
    "retention": ["--quick"],
    "transfer": ["--shape", "qwen3-32b-tp8", "--layers", "1", "--blocks", "8", "--spare-blocks", "8", "--repeat", "2",
                 "--chunk-mib", "1", "--pattern", "scattered"],
}


def _run(bench: str, argv: list[str]) -> dict[str, Any]:
    module = importlib.import_module(f"kvshuttle.bench.{bench}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    result: dict[str, Any] = module.run(parser.parse_args(argv))
    assert module.format_table(result)
    return json.loads(json.dumps(result))  # JSON-ready


def _check_results(result: dict[str, Any]) -> None:
    schema.check(result)
    for row in result["results"]:
        assert isinstance(row["seconds"], dict) and all(v > 0 for v in row["seconds"].values()), row
        assert isinstance(row["rounds"], int) and row["rounds"] >= 1
        ratios = [k for k in row if "_vs_" in k]
        assert sorted(ratios) == sorted(row.get("ratio_spread", {})), "every ratio has its per-round spread"
        for name in ratios:
            s = row["ratio_spread"][name]
            if s is None:  # an earlier session's output, converted: ratios of medians, no rounds kept
                assert "EARLIER SESSION" in result["note"]
                continue
            assert s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"] and s["median"] == row[name]
        if "bytes" in row and "gbps" in row:
            assert row["gbps"].keys() == row["seconds"].keys()
        for key in ("descriptors", "bytes_per_descriptor"):
            assert key not in row or isinstance(row[key], dict)


@pytest.mark.parametrize("bench", sorted(TINY))
def test_every_bench_prints_the_same_envelope(bench: str) -> None:
    result = _run(bench, TINY[bench])
    _check_results(result)
    assert result["bench"] == bench and result["command"].startswith(f"kvshuttle bench {bench} ")
    assert result["command"].endswith("--json") and result["machine"]["cpus"] >= 1
    assert tuple(result["machine"]) == schema.MACHINE_KEYS + schema.MACHINE_DETAIL_KEYS
    llc = result["machine"]["llc_bytes"]
    assert llc is None or (isinstance(llc, int) and llc >= 1 << 10)  # a cache size, however the kernel spells it
    if bench != "policy":
        assert all(row.get("verified") not in (False, None) for row in result["results"])
    if bench == "transfer":  # where each packed read's time went, from its telemetry
        for row in result["results"]:
            stages = row["packed_stages"]
            assert set(stages) == {"pack_s", "read_s", "unpack_s", "total_s"} and all(v > 0 for v in stages.values())
            assert stages["total_s"] >= stages["read_s"]


def test_command_lists_the_options_that_differ_from_the_defaults() -> None:
    result = _run("plan", ["--layers", "4", "--blocks", "64", "--repeat", "3"])
    assert result["command"] == "kvshuttle bench plan --layers 4 --blocks 64 --repeat 3 --json"
    assert result["config"]["cache_blocks"] == 4096


def test_pack_ratios_come_from_interleaved_rounds() -> None:
    result = _run("pack", TINY["pack"])
    for row in result["results"]:
        assert row["rounds"] == 3 and set(row["seconds"]) == {"pack", "unpack", "copy", "peer_pack", "peer_unpack"}
        assert row["pack_vs_copy"] > 0 and row["verified"] is True
        assert row["bytes"] == 32 * 2 * 2 * row["bytes_per_piece"] and "kernel_seconds" not in row  # CPU run


def test_interleaved_rounds_rotate_and_spread() -> None:
    calls: list[str] = []
    samples = interleaved_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3, warmup=0)
    assert calls == ["a", "b", "b", "a", "a", "b"] and all(len(v) == 3 for v in samples.values())
    ratios, spreads = speedups({"a": [1.0, 2.0, 1.0], "b": [2.0, 2.0, 4.0]}, {"a_vs_b": ("a", "b")})
    assert ratios == {"a_vs_b": 2.0} and spreads["a_vs_b"]["min"] == 1.0 and spreads["a_vs_b"]["max"] == 4.0
    assert spread([5.0]) == {"min": 5.0, "q1": 5.0, "median": 5.0, "q3": 5.0, "max": 5.0}


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("*.json")), ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_results_follow_the_schema(path: Path) -> None:
    result = json.loads(path.read_text())
    if str(result.get("command", "")).startswith("python benchmarks/"):  # a script's record (packed_chunk_cost.py)
        assert result["commit"] and tuple(result["machine"]) == schema.MACHINE_KEYS + schema.MACHINE_DETAIL_KEYS
        return
    if "bench" not in result:  # kvshuttle info output, not a bench
        assert "version" in result and "native" in result
        return
    _check_results(result)


class _FakeEvent:
    """Stands in for torch.cuda.Event on a machine without a GPU: host time between records."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        import time

        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.at - self.at) * 1e3 + 1e-6  # milliseconds, as torch's


def test_pack_kernel_timing_plumbing_without_a_gpu() -> None:
    """The CUDA-event path of the pack bench (its GPU run is untested here): rounds, sleeps, result keys."""
    from types import SimpleNamespace

    from kvshuttle.bench import pack

    sleeps: list[int] = []
    fake = SimpleNamespace(cuda=SimpleNamespace(Event=_FakeEvent, _sleep=sleeps.append))
    assert pack._device_sleep_rate(fake) > 0 and sleeps == [50_000_000]
    fns = {name: (lambda: None) for name in pack.METHODS}
    e2e = interleaved_rounds(fns, 4, number=2)
    kernel = pack._kernel_rounds(fake, fns, e2e, 2, sleep_rate=1e9)
    assert all(len(v) == 4 and all(t > 0 for t in v) for v in kernel.values())
    assert len(sleeps) == 1 + 4 * len(pack.METHODS) and min(sleeps[1:]) >= 100_000
    row = pack._result(pack.SHAPES["qwen3-32b-tp8"], 2, 8, 8 * 2 * 2 * 4096, e2e, "cuda", 0, 2, True, kernel)
    assert {"kernel_seconds", "kernel_gbps", "pack_vs_copy_kernel"} <= set(row)
    assert set(row["ratio_spread"]) == {k for k in row if "_vs_" in k}
    fake_result = {"results": [row], "note": "fake"}
    assert "cuda/k" in pack.format_table(fake_result)
