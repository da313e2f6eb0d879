"""The command line: info, the pack/plan benchmarks at tiny sizes, and the two-process demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvshuttle.demo import DemoShape, run_demo


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
    assert [r["shape"] for r in result["results"]] == ["qwen3-32b", "qwen3-32b-tp8"]
    for r in result["results"]:
        assert r["bytes"] == 64 * 2 * 2 * r["bytes_per_piece"] and r["pieces"] == 64 * 2 * 2
        assert r["pack_vs_copy"] > 0 and r["unpack_vs_peer"] > 0


def test_bench_plan_json() -> None:
    out = kvshuttle("bench", "plan", "--layers", "4", "--blocks", "64", "--repeat", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)


@pytest.mark.parametrize("path", ["direct", "packed"])
def test_demo_reads_every_previous_turn_back_byte_exact(path: str) -> None:
    shape = DemoShape(layers=2, kv_heads=2, head_size=64, cache_blocks=256, first_prompt=50, user_tokens=10,
                      answer_tokens=30, turns=3)
    result = run_demo(shape, path)
    turns = result["turns"]
    assert result["all_verified"] and all(t["verified"] for t in turns)
    assert [t["reused_tokens"] for t in turns] == [0, 79, 119]  # prompt + answer - 1 of the turn before
    assert [t["computed_tokens"] for t in turns] == [50, 11, 11]
    assert all(t["path"] == path for t in turns[1:])
    per_token = result["kv_bytes_per_token"]
    assert turns[1]["bytes"] >= 79 * per_token

