"""``kvshuttle bench transfer --device cuda``: packed vs direct vs one contiguous read, VRAM to VRAM.

Two processes on one GPU (NIXL/UCX, caches and staging in VRAM through cupy): an owner serves a FlashAttention
cache of Qwen3-32B-shaped blocks (TP1: 32 KiB pieces, TP8: 4 KiB) held in one allocation; this process reads
``--blocks`` blocks back three ways and compares with a device-to-device copy of the same bytes:

* ``direct``: the planner's READ (runs contiguous on both sides coalesced), one descriptor per piece when scattered;
* ``packed``: the owner packs chunks on its CUDA stream, this side READs each chunk and unpacks on its stream;
* ``one_read``: one NIXL READ of the same number of bytes, contiguous on both sides (the link's best case);
* ``device_copy``: ``cupy`` copying the same bytes inside this process's GPU memory.

Every method's bytes are verified once against the owner's data (regenerated from the seed) before timing.

``--host-tier`` adds a row per shape for the host tier on a GPU host (``transfer/host_tier.py``): the owner
demotes the blocks into pinned host slots (a pack on its stream, then device-to-host copies), timed against one
device-to-host copy of the same bytes (the bus's limit); this side then reads the tier's claim packed (the owner's
kernel reads the host slots in place) against the hot claim read direct and packed, and against one
host-to-device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import queue
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..core.layout import CacheKind, PagedKVCache
from .schema import envelope
from .timing import gbps, interleaved_rounds, medians, speedups
from .transfer_workload import (
    SHAPES,
    Shape,
    add_arguments,
    block_ids,
    hot_and_tiered,
    layer_arrays,
    owner_process,
    sweep,
)

METHODS = ("direct", "packed", "one_read", "device_copy")
PAIRS = {"packed_vs_direct": ("packed", "direct"), "packed_vs_one_read": ("packed", "one_read"),
         "one_read_vs_device_copy": ("one_read", "device_copy")}


def _device_cache(cupy: Any, shape: Shape, layers: int, blocks: int, seed: int | None) -> tuple[Any, list[Any]]:
    """One VRAM allocation ``[L, 2, N, B, H, D]`` (the seed's words, or zeros) and its per-layer views."""
    dims = (layers, 2, blocks, shape.block_size, shape.kv_heads, shape.head_size)
    buffer = cupy.zeros(dims, dtype=cupy.uint16)
    if seed is not None:
        buffer[...] = cupy.asarray(np.stack(layer_arrays(shape, layers, blocks, seed)))
    cupy.cuda.Device().synchronize()
    return buffer, [buffer[layer] for layer in range(layers)]


def _owner(conn: Any, shape: Shape, layers: int, blocks: int, seed: int, config: dict[str, Any]) -> None:
    import cupy

    from ..transfer import EngineConfig, TransferEngine

    buffer, views = _device_cache(cupy, shape, layers, blocks, seed)
    with TransferEngine(PagedKVCache.from_arrays(views, CacheKind.FLASH_ATTN), EngineConfig(**config)) as engine:
        conn.send((engine.serve(), int(buffer.data.ptr)))
        while not conn.poll(0.2):
            pass


def _tier_owner(conn: Any, shape: Shape, layers: int, blocks: int, seed: int, config: dict[str, Any],
                ids: list[int], repeat: int) -> None:
    """An owner whose ledger keeps blocks ``ids`` twice, hot and demoted; sends the demotion's timings."""
    import cupy

    from ..retention import Demotion
    from ..transfer import EngineConfig, TransferEngine
    from ..transfer.host_tier import D2H, HostTier, host_buffer

    _, views = _device_cache(cupy, shape, layers, blocks, seed)
    cache = PagedKVCache.from_arrays(views, CacheKind.FLASH_ATTN)
    tier = HostTier(cache, len(ids))
    with TransferEngine(cache, EngineConfig(**config), tier=tier) as engine:
        nbytes = len(ids) * tier.block_bytes
        landed: queue.Queue[bool] = queue.Queue()
        demotion = Demotion("bench", tuple(ids), tuple(range(len(ids))), landed.put)
        source, pinned = cupy.empty(nbytes, dtype=cupy.uint8), host_buffer(nbytes, pinned=True)

        def demote() -> None:
            tier.demote(demotion)
            if not landed.get(timeout=60):
                raise RuntimeError("a demotion copy failed")

        def one_copy() -> None:
            cupy.cuda.runtime.memcpy(pinned.ctypes.data, source.data.ptr, nbytes, D2H)

        samples = interleaved_rounds({"demotion": demote, "d2h_copy": one_copy}, repeat)
        hot, tiered = hot_and_tiered(engine, ids, shape.block_size)
        conn.send((engine.address, (hot, tiered), samples, nbytes))
        while not conn.poll(0.2):
            pass


class _Reader:
    """This side of one run: a VRAM cache, an engine connected to the owner, the baselines' buffers."""

    def __init__(self, cupy: Any, shape: Shape, args: argparse.Namespace, total: int, config: dict[str, Any],
                 address: str, remote_base: int) -> None:
        from ..transfer import EngineConfig, TransferEngine

        self.cupy = cupy
        self.buffer, self.layers = _device_cache(cupy, shape, args.layers, total, None)
        self.cache = PagedKVCache.from_arrays(self.layers, CacheKind.FLASH_ATTN)
        self.engine = TransferEngine(self.cache, EngineConfig(**config))
        self.peer = self.engine.connect(address)
        self.remote_base = remote_base
        self.copy_dst = cupy.empty(self.buffer.nbytes, dtype=cupy.uint8)
        self.descriptors: dict[str, int] = {}

    def one_read(self, nbytes: int) -> None:
        """One descriptor of ``nbytes``, contiguous on both sides (the engine's own agent pair)."""
        agent, device = self.engine._agent, self.engine.device_id
        local = np.array([[int(self.buffer.data.ptr), nbytes, device]], dtype=np.uint64)
        remote = np.array([[self.remote_base, nbytes, self.peer.info.side.device_id]], dtype=np.uint64)
        xfer = agent.make_xfer(local, "VRAM", remote, "VRAM", self.peer.agent_name)
        try:
            state = agent.post(xfer)
            while state == "PROC":
                state = agent.state(xfer)
            if state != "DONE":
                raise RuntimeError("the contiguous VRAM READ failed")
        finally:
            agent.release(xfer)
        self.descriptors["one_read"] = 1

    def device_copy(self, nbytes: int) -> None:
        flat = self.buffer.reshape(-1).view(self.cupy.uint8)
        self.cupy.copyto(self.copy_dst[:nbytes], flat[:nbytes])
        self.cupy.cuda.Device().synchronize()

    def read(self, name: str, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64], nbytes: int) -> None:
        if name == "one_read":
            return self.one_read(nbytes)
        if name == "device_copy":
            return self.device_copy(nbytes)
        tel = self.engine.read(self.peer, lids, rids, path="packed" if name == "packed" else "direct").wait(120)
        self.descriptors[name] = tel.nixl_descriptors or tel.descriptors
        return None

    def verify(self, name: str, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64], nbytes: int,
               source: npt.NDArray[Any]) -> bool:
        """Every byte this method moved equals the owner's (``source``: its whole cache, on the host)."""
        got = self.cupy.asnumpy(self.buffer)
        if name == "one_read":
            return bool(np.array_equal(got.reshape(-1).view(np.uint8)[:nbytes],
                                       source.reshape(-1).view(np.uint8)[:nbytes]))
        if name == "device_copy":
            return bool(np.array_equal(self.cupy.asnumpy(self.copy_dst[:nbytes]),
                                       got.reshape(-1).view(np.uint8)[:nbytes]))
        return bool(np.array_equal(got[:, :, lids], source[:, :, rids]))

    def close(self) -> None:
        self.engine.close()


