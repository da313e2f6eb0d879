"""``kvshuttle bench pack``: native pack/unpack against memcpy and a fancy-indexing peer, same run.

Shapes come from Qwen3-32B (64 layers, 8 KV heads, head 128, bf16, block 16) and its TP8 shard (1 KV head).
On the CPU the layer count is scaled down (default 16) so caches fit comfortably; the result says so.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core import ops
from ..core.layout import CacheKind, PagedKVCache
from .timing import batched_seconds, gbps, median_seconds, ratio


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    itemsize: int  # bf16


SHAPES = {
    "qwen3-32b": ModelShape("qwen3-32b", 64, 8, 128, 16, 2),
    "qwen3-32b-tp8": ModelShape("qwen3-32b-tp8", 64, 1, 128, 16, 2),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers to allocate (default: 16 on cpu, the model's 64 on cuda)")
    parser.add_argument("--blocks", type=int, default=1536, help="blocks moved (1,536 = 24k tokens)")
    parser.add_argument("--spare-blocks", type=int, default=512, help="extra cache blocks not moved")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: usable cores)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)


def _random_bytes(rng: np.random.Generator, shape: tuple[int, ...], itemsize: int) -> npt.NDArray[Any]:
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize]
    words = rng.integers(0, 2**63, size=int(np.prod(shape)) * itemsize // 8 + 1, dtype=np.uint64)
    return words.view(np.uint8)[: int(np.prod(shape)) * itemsize].view(dtype).reshape(shape)


def _result(shape: ModelShape, layers: int, nbytes: int, pieces: int, times: dict[str, float],
            device: str, threads: int) -> dict[str, Any]:
    rates = {name: round(gbps(nbytes, t), 3) for name, t in times.items()}
    return {
        "shape": shape.name,
        "device": device,
        "layers": layers,
        "layers_in_model": shape.layers,
        "blocks": pieces // (2 * layers),
        "bytes": nbytes,
        "pieces": pieces,
        "bytes_per_piece": nbytes // pieces,
        "threads": threads,
        "gbps": rates,
        "pack_vs_copy": ratio(rates["pack"], rates["copy"]),
        "unpack_vs_copy": ratio(rates["unpack"], rates["copy"]),
        "pack_vs_peer": ratio(rates["pack"], rates["peer_pack"]),
        "unpack_vs_peer": ratio(rates["unpack"], rates["peer_unpack"]),
    }


def _run_cpu(shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
    from .. import _native

    _native.set_num_threads(args.threads)
    layers = args.layers or 16
    rng = np.random.default_rng(args.seed)
    total = args.blocks + args.spare_blocks
    kv_shape = (2, total, shape.block_size, shape.kv_heads, shape.head_size)
    caches = [_random_bytes(rng, kv_shape, shape.itemsize) for _ in range(layers)]
    cache = PagedKVCache.from_arrays(caches, CacheKind.FLASH_ATTN)
    ids = rng.permutation(total)[: args.blocks]
    nbytes = ops.staging_nbytes(cache, args.blocks * shape.block_size)
    staging = np.empty(nbytes, dtype=np.uint8)
    copy_dst = np.empty(nbytes, dtype=np.uint8)
    # The obvious peer: one numpy fancy-indexing gather/scatter per layer into [L, 2, n, B, H, D].
    peer = np.empty((layers, 2, args.blocks, *kv_shape[2:]), dtype=caches[0].dtype)

    def peer_pack() -> None:
        for layer, kv in enumerate(caches):
            np.take(kv, ids, axis=1, out=peer[layer])

    def peer_unpack() -> None:
        for layer, kv in enumerate(caches):
            kv[:, ids] = peer[layer]

    src_addr, dst_addr = staging.ctypes.data, copy_dst.ctypes.data
    times = {
        "pack": median_seconds(lambda: ops.pack(cache, ids, staging), args.repeat),
        "unpack": median_seconds(lambda: ops.unpack(staging, cache, ids), args.repeat),
        "copy": median_seconds(lambda: _native.parallel_memcpy(dst_addr, src_addr, nbytes), args.repeat),
        "peer_pack": median_seconds(peer_pack, args.repeat),
        "peer_unpack": median_seconds(peer_unpack, args.repeat),
    }
    if not np.array_equal(copy_dst, staging):
        raise AssertionError("memcpy baseline mismatch")
    return _result(shape, layers, nbytes, args.blocks * layers * 2, times, "cpu", _native.num_threads())


def _run_cuda(shape: ModelShape, args: argparse.Namespace) -> dict[str, Any]:
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

    # Calls are enqueued back to back (host validation overlaps the previous kernel), one sync per batch.
    sync = torch.cuda.synchronize
    times = {
        "pack": batched_seconds(lambda: ops.pack(cache, ids, staging), args.repeat, sync),
        "unpack": batched_seconds(lambda: ops.unpack(staging, cache, ids), args.repeat, sync),
        "copy": batched_seconds(device_copy, args.repeat, sync),
        "peer_pack": batched_seconds(peer_pack, args.repeat, sync),
        "peer_unpack": batched_seconds(peer_unpack, args.repeat, sync),
    }
    return _result(shape, layers, nbytes, args.blocks * layers * 2, times, "cuda", 0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the pack benchmark for the chosen shapes; returns one JSON-ready dict."""
    names = list(SHAPES) if args.shape == "all" else [args.shape]
    runner = _run_cuda if args.device == "cuda" else _run_cpu
    return {"benchmark": "pack", "results": [runner(SHAPES[name], args) for name in names]}


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'shape':<15}{'dev':<5}{'layers':>7}{'piece':>8}{'GiB':>7}{'pack':>8}{'unpack':>8}{'copy':>8}"
        f"{'peer_p':>8}{'peer_u':>8}{'p/copy':>8}{'u/copy':>8}{'p/peer':>8}{'u/peer':>8}"
    ]
    for r in result["results"]:
        g = r["gbps"]
        lines.append(
            f"{r['shape']:<15}{r['device']:<5}{r['layers']:>7}{r['bytes_per_piece']:>8}"
            f"{r['bytes'] / 2**30:>7.2f}{g['pack']:>8.2f}{g['unpack']:>8.2f}{g['copy']:>8.2f}"
            f"{g['peer_pack']:>8.2f}{g['peer_unpack']:>8.2f}{r['pack_vs_copy']:>8.2f}{r['unpack_vs_copy']:>8.2f}"
            f"{r['pack_vs_peer']:>8.2f}{r['unpack_vs_peer']:>8.2f}"
        )
    lines.append("GB/s; p/copy = pack / memcpy of the same bytes; p/peer = pack / fancy-indexing peer")
    return "\n".join(lines)
