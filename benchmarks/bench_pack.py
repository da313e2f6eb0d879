"""pytest-benchmark cases for pack/unpack: native vs memcpy vs a numpy fancy-indexing peer.

Run: pytest benchmarks/bench_pack.py --benchmark-enable --benchmark-group-by=param:setup
Each group holds the native pack/unpack, memcpy of the same bytes and the numpy peer, so the table shows
the ratios directly. Sizes are small (4 layers x 512 blocks); `kvshuttle bench pack` runs the full shapes
with the methods interleaved round by round. Every case checks the bytes it moved after timing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvshuttle as ks
from kvshuttle import _native

SHAPES = {"qwen3-32b": 8, "qwen3-32b-tp8": 1}  # KV heads per rank; head 128, bf16, block 16
LAYERS, BLOCKS, SPARE = 4, 512, 128


@pytest.fixture(scope="module", params=list(SHAPES))
def setup(request: pytest.FixtureRequest) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    shape = (2, BLOCKS + SPARE, 16, SHAPES[request.param], 128)
    layers = [rng.integers(1, 2**16, size=shape, dtype=np.uint16) for _ in range(LAYERS)]
    cache = ks.PagedKVCache.from_arrays(layers, "flash_attn")
    ids = rng.permutation(BLOCKS + SPARE)[:BLOCKS]
    gather = np.stack([kv[:, ids] for kv in layers])  # [L, 2, n, B, H, D]
    expected = np.ascontiguousarray(np.moveaxis(gather, 2, 0)).view(np.uint8).reshape(-1)  # staging [n][L][2][piece]
    staging = np.empty(ks.staging_nbytes(cache, BLOCKS * 16), np.uint8)
    peer = np.empty((LAYERS, 2, BLOCKS, *shape[2:]), np.uint16)
    return {"layers": layers, "cache": cache, "ids": ids, "staging": staging, "peer": peer, "gather": gather,
            "expected": expected, "copy_dst": np.empty_like(staging)}


def _blocks_hold_the_gather(setup: dict[str, Any]) -> bool:
    return all(np.array_equal(kv[:, setup["ids"]], setup["gather"][layer]) for layer, kv in enumerate(setup["layers"]))


def test_pack_native(benchmark: Any, setup: dict[str, Any]) -> None:
    setup["staging"].fill(0)
    benchmark(ks.pack, setup["cache"], setup["ids"], setup["staging"])
    assert np.array_equal(setup["staging"], setup["expected"])


def test_unpack_native(benchmark: Any, setup: dict[str, Any]) -> None:
    setup["staging"][:] = setup["expected"]
    for kv in setup["layers"]:
        kv[:, setup["ids"]] = 0
    benchmark(ks.unpack, setup["staging"], setup["cache"], setup["ids"])
    assert _blocks_hold_the_gather(setup)


def test_memcpy_same_bytes(benchmark: Any, setup: dict[str, Any]) -> None:
    src, dst = setup["expected"], setup["copy_dst"]
    dst.fill(0)
    benchmark(_native.parallel_memcpy, dst.ctypes.data, src.ctypes.data, src.nbytes)
    assert np.array_equal(dst, src)


def test_pack_numpy_peer(benchmark: Any, setup: dict[str, Any]) -> None:
    setup["peer"].fill(0)

    def gather() -> None:
        for layer, kv in enumerate(setup["layers"]):
            np.take(kv, setup["ids"], axis=1, out=setup["peer"][layer])

    benchmark(gather)
    assert np.array_equal(setup["peer"], setup["gather"])


def test_unpack_numpy_peer(benchmark: Any, setup: dict[str, Any]) -> None:
    setup["peer"][:] = setup["gather"]
    for kv in setup["layers"]:
        kv[:, setup["ids"]] = 0

    def scatter() -> None:
        for layer, kv in enumerate(setup["layers"]):
            kv[:, setup["ids"]] = setup["peer"][layer]

    benchmark(scatter)
    assert _blocks_hold_the_gather(setup)
