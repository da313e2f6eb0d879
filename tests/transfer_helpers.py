"""Real-process helpers for the transfer tests: an owner ("decode") process serving paged caches.

The owner runs in a fresh interpreter (multiprocessing "spawn"), builds its caches from a seed with the
same code the tests use (so a test regenerates the owner's bytes instead of shipping them), serves each
through its own TransferEngine, and answers commands over a pipe. Every wait has a timeout and the
process is killed in ``close()`` whatever happens.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from conftest import Geo, HostCache, make_cache

Bytes = npt.NDArray[np.uint8]
STARTUP_TIMEOUT_S = 60.0
COMMAND_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class OwnerSpec:
    """One cache to serve: geometry, data seed and EngineConfig keyword arguments."""

    geo: Geo
    seed: int
    config: dict[str, Any] = field(default_factory=dict)


def build_cache(geo: Geo, seed: int) -> HostCache:
    return make_cache(np.random.default_rng(seed), geo)


def token_bytes(cache: HostCache, ids: Any, num_tokens: int, head_offset: int = 0,
                heads: int | None = None) -> Bytes:
    """``[L, P, T, h, D, itemsize]`` bytes of tokens ``0..num_tokens`` of blocks ``ids`` (in order)."""
    geo = cache.geo
    ids = np.asarray(ids, dtype=np.int64)
    t = np.arange(num_tokens)
    blocks, slots = ids[t // geo.block_size], t % geo.block_size
    h = slice(head_offset, head_offset + (heads or geo.heads))
    return np.stack([cache.canonical(layer)[:, blocks, slots, h] for layer in range(geo.num_layers)])


def in_process_pair(owner_geo: Geo, reader_geo: Geo, seeds: tuple[int, int], config: dict[str, Any]) -> tuple[
        HostCache, HostCache, Any, Any]:
    """(source, poisoned target, owner engine, reader engine): two engines of this process over fresh caches."""
    from conftest import POISON
    from kvshuttle.transfer import EngineConfig, TransferEngine

    source = make_cache(np.random.default_rng(seeds[0]), owner_geo)
    target = make_cache(np.random.default_rng(seeds[1]), reader_geo)
    for raw in target.raws:
        raw[:] = POISON
    return source, target, TransferEngine(source.cache(), EngineConfig(**config)), \
        TransferEngine(target.cache(), EngineConfig(**config))


def block_bytes(cache: HostCache, ids: Any) -> Bytes:
    """``[L, P, n, B, H, D, itemsize]`` bytes of whole blocks ``ids``."""
    ids = np.asarray(ids, dtype=np.int64)
    return np.stack([cache.canonical(layer)[:, ids] for layer in range(cache.geo.num_layers)])


class LocalReader:
    """A reader engine over its own cache of ``geo`` (random bytes, poisoned on demand), connected lazily to
    an owner process's caches by index (or by name, given the owner's cache names in order)."""

    def __init__(self, geo: Geo, owner: OwnerProcess, config: dict[str, Any], seed: int = 7,
                 names: list[str] | None = None) -> None:
        from kvshuttle.transfer import EngineConfig, TransferEngine

        self.cache = make_cache(np.random.default_rng(seed), geo)
        self.engine = TransferEngine(self.cache.cache(), EngineConfig(**config))
        self.owner = owner
        self.names = names or []
        self.peers: dict[int, Any] = {}

    def peer(self, key: int | str) -> Any:
        index = self.names.index(key) if isinstance(key, str) else key
        if index not in self.peers:
            self.peers[index] = self.engine.connect(self.owner.addresses[index])
        return self.peers[index]

    def poison(self, fill: int = 0xA5) -> None:
        for raw in self.cache.raws:  # one flat buffer per layer, or one for all (vLLM 0.32)
            raw[:] = fill

    def check_tokens(self, source: HostCache, lids: Any, rids: Any, num_tokens: int, *, local_head_offset: int = 0,
                     remote_head_offset: int = 0, heads: int | None = None) -> None:
        """The read tokens equal the owner's ``source``; blocks outside ``lids`` still hold the poison."""
        h = heads or min(self.cache.geo.heads, source.geo.heads)
        got = token_bytes(self.cache, lids, num_tokens, local_head_offset, h)
        want = token_bytes(source, rids, num_tokens, remote_head_offset, h)
        assert np.array_equal(got, want), "read tokens differ from the owner's bytes"
        others = np.setdiff1d(np.arange(self.cache.geo.num_blocks), lids)
        assert (block_bytes(self.cache, others) == 0xA5).all(), "a block outside the read was written"


