"""The workload both transfer benches run (``kvshuttle bench transfer``, ``--device cpu`` or ``cuda``).

Model shapes, the command's arguments, the cache contents (the same in both processes, from a seed), the block
ids read and the owner process: :mod:`.transfer` (host memory) and :mod:`.transfer_cuda` (VRAM) build on these
and not on each other.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Shape:
    name: str
    layers_in_model: int
    kv_heads: int
    head_size: int
    block_size: int
    itemsize: int  # bf16 bytes (the bench moves bytes; a 2-byte integer stands in for bf16)


SHAPES = {
    "qwen3-32b-tp1": Shape("qwen3-32b-tp1", 64, 8, 128, 16, 2),
    "qwen3-32b-tp2": Shape("qwen3-32b-tp2", 64, 4, 128, 16, 2),
    "qwen3-32b-tp4": Shape("qwen3-32b-tp4", 64, 2, 128, 16, 2),
    "qwen3-32b-tp8": Shape("qwen3-32b-tp8", 64, 1, 128, 16, 2),
    **{f"piece-{kib}k": Shape(f"piece-{kib}k", 64, heads, head, 16, 2)
       for kib, heads, head in ((1, 1, 32), (2, 1, 64), (4, 1, 128), (8, 2, 128), (16, 4, 128), (32, 8, 128),
                                (64, 16, 128))},
}
DEFAULT_SHAPES = ("qwen3-32b-tp1", "qwen3-32b-tp8")  # --shape all
PIECE_SHAPES = tuple(name for name in SHAPES if name.startswith("piece-"))  # --shape pieces
def shape_names(text: str) -> list[str]:
    """``--shape``'s comma-separated names (or ``all``, ``pieces``) as a list; ArgumentTypeError if unknown."""
    if text in ("all", "pieces"):
        return list(DEFAULT_SHAPES if text == "all" else PIECE_SHAPES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}, all or "
                                         "pieces")
    return names


def positive_floats(text: str) -> list[float]:
    """A comma-separated list of positive numbers (``--chunk-mib``, ``--depth``); ArgumentTypeError if not."""
    try:
        values = [float(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="all",
                        help=f"comma-separated, of {', '.join(SHAPES)}; all: {', '.join(DEFAULT_SHAPES)}; "
                             "pieces: the piece-* sweep")
    parser.add_argument("--layers", type=int, default=8, help="layers allocated (the model has 64)")
    parser.add_argument("--blocks", type=int, default=256, help="blocks read per transfer (16 tokens each)")
    parser.add_argument("--spare-blocks", type=int, default=256, help="cache blocks not read")
    parser.add_argument("--pattern", choices=["scattered", "contiguous", "all"], default="all")
    parser.add_argument("--chunk-mib", default="16", help="staging chunk size (MiB); a comma list sweeps")
    parser.add_argument("--depth", default="4", help="staging chunks in flight per packed read; a comma list sweeps")
    parser.add_argument("--repeat", type=int, default=9, help="timed rounds (methods interleaved)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-verify", action="store_true", help="skip the byte check of each method")
    parser.add_argument("--host-tier", action="store_true",
                        help="also read the same blocks from a host tier and from the cache (tier_vs_hot)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: caches and staging in VRAM (cupy), packed vs direct vs one contiguous read")


def layer_arrays(shape: Shape, layers: int, blocks: int, seed: int) -> list[npt.NDArray[Any]]:
    """FlashAttention NHD layers ``[2, N, B, H, D]`` of 2-byte words from ``seed`` (same in both processes)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        words = rng.integers(0, 2**63, size=2 * blocks * shape.block_size * shape.kv_heads * shape.head_size // 4,
                             dtype=np.uint64)
        out.append(words.view(np.uint16).reshape(2, blocks, shape.block_size, shape.kv_heads, shape.head_size))
    return out


def block_ids(pattern: str, blocks: int, total: int, rng: np.random.Generator) -> tuple[Any, Any]:
    """``(local, remote)`` ids of ``blocks`` of ``total`` blocks: one run on each side, or random on both."""
    if pattern == "contiguous":
        return np.arange(blocks, dtype=np.int64), np.arange(total - blocks, total, dtype=np.int64)
    return rng.permutation(total)[:blocks].astype(np.int64), rng.permutation(total)[:blocks].astype(np.int64)


@contextlib.contextmanager
def owner_process(target: Callable[..., None], args: tuple[Any, ...], start_s: float,
                  pipes: list[Any] | None = None) -> Iterator[Any]:
    """The owner in a spawned process (``target(pipe, *args)`` sends what the reader needs, then waits for
    "stop"): yields what it sent; stopped (killed if it will not) on the way out. ``pipes``: gets this side's
    pipe appended, for targets that answer more requests."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    if pipes is not None:
        pipes.append(parent)
    owner = ctx.Process(target=target, args=(child, *args), daemon=True)
    owner.start()
    try:
        if not parent.poll(start_s):
            raise RuntimeError(f"the owner process did not start within {start_s:.0f} s")
        yield parent.recv()
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        owner.join(10)
        if owner.is_alive():
            owner.kill()


def sweep(args: argparse.Namespace) -> tuple[list[str], list[float], list[int], list[str]]:
    """``(shapes, chunk MiB, depths, patterns)`` the arguments ask for; SystemExit saying what is wrong."""
    try:
        names, chunks = shape_names(str(args.shape)), positive_floats(str(args.chunk_mib))
        depths = [int(d) for d in positive_floats(str(args.depth))]
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"kvshuttle bench transfer: {exc}") from None
    patterns = ["scattered", "contiguous"] if args.pattern == "all" else [args.pattern]
    return names, chunks, depths, patterns


def hot_and_tiered(engine: Any, ids: list[int], block_size: int) -> tuple[Any, Any]:
    """On a serving ``engine`` with a host tier of ``len(ids)`` slots: a ledger keeping blocks ``ids`` twice, one
    retention hot and one demoted into the tier (waited for); returns both handles."""
    from ..retention import RetentionLedger, RetentionTerms, TierTerms

    host, port = engine.serve().removeprefix("tcp://").rsplit(":", 1)
    ledger = RetentionLedger("bench", host, int(port), terms=RetentionTerms(tier=TierTerms(len(ids))),
                             on_demote=engine.tier.demote)
    engine.claims = ledger
    digests = [k.to_bytes(16, "little") for k in range(len(ids))]
    args = ("hot", ids, digests, len(ids) * block_size, block_size)
    hot, tiered = ledger.retain(*args), ledger.retain("tier", *args[1:])  # the second shares the blocks
    ledger.demote(tiered.handle_id)
    deadline = time.monotonic() + 60
    while ledger.metrics()["tiers"]["host"]["copying"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return hot, tiered
