"""The command line: info, the benchmarks at tiny sizes, and the two-process demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvshuttle.demo.run import run_demo
from kvshuttle.demo.workers import DemoShape


def kvshuttle(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvshuttle.cli", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_info_reports_the_build() -> None:
    out = kvshuttle("info")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["native"] is True and info["num_threads"] >= 1


def test_bench_pack_json_is_one_object_with_ratios() -> None:
    out = kvshuttle("bench", "pack", "--layers", "2", "--blocks", "64", "--spare-blocks", "16", "--repeat", "1",
                    "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [r["shape"] for r in result["results"]] == ["qwen3-32b", "qwen3-32b-tp8", "qwen3-32b-vllm-flash",
                                                       "qwen3-32b-vllm-cpu"]
    assert [r["kind"] for r in result["results"]] == ["flash_attn", "flash_attn", "vllm_flash_attn", "vllm_cpu_attn"]
    for r in result["results"]:
        assert r["bytes"] == 64 * 2 * 2 * r["bytes_per_piece"] and r["pieces"] == 64 * 2 * 2
        assert r["pack_vs_copy"] > 0 and r["unpack_vs_peer"] > 0 and r["verified"]
        assert r["copy_method"].startswith("memcpy")
        # Packs of 1-8 MiB stay below the streaming threshold: no lanes. Unpacks stream; from 4 MiB they are timed
        # (tuned between 1 and 4 lanes), below that they take the prior, one lane.
        assert r["lanes"]["pack"] == {"lanes": None, "tuned": False}
        unpack = r["lanes"]["unpack"]
        timed = r["bytes"] >= 4 << 20
        assert unpack["tuned"] == timed and unpack["lanes"] in ((1, 4) if timed else (1,))


@pytest.mark.parametrize("bench", ["plan", "policy", "retention"])
def test_other_benches_print_json(bench: str) -> None:
    small = {"plan": ["--layers", "4", "--blocks", "64", "--repeat", "2"],
             "policy": ["--blocks", "64", "--repeat", "2", "--number", "2"],
             "retention": ["--quick"]}[bench]
    out = kvshuttle("bench", bench, *small, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)


@pytest.mark.parametrize("path", ["direct", "packed"])
def test_demo_walks_every_case_and_verifies_every_byte(path: str) -> None:
    shape = DemoShape(layers=2, kv_heads=2, head_size=64)
    result = run_demo(shape, path)
    rows = {f"{r['conversation']}{r['turn']}": r for r in result["turns"]}
    assert result["all_verified"] and all(r["verified"] for r in result["turns"])
    assert rows["A1"]["decision"] == "recompute" and rows["A1"]["reason"] == "no_handle"
    # Continuation: everything decode held (prompt + answer - 1 = 799 tokens) is read back.
    assert rows["A2"]["decision"] == "fetch" and rows["A2"]["fetched_tokens"] == 799
    assert rows["A2"]["path"] == path and rows["A2"]["bytes"] >= 799 * shape.kv_bytes_per_token
    # Edited history at token 300: only the 18 verified blocks before it; unverified reuse would be wrong.
    assert rows["A3"]["fetched_tokens"] == 18 * 16 and rows["A3"]["unverified_wrong_tokens"] > 0
    assert rows["B2"]["decision"] == "recompute" and rows["B2"]["reason"] == "below_threshold"
    assert rows["C2"]["decision"] == "recompute" and rows["C2"]["reason"] == "expired"
    assert rows["D2"]["decision"] == "fetch"
    assert rows["A4"]["decision"] == "recompute" and rows["A4"]["reason"] == "claim_refused"
    assert rows["A4"]["owner_reason"] == "HandleEvictedError"
