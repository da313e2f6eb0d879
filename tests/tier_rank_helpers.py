"""Real-process decode ranks for the uneven-tier tests: each TP rank's ShuttleWorker in its own interpreter, as
vLLM's multiprocess executor runs them.

A rank process builds its cache shard from a seed (the test regenerates the bytes), a ShuttleWorker with its own
TransferEngine, NIXL agent, side channel, ledger and host tier (a :class:`GatedTier`), and answers commands over a
pipe: the worker's per-step calls (the step's metadata pickled in, its reports pickled out, as vLLM does), the
ledger's public calls, and the tier's gate. :class:`RankProcess` offers the worker calls the connector's facade
makes, so ``facade(None, RankProcess(...))`` drives it like vLLM's worker process.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from conftest import HostCache, make_cache
from kvshuttle.transfer.host_tier import DemotionOrder, HostTier
from transfer_helpers import PipedProcess

STARTUP_TIMEOUT_S = 120.0  # two ranks start at once on 2 loaded cores
WORKER_CALLS = ("start", "finished", "worker_meta", "load_errors", "settle_layered", "take_stats", "state_sizes")


class GatedTier(HostTier):
    """A host tier whose demotion copies wait while ``closed`` (a slow copy), so who reports first is the test's,
    or fail while ``failing`` (as a copy that did not complete in time)."""

    def __init__(self, cache: Any, capacity_blocks: int, **options: Any) -> None:
        super().__init__(cache, capacity_blocks, **options)
        self.closed = self.failing = False
        self.held: list[DemotionOrder] = []

    def demote(self, order: DemotionOrder) -> None:
        if self.failing:
            order.done(False)
        elif self.closed:
            self.held.append(order)
        else:
            super().demote(order)

    def open(self) -> None:
        self.closed = False
        held, self.held = self.held, []
        for order in held:
            super().demote(order)


def shard(rank: int, seed: int, heads: int) -> HostCache:
    """Rank ``rank``'s cache shard (``heads`` KV heads) of the test's geometry, the same bytes in every process."""
    from test_connector_worker import GEO  # 64 blocks of BS tokens

    return make_cache(np.random.default_rng(seed), GEO.with_(num_heads=heads))


def _rank_main(conn: Any, rank: int, tp_size: int, num_kv_heads: int, seed: int, extra: dict[str, Any]) -> None:
    from kvshuttle.integrations.vllm import ShuttleConfig
    from kvshuttle.integrations.vllm import worker as worker_module
    from test_vllm_scheduler import BS, SECRET

    worker_module.HostTier = GatedTier  # the worker builds its tier from this name (this process only)
    w = None
    try:
        config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **extra}, model="m")
        w = worker_module.ShuttleWorker(config, "eng", BS, secret=SECRET, tp_rank=rank, tp_size=tp_size,
                                        num_kv_heads=num_kv_heads)
        cache = shard(rank, seed, num_kv_heads // tp_size)
        w.register_kv_caches({f"model.layers.{i}.self_attn": x for i, x in enumerate(cache.layers)}, "CPU_ATTN")
        tier = w.tier
        assert isinstance(tier, GatedTier) and w.ledger is not None
        conn.send(("ready", w.handshake()))
        while True:
            if not conn.poll(0.05):
                continue
            command, args = conn.recv()
            if command == "stop":
                break
            try:
                if command == "worker" and args["name"] in WORKER_CALLS:
                    reply = getattr(w, args["name"])(*args["args"])
                elif command == "ledger":
                    call = getattr(w.ledger, args["name"]) if args["name"] != "len" else lambda: len(w.ledger)
                    reply = call(*args["args"], **args["kwargs"])
                elif command == "gate":
                    tier.closed = True
                    reply = None
                elif command == "fail":
                    tier.failing = True
                    reply = None
                elif command == "open":
                    tier.open()
                    reply = None
                else:
                    raise ValueError(f"unknown command {command!r}")
            except Exception as exc:  # the test sees the rank's error
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
                continue
            conn.send((command, reply))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if w is not None:
            w.shutdown()
        conn.close()


class RankLedger:
    """The rank's RetentionLedger, called over the pipe (what its side channel answers is the same object)."""

    def __init__(self, rank: RankProcess) -> None:
        self._rank = rank

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self._rank.call("ledger", name=name, args=args, kwargs=kwargs)

    def __len__(self) -> int:
        return int(self._rank.call("ledger", name="len", args=(), kwargs={}))


class RankProcess(PipedProcess):
    """One decode rank's worker process; ``start_ranks`` starts several at once."""

    def __init__(self, rank: int, tp_size: int, num_kv_heads: int, seed: int, extra: dict[str, Any]) -> None:
        self.tp_rank, self.seed, self.heads = rank, seed, num_kv_heads // tp_size
        super().__init__(f"decode rank {rank}", _rank_main, (rank, tp_size, num_kv_heads, seed, extra))
        self.ledger = RankLedger(self)
        self._handshake: Any = None

    def wait_ready(self) -> None:
        reply = self._receive(STARTUP_TIMEOUT_S)
        if reply[0] != "ready":
            raise RuntimeError(f"decode rank {self.tp_rank} failed to start: {reply}")
        self._handshake = reply[1]

    def handshake(self) -> Any:
        return self._handshake

    def cache(self) -> HostCache:
        return shard(self.tp_rank, self.seed, self.heads)

    def close_gate(self) -> None:
        self.call("gate")

    def open_gate(self) -> None:
        self.call("open")

    def fail_copies(self) -> None:
        self.call("fail")

    def expire(self, after_s: float) -> None:
        """Its sweep at ``after_s`` from now (CLOCK_MONOTONIC is one clock for every process of a host)."""
        self.ledger.sweep(time.monotonic() + after_s)

    def __getattr__(self, name: str) -> Any:  # the worker calls the facade makes
        if name not in WORKER_CALLS:
            raise AttributeError(name)
        return lambda *args: self.call("worker", name=name, args=args)


def start_ranks(tp_size: int, num_kv_heads: int, seed: int, extra: dict[str, Any]) -> list[RankProcess]:
    """Every rank of one decode engine, started at once; closed on failure."""
    started: list[RankProcess] = []
    try:
        for rank in range(tp_size):
            started.append(RankProcess(rank, tp_size, num_kv_heads, seed + rank, extra))
        for proc in started:
            proc.wait_ready()
    except BaseException:
        for proc in started:
            proc.close()
        raise
    return started
