"""Real-process helpers for the tensor-parallel reuse tests: owner ranks, each its own process and peer.

Every owner rank runs in a fresh interpreter (multiprocessing "spawn") and serves its head shard of one global
random cache (built from a seed, so the test regenerates the bytes instead of shipping them) through its own
TransferEngine, with its own RetentionLedger as the claim authority. It answers commands over a pipe (retain,
release, metrics; a retain may ask for a use-once handle in the rank's multi-read ledger). Every wait has a
timeout and the process is killed in ``close()`` whatever happens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from transfer_helpers import PipedProcess

SECRET_BYTES = b"kvshuttle-tensor-parallel-rank-tests-secret-0001"
STARTUP_TIMEOUT_S = 180  # 9 owner-rank processes start at once: slow on 2 loaded cores
POISON = 0xA5A5

Layers = list[npt.NDArray[np.uint16]]


@dataclass(frozen=True)
class Model:
    """A small flash_attn-layout model: every layer ``[2, N, B, H, D]`` of uint16 (bf16 moved as raw words)."""

    num_kv_heads: int
    seed: int
    layers: int = 2
    num_blocks: int = 12
    block_size: int = 16
    head_size: int = 16


def global_layers(model: Model) -> Layers:
    """The whole model's cache (every head), random non-zero words: equal in every process."""
    rng = np.random.default_rng(model.seed)
    shape = (2, model.num_blocks, model.block_size, model.num_kv_heads, model.head_size)
    return [rng.integers(1, 2**16, size=shape, dtype=np.uint16) for _ in range(model.layers)]


def shard_of(layers: Layers, heads: range) -> Layers:
    """One rank's head shard of ``layers`` (its own contiguous arrays)."""
    return [np.ascontiguousarray(layer[:, :, :, heads.start:heads.stop]) for layer in layers]


def poisoned_shard(model: Model, num_heads: int) -> Layers:
    shape = (2, model.num_blocks, model.block_size, num_heads, model.head_size)
    return [np.full(shape, POISON, dtype=np.uint16) for _ in range(model.layers)]


def _rank_main(conn: Any, model: Model, tp_size: int, rank: int) -> None:
    from kvshuttle.core.layout import CacheKind, PagedKVCache
    from kvshuttle.core.ranks import rank_heads
    from kvshuttle.retention import RetentionLedger
    from kvshuttle.transfer import EngineConfig, TransferEngine
    from kvshuttle.trust import DeploymentSecret

    engine = None
    try:
        layers = shard_of(global_layers(model), rank_heads(model.num_kv_heads, tp_size, rank))
        engine = TransferEngine(PagedKVCache.from_arrays(layers, CacheKind.FLASH_ATTN),
                                EngineConfig(secret=DeploymentSecret(SECRET_BYTES)))
        host, port = engine.serve().removeprefix("tcp://").rsplit(":", 1)
        ledger = RetentionLedger(f"owner-rank{rank}", host, int(port))
        engine.claims = ledger
        conn.send(("ready", f"{host}:{port}", os.getpid()))
        while True:
            if not conn.poll(0.05):
                continue
            command, args = conn.recv()
            if command == "stop":
                break
            if command == "retain":
                if args.get("ranks"):  # what a renewal's params name (the connector's worker sets it too)
                    ledger.ranks = tuple(args["ranks"])
                handle = ledger.retain(args["request_id"], args["block_ids"], args["digests"], args["num_tokens"],
                                       model.block_size, tp_size, ttl_s=300.0, handle_id=args["handle_id"],
                                       generation=0, mode=args.get("mode"))
                conn.send(("retain", handle.handle_id))
            elif command == "release":
                conn.send(("release", ledger.release(args["handle_id"])))
            elif command == "expiry":
                held = ledger.get(args["handle_id"])
                conn.send(("expiry", None if held is None else held.expiry_time))
            elif command == "metrics":
                conn.send(("metrics", ledger.metrics()))
            else:
                conn.send(("error", f"unknown command {command!r}"))
    except Exception as exc:  # report failures to the test instead of hanging it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if engine is not None:
            engine.close()
        conn.close()


class OwnerRank(PipedProcess):
    """One owner rank's process. ``start`` does not wait: start every rank, then ``wait_ready`` each."""

    def __init__(self, model: Model, tp_size: int, rank: int) -> None:
        self.model, self.tp_size, self.rank = model, tp_size, rank
        super().__init__(f"owner rank {rank}", _rank_main, (model, tp_size, rank))
        self.address = ""

    def wait_ready(self) -> None:
        reply = self._receive(STARTUP_TIMEOUT_S)
        if reply[0] != "ready":
            raise RuntimeError(f"owner rank {self.rank} failed to start: {reply}")
        self.address = reply[1]


def start_owner_groups(groups: list[tuple[Model, int]]) -> list[list[OwnerRank]]:
    """One owner engine per (model, TP size): all its ranks' processes, started at once; closed on failure."""
    started: list[list[OwnerRank]] = []
    try:
        for model, tp_size in groups:
            started.append([OwnerRank(model, tp_size, rank) for rank in range(tp_size)])
        for group in started:
            for owner in group:
                owner.wait_ready()
    except BaseException:
        close_all(started)
        raise
    return started


def close_all(groups: list[list[OwnerRank]]) -> None:
    for group in groups:
        for owner in group:
            owner.close()
