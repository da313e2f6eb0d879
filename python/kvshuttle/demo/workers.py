"""The two processes of ``kvshuttle demo``: decode (owner, retention ledger) and prefill (reader, policy).

Token t's KV is a deterministic function of the token ids up to t (a rolling hash seeds its bytes), the way a
real model's KV depends on the whole prefix: after an edit in the history, every later position's KV
changes, so reading unverified blocks would put wrong KV into the prefill cache and the byte check would
catch it. Each worker answers commands from the coordinator over a pipe.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

COMMAND_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DemoShape:
    """A small FlashAttention-layout model (bf16 moved as raw 16-bit words)."""

    layers: int = 8
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    cache_blocks: int = 1024
    retention_budget_blocks: int = 200  # decode keeps at most this many blocks for finished requests
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_size * 2


def token_kv(shape: DemoShape, tokens: list[int], start: int, stop: int) -> npt.NDArray[np.uint16]:
    """KV of positions [start, stop) given the token ids: ``[T, L, 2, H, D]``, equal in every process."""
    out = np.empty((stop - start, shape.layers, 2, shape.kv_heads, shape.head_size), dtype=np.uint16)
    state = hashlib.blake2b(str(shape.seed).encode(), digest_size=16)
    for t in range(stop):
        state.update(int(tokens[t]).to_bytes(4, "little"))
        if t >= start:
            seed = int.from_bytes(state.copy().digest()[:8], "little")
            out[t - start] = np.random.default_rng(seed).integers(1, 2**16, size=out.shape[1:], dtype=np.uint16)
    return out


class PagedWorker:
    """A paged DRAM cache with a block allocator and a TransferEngine."""

    def __init__(self, shape: DemoShape, role: str) -> None:
        from ..core.layout import CacheKind, PagedKVCache
        from ..transfer import EngineConfig, TransferEngine

        self.shape = shape
        rng = np.random.default_rng((shape.seed, 1 if role == "decode" else 2))
        # Poisoned caches: random words that are no token's KV, so a missed or wrong copy cannot pass.
        self.layers = [rng.integers(0, 2**16, size=(2, shape.cache_blocks, shape.block_size, shape.kv_heads,
                                                    shape.head_size), dtype=np.uint16) for _ in range(shape.layers)]
        self.cache = PagedKVCache.from_arrays(self.layers, CacheKind.FLASH_ATTN)
        self.free = [int(b) for b in rng.permutation(shape.cache_blocks)]  # scattered block ids
        self.engine = TransferEngine(self.cache, EngineConfig())

    def allocate(self, tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-tokens // self.shape.block_size))]

    def write(self, blocks: list[int], tokens: list[int], start: int, stop: int) -> None:
        """Compute (here: generate) the KV of positions [start, stop) into ``blocks``."""
        kv = token_kv(self.shape, tokens, start, stop)
        t = np.arange(start, stop)
        ids, slots = np.asarray(blocks)[t // self.shape.block_size], t % self.shape.block_size
        for layer, cache in enumerate(self.layers):
            cache[:, ids, slots] = kv[:, layer].transpose(1, 0, 2, 3)

    def holds(self, blocks: list[int], tokens: list[int], count: int) -> bool:
        """Every byte of positions [0, count) in ``blocks`` is the KV these tokens must have."""
        if count == 0:
            return True
        t = np.arange(count)
        ids, slots = np.asarray(blocks)[t // self.shape.block_size], t % self.shape.block_size
        got = np.stack([cache[:, ids, slots] for cache in self.layers], axis=1)  # [2, L, T, H, D]
        return bool(np.array_equal(got.transpose(2, 1, 0, 3, 4), token_kv(self.shape, tokens, 0, count)))


class Decode(PagedWorker):
    """Generates answers and retains each finished request's blocks in a ledger; serves claims and reads."""

    def __init__(self, shape: DemoShape) -> None:
        from ..retention import RetentionLedger

        super().__init__(shape, "decode")
        self.address = self.engine.serve()
        host, port = self.address.removeprefix("tcp://").rsplit(":", 1)
        self.ledger = RetentionLedger("decode-0", host, int(port), budget_blocks=shape.retention_budget_blocks,
                                      bytes_per_block=shape.block_size * shape.kv_bytes_per_token,
                                      on_free=self.free.extend)
        self.engine.claims = self.ledger
        self.handles: dict[str, str] = {}  # conversation -> its live handle id

    def finish_turn(self, conversation: str, request_id: str, tokens: list[int], held: int,
                    ttl_s: float | None) -> dict[str, Any]:
        """The request's KV (prompt from prefill, then the generated answer) is in fresh blocks; retain them."""
        from ..policy.digests import block_digests

        blocks = self.allocate(held)
        self.write(blocks, tokens, 0, held)
        previous = self.handles.pop(conversation, None)
        if previous is not None:  # this turn's blocks supersede the last turn's
            self.ledger.release(previous)
        handle = self.ledger.retain(request_id, blocks, block_digests(tokens[:held], self.shape.block_size),
                                    held, self.shape.block_size, conversation_id=conversation, ttl_s=ttl_s)
        self.handles[conversation] = handle.handle_id
        metrics = self.ledger.metrics()
        return {"kv_transfer_params": handle.to_kv_transfer_params(self.engine.secret),
                "verified": self.holds(blocks, tokens, held), "retained_blocks": metrics.get("retained_blocks"),
                "evictions": metrics.get("evictions")}

    def release(self, conversation: str) -> bool:
        """End a conversation's retention now (its blocks go back to the free list)."""
        handle_id = self.handles.pop(conversation, None)
        return handle_id is not None and self.ledger.release(handle_id)