class ReaderPool:
    """The reader engines of one test module: one per (geometry, config), made on first use, closed at the end."""

    def __init__(self, owner: OwnerProcess, config: dict[str, Any], names: list[str] | None = None) -> None:
        self.owner, self.config, self.names = owner, config, names
        self._made: dict[Any, LocalReader] = {}

    def get(self, geo: Geo, **config: Any) -> LocalReader:
        key = (geo, tuple(sorted(config.items())))
        if key not in self._made:
            self._made[key] = LocalReader(geo, self.owner, {**self.config, **config}, names=self.names)
        return self._made[key]

    def __iter__(self) -> Iterator[LocalReader]:
        return iter(list(self._made.values()))

    def close(self) -> None:
        for reader in self._made.values():
            reader.engine.close()


def _owner_main(conn: Any, specs: list[OwnerSpec]) -> None:
    from kvshuttle.transfer import EngineConfig, TransferEngine

    engines = []
    try:
        caches = [build_cache(spec.geo, spec.seed) for spec in specs]
        for spec, cache in zip(specs, caches, strict=True):
            engines.append(TransferEngine(cache.cache(), EngineConfig(**spec.config)))
        conn.send(("ready", [engine.serve() for engine in engines], os.getpid()))
        while True:
            if not conn.poll(0.05):
                continue
            command, args = conn.recv()
            if command == "stop":
                break
            if command == "notifs":
                deadline = time.monotonic() + args.get("wait", 0.0)
                got = [[(n.peer_agent, n.transfer_id, n.tag) for n in e.notifications()] for e in engines]
                while sum(map(len, got)) < args.get("at_least", 0) and time.monotonic() < deadline:
                    time.sleep(0.01)
                    for i, e in enumerate(engines):
                        got[i] += [(n.peer_agent, n.transfer_id, n.tag) for n in e.notifications()]
                conn.send(("notifs", got))
            elif command == "stats":
                conn.send(("stats", [e.stats() for e in engines]))
            else:
                conn.send(("error", f"unknown command {command!r}"))
    except Exception as exc:  # report start-up failures to the test instead of hanging it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for engine in engines:
            engine.close()
        conn.close()


class PipedProcess:
    """A helper process ("spawn") answering commands over a pipe: every wait has a timeout, and ``close()``
    always ends it (a polite stop, then SIGKILL)."""

    def __init__(self, name: str, target: Any, args: tuple[Any, ...]) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()

    def _receive(self, timeout: float) -> Any:
        try:
            if not self._conn.poll(timeout):
                raise TimeoutError(f"{self.name} did not answer within {timeout} s")
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"{self.name} exited (exit code {self.process.exitcode})") from exc

    def call(self, command: str, timeout: float = COMMAND_TIMEOUT_S, **args: Any) -> Any:
        self._conn.send((command, args))
        reply = self._receive(timeout)
        if reply[0] == "error":
            raise RuntimeError(reply[1])
        return reply[1]

    def kill(self) -> None:
        """SIGKILL, the way a crashed decode worker disappears."""
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(10)

    def close(self) -> None:
        try:
            if self.process.is_alive():
                with contextlib.suppress(OSError):
                    self._conn.send(("stop", {}))
                self.process.join(5)
        finally:
            if self.process.is_alive():
                self.kill()
            self._conn.close()


class OwnerProcess(PipedProcess):
    """An owner process; use as a context manager (it is always killed on exit)."""

    def __init__(self, specs: list[OwnerSpec]) -> None:
        self.specs = specs
        super().__init__("owner process", _owner_main, (specs,))
        reply = self._receive(STARTUP_TIMEOUT_S)
        if reply[0] != "ready":
            self.close()
            raise RuntimeError(f"owner process failed to start: {reply}")
        self.addresses: list[str] = reply[1]
        self.pid: int = reply[2]

    def __enter__(self) -> OwnerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
