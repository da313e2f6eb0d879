"""``kvshuttle bench transfer``: direct vs packed vs a raw per-block NIXL peer, between two processes.

An owner process (spawned) serves a paged cache; this process reads blocks back through the same NIXL
agent pair four ways and reports GB/s against a memcpy of the same bytes measured in the same run:

* ``direct``: one READ built by the planner (runs contiguous on both sides coalesced), ``initialize_xfer``;
* ``direct_prepped``: the same READ by index into lists prepared once (``make_prepped_xfer``);
* ``packed``: the owner packs into staging chunks, the reader reads chunks and unpacks, pipelined;
* ``raw_per_block``: vLLM's way: one descriptor per (layer, K/V, block), prepared once per side, one
  ``make_prepped_xfer`` per read (NIXL merges runs contiguous on both sides by itself);
* ``auto``: ``path="auto"`` on the same engine and peer as ``direct`` and ``packed``, whose reads feed the
  peer's path model (transfer/path_model.py), as a serving engine's earlier reads would; ``auto_vs_best`` is
  auto's speed over the faster (by median) of direct and packed, ``auto_paths`` how often it took each.

``--host-tier`` adds ``host_tier`` to each row: a second owner process keeps the read blocks twice under its
retention ledger, one retention hot and one demoted into its host tier (``transfer/host_tier.py``), and the reader
claims and reads each packed and direct (the tier's slots), interleaved round by round: the same bytes from the
tier and from the cache; ``tier_vs_hot`` is the packed tier read's speed over the packed hot one's,
``tier_direct_vs_hot_direct`` the same for direct reads (target: at least 0.8), ``tier_direct_vs_hot_packed``
the direct tier read's over the packed hot one's.

``packed_stages`` gives where a packed read's time goes (medians over the timed reads, from its telemetry):
``pack_s`` the owner's packs, ``read_s`` the chunk READs, ``unpack_s`` the unpacks, ``total_s`` the read; the
stages overlap, so they add up to more than the total.

Shapes are Qwen3-32B's (8 KV heads x 128 x bf16, 16-token blocks: 32 KiB pieces) and its TP8 shard
(1 head: 4 KiB pieces), plus TP2 (16 KiB) and TP4 (8 KiB) on request (``--shape`` takes a comma-separated
list; ``pieces`` is a sweep of 1-64 KiB pieces: 1 head of 32 or 64, 1-16 heads of 128), with fewer layers
than the model's 64 so both caches fit this machine; the result says how many.
Block ids are "scattered" (random on both sides) or "contiguous" (one run on each side). ``--chunk-mib``
and ``--depth`` take comma-separated lists too: every combination is a run of its own (a sweep).

The methods and the memcpy are interleaved round by round; each ratio is the median of the ratios measured
within a round, with their spread (``ratio_spread``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core.layout import CacheKind, PagedKVCache
from .schema import envelope
from .timing import gbps, interleaved_rounds, medians, round_ratios, speedups, spread
from .transfer_workload import (
    DEFAULT_SHAPES,
    PIECE_SHAPES,
    SHAPES,
    Shape,
    block_ids,
    hot_and_tiered,
    layer_arrays,
    owner_process,
    sweep,
)
from .transfer_workload import add_arguments as workload_arguments

__all__ = ["DEFAULT_SHAPES", "METHODS", "PIECE_SHAPES", "SHAPES", "Shape", "add_arguments", "format_table",
           "owner_process", "run"]
_ids = block_ids  # the name benchmarks/packed_*.py import


METHODS = ("direct", "direct_prepped", "packed", "raw_per_block", "auto")
PAIRS = {"packed_vs_memcpy": ("packed", "memcpy"), "packed_vs_direct": ("packed", "direct"),
         "direct_vs_raw_per_block": ("direct", "raw_per_block")}


def _owner(conn: Any, shape: Shape, layers: int, blocks: int, seed: int, config: dict[str, Any]) -> None:
    from ..transfer import EngineConfig, TransferEngine

    caches = layer_arrays(shape, layers, blocks, seed)
    with TransferEngine(PagedKVCache.from_arrays(caches, CacheKind.FLASH_ATTN), EngineConfig(**config)) as engine:
        conn.send(engine.serve())
        while not conn.poll(0.2):
            pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    workload_arguments(parser)


def _tier_owner(conn: Any, shape: Shape, layers: int, blocks: int, seed: int, config: dict[str, Any],
                ids: list[int]) -> None:
    """An owner whose ledger keeps blocks ``ids`` twice: hot, and demoted into its host tier."""
    from ..transfer import EngineConfig, TransferEngine
    from ..transfer.host_tier import HostTier

    cache = PagedKVCache.from_arrays(layer_arrays(shape, layers, blocks, seed), CacheKind.FLASH_ATTN)
    with TransferEngine(cache, EngineConfig(**config), tier=HostTier(cache, len(ids))) as engine:
        hot, tiered = hot_and_tiered(engine, ids, shape.block_size)
        conn.send((engine.address, (hot, tiered)))
        while not conn.poll(0.2):
            pass


def _claimed_read(engine: Any, peer: Any, lids: npt.NDArray[np.int64], handle: Any, path: str) -> None:
    ticket = engine.claim(peer, handle)
    engine.read(peer, lids, list(ticket.block_ids), path=path, claim=ticket).wait(120)
    engine.finish_claim(peer, ticket, ok=True)


TIER_READS = {"hot": (0, "packed"), "host_tier": (1, "packed"), "hot_direct": (0, "direct"),
              "tier_direct": (1, "direct")}  # name: (which retention, path)
TIER_PAIRS = {"tier_vs_hot": ("host_tier", "hot"), "tier_direct_vs_hot_direct": ("tier_direct", "hot_direct"),
              "tier_direct_vs_hot_packed": ("tier_direct", "hot")}


def _tier_vs_hot(shape: Shape, args: argparse.Namespace, reads: list[tuple[Any, Any]], config: dict[str, Any],
                 source: list[npt.NDArray[Any]] | None) -> list[dict[str, Any]]:
    """Per read: packed and direct reads of the same blocks from the owner's host tier and from its cache,
    interleaved (an owner per read: the reads' block ids overlap at other positions, which one ledger would take
    for a reuse)."""
    from ..transfer import EngineConfig, TransferEngine

    total = args.blocks + args.spare_blocks
    layers = [np.ones((2, total, shape.block_size, shape.kv_heads, shape.head_size), dtype=np.uint16)
              for _ in range(args.layers)]
    out = []
    for lids, rids in reads:
        wanted = [int(b) for b in rids]
        cache = PagedKVCache.from_arrays(layers, CacheKind.FLASH_ATTN)
        with owner_process(_tier_owner, (shape, args.layers, total, args.seed, config, wanted), 120) as sent, \
                TransferEngine(cache, EngineConfig(**config)) as engine:
            address, pair = sent
            peer = engine.connect(address)
            methods = {name: functools.partial(_claimed_read, engine, peer, lids, pair[which], path)
                       for name, (which, path) in TIER_READS.items()}
            verified = {}
            for name, read in methods.items():
                for layer in layers:
                    layer[:, lids] = 0
                read()
                verified[name] = source is None or all(np.array_equal(layer[:, lids], src[:, rids])
                                                       for layer, src in zip(layers, source, strict=True))
            if not all(verified.values()):
                raise AssertionError(f"{shape.name}: wrong bytes read back by {verified}")
            samples = interleaved_rounds(dict(methods), args.repeat)
            ratios, spreads = speedups(samples, TIER_PAIRS)
            nbytes = len(rids) * 2 * args.layers * shape.block_size * shape.kv_heads * shape.head_size * 2
            out.append({"gbps": {k: round(gbps(nbytes, t), 3) for k, t in medians(samples).items()},
                        **ratios, "ratio_spread": spreads, "verified": verified})
    return out


def _raw_per_block(engine: Any, peer: Any) -> tuple[Any, Any]:
    """vLLM-style prepared lists: one descriptor per (layer, K/V, block) on each side."""
    from ..transfer.direct import all_pieces

    agent = engine._agent  # the same agent pair as the engine's own reads
    rmem = peer.info.mem_type
    local = agent.prep_dlist(None, all_pieces(engine.side), engine.mem_type)
    remote = agent.prep_dlist(peer.agent_name, all_pieces(peer.info.side), rmem)
    return local, remote


def _raw_read(engine: Any, peer: Any, lists: tuple[Any, Any], lids: npt.NDArray[np.int64],
              rids: npt.NDArray[np.int64]) -> int:
    from ..transfer.direct import piece_indices

    agent = engine._agent
    xfer = agent.make_prepped_xfer(lists[0], piece_indices(engine.side, lids), lists[1],
                                   piece_indices(peer.info.side, rids))
    try:
        state = agent.post(xfer)
        while state == "PROC":
            state = agent.state(xfer)
        if state != "DONE":
            raise RuntimeError("raw per-block READ failed")
        tel = agent.telemetry(xfer)
        return int(tel.descriptors) if tel else int(lids.size) * engine.side.num_planes
    finally:
        agent.release(xfer)


class _Memcpy:
    """A memcpy of ``nbytes`` with the native thread pool, between buffers faulted in first (the peer)."""

    def __init__(self, native: Any, nbytes: int) -> None:
        self._native, self._nbytes = native, nbytes
        self._src, self._dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)

    def __call__(self) -> None:
        self._native.parallel_memcpy(self._dst.ctypes.data, self._src.ctypes.data, self._nbytes)


class _Reader:
    """The reading side of one run: a cache, two engines (initialize / prepped), the raw peer's lists."""

    def __init__(self, shape: Shape, args: argparse.Namespace, total: int, config: dict[str, Any],
                 address: str) -> None:
        from ..transfer import EngineConfig, TransferEngine

        dims = (2, total, shape.block_size, shape.kv_heads, shape.head_size)
        self.layers = [np.zeros(dims, dtype=np.uint16) for _ in range(args.layers)]
        for layer in self.layers:
            layer.fill(1)  # fault the pages in before timing
        self.cache = PagedKVCache.from_arrays(self.layers, CacheKind.FLASH_ATTN)
        self.direct = TransferEngine(self.cache, EngineConfig(**config))
        self.prepped = TransferEngine(self.cache, EngineConfig(**config, direct_mode="prepped"))
        self.peer = self.direct.connect(address)
        self.prepped_peer = self.prepped.connect(address)
        self.raw_lists = _raw_per_block(self.direct, self.peer)
        self.descriptors: dict[str, int] = {}
        self.auto_paths: dict[str, int] = {}  # timed auto reads per path taken
        self.auto_reason = ""
        self.packed_stages: dict[str, list[float]] = {"pack_s": [], "read_s": [], "unpack_s": [], "total_s": []}

    def read(self, name: str, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64]) -> None:
        if name == "raw_per_block":
            self.descriptors[name] = _raw_read(self.direct, self.peer, self.raw_lists, lids, rids)
            return
        engine, peer = (self.prepped, self.prepped_peer) if name == "direct_prepped" else (self.direct, self.peer)
        path = name if name in ("packed", "auto") else "direct"
        tel = engine.read(peer, lids, rids, path=path).wait(120)  # type: ignore[arg-type]
        self.descriptors[name] = tel.nixl_descriptors or tel.descriptors
        if name == "auto":
            self.auto_paths[tel.path] = self.auto_paths.get(tel.path, 0) + 1
            self.auto_reason = tel.reason
        if name == "packed":  # where a packed read's time goes (the stages overlap: they add up to more)
            for key, seconds in (("pack_s", tel.owner_pack_time_s), ("read_s", tel.post_time_s),
                                 ("unpack_s", tel.unpack_time_s), ("total_s", tel.transfer_time_s)):
                self.packed_stages[key].append(seconds)

    def close(self) -> None:
        self.direct.close()
        self.prepped.close()


