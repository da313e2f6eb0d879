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
    return {"name": request.param, "local": local, "remote": remote, "lids": lids, "rids": rids}


@pytest.mark.skipif(not plan.native_available(), reason="native planner not built")
def test_plan_native(benchmark: Any, case: dict[str, Any]) -> None:
    result = benchmark(plan.plan_read, case["local"], case["lids"], case["remote"], case["rids"],
                       backend="native")
    reference = plan.plan_read(case["local"], case["lids"], case["remote"], case["rids"], backend="reference")
    assert np.array_equal(result.local, reference.local) and np.array_equal(result.remote, reference.remote)
    assert result.num_pieces == 2 * LAYERS * READ


def test_plan_reference(benchmark: Any, case: dict[str, Any]) -> None:
    result = benchmark(plan.plan_read, case["local"], case["lids"], case["remote"], case["rids"],
                       backend="reference")
    # Scattered ids merge nothing; contiguous ones merge into one descriptor per region (K and V of each layer).
    assert result.num_descriptors == (2 * LAYERS * READ if case["name"] == "permuted" else 2 * LAYERS)
    assert result.total_bytes == 2 * LAYERS * READ * PIECE == int(result.local[:, 1].sum())


def test_plan_vllm_style_peer(benchmark: Any, case: dict[str, Any]) -> None:
    local, remote = case["local"], case["remote"]

    def peer() -> tuple[Any, Any]:
        return (vllm_style_descriptors(local.plane_bases, case["lids"], local.piece_bytes, local.device_id),
                vllm_style_descriptors(remote.plane_bases, case["rids"], remote.piece_bytes, remote.device_id))

    local_rows, remote_rows = benchmark(peer)
    assert local_rows.shape == remote_rows.shape == (2 * LAYERS * READ, 3)
    assert int(local_rows[:, 1].sum()) == 2 * LAYERS * READ * PIECE
