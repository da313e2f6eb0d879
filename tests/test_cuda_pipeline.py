"""The GPU path beyond one kernel call (needs a GPU; skipped otherwise, and never run in CI):

* the pinned upload ring: back-to-back launches allocate nothing, return before the device ran them, and a slot's
  table is never overwritten while a queued kernel still reads it (each call packs other blocks: a reused table
  would pack the wrong bytes);
* the CUDA executor: a completion is done only after its copy ran; byte-exact against the numpy reference;
* packed reads between two engines of this process with caches and staging in VRAM (NIXL VRAM -> VRAM), with
  every layout transform, vLLM 0.32/0.33 FlashAttention and FlashInfer pages included; bytes compared with the
  owner's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvshuttle
from conftest import POISON, Geo, HostCache, assert_bytes_equal, make_cache, poisoned, random_ids, staging_layout
from kvshuttle import pack
from kvshuttle.core import native
from test_pack_cuda import CupyDevice, DeviceCache, TorchDevice
from transfer_helpers import block_bytes, token_bytes

pytestmark = pytest.mark.cuda

GEO = Geo("flash_attn", "NHD", "bf16", num_layers=4, num_blocks=256, block_size=16, num_heads=8, head_size=128)


def _reference(host: HostCache, ids: np.ndarray, layout: Any = None) -> np.ndarray:
    want = poisoned(kvshuttle.staging_nbytes(host.cache(), len(ids) * host.geo.block_size, layout))
    pack(host.cache(), ids, want, layout=layout, backend="reference")
    return want


# ------------------------------------------------------------------------------------------- upload ring
def test_back_to_back_launches_allocate_nothing_and_return_before_the_device_ran_them(rng) -> None:
    dev = TorchDevice()
    torch = dev.torch
    host = make_cache(rng, GEO)
    gpu = DeviceCache(dev, host)
    calls = 8  # the ring's slots: this many launches queue without the host waiting
    ids = [random_ids(rng, GEO.num_blocks, 16) for _ in range(calls)]
    stagings = [dev.upload(poisoned(kvshuttle.staging_nbytes(host.cache(), 16 * GEO.block_size)))
                for _ in range(calls)]
    pack(gpu.cache(), ids[0], stagings[0])  # warm: the slots' buffers exist
    for i in range(calls):
        pack(gpu.cache(), ids[i], stagings[i])
    dev.sync()
    before = native.ext.cuda_launch_stats()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(int(2e9))  # about a second of device time ahead of every launch below
    start = time.perf_counter()
    for i in range(calls):
        pack(gpu.cache(), ids[i], stagings[i], stream=int(stream.cuda_stream))
    enqueue_s = time.perf_counter() - start
    dev.sync()
    after = native.ext.cuda_launch_stats()
    assert after.device_allocations == before.device_allocations
    assert after.host_allocations == before.host_allocations
    assert after.launches - before.launches == calls
    assert after.reuse_waits == before.reuse_waits  # no launch waited: they overlapped the sleeping stream
    assert enqueue_s < 0.2, f"{calls} launches took {enqueue_s:.3f} s to enqueue: something synchronized"
    for i in range(calls):
        assert_bytes_equal(dev.download(stagings[i]), _reference(host, ids[i]), f"call {i}")


def test_a_slot_waits_for_its_kernel_before_its_table_is_rewritten(rng) -> None:
    dev = TorchDevice()
    torch = dev.torch
    host = make_cache(rng, GEO)
    gpu = DeviceCache(dev, host)
    calls = 20  # more than the ring's slots: later calls reuse slots whose kernels sit behind the sleep
    ids = [random_ids(rng, GEO.num_blocks, 8 + i) for i in range(calls)]  # different tables, growing
    stagings = [dev.upload(poisoned(kvshuttle.staging_nbytes(host.cache(), len(b) * GEO.block_size))) for b in ids]
    dev.sync()
    before = native.ext.cuda_launch_stats()
    torch.cuda._sleep(int(2e8))
    for i in range(calls):
        pack(gpu.cache(), ids[i], stagings[i])
    dev.sync()
    after = native.ext.cuda_launch_stats()
    assert after.reuse_waits > before.reuse_waits
    for i in range(calls):
        assert_bytes_equal(dev.download(stagings[i]), _reference(host, ids[i]), f"call {i}")


# ----------------------------------------------------------------------------------------- CUDA executor
def test_cuda_executor_completes_after_the_copy_and_matches_the_reference(rng) -> None:
    from kvshuttle.transfer.executors import CudaExecutor, executor_for

    dev = CupyDevice()
    torch = pytest.importorskip("torch")
    host = make_cache(rng, GEO)
    gpu = DeviceCache(dev, host)
    cache = gpu.cache()
    executor = executor_for(cache)
    assert isinstance(executor, CudaExecutor)
    ids = random_ids(rng, GEO.num_blocks, 40)
    layout = staging_layout(GEO, block_size=32, order="HND", num_heads=4)
    staging = dev.upload(poisoned(kvshuttle.staging_nbytes(cache, 40 * GEO.block_size, layout)))
    dev.sync()
    with torch.cuda.stream(torch.cuda.ExternalStream(int(executor.stream.ptr))):
        torch.cuda._sleep(int(5e8))  # the executor's stream is busy: the pack waits behind it
    done = executor.pack(cache, ids, staging, num_tokens=40 * GEO.block_size, layout=layout, head_offset=2)
    assert not done.done()
    assert done.wait(30) and done.result() > 0
    want = poisoned(staging.size)
    pack(host.cache(), ids, want, layout=layout, head_offset=2, backend="reference")
    assert_bytes_equal(dev.download(staging), want)
    dest = make_cache(None, GEO, fill=POISON)
    gpu_dest = DeviceCache(dev, dest)
    back = executor.unpack(staging, gpu_dest.cache(), ids, num_tokens=40 * GEO.block_size, layout=layout,
                           head_offset=2)
    assert back.wait(30)
    kvshuttle.unpack(want, dest.cache(), ids, layout=layout, head_offset=2, backend="reference")
    for got, expected in zip(gpu_dest.download(), dest.raws, strict=True):
        assert_bytes_equal(got, expected, "cache after the executor's unpack")


# ----------------------------------------------------------------------------- packed reads in VRAM
pytest.importorskip("nixl._api")
pytest.importorskip("zmq")

from kvshuttle.transfer import EngineConfig, TransferEngine  # noqa: E402

CONFIG = {"staging_chunk_bytes": 32 << 10, "staging_chunks": 4, "connect_timeout_s": 10.0}
BASE = Geo("flash_attn", "NHD", "float16", num_layers=2, num_blocks=32, block_size=16, num_heads=4, head_size=32)
CASES = {  # owner geometry, reader geometry, remote head offset
    "identity": (BASE, BASE, 0),
    "order_and_block": (BASE, BASE.with_(kind="flashinfer", order="HND", block_size=32, num_blocks=16), 0),
    "tp_head_slice": (BASE, BASE.with_(num_heads=2), 2),
    "vllm_flash_attn_to_flashinfer": (BASE.with_(kind="vllm_flash_attn", layout="LBNHC"),
                                      BASE.with_(kind="vllm_flashinfer", layout="BHLNC", block_size=32,
                                                 num_blocks=16), 0),
    "vllm_flashinfer_head_slice": (BASE.with_(kind="vllm_flashinfer", layout="LBHNC"),
                                   BASE.with_(kind="vllm_flash_attn", layout="LBNHC", num_heads=1), 3),
}


@pytest.fixture(scope="module")
def cupy_dev() -> CupyDevice:
    return CupyDevice()


@pytest.fixture
def vram_pair(cupy_dev: CupyDevice, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    owner_geo, reader_geo, offset = CASES[request.param]
    source = make_cache(np.random.default_rng(21), owner_geo)
    target = make_cache(None, reader_geo, fill=POISON)
    gpu_source, gpu_target = DeviceCache(cupy_dev, source), DeviceCache(cupy_dev, target)
    cupy_dev.sync()
    owner = TransferEngine(gpu_source.cache(), EngineConfig(**CONFIG))
    reader = TransferEngine(gpu_target.cache(), EngineConfig(**CONFIG))
    try:
        assert owner.pool.view.is_cuda and reader.pool.view.is_cuda  # VRAM staging on both sides
        peer = reader.connect(owner.serve())
        yield {"owner": owner, "reader": reader, "peer": peer, "source": source, "target": target,
               "gpu_target": gpu_target, "offset": offset}
    finally:
        reader.close()
        owner.close()


@pytest.mark.parametrize("vram_pair", list(CASES), indirect=True)
def test_packed_vram_read_is_byte_exact(vram_pair: dict[str, Any]) -> None:
    reader, source, target = vram_pair["reader"], vram_pair["source"], vram_pair["target"]
    rng = np.random.default_rng(3)
    tokens = 9 * 16 + 5  # the last block is partial
    lids = rng.permutation(target.geo.num_blocks)[: -(-tokens // target.geo.block_size)]
    rids = rng.permutation(source.geo.num_blocks)[: -(-tokens // source.geo.block_size)]
    heads = min(source.geo.heads, target.geo.heads)
    handle = reader.read(vram_pair["peer"], lids, rids, num_tokens=tokens, path="packed", num_heads=heads,
                         remote_head_offset=vram_pair["offset"])
    tel = handle.wait(60)
    assert tel.path == "packed" and tel.chunks >= 2
    for raw, got in zip(target.raws, vram_pair["gpu_target"].download(), strict=True):
        raw[:] = got
    want = token_bytes(source, rids, tokens, vram_pair["offset"], heads)
    assert np.array_equal(token_bytes(target, lids, tokens, 0, heads), want), "read tokens differ"
    others = np.setdiff1d(np.arange(target.geo.num_blocks), lids)
    assert (block_bytes(target, others) == POISON).all(), "a block outside the read was written"
    assert reader.stats()["staging_free"] == CONFIG["staging_chunks"]


def test_bench_transfer_cuda_runs_and_verifies(cupy_dev: CupyDevice) -> None:
    """The VRAM benchmark's plumbing at a tiny size: every method's bytes verified (numbers not asserted)."""
    import argparse

    from kvshuttle.bench import transfer as bench
    from kvshuttle.bench import transfer_cuda

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--device", "cuda", "--shape", "qwen3-32b-tp8", "--layers", "1", "--blocks", "8",
                              "--spare-blocks", "8", "--repeat", "1", "--chunk-mib", "1"])
    result = bench.run(args)
    assert [r["pattern"] for r in result["results"]] == ["scattered", "contiguous"]
    for row in result["results"]:
        assert row["verified"] == dict.fromkeys(transfer_cuda.METHODS, True)
    assert "VRAM to VRAM" in result["note"] and "packed_vs_one_read" in bench.format_table(result)