class Prefill(PagedWorker):
    """No prefix cache: each turn runs the library's reuse read (decide, claim, read, confirm) and computes the rest."""

    def __init__(self, shape: DemoShape, role: str) -> None:
        from ..reuse import ReuseReader

        super().__init__(shape, role)
        self.reuse = ReuseReader(self.engine, timeout_s=COMMAND_TIMEOUT_S)

    def turn(self, tokens: list[int], kv_transfer_params: dict[str, Any] | None, path: str,
             threshold_tokens: int) -> dict[str, Any]:
        from ..policy import PolicyConfig

        self.reuse.policy = PolicyConfig(threshold_tokens=threshold_tokens)
        self.reuse.path = path  # type: ignore[assignment]
        blocks = self.allocate(len(tokens))
        result = self.reuse.read(kv_transfer_params, tokens, local_hit_tokens=0, local_block_ids=blocks)
        telemetry = result.telemetry
        # compute only what was not reused (the invalid blocks are rewritten by this)
        self.write(blocks, tokens, result.reused_tokens, len(tokens))
        row: dict[str, Any] = {
            "decision": result.action if result.action != "fetched" else "fetch", "reason": result.reason,
            "why": result.message, "owner_reason": result.owner_reason, "fetched_tokens": result.fetched_tokens,
            "computed_tokens": len(result.recompute),
            "bytes": result.bytes, "descriptors": telemetry.descriptors if telemetry else 0,
            "path": telemetry.path if telemetry else "-",
            "transfer_ms": telemetry.transfer_time_s * 1e3 if telemetry else 0.0,
            "gbps": telemetry.gbps if telemetry else 0.0,
            "verified": self.holds(blocks, tokens, len(tokens)),
        }
        self.free.extend(blocks)  # prefix cache off: nothing kept for the next turn
        return row


def _serve(conn: Any, shape: DemoShape, role: str) -> None:
    worker: PagedWorker | None = None
    try:
        worker = Decode(shape) if role == "decode" else Prefill(shape, role)
        conn.send(("ok", getattr(worker, "address", None)))
        while True:
            command, args = conn.recv()
            if command == "stop":
                break
            conn.send(("ok", getattr(worker, command)(**args)))
    except Exception as exc:  # report to the coordinator instead of hanging it
        conn.send(("error", f"{role}: {type(exc).__name__}: {exc}"))
    finally:
        if worker is not None:
            worker.engine.close()


class WorkerProcess:
    """One worker in its own process ("spawn"); every wait has a timeout; always stopped in close()."""

    def __init__(self, shape: DemoShape, role: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, shape, role), daemon=True)
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
