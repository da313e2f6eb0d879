"""``kvshuttle demo``: a multi-turn conversation whose prefill reads the previous turns' KV back from decode.

Two local processes, each with its own paged DRAM cache and NIXL agent: "decode" (the owner) keeps the KV of
every token it has seen and serves it; "prefill" (the reader) has no prefix cache, so each turn it READs the
blocks decode holds for the previous turns (prompt *and* generated answer) into freshly allocated blocks of
its own, verifies every byte, and computes only the new suffix. Token ``t``'s KV is a deterministic function
of (seed, t), so both sides can check what they hold without shipping data. The coordinator (this process)
prints one row per turn: tokens reused, bytes, descriptors, path, transfer time, verification.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

COMMAND_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DemoShape:
    """A small FlashAttention-layout model (bf16 as raw 16-bit words) and the conversation's rhythm."""

    layers: int = 8
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    cache_blocks: int = 1024
    first_prompt: int = 600
    user_tokens: int = 120  # new user input per later turn
    answer_tokens: int = 200  # tokens decode generates per turn
    turns: int = 5
    seed: int = 0

    def kv_shape(self) -> tuple[int, ...]:
        return (2, self.cache_blocks, self.block_size, self.kv_heads, self.head_size)


def token_kv(shape: DemoShape, start: int, stop: int) -> npt.NDArray[np.uint16]:
    """KV of tokens [start, stop): ``[T, L, 2, H, D]``, the same in every process for a given seed."""
    out = np.empty((stop - start, shape.layers, 2, shape.kv_heads, shape.head_size), dtype=np.uint16)
    for t in range(start, stop):
        out[t - start] = np.random.default_rng((shape.seed, t)).integers(
            1, 2**16, size=out.shape[1:], dtype=np.uint16)
    return out


