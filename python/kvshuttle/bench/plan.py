"""``kvshuttle bench plan``: native read planning against a vLLM-style numpy descriptor builder, same run.

Geometry only (fake addresses, nothing allocated): Qwen3-32B at TP1 in the FlashAttention layout, 64
layers x K/V = 128 regions, 32 KiB pieces, 24k tokens = 1,536 blocks read = 196,608 pieces. Two cases:

* permuted: random ids on both sides, no two pieces adjacent on both sides: 196,608 descriptors;
* contiguous: one run of ids on each side: one descriptor per region, 128.

The peer builds the arrays the way vLLM's NixlConnector does with numpy (``_build_fa_local`` /
``_stack_descs`` addresses ``base + block_id * block_len`` per region, region-major as in
``_compute_desc_ids``): one descriptor per block per layer per K/V, no coalescing. ``vllm_desc_ids``
is what vLLM itself computes per request once its full lists are prepared at the handshake (indices only;
NIXL then builds the descriptors in C++): context, not the compared peer.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core import plan
from .schema import envelope
from .timing import interleaved_rounds, medians, speedups

U64 = npt.NDArray[np.uint64]
Ids = npt.NDArray[np.int64]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=64, help="model layers (Qwen3-32B: 64)")
    parser.add_argument("--blocks", type=int, default=1536, help="blocks read (1,536 = 24k tokens)")
    parser.add_argument("--cache-blocks", type=int, default=4096, help="blocks in each side's cache")
    parser.add_argument("--piece-bytes", type=int, default=32 * 1024,
                        help="bytes of one block of one layer's K or V (Qwen3-32B, TP1, bf16: 32 KiB)")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)


def fa_side(layers: int, cache_blocks: int, piece: int, base: int, device: int) -> plan.SideGeometry:
    """FlashAttention caches as vLLM allocates them: per layer a K and a V region, 2 MiB-aligned layers."""
    region = cache_blocks * piece
    layer_stride = -(-2 * region // (2 << 20)) * (2 << 20) + (2 << 20)  # a gap: layers never merge
    bases = [base + layer * layer_stride + kv * region for layer in range(layers) for kv in range(2)]
    return plan.SideGeometry(np.array(bases, dtype=np.uint64), 2, piece, piece, cache_blocks, device)


def vllm_style_descriptors(bases: U64, block_ids: Ids, block_len: int, device_id: int) -> U64:
    """One side's Nx3 (addr, len, dev) rows, region-major, the way vLLM builds them with numpy."""
    block_arr = block_ids.astype(np.uint64)[None, :]
    addrs = (bases[:, None] + block_arr * np.uint64(block_len)).reshape(-1)
    out = np.empty((addrs.shape[0], 3), dtype=np.uint64)  # vLLM's _stack_descs
    out[:, 0] = addrs
    out[:, 1] = block_len
    out[:, 2] = device_id
    return out


def vllm_desc_ids(block_ids: Ids, num_regions: int, num_blocks: int) -> Ids:
    """vLLM's per-request work with prepared lists: ``region_id * num_blocks + block_id``, flattened."""
    region_ids = np.arange(num_regions)[:, None]
    return (region_ids * num_blocks + block_ids[None, :]).flatten()


def case_ids(case: str, rng: np.random.Generator, blocks: int, cache_blocks: int) -> tuple[Ids, Ids]:
    if case == "contiguous":
        return np.arange(7, 7 + blocks, dtype=np.int64), np.arange(100, 100 + blocks, dtype=np.int64)
    local = rng.permutation(cache_blocks)[:blocks].astype(np.int64)
    while True:  # redraw until no pair of ids steps by one on both sides (nothing can merge)
        remote = rng.permutation(cache_blocks)[:blocks].astype(np.int64)
        by_local = np.argsort(local)
        lsorted, rsorted = local[by_local], remote[by_local]
        if not np.any((np.diff(lsorted) == 1) & (np.diff(rsorted) == 1)):
            return local, remote