def _measure(reader: _Reader, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64], nbytes: int,
             repeat: int, source: npt.NDArray[Any] | None) -> tuple[dict[str, list[float]], dict[str, bool]]:
    verified = {}
    for name in METHODS:  # warm-up, and one byte check per method into a zeroed cache
        reader.buffer.fill(0)
        reader.cupy.cuda.Device().synchronize()
        reader.read(name, lids, rids, nbytes)
        if source is not None:
            verified[name] = reader.verify(name, lids, rids, nbytes, source)
    fns: dict[str, Callable[[], object]] = {name: functools.partial(reader.read, name, lids, rids, nbytes)
                                            for name in METHODS}
    return interleaved_rounds(fns, repeat, warmup=0), verified


def _run_shape(shape: Shape, args: argparse.Namespace, patterns: list[str], chunk_mib: float,
               depth: int) -> list[dict[str, Any]]:
    import cupy

    total = args.blocks + args.spare_blocks
    config = {"staging_chunk_bytes": int(chunk_mib * (1 << 20)), "staging_chunks": max(4, 2 * depth),
              "pipeline_depth": depth}
    reader: _Reader | None = None
    results = []
    with owner_process(_owner, (shape, args.layers, total, args.seed, config), 180) as (address, remote_base):
        try:
            reader = _Reader(cupy, shape, args, total, config, address, remote_base)
            source = None if args.no_verify else np.stack(layer_arrays(shape, args.layers, total, args.seed))
            rng = np.random.default_rng(args.seed + 1)
            g = reader.cache.geometry
            for pattern in patterns:
                lids, rids = block_ids(pattern, args.blocks, total, rng)
                nbytes = args.blocks * g.num_planes * g.piece_bytes
                samples, verified = _measure(reader, lids, rids, nbytes, args.repeat, source)
                if source is not None and not all(verified.values()):
                    raise AssertionError(f"{shape.name} {pattern}: wrong bytes moved: {verified}")
                times = medians(samples)
                ratios, spreads = speedups(samples, PAIRS)
                results.append({
                    "shape": shape.name, "device": "cuda", "pattern": pattern, "layers": args.layers,
                    "layers_in_model": shape.layers_in_model, "blocks": args.blocks, "block_size": shape.block_size,
                    "chunk_mib": chunk_mib, "depth": depth, "bytes": nbytes, "pieces": args.blocks * g.num_planes,
                    "bytes_per_piece": g.piece_bytes, "descriptors": dict(reader.descriptors), "rounds": args.repeat,
                    "seconds": {name: float(f"{t:.6g}") for name, t in times.items()},
                    "gbps": {name: round(gbps(nbytes, t), 3) for name, t in times.items()},
                    **ratios, "ratio_spread": spreads, "verified": verified,
                })
        finally:
            if reader is not None:
                reader.close()
    return results


