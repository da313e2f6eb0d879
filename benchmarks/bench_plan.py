"""pytest-benchmark cases for read planning: native vs the numpy reference vs a vLLM-style numpy peer.

Run: pytest benchmarks/bench_plan.py --benchmark-enable --benchmark-group-by=param:case
Each group holds the native planner, the reference and the peer (vLLM's per-region ``base + id * len``
Nx3 builder, both sides, no coalescing) on the same ids. Small: 16 layers x 512 blocks read of 1,024;
`kvshuttle bench plan` runs the full Qwen3-32B shape (64 layers x 1,536 blocks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvshuttle.bench.plan import case_ids, fa_side, vllm_style_descriptors, warm_allocator
from kvshuttle.core import plan

LAYERS, READ, CACHE_BLOCKS, PIECE = 16, 512, 1024, 32 * 1024


@pytest.fixture(scope="module", params=["permuted", "contiguous"])
def case(request: pytest.FixtureRequest) -> dict[str, Any]:
    warm_allocator()
    local = fa_side(LAYERS, CACHE_BLOCKS, PIECE, base=1 << 40, device=0)
    remote = fa_side(LAYERS, CACHE_BLOCKS, PIECE, base=1 << 46, device=1)
    lids, rids = case_ids(request.param, np.random.default_rng(0), READ, CACHE_BLOCKS)
    return {"local": local, "remote": remote, "lids": lids, "rids": rids}


@pytest.mark.skipif(not plan.native_available(), reason="native planner not built")
def test_plan_native(benchmark: Any, case: dict[str, Any]) -> None:
    result = benchmark(plan.plan_read, case["local"], case["lids"], case["remote"], case["rids"],
                       backend="native")
    assert result.num_pieces == 2 * LAYERS * READ


def test_plan_reference(benchmark: Any, case: dict[str, Any]) -> None:
    benchmark(plan.plan_read, case["local"], case["lids"], case["remote"], case["rids"], backend="reference")


def test_plan_vllm_style_peer(benchmark: Any, case: dict[str, Any]) -> None:
    local, remote = case["local"], case["remote"]

    def peer() -> None:
        vllm_style_descriptors(local.plane_bases, case["lids"], local.piece_bytes, local.device_id)
        vllm_style_descriptors(remote.plane_bases, case["rids"], remote.piece_bytes, remote.device_id)

    benchmark(peer)
