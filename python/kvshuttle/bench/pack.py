"""``kvshuttle bench pack``: native pack/unpack against memcpy and a fancy-indexing peer, same run.

Shapes come from Qwen3-32B (64 layers, 8 KV heads, head 128, bf16, block 16) and its TP8 shard (1 KV head),
in the two-region FlashAttention layout, plus the TP1 shape in vLLM 0.32's one-allocation pages (``[N, H, B, 2D]``
per layer, KVCacheLayout LBHNC): FLASH_ATTN (K and V rows interleaved, copied row by row) and CPU_ATTN (per
head a K region then a V region). On the CPU the layer count is scaled down (default 16) so caches fit
comfortably; the result says so. Host buffers are page-aligned, as torch's and vLLM's allocations are.

The five methods (pack, unpack, copy, peer_pack, peer_unpack) are interleaved round by round (see
:func:`~kvshuttle.bench.timing.interleaved_rounds`); each ratio is the median of the ratios measured within a
round, with their spread. On a GPU each round enqueues ``--batch`` calls back to back and synchronizes once
(end-to-end time, host included), then times the same batch with CUDA events queued behind a device sleep, so
the host's enqueueing leaves no gaps between the calls: ``kernel_seconds`` is the device's own time.
On the CPU, 8 untimed rounds come first, so the lane tuner (csrc/include/kvshuttle/lane_tuner.h) has measured one
and four source lanes for each copy before timing, as a serving engine's earlier copies would have; ``lanes`` in
each result says what it chose and the medians behind it (``--lanes`` fixes it instead).
After timing, the bytes are checked: staging against the peer's gather, the cache after unpacking into
zeroed blocks against the peer, and the memcpy copy against staging.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core import ops
from ..core.layout import CacheKind, PagedKVCache, StagingLayout
from .schema import envelope
from .timing import gbps, interleaved_rounds, medians, speedups

METHODS = ("pack", "unpack", "copy", "peer_pack", "peer_unpack")
PAIRS = {"pack_vs_copy": ("pack", "copy"), "unpack_vs_copy": ("unpack", "copy"),
         "pack_vs_peer": ("pack", "peer_pack"), "unpack_vs_peer": ("unpack", "peer_unpack")}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    itemsize: int  # bf16
    kind: CacheKind = CacheKind.FLASH_ATTN


SHAPES = {
    "qwen3-32b": ModelShape("qwen3-32b", 64, 8, 128, 16, 2),
    "qwen3-32b-tp8": ModelShape("qwen3-32b-tp8", 64, 1, 128, 16, 2),
    "qwen3-32b-vllm-flash": ModelShape("qwen3-32b-vllm-flash", 64, 8, 128, 16, 2, CacheKind.VLLM_FLASH_ATTN),
    "qwen3-32b-vllm-cpu": ModelShape("qwen3-32b-vllm-cpu", 64, 8, 128, 16, 2, CacheKind.VLLM_CPU_ATTN),
}
# What the ``copy`` method is on each device: the physical baseline of the ratios.
COPY_METHODS = {
    "cpu": "memcpy (glibc) of the same bytes between two contiguous buffers, split over the same pool threads",
    "cuda": "torch device-to-device copy_ of the same bytes between two contiguous buffers",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers to allocate (default: 16 on cpu, the model's 64 on cuda)")
    parser.add_argument("--blocks", type=int, default=1536, help="blocks moved (1,536 = 24k tokens)")
    parser.add_argument("--spare-blocks", type=int, default=512, help="extra cache blocks not moved")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: usable cores)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (methods interleaved)")
    parser.add_argument("--batch", type=int, default=None,
                        help="calls per method per round, back to back (default: 1 on cpu, 20 on cuda)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lanes", type=int, choices=(0, 1, 2, 3, 4), default=0,
                        help="CPU: source pages a streamed copy reads at once; 0 (default): measured per kind of "
                             "copy, as in service (the tuner settles during the warm-up rounds)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed rounds first (default: 8 on cpu, enough for the lane tuner; 1 on cuda)")


PAGE = 4096


def _aligned_empty(nbytes: int) -> npt.NDArray[np.uint8]:
    """``nbytes`` uninitialised bytes starting on a page boundary (numpy's own start is only 16-aligned)."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start: start + nbytes]


def _random_bytes(rng: np.random.Generator, shape: tuple[int, ...], itemsize: int) -> npt.NDArray[Any]:
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize]
    nbytes = int(np.prod(shape)) * itemsize
    out = _aligned_empty(nbytes)
    words = rng.integers(0, 2**63, size=nbytes // 8 + 1, dtype=np.uint64)
    out[:] = words.view(np.uint8)[:nbytes]
    return out.view(dtype).reshape(shape)


def _sig(seconds: float) -> float:
    return float(f"{seconds:.6g}")


def _result(shape: ModelShape, layers: int, blocks: int, nbytes: int, samples: dict[str, list[float]],
            device: str, threads: int, batch: int, verified: bool,
            kernel: dict[str, list[float]] | None = None) -> dict[str, Any]:
    times = medians(samples)
    ratios, spreads = speedups(samples, PAIRS)
    pieces = blocks * layers * 2
    out: dict[str, Any] = {
        "shape": shape.name, "device": device, "layers": layers, "layers_in_model": shape.layers,
        "blocks": blocks, "bytes": nbytes, "pieces": pieces, "bytes_per_piece": nbytes // pieces,
        "kind": shape.kind.value, "threads": threads, "rounds": len(samples["pack"]), "batch": batch,
        "copy_method": COPY_METHODS[device],
        "seconds": {name: _sig(t) for name, t in times.items()},
        "gbps": {name: round(gbps(nbytes, t), 3) for name, t in times.items()},
        **ratios,
        "ratio_spread": spreads,
        "verified": verified,
    }
    if kernel is not None:
        k_times = medians(kernel)
        k_ratios, k_spreads = speedups(kernel, PAIRS)
        out["kernel_seconds"] = {name: _sig(t) for name, t in k_times.items()}
        out["kernel_gbps"] = {name: round(gbps(nbytes, t), 3) for name, t in k_times.items()}
        out.update({f"{name}_kernel": v for name, v in k_ratios.items()})
        out["ratio_spread"].update({f"{name}_kernel": v for name, v in k_spreads.items()})
    return out


def _cpu_cache(shape: ModelShape, layers: int, total: int, rng: np.random.Generator
               ) -> tuple[PagedKVCache, list[npt.NDArray[Any]]]:
    """The cache and its per-layer arrays: ``[2, N, B, H, D]`` per layer, or vLLM 0.32's ``[N, H, B, 2D]``
    views of one allocation (LBHNC)."""
    if shape.kind.is_vllm_view:
        one = _random_bytes(rng, (layers, total, shape.kv_heads, shape.block_size, 2 * shape.head_size),
                            shape.itemsize)
        views = [one[layer] for layer in range(layers)]
        return PagedKVCache.from_arrays(views, shape.kind), views
    kv_shape = (2, total, shape.block_size, shape.kv_heads, shape.head_size)
    caches = [_random_bytes(rng, kv_shape, shape.itemsize) for _ in range(layers)]
    return PagedKVCache.from_arrays(caches, shape.kind), caches


def _run_cpu(shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    from .. import _native
    from ..core import reference

    _native.set_num_threads(args.threads)
    for direction in (_native.Direction.PACK, _native.Direction.UNPACK):
        _native.set_copy_lanes(args.lanes, direction)
    _native.reset_copy_tuning()
    layers = args.layers or 16
    rng = np.random.default_rng(args.seed)
    total = args.blocks + args.spare_blocks
    cache, caches = _cpu_cache(shape, layers, total, rng)
    block_axis = 0 if shape.kind.is_vllm_view else 1
    ids = rng.permutation(total)[: args.blocks]
    nbytes = ops.staging_nbytes(cache, args.blocks * shape.block_size)
    staging = _aligned_empty(nbytes)
    copy_dst = _aligned_empty(nbytes)
    # The obvious peer: one numpy fancy-indexing gather/scatter of whole blocks per layer.
    peer_shape = list(caches[0].shape)
    peer_shape[block_axis] = args.blocks
    peer = np.empty((layers, *peer_shape), dtype=caches[0].dtype)

    def peer_pack() -> None:
        for layer, kv in enumerate(caches):
            np.take(kv, ids, axis=block_axis, out=peer[layer])

    def peer_unpack() -> None:
        for layer, kv in enumerate(caches):
            if block_axis == 0:
                kv[ids] = peer[layer]
            else:
                kv[:, ids] = peer[layer]

    src_addr, dst_addr = staging.ctypes.data, copy_dst.ctypes.data
    fns: dict[str, Callable[[], object]] = {
        "pack": lambda: ops.pack(cache, ids, staging),
        "unpack": lambda: ops.unpack(staging, cache, ids),
        "copy": lambda: _native.parallel_memcpy(dst_addr, src_addr, nbytes),
        "peer_pack": peer_pack,
        "peer_unpack": peer_unpack,
    }
    batch = args.batch or 1
    samples = interleaved_rounds(fns, args.repeat, number=batch, warmup=8 if args.warmup is None else args.warmup)
    lanes = _lanes(_native)

    # Bytes checked after timing: staging = the numpy reference's; unpack into zeroed blocks restores them.
    ops.pack(cache, ids, staging)
    peer_pack()
    layout = StagingLayout.like(cache.geometry)
    reference.pack(cache, ids, copy_dst, layout, args.blocks * shape.block_size, 0)
    ok = bool(np.array_equal(copy_dst, staging))
    for kv in caches:
        if block_axis == 0:
            kv[ids] = 0
        else:
            kv[:, ids] = 0
    ops.unpack(staging, cache, ids)
    ok = ok and all(np.array_equal(np.take(kv, ids, axis=block_axis), peer[layer]) for layer, kv in enumerate(caches))
    _native.parallel_memcpy(dst_addr, src_addr, nbytes)
    ok = ok and np.array_equal(copy_dst, staging)
    if not ok:
        raise AssertionError(f"{shape.name}: pack, unpack or the memcpy baseline moved the wrong bytes")
    return {**_result(shape, layers, args.blocks, nbytes, samples, "cpu", _native.num_threads(), batch, ok),
            "lanes": lanes}


def _lanes(ext: Any) -> dict[str, Any]:
    """Per direction: the lanes fixed by --lanes, or the tuner's choice and its medians by candidate (lanes None:
    no copy streamed, so none took lanes)."""
    out: dict[str, Any] = {}
    for direction in (ext.Direction.PACK, ext.Direction.UNPACK):
        name = direction.name.lower()
        fixed = ext.copy_lanes(direction)
        rows = [t for t in ext.copy_tuning() if t.shape.direction == direction]
        if fixed or not rows:
            out[name] = {"lanes": fixed or None, "tuned": False}
            continue
        t = max(rows, key=lambda row: row.decisions)  # the timed copies' kind (the checks' are alike)
        out[name] = {"lanes": t.lanes, "tuned": t.decisions > 0, "decisions": t.decisions,  # 0: too short to time
                     "gbps_by_lanes": {str(c): round(g, 3) for c, g in zip(ext.LaneTuner.candidates, t.median_gbps,
                                                                             strict=True)},
                     "timed_by_lanes": {str(c): n for c, n in zip(ext.LaneTuner.candidates, t.timed, strict=True)}}
    return out


def _device_sleep_rate(torch: Any) -> float:
    """Cycles per second of ``torch.cuda._sleep`` (0.0 where it is missing: events then include host gaps)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    start.record()
    sleep(cycles)
    end.record()
    end.synchronize()
    return float(cycles / (start.elapsed_time(end) / 1e3))


def _kernel_rounds(torch: Any, fns: dict[str, Callable[[], object]], e2e: dict[str, list[float]], batch: int,
                   sleep_rate: float) -> dict[str, list[float]]:
    """Per round, device seconds per call of each method from CUDA events around a batch of ``batch`` calls.

    The events and the calls are queued behind a device sleep longer than the batch took end to end (the host
    enqueues it all while the stream is still busy), so the span between the events is device work only:
    each call's table upload and kernel, without the host's validation and launch gaps.
    """
    sleep = getattr(torch.cuda, "_sleep", None)
    out: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for k in range(len(e2e[names[0]])):
        for name in names[k % len(names):] + names[:k % len(names)]:
            fn = fns[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if sleep is not None and sleep_rate > 0:
                sleep(int(max(e2e[name]) * batch * 1.5 * sleep_rate) + 100_000)
            start.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            out[name].append(start.elapsed_time(end) / 1e3 / batch)
    return out


def _run_cuda(shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    """Untested on a GPU since the events were added (written without one): check on the first GPU run."""
    import torch

    layers = args.layers or shape.layers
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    total = args.blocks + args.spare_blocks
    kv_shape = (2, total, shape.block_size, shape.kv_heads, shape.head_size)
    caches = [torch.randn(kv_shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    cache = PagedKVCache.from_arrays(caches, CacheKind.FLASH_ATTN)
    ids = np.random.default_rng(args.seed).permutation(total)[: args.blocks]
    ids_dev = torch.from_numpy(ids).cuda()
    nbytes = ops.staging_nbytes(cache, args.blocks * shape.block_size)
    staging = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(staging)
    peer = torch.empty((layers, 2, args.blocks, *kv_shape[2:]), dtype=torch.bfloat16, device="cuda")

    def peer_pack() -> None:
        for layer, kv in enumerate(caches):
            torch.index_select(kv, 1, ids_dev, out=peer[layer])

    def peer_unpack() -> None:
        for layer, kv in enumerate(caches):
            kv.index_copy_(1, ids_dev, peer[layer])

    def device_copy() -> None:
        copy_dst.copy_(staging)

    fns: dict[str, Callable[[], object]] = {
        "pack": lambda: ops.pack(cache, ids, staging),
        "unpack": lambda: ops.unpack(staging, cache, ids),
        "copy": device_copy,
        "peer_pack": peer_pack,
        "peer_unpack": peer_unpack,
    }
    batch = args.batch or 20
    # End to end: ``batch`` calls enqueued back to back (host validation overlaps the previous kernel), one sync.
    samples = interleaved_rounds(fns, args.repeat, number=batch, sync=torch.cuda.synchronize,
                                 warmup=1 if args.warmup is None else args.warmup)
    kernel = _kernel_rounds(torch, fns, samples, batch, _device_sleep_rate(torch))

    ops.pack(cache, ids, staging)
    peer_pack()
    torch.cuda.synchronize()
    staged = staging.view(torch.bfloat16).reshape(args.blocks, layers, *kv_shape[:1], *kv_shape[2:])
    ok = all(torch.equal(staged[:, layer].view(torch.int16), peer[layer].transpose(0, 1).view(torch.int16))
             for layer in range(layers))
    for kv in caches:
        kv[:, ids_dev] = 0
    ops.unpack(staging, cache, ids)
    torch.cuda.synchronize()
    ok = ok and all(torch.equal(kv[:, ids_dev].view(torch.int16), peer[layer].view(torch.int16))
                    for layer, kv in enumerate(caches))
    device_copy()
    ok = ok and torch.equal(copy_dst, staging)
    if not ok:
        raise AssertionError(f"{shape.name}: pack, unpack or the device copy moved the wrong bytes")
    return _result(shape, layers, args.blocks, nbytes, samples, "cuda", 0, batch, ok, kernel)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the pack benchmark for the chosen shapes; returns the :mod:`~kvshuttle.bench.schema` envelope."""
    started = time.perf_counter()
    names = list(SHAPES) if args.shape == "all" else [args.shape]
    gpu = None
    if args.device == "cuda":
        # The GPU path builds two-region FlashAttention caches only.
        names = [name for name in names if SHAPES[name].kind is CacheKind.FLASH_ATTN]
        import torch

        gpu = str(torch.cuda.get_device_name())
        results = [_run_cuda(SHAPES[name], args) for name in names]
        note = (f"{args.repeat} rounds, methods interleaved; per round {args.batch or 20} calls enqueued back to "
                "back, one sync (end to end); kernel_*: CUDA events around the same batch queued behind a device "
                "sleep (device time only)")
    else:
        results = [_run_cpu(SHAPES[name], args) for name in names]
        layers = args.layers or 16
        note = (f"layers scaled to {layers} of the model's 64; {args.repeat} rounds, methods interleaved, "
                f"{args.batch or 1} call(s) per method per round; ratios: median of per-round ratios")
    return envelope("pack", args, add_arguments, results, note=note, started=started, gpu=gpu)


def _cell(r: dict[str, Any], name: str) -> str:
    s = r["ratio_spread"][name]
    if s is None:  # an earlier session's output: a ratio of medians, no rounds kept
        return f"{r[name]:>5.2f}"
    return f"{r[name]:>5.2f} ({s['min']:.2f}-{s['max']:.2f})"


def _lanes_cell(r: dict[str, Any]) -> str:
    def one(d: dict[str, Any] | None) -> str:
        if not d or d.get("lanes") is None:
            return "-"
        return f"{d['lanes']}{'*' if d.get('tuned') else ''}"
    lanes = r.get("lanes") or {}
    return f"{one(lanes.get('pack'))}/{one(lanes.get('unpack'))}"


def format_table(result: dict[str, Any]) -> str:
    ratios = list(PAIRS)
    with_lanes = any("lanes" in r for r in result["results"])  # earlier output kept no lanes
    lines = [
        f"{'shape':<22}{'dev':<5}{'layers':>7}{'piece':>7}{'GiB':>6}{'pack':>9}{'unpack':>9}{'copy':>9}"
        f"{'peer_p':>8}{'peer_u':>8}  " + "".join(f"{name:<19}" for name in ratios)
        + ("lanes p/u" if with_lanes else "")
    ]
    for r in result["results"]:
        for prefix in ("", "kernel_") if "kernel_gbps" in r else ("",):
            g = r[f"{prefix}gbps"]
            suffix = "_kernel" if prefix else ""
            lines.append(
                f"{r['shape']:<22}{r['device'] + ('/k' if prefix else ''):<5}{r['layers']:>7}"
                f"{r['bytes_per_piece']:>7}{r['bytes'] / 2**30:>6.2f}{g['pack']:>9.2f}{g['unpack']:>9.2f}"
                f"{g['copy']:>9.2f}{g['peer_pack']:>8.2f}{g['peer_unpack']:>8.2f}  "
                + "".join(f"{_cell(r, name + suffix):<19}" for name in ratios)
                + (_lanes_cell(r) if with_lanes else "")
            )
    lines.append("GB/s (median per method); pack_vs_copy = pack speed / memcpy (GPU: device copy) of the same bytes, "
                 "pack_vs_peer = pack / fancy-indexing peer: median of per-round ratios (min-max); cuda/k = "
                 "kernel time from CUDA events")
    if with_lanes:
        lines.append("lanes p/u = source pages a streamed pack / unpack read at once (* = chosen by the lane tuner "
                     "from its medians)")
    copy_methods = sorted({r["copy_method"] for r in result["results"] if "copy_method" in r})
    lines.extend(f"copy = {method}" for method in copy_methods)
    lines.append(result["note"])
    return "\n".join(lines)