def _claimed(reader: _Reader, lids: npt.NDArray[np.int64], handle: Any,
             path: Literal["direct", "packed"]) -> None:
    engine = reader.engine
    ticket = engine.claim(reader.peer, handle)
    engine.read(reader.peer, lids, list(ticket.block_ids), path=path, claim=ticket).wait(120)
    engine.finish_claim(reader.peer, ticket, ok=True)


def _tier_row(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """The host tier on this GPU: demotion vs one device-to-host copy; tier read vs hot reads and vs one
    host-to-device copy of the same bytes (the bus's limit both ways)."""
    import cupy

    from ..transfer.host_tier import host_buffer

    total = args.blocks + args.spare_blocks
    config = {"staging_chunk_bytes": 16 << 20, "staging_chunks": 8, "pipeline_depth": 4}
    rng = np.random.default_rng(args.seed + 2)
    lids, rids = block_ids("random", args.blocks, total, rng)
    wanted = [int(b) for b in rids]
    with owner_process(_tier_owner, (shape, args.layers, total, args.seed, config, wanted, args.repeat),
                       180) as sent:
        address, (hot, tiered), demotions, nbytes = sent
        reader = _Reader(cupy, shape, args, total, config, address, 0)
        try:
            source = np.stack(layer_arrays(shape, args.layers, total, args.seed))
            pinned, device = host_buffer(nbytes, pinned=True), cupy.empty(nbytes, dtype=cupy.uint8)

            def h2d_copy() -> None:
                cupy.cuda.runtime.memcpy(device.data.ptr, pinned.ctypes.data, nbytes, 1)  # cudaMemcpyHostToDevice

            fns: dict[str, Callable[[], object]] = {
                "hot_direct": functools.partial(_claimed, reader, lids, hot, "direct"),
                "hot_packed": functools.partial(_claimed, reader, lids, hot, "packed"),
                "tier_packed": functools.partial(_claimed, reader, lids, tiered, "packed"),
                "tier_direct": functools.partial(_claimed, reader, lids, tiered, "direct"), "h2d_copy": h2d_copy}
            verified = {}
            for name in ("hot_direct", "hot_packed", "tier_packed", "tier_direct"):  # one byte check each
                reader.buffer.fill(0)
                cupy.cuda.Device().synchronize()
                fns[name]()
                verified[name] = bool(np.array_equal(cupy.asnumpy(reader.buffer)[:, :, lids], source[:, :, rids]))
            if not all(verified.values()):
                raise AssertionError(f"{shape.name} host tier: wrong bytes read back by {verified}")
            samples = interleaved_rounds(fns, args.repeat)
        finally:
            reader.close()
    ratios, spreads = speedups({**samples, **demotions}, TIER_PAIRS)
    times = medians({**samples, **demotions})
    return {"shape": shape.name, "device": "cuda", "host_tier": True, "pattern": "random", "layers": args.layers,
            "blocks": args.blocks, "bytes": nbytes, "rounds": args.repeat,
            "seconds": {name: float(f"{t:.6g}") for name, t in times.items()},
            "gbps": {name: round(gbps(nbytes, t), 3) for name, t in times.items()},
            **ratios, "ratio_spread": spreads, "verified": verified}


TIER_PAIRS = {"tier_vs_hot_direct": ("tier_packed", "hot_direct"), "tier_vs_hot_packed": ("tier_packed", "hot_packed"),
              "tier_direct_vs_hot_direct": ("tier_direct", "hot_direct"), "tier_vs_h2d": ("tier_packed", "h2d_copy"),
              "demotion_vs_d2h": ("demotion", "d2h_copy")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every shape x pattern x chunk size x depth on the GPU; the :mod:`~kvshuttle.bench.schema` envelope."""
    import cupy

    started = time.perf_counter()
    names, chunks, depths, patterns = sweep(args)
    results = [r for name in names for chunk_mib, depth in itertools.product(chunks, depths)
               for r in _run_shape(SHAPES[name], args, patterns, chunk_mib, depth)]
    if getattr(args, "host_tier", False):
        results += [_tier_row(SHAPES[name], args) for name in names]
    gpu = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    note = (f"VRAM to VRAM between two processes on one GPU (NIXL UCX); layers scaled to {args.layers} of the "
            f"model's 64; bf16 moved as 2-byte words; {args.repeat} rounds, methods interleaved; ratios: median of "
            "per-round ratios; every method's bytes verified once")
    return envelope("transfer", args, add_arguments, results, note=note, started=started,
                    gpu=gpu.decode() if isinstance(gpu, bytes) else str(gpu))


def format_table(result: dict[str, Any]) -> str:
    lines = [result["note"], f"{'shape':15} {'pattern':11} {'MiB':>5} " + " ".join(f"{m:>16}" for m in METHODS)
             + "  " + "  ".join(f"{p:<24}" for p in PAIRS)]
    for r in result["results"]:
        if r.get("host_tier"):
            lines.append(f"{r['shape']:15} host tier   {r['bytes'] / 2**20:5.0f} "
                         + " ".join(f"{m} {g:.2f} GB/s" for m, g in r["gbps"].items()) + "  "
                         + "  ".join(f"{p} {r[p]:.2f}" for p in TIER_PAIRS))
            continue
        cells = "  ".join(f"{r[p]:.2f} ({r['ratio_spread'][p]['min']:.2f}-{r['ratio_spread'][p]['max']:.2f})"
                          .ljust(24) for p in PAIRS)
        lines.append(f"{r['shape']:15} {r['pattern']:11} {r['bytes'] / 2**20:5.0f} "
                     + " ".join(f"{r['gbps'][m]:11.2f} GB/s" for m in METHODS) + "  " + cells)
    lines.append("GB/s: median per method; ratios: speed of the first over the second, median of per-round "
                 "ratios (min-max)")
    return "\n".join(lines)