def _measure(reader: _Reader, lids: npt.NDArray[np.int64], rids: npt.NDArray[np.int64], repeat: int,
             source: list[npt.NDArray[Any]] | None, memcpy: _Memcpy,
             ) -> tuple[dict[str, list[float]], dict[str, bool]]:
    """Per-round seconds of each method and the memcpy, interleaved round by round (a noisy VM hits all alike)."""
    verified = {}
    for name in METHODS:  # warm-up, and one byte check per method
        for layer in reader.layers:
            layer[:, lids] = 0
        reader.read(name, lids, rids)
        if source is not None:
            verified[name] = all(np.array_equal(layer[:, lids], src[:, rids])
                                 for layer, src in zip(reader.layers, source, strict=True))
    fns: dict[str, Callable[[], object]] = {name: functools.partial(reader.read, name, lids, rids)
                                            for name in METHODS}
    fns["memcpy"] = memcpy
    reader.auto_paths = {}
    reader.packed_stages = {key: [] for key in reader.packed_stages}
    return interleaved_rounds(fns, repeat, warmup=0), verified


def _auto_vs_best(samples: dict[str, list[float]]) -> tuple[float, dict[str, float], str]:
    """Auto's speed over the faster of direct and packed (the lower median time): the median of per-round
    ratios against that path, their spread, and its name. (Against the faster of the two in each round, noise
    alone would put auto below 1 where the paths are even.)"""
    best = min(("direct", "packed"), key=lambda name: statistics.median(samples[name]))
    sp = spread(round_ratios(samples, "auto", best))
    return sp["median"], sp, best