def _run_case(case: str, args: argparse.Namespace, local: plan.SideGeometry, remote: plan.SideGeometry,
              rng: np.random.Generator) -> dict[str, Any]:
    lids, rids = case_ids(case, rng, args.blocks, args.cache_blocks)
    backend: plan.Backend = "native" if plan.native_available() else "reference"
    result = plan.plan_read(local, lids, remote, rids, backend=backend)
    reference = plan.plan_read(local, lids, remote, rids, backend="reference")
    same = np.array_equal(result.local, reference.local) and np.array_equal(result.remote, reference.remote)
    if not same:
        raise AssertionError(f"{case}: native and reference plans differ")
    peer_rows = vllm_style_descriptors(local.plane_bases, lids, local.piece_bytes, local.device_id)
    peer_bytes = int(peer_rows[:, 1].sum())
    if peer_bytes != result.total_bytes:
        raise AssertionError(f"{case}: the peer moves {peer_bytes} bytes, the plan {result.total_bytes}")

    def peer() -> None:
        vllm_style_descriptors(local.plane_bases, lids, local.piece_bytes, local.device_id)
        vllm_style_descriptors(remote.plane_bases, rids, remote.piece_bytes, remote.device_id)

    def desc_ids() -> None:
        vllm_desc_ids(lids, local.num_planes, local.num_blocks)
        vllm_desc_ids(rids, remote.num_planes, remote.num_blocks)

    samples = interleaved_rounds({
        "native": lambda: plan.plan_read(local, lids, remote, rids, backend=backend),
        "peer": peer,
        "reference": lambda: plan.plan_read(local, lids, remote, rids, backend="reference"),
        "vllm_desc_ids": desc_ids,
    }, args.repeat)
    ratios, spreads = speedups(samples, {"native_vs_peer": ("native", "peer"),
                                         "native_vs_reference": ("native", "reference")})
    descriptors = {"native": result.num_descriptors, "peer": int(peer_rows.shape[0])}
    return {
        "case": case,
        "pieces": result.num_pieces,
        "bytes": result.total_bytes,
        "descriptors": descriptors,
        "bytes_per_descriptor": {k: round(result.total_bytes / v, 1) for k, v in descriptors.items()},
        "rounds": args.repeat,
        "seconds": {k: float(f"{v:.6g}") for k, v in medians(samples).items()},
        **ratios,
        "ratio_spread": spreads,
        "verified": same,
    }


def warm_allocator(nbytes: int = 16 << 20) -> None:
    """Free one large allocation: glibc then raises its mmap threshold (up to 32 MiB) and serves the
    peer's multi-MB arrays from the heap instead of fresh, page-faulting mappings. This is the peer's
    steady state in a long-running server and its best case (cold, it pays page faults on every call);
    the native planner keeps its row buffers mapped either way."""
    np.empty(nbytes, dtype=np.uint8)


def run_plan_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Plan permuted and contiguous reads natively and with the peer; returns the schema envelope."""
    started = time.perf_counter()
    warm_allocator()
    rng = np.random.default_rng(args.seed)
    local = fa_side(args.layers, args.cache_blocks, args.piece_bytes, base=1 << 40, device=0)
    remote = fa_side(args.layers, args.cache_blocks, args.piece_bytes, base=1 << 46, device=1)
    results = [_run_case(case, args, local, remote, rng) for case in ("permuted", "contiguous")]
    native = "native planner" if plan.native_available() else "NOT BUILT: 'native' timed the numpy reference"
    note = (f"flash_attn, {args.layers} layers x K/V = {local.num_planes} regions, {args.blocks} blocks read of "
            f"{args.cache_blocks}, {args.piece_bytes} B pieces; {args.repeat} rounds, methods interleaved; "
            f"peer: vLLM-style numpy Nx3 builder, both sides; {native}")
    return envelope("plan", args, add_arguments, results, note=note, started=started,
                    summary={"native": plan.native_available(), "regions": local.num_planes})


run = run_plan_bench


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'case':<12}{'pieces':>9}{'descs':>9}{'B/desc':>11}{'native ms':>11}{'peer ms':>10}"
        f"{'native_vs_peer':>22}{'ref ms':>9}{'ids ms':>9}"
    ]
    for r in result["results"]:
        t, s = r["seconds"], r["ratio_spread"]["native_vs_peer"]
        spread = f"{r['native_vs_peer']:.1f} ({s['min']:.1f}-{s['max']:.1f})"
        lines.append(
            f"{r['case']:<12}{r['pieces']:>9}{r['descriptors']['native']:>9}"
            f"{r['bytes_per_descriptor']['native']:>11.0f}{t['native'] * 1e3:>11.3f}{t['peer'] * 1e3:>10.3f}"
            f"{spread:>22}{t['reference'] * 1e3:>9.3f}{t['vllm_desc_ids'] * 1e3:>9.3f}"
        )
    lines.append("medians; native_vs_peer = peer time / native time, median of per-round ratios (min-max); "
                 "ids ms = vLLM's per-request desc-id math")
    lines.append(result["note"])
    return "\n".join(lines)