class Worker:
    """One side: a paged cache, a block allocator and a TransferEngine."""

    def __init__(self, shape: DemoShape, role: str, path: str) -> None:
        from .layout import CacheKind, PagedKVCache
        from .transfer import EngineConfig, TransferEngine

        self.shape, self.role, self.path = shape, role, path
        rng = np.random.default_rng((shape.seed, 1 if role == "decode" else 2))
        # Poisoned caches: random words that are not any token's KV, so a missed copy cannot pass.
        self.layers = [rng.integers(0, 2**16, size=shape.kv_shape(), dtype=np.uint16) for _ in range(shape.layers)]
        self.cache = PagedKVCache.from_arrays(self.layers, CacheKind.FLASH_ATTN)
        self.free = [int(b) for b in rng.permutation(shape.cache_blocks)]  # scattered block ids
        self.engine = TransferEngine(self.cache, EngineConfig())
        self.blocks: list[int] = []  # this side's blocks of the conversation, in token order
        self.tokens = 0  # tokens whose KV those blocks hold

    def grow(self, tokens: int) -> None:
        """Write the KV of tokens [self.tokens, tokens) (decode generating, or prefill computing)."""
        while len(self.blocks) * self.shape.block_size < tokens:
            self.blocks.append(self.free.pop())
        kv = token_kv(self.shape, self.tokens, tokens)
        for t in range(self.tokens, tokens):
            block, slot = self.blocks[t // self.shape.block_size], t % self.shape.block_size
            for layer, cache in enumerate(self.layers):
                cache[:, block, slot] = kv[t - self.tokens, layer]
        self.tokens = tokens

    def verify(self, tokens: int) -> bool:
        """Every byte of tokens [0, tokens) in this side's blocks equals the expected KV."""
        want = token_kv(self.shape, 0, tokens)
        t = np.arange(tokens)
        blocks, slots = np.asarray(self.blocks)[t // self.shape.block_size], t % self.shape.block_size
        got = np.stack([cache[:, blocks, slots] for cache in self.layers], axis=1)  # [2, L, T, H, D]
        return bool(np.array_equal(got.transpose(2, 1, 0, 3, 4), want))

    def read_back(self, address: str, remote_blocks: list[int], tokens: int) -> dict[str, Any]:
        """Prefill: drop the local copy (no prefix cache), READ the first ``tokens`` tokens from decode."""
        self.free.extend(self.blocks)
        self.blocks, self.tokens = [], 0
        count = -(-tokens // self.shape.block_size)
        self.blocks = [self.free.pop() for _ in range(count)]
        peer = self.engine.connect(address)
        try:
            handle = self.engine.read(peer, self.blocks, remote_blocks[:count], num_tokens=tokens,
                                      path=self.path)  # type: ignore[arg-type]
            telemetry = handle.wait(timeout=COMMAND_TIMEOUT_S)
        finally:
            self.engine.disconnect(peer)
        self.tokens = tokens
        return {**telemetry.to_dict(), "verified": self.verify(tokens)}


def _worker_main(conn: Any, shape: DemoShape, role: str, path: str) -> None:
    worker = None
    try:
        worker = Worker(shape, role, path)
        conn.send(("ready", worker.engine.serve() if role == "decode" else None))
        while True:
            command, args = conn.recv()
            if command == "stop":
                break
            if command == "grow":
                worker.grow(args["tokens"])
                conn.send(("ok", {"blocks": worker.blocks, "verified": worker.verify(worker.tokens)}))
            elif command == "read_back":
                conn.send(("ok", worker.read_back(**args)))
    except Exception as exc:  # report to the coordinator instead of hanging it
        conn.send(("error", f"{role}: {type(exc).__name__}: {exc}"))
    finally:
        if worker is not None:
            worker.engine.close()


class WorkerProcess:
    def __init__(self, shape: DemoShape, role: str, path: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, shape, role, path), daemon=True)
        self.process.start()
        child.close()
        self.address: str | None = self._reply()

    def _reply(self) -> Any:
        if not self.conn.poll(COMMAND_TIMEOUT_S):
            raise TimeoutError(f"worker did not answer within {COMMAND_TIMEOUT_S} s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(value)
        return value

    def call(self, command: str, **args: Any) -> Any:
        self.conn.send((command, args))
        return self._reply()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop", {}))
                self.process.join(10)
            finally:
                if self.process.is_alive():
                    self.process.kill()
                    self.process.join(5)


def run_demo(shape: DemoShape, path: str = "auto") -> dict[str, Any]:
    """Run the conversation; one dict per turn."""
    started = time.perf_counter()
    decode = WorkerProcess(shape, "decode", path)
    prefill = WorkerProcess(shape, "prefill", path)
    turns = []
    try:
        held, prompt = 0, shape.first_prompt  # tokens whose KV decode holds; this turn's prompt length
        for turn in range(1, shape.turns + 1):
            row: dict[str, Any] = {"turn": turn, "prompt_tokens": prompt, "reused_tokens": held}
            if held:
                blocks = decode.call("grow", tokens=held)["blocks"]
                row.update(prefill.call("read_back", address=decode.address, remote_blocks=blocks, tokens=held))
            else:
                row.update({"bytes": 0, "descriptors": 0, "path": "-", "transfer_time_s": 0.0, "verified": True})
            prefill.call("grow", tokens=prompt)  # compute only the new suffix
            row["computed_tokens"] = prompt - held
            # Decode gets the prompt's KV (the usual P->D direction) and generates the answer; the last
            # sampled token has no KV yet, so it holds prompt + answer - 1 tokens for the next turn.
            held = prompt + shape.answer_tokens - 1
            grown = decode.call("grow", tokens=held)
            row["verified"] = row["verified"] and grown["verified"]
            prompt = held + 1 + shape.user_tokens
            turns.append(row)
    finally:
        prefill.close()
        decode.close()
    kv_bytes_per_token = shape.layers * 2 * shape.kv_heads * shape.head_size * 2
    return {"demo": "multi-turn reverse read", "shape": asdict(shape), "path": path,
            "kv_bytes_per_token": kv_bytes_per_token, "turns": turns,
            "all_verified": all(t["verified"] for t in turns), "seconds": round(time.perf_counter() - started, 2)}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'turn':>4}{'prompt':>8}{'reused':>8}{'computed':>9}{'MiB':>8}{'descs':>7}{'KiB/desc':>9}"
             f"{'path':>8}{'ms':>8}{'GB/s':>7}  verified"]
    for t in result["turns"]:
        per_desc = t.get("bytes_per_descriptor", 0) / 1024
        lines.append(
            f"{t['turn']:>4}{t['prompt_tokens']:>8}{t['reused_tokens']:>8}{t['computed_tokens']:>9}"
            f"{t['bytes'] / 2**20:>8.1f}{t['descriptors']:>7}{per_desc:>9.0f}{t['path']:>8}"
            f"{t['transfer_time_s'] * 1e3:>8.1f}{t.get('gbps', 0.0):>7.2f}  {'yes' if t['verified'] else 'NO'}")
    lines.append(f"every byte verified: {'yes' if result['all_verified'] else 'NO'}; {result['seconds']} s in all")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoShape()
    parser.add_argument("--turns", type=int, default=defaults.turns)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--path", choices=["auto", "direct", "packed"], default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def main(args: argparse.Namespace) -> int:
    shape = DemoShape(turns=args.turns, layers=args.layers, kv_heads=args.kv_heads)
    result = run_demo(shape, args.path)
    print(json.dumps(result) if args.json else format_table(result))
    return 0 if result["all_verified"] else 1