def _run_shape(shape: Shape, args: argparse.Namespace, patterns: list[str], chunk_mib: float,
               depth: int) -> list[dict[str, Any]]:
    from ..core import native  # the one door to the extension

    native.require()
    total = args.blocks + args.spare_blocks
    config = {"staging_chunk_bytes": int(chunk_mib * (1 << 20)), "staging_chunks": max(4, 2 * depth),
              "pipeline_depth": depth}
    reader: _Reader | None = None
    results = []
    reads = []
    with owner_process(_owner, (shape, args.layers, total, args.seed, config), 120) as address:
        try:
            reader = _Reader(shape, args, total, config, address)
            source = None if args.no_verify else layer_arrays(shape, args.layers, total, args.seed)
            rng = np.random.default_rng(args.seed + 1)
            g = reader.cache.geometry
            for pattern in patterns:
                lids, rids = block_ids(pattern, args.blocks, total, rng)
                reads.append((lids, rids))
                nbytes = args.blocks * g.num_planes * g.piece_bytes
                samples, verified = _measure(reader, lids, rids, args.repeat, source, _Memcpy(native.ext, nbytes))
                if source is not None and not all(verified.values()):
                    raise AssertionError(f"{shape.name} {pattern}: wrong bytes read by {verified}")
                times = medians(samples)
                ratios, spreads = speedups(samples, PAIRS)
                ratios["auto_vs_best"], spreads["auto_vs_best"], best = _auto_vs_best(samples)
                descriptors = dict(reader.descriptors)
                results.append({
                    "shape": shape.name, "pattern": pattern, "layers": args.layers,
                    "layers_in_model": shape.layers_in_model, "blocks": args.blocks, "block_size": shape.block_size,
                    "chunk_mib": chunk_mib, "depth": depth, "bytes": nbytes,
                    "pieces": args.blocks * g.num_planes, "bytes_per_piece": g.piece_bytes,
                    "descriptors": descriptors,
                    "bytes_per_descriptor": {k: round(nbytes / v) for k, v in descriptors.items() if v},
                    "rounds": args.repeat,
                    "seconds": {name: float(f"{t:.6g}") for name, t in times.items()},
                    "gbps": {name: round(gbps(nbytes, t), 3) for name, t in times.items()},
                    **ratios,
                    "ratio_spread": spreads,
                    "auto_paths": dict(reader.auto_paths), "auto_reason": reader.auto_reason, "best_path": best,
                    "packed_stages": {key: float(f"{statistics.median(v):.6g}") for key, v in
                                      reader.packed_stages.items() if v},
                    "verified": verified,
                })
        finally:
            if reader is not None:
                reader.close()
    if getattr(args, "host_tier", False):  # its own owner, after the other methods' (one cache at a time)
        source = None if args.no_verify else layer_arrays(shape, args.layers, total, args.seed)
        for row, tier in zip(results, _tier_vs_hot(shape, args, reads, config, source), strict=True):
            row["host_tier"] = tier
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every shape x pattern x chunk size x depth; returns the :mod:`~kvshuttle.bench.schema` envelope."""
    if getattr(args, "device", "cpu") == "cuda":
        from . import transfer_cuda  # cupy's bench: imported only when asked for

        return transfer_cuda.run(args)
    started = time.perf_counter()
    names, chunks, depths, patterns = sweep(args)
    results = [r for name in names for chunk_mib, depth in itertools.product(chunks, depths)
               for r in _run_shape(SHAPES[name], args, patterns, chunk_mib, depth)]
    staging = ", ".join(f"{c:g} MiB x {d}" for c, d in itertools.product(chunks, depths))
    note = (f"layers scaled to {args.layers} of the model's 64; bf16 moved as 2-byte words; NIXL UCX between "
            f"two processes on one host (DRAM; CMA); staging chunks x depth: {staging}; {args.repeat} rounds, "
            "methods and memcpy interleaved; ratios: median of per-round ratios")
    return envelope("transfer", args, add_arguments, results, note=note, started=started)


def _cell(r: dict[str, Any], name: str) -> str:
    sp = r["ratio_spread"][name]
    return f"{r[name]:.2f} ({sp['min']:.2f}-{sp['max']:.2f})"


def format_table(result: dict[str, Any]) -> str:
    if any(r.get("device") == "cuda" for r in result["results"]):
        from . import transfer_cuda

        return transfer_cuda.format_table(result)
    rows = result["results"]
    methods = [m for m in (*METHODS, "memcpy") if all(m in r["gbps"] for r in rows)]  # older runs: no auto
    pairs = [p for p in (*PAIRS, "auto_vs_best") if all(p in r for r in rows)]
    lines = [result["note"], f"{'shape':15} {'pattern':11} {'chunk':>9} {'MiB':>5} " + " ".join(
        f"{m:>14}" for m in methods) + "  " + "  ".join(f"{p:<17}" for p in pairs)]
    for r in rows:
        lines.append(f"{r['shape']:15} {r['pattern']:11} {r['chunk_mib']:>5g}x{r['depth']:<3} "
                     f"{r['bytes'] / 2**20:5.0f} " + " ".join(f"{r['gbps'][m]:9.2f} GB/s" for m in methods)
                     + "  " + "  ".join(f"{_cell(r, p):<17}" for p in pairs))
        lines.append(" " * 38 + "descriptors: " + ", ".join(f"{k} {v}" for k, v in r["descriptors"].items()))
        if "host_tier" in r:
            tier = r["host_tier"]
            lines.append(" " * 38 + "host tier (claimed) GB/s: " + ", ".join(
                f"{name} {gb:.2f}" for name, gb in tier["gbps"].items()) + "; " + ", ".join(
                f"{pair} {tier[pair]:.2f} ({tier['ratio_spread'][pair]['min']:.2f}-"
                f"{tier['ratio_spread'][pair]['max']:.2f})" for pair in TIER_PAIRS if pair in tier))
        if "auto_paths" in r:
            taken = ", ".join(f"{path} {n}" for path, n in sorted(r["auto_paths"].items()))
            lines.append(" " * 38 + f"faster path {r['best_path']}; auto took: {taken}; last reason: "
                         f"{r['auto_reason']}")
    lines.append("GB/s: median per method; ratios: speed of the first over the second, median of per-round "
                 "ratios (min-max); auto_vs_best: auto over the faster (by median) of direct and packed")
    return "\n".join(lines)
