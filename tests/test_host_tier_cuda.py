"""The host tier on a GPU host (needs a GPU, the CUDA build and cupy; skipped otherwise).

A cache in VRAM (cupy, or torch as vLLM holds it) demotes blocks into pinned, mapped host slots: a pack on the
tier's CUDA stream into a bounce buffer, then device-to-host copies, ordered after the caller's current stream.
The owner then packs a tier claim's reads on its stream straight from those host slots into its VRAM staging,
and a reader in another process reads them back over real NIXL, byte for byte, while the owner's allocator
has reused (zeroed) every hot block the ledger handed back.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvshuttle
from conftest import POISON, Geo, HostCache, make_cache, torch_layer
from kvshuttle import PagedKVCache, StagingLayout
from transfer_helpers import PipedProcess, build_cache, token_bytes

pytestmark = pytest.mark.cuda

CAPACITY = 12
GEOS = {
    "flash_nhd": Geo("flash_attn", "NHD", "float16", num_blocks=16),
    "flashinfer_hnd": Geo("flashinfer", "HND", "bf16", num_blocks=16, num_layers=3),
    "mla": Geo("mla", "NHD", "fp8", num_blocks=16, num_heads=1, head_size=40),
}
CUPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bf16": np.uint16, "fp8": np.uint8}
SPIN = r"""extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}"""


def gpu_cache(host: HostCache, framework: str) -> tuple[PagedKVCache, list[Any]]:
    """The bytes of ``host`` in VRAM: (the cache, each layer's flat uint8 device buffer)."""
    geo = host.geo
    if framework == "torch":
        torch = pytest.importorskip("torch")
        raws: list[Any] = [torch.from_numpy(r).cuda() for r in host.raws]
        layers = [torch_layer(r, geo) for r in raws]
    else:
        cupy = pytest.importorskip("cupy")
        raws = [cupy.asarray(r) for r in host.raws]
        layers = [r.view(CUPY_DTYPES[geo.dtype]).reshape(geo.physical_shape).transpose(geo.perm) for r in raws]
    return PagedKVCache.from_arrays(layers, geo.kind, geo.order), raws


def packed_blocks(host: HostCache, ids: Any) -> np.ndarray:
    """What the tier must hold for blocks ``ids`` in consecutive slots: their identity staging pack (host)."""
    cache = host.cache()
    g = cache.geometry
    layout = StagingLayout.like(g)
    out = np.full(layout.nbytes(g, len(ids) * g.block_size), POISON, dtype=np.uint8)
    kvshuttle.pack(cache, np.asarray(ids, dtype=np.int64), out, num_tokens=len(ids) * g.block_size, layout=layout)
    return out


def demote(tier: Any, ids: Any, slots: tuple[int, ...]) -> queue.Queue[bool]:
    from kvshuttle.retention import Demotion

    landed: queue.Queue[bool] = queue.Queue()
    tier.demote(Demotion("h", tuple(int(b) for b in ids), slots, landed.put))
    return landed


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("name", list(GEOS))
def test_a_gpu_demotion_lands_exactly_in_scattered_slots(name: str, framework: str) -> None:
    from kvshuttle.transfer.host_tier import HostTier

    geo = GEOS[name]
    rng = np.random.default_rng(7)
    host = make_cache(rng, geo)
    cache, _ = gpu_cache(host, framework)
    tier = HostTier(cache, CAPACITY)
    try:
        assert tier.cache.is_cuda  # the owner packs tier claims on its stream, reading the host slots in place
        tier.buffer[:] = POISON
        ids = rng.permutation(geo.num_blocks)[:6]
        slots = (7, 8, 2, 3, 4, 10)  # three runs of consecutive slots
        assert demote(tier, ids, slots).get(timeout=30) is True
        want, size = packed_blocks(host, ids), tier.block_bytes
        for index, slot in enumerate(slots):
            assert np.array_equal(tier.slot_bytes(slot), want[index * size:(index + 1) * size]), f"slot {slot}"
        for slot in set(range(CAPACITY)) - set(slots):
            assert (tier.slot_bytes(slot) == POISON).all(), f"slot {slot} was written"
        assert tier.copies == 1
    finally:
        tier.close()


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_a_gpu_demotion_waits_for_the_callers_stream_without_blocking_it(framework: str) -> None:
    """The caller's stream (not the default one) is busy, then overwrites the blocks: the demotion returns at
    once, and its copy holds the overwritten bytes (it waited for them on the device)."""
    cupy = pytest.importorskip("cupy")
    from kvshuttle.transfer.host_tier import HostTier

    geo = GEOS["flash_nhd"]
    host = make_cache(np.random.default_rng(3), geo)
    cache, raws = gpu_cache(host, framework)
    tier = HostTier(cache, CAPACITY)
    spin = cupy.RawKernel(SPIN, "spin")
    cycles = 1_500_000_000  # about a second at H200 clocks
    try:
        if framework == "torch":
            import torch

            stream = torch.cuda.Stream()
            context: Any = torch.cuda.stream(stream)
            handle = int(stream.cuda_stream)
        else:
            stream = cupy.cuda.Stream(non_blocking=True)
            context, handle = stream, int(stream.ptr)
        with context:
            with cupy.cuda.ExternalStream(handle):
                spin((1,), (1,), (np.int64(cycles),))
            for raw in raws:
                raw.fill_(0x3C) if framework == "torch" else raw.fill(0x3C)
            landed = demote(tier, [5, 1, 9], (0, 1, 2))
            assert landed.empty(), "the copy completed before the caller's stream wrote the blocks"
        assert landed.get(timeout=30) is True
        assert (tier.slot_bytes(0, 3) == 0x3C).all(), "the copy did not wait for the caller's stream"
    finally:
        tier.close()


# ------------------------------------------------------------------------- a tier claim over NIXL, on the GPU
def _owner_main(conn: Any, seed: int) -> None:
    import torch

    from kvshuttle.policy import block_digests
    from kvshuttle.retention import RetentionLedger, RetentionTerms, TierTerms
    from kvshuttle.transfer import EngineConfig, TransferEngine
    from kvshuttle.transfer.host_tier import HostTier

    engine = None
    try:
        geo = GEOS["flash_nhd"]
        cache, _ = gpu_cache(build_cache(geo, seed), "torch")  # as vLLM holds it
        tier = HostTier(cache, geo.num_blocks)  # room for every case's retention
        engine = TransferEngine(cache, EngineConfig(), tier=tier)
        address, port = engine.serve().removeprefix("tcp://").rsplit(":", 1)
        freed: list[int] = []

        def reuse(blocks: list[int]) -> None:  # the allocator hands them to the next request at once
            freed.extend(blocks)
            for layer in cache.layers:
                layer.owner[:, blocks] = 0
            torch.cuda.synchronize()

        ledger = RetentionLedger("decode", address, int(port), terms=RetentionTerms(
            ttl_s=100.0, tier=TierTerms(geo.num_blocks, 1000.0)), on_free=reuse, on_demote=tier.demote,
            bytes_per_block=tier.block_bytes)
        engine.claims = ledger
        conn.send(("ready", engine.address))
        while True:
            if not conn.poll(0.05):
                continue
            command, args = conn.recv()
            if command == "stop":
                break
            if command == "retain":
                digests = block_digests(list(range(args["num_tokens"])), geo.block_size)
                conn.send(("ok", ledger.retain("req", args["blocks"], digests, args["num_tokens"], geo.block_size)))
            elif command == "demote":
                ok = ledger.demote(args["handle_id"])
                deadline = time.monotonic() + 30
                while ledger.metrics()["tiers"]["host"]["copying"] and time.monotonic() < deadline:
                    time.sleep(0.01)
                conn.send(("ok", (ok, ledger.metrics(), list(freed))))
            else:
                conn.send(("error", f"unknown command {command!r}"))
    except Exception as exc:  # report failures to the test instead of hanging it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if engine is not None:
            engine.close()
        conn.close()


class GpuTierOwner(PipedProcess):
    SEED = 11

    def __init__(self) -> None:
        super().__init__("gpu tier owner", _owner_main, (self.SEED,))
        reply = self._receive(120.0)
        if reply[0] != "ready":
            self.close()
            raise RuntimeError(f"owner process failed to start: {reply}")
        self.address: str = reply[1]


@pytest.fixture(scope="module")
def owner() -> Iterator[GpuTierOwner]:
    process = GpuTierOwner()
    try:
        yield process
    finally:
        process.close()


READS = [("cuda", "packed"), ("cuda", "direct"), ("cpu", "packed")]


@pytest.mark.parametrize(("reader_device", "path"), READS)
def test_a_tier_claim_of_a_gpu_owner_reads_back_exactly(owner: GpuTierOwner, reader_device: str, path: str) -> None:
    from kvshuttle.transfer import EngineConfig, TransferEngine

    geo = GEOS["flash_nhd"]
    case = READS.index((reader_device, path))
    rng = np.random.default_rng(case)
    # blocks of their own per case: a demotion hands its hot blocks to the allocator, which zeroes them for good
    blocks = [int(b) for b in rng.permutation(np.arange(5) + 5 * case)]
    handle = owner.call("retain", blocks=blocks, num_tokens=5 * geo.block_size - 3)
    ok, metrics, freed = owner.call("demote", handle_id=handle.handle_id, timeout=40.0)
    tier = metrics["tiers"]["host"]  # the module's owner: 5 blocks per test so far
    assert ok and tier["blocks"] == 5 * tier["demotions"] and set(blocks) <= set(freed)  # hot blocks reused
    local = [int(b) for b in rng.permutation(geo.num_blocks)[:5]]
    poisoned = make_cache(None, geo, fill=POISON)
    cache, raws = gpu_cache(poisoned, "cupy") if reader_device == "cuda" else (poisoned.cache(), poisoned.raws)
    with TransferEngine(cache, EngineConfig()) as engine:
        peer = engine.connect(owner.address)
        ticket = engine.claim(peer, handle)
        assert ticket.tier == "host"
        read = engine.read(peer, local, list(ticket.block_ids), num_tokens=handle.num_tokens, path=path,
                           claim=ticket)
        read.wait(30)
        assert read.path == path  # direct: the tier's slots in the owner's host memory, into VRAM
        engine.finish_claim(peer, ticket, ok=True)
    got = HostCache(geo, [r.get() if reader_device == "cuda" else r for r in raws])
    want = build_cache(geo, GpuTierOwner.SEED)
    assert np.array_equal(token_bytes(got, local, handle.num_tokens), token_bytes(want, blocks, handle.num_tokens))
    others = sorted(set(range(geo.num_blocks)) - set(local))
    for layer in got.raws:  # flash_attn NHD: [2, N, B, H, D, itemsize]
        assert (layer.reshape(*geo.physical_shape, geo.itemsize)[:, others] == POISON).all(), \
            "a block outside the read was written"
