"""pytest-benchmark cases for the reuse policy and the digest chain, each beside a naive peer.

Run: pytest benchmarks/bench_policy.py --benchmark-enable   (grouped: decide per case, digests)
Small (256 blocks of 16 = 4k tokens); ``kvshuttle bench policy`` runs 1,536 blocks (24k tokens) and prints
the ratios and the targets (decide <= 50 us, <= 1 us per 16-token block).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvshuttle.bench.policy import (
    NOW,
    make_handle,
    naive_blake2b_digests,
    naive_first_mismatch,
    vllm_style_digests,
)
from kvshuttle.policy import PolicyConfig, PromptDigests, block_digests, decide

BLOCKS, BS = 256, 16


@pytest.fixture(scope="module", params=["continuation", "edited_middle"])
def case(request: pytest.FixtureRequest) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    remote = rng.integers(0, 150_000, size=BLOCKS * BS - 7)
    prompt = np.concatenate([remote, rng.integers(0, 150_000, size=100)])
    if request.param == "edited_middle":
        prompt[(BLOCKS // 2) * BS] ^= 1
    digests = PromptDigests.from_tokens(prompt, BS)
    handle = make_handle(remote, BS)
    return {"name": request.param, "handle": handle, "digests": digests,
            "mismatch": BLOCKS // 2 if request.param == "edited_middle" else None,
            "prompt_list": [digests.digest(k) for k in range(digests.num_full_blocks)],
            "remote_full": handle.digests[: handle.num_tokens // BS]}


def test_decide(benchmark: Any, case: dict[str, Any]) -> None:
    benchmark.group = f"decide {case['name']}"
    d = benchmark(lambda: decide(case["digests"], local_hit_tokens=0, handle=case["handle"], now_wall=NOW,
                                 config=PolicyConfig()))
    assert d.action == "fetch" and d.mismatch_block == case["mismatch"]
    assert d.fetch_tokens == (BLOCKS // 2 * BS if case["name"] == "edited_middle" else BLOCKS * BS - 7)


def test_naive_loop_peer(benchmark: Any, case: dict[str, Any]) -> None:
    benchmark.group = f"decide {case['name']}"
    found = benchmark(naive_first_mismatch, case["remote_full"], case["prompt_list"])
    assert found == (case["mismatch"] if case["mismatch"] is not None else len(case["remote_full"]))


@pytest.fixture(scope="module")
def tokens_() -> dict[str, Any]:
    arr = np.random.default_rng(1).integers(0, 150_000, size=BLOCKS * BS)
    return {"array": arr, "list": arr.tolist()}


@pytest.fixture
def tokens(benchmark: Any, tokens_: dict[str, Any]) -> dict[str, Any]:
    benchmark.group = f"digests {BLOCKS} blocks of {BS}"
    return tokens_


def test_digests_numpy(benchmark: Any, tokens: dict[str, Any]) -> None:
    assert len(benchmark(block_digests, tokens["array"], BS)) == BLOCKS


def test_digests_list(benchmark: Any, tokens: dict[str, Any]) -> None:
    assert benchmark(block_digests, tokens["list"], BS) == block_digests(tokens["array"], BS)


def test_digests_vllm_sha256_pickle_peer(benchmark: Any, tokens: dict[str, Any]) -> None:
    digests = benchmark(vllm_style_digests, tokens["list"], BS)
    assert len(digests) == BLOCKS and len(set(digests)) == BLOCKS


def test_digests_naive_blake2b_peer(benchmark: Any, tokens: dict[str, Any]) -> None:
    assert benchmark(naive_blake2b_digests, tokens["list"], BS) == block_digests(tokens["array"], BS)
