"""Dead and frozen owners are detected fast, with default timeouts, on every path; lost peers fail at once.

The bounds asserted here are the documented failure-detection contract (EngineConfig): an owner that dies
before or during a read is detected within 2 s; once a peer is known lost, later calls to it fail within
0.5 s; an owner that comes back on the same address is reachable again with ``connect``. Owners run in
real processes (killed with SIGKILL, frozen with SIGSTOP); only staging sizes differ from the defaults.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from conftest import POISON, Geo, make_cache
from kvshuttle.policy import KVHandle
from kvshuttle.transfer import (
    EngineConfig,
    PeerLostError,
    PeerUnreachableError,
    TransferEngine,
    TransferError,
)
from transfer_helpers import OwnerProcess, OwnerSpec, block_bytes, build_cache

GEO = Geo(kind="flash_attn", order="NHD", dtype="float16", num_layers=2, num_blocks=32, block_size=16,
          num_heads=4, head_size=32)
STAGING = {"staging_chunk_bytes": 32 << 10, "staging_chunks": 6}  # two blocks per chunk; timeouts: defaults
DETECT_S = 2.0  # an owner that died before or during a read
LOST_S = 0.5  # a call to a peer already known lost


@pytest.fixture
def reader() -> Iterator[tuple[TransferEngine, Any]]:
    cache = make_cache(np.random.default_rng(3), GEO)
    for raw in cache.raws:
        raw[:] = POISON
    engine = TransferEngine(cache.cache(), EngineConfig(**STAGING))
    try:
        yield engine, cache
    finally:
        engine.close()


def elapsed(fn: Callable[[], Any]) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_handle(port: int) -> KVHandle:
    return KVHandle("e", "r", "127.0.0.1", port, (0, 1), 32, time.time() + 60, 1, "h", 0, 16,
                    (b"\x01" * 16, b"\x02" * 16), time.time(), 60.0)


@pytest.mark.parametrize("path", ["direct", "packed"])
def test_owner_dead_before_the_read(reader: tuple[TransferEngine, Any], path: str) -> None:
    engine, cache = reader
    with OwnerProcess([OwnerSpec(GEO, 21, STAGING)]) as owner:
        peer = engine.connect(owner.addresses[0])
        owner.kill()

        def read() -> None:
            with pytest.raises(PeerLostError) as info:
                engine.read(peer, [3, 4, 5], [0, 1, 2], path=path).wait()
            assert info.value.invalid_block_ids == (3, 4, 5)

        assert elapsed(read) < DETECT_S
    assert (block_bytes(cache, [3, 4, 5]) == POISON).all(), "nothing may land from a dead owner"
    assert engine.stats()["peers"] == 0, "a lost peer is forgotten"


def test_owner_dies_during_a_packed_read(reader: tuple[TransferEngine, Any]) -> None:
    engine, _ = reader
    with OwnerProcess([OwnerSpec(GEO, 22, {**STAGING, "debug_pack_delay_s": 0.2})]) as owner:
        peer = engine.connect(owner.addresses[0])
        handle = engine.read(peer, np.arange(24), np.arange(8, 32), path="packed")
        while handle.chunks_done < 1:  # type: ignore[attr-defined]
            handle._outcome.finished.wait(0.01)  # the read is under way
        owner.kill()
        start = time.monotonic()
        with pytest.raises(PeerLostError) as info:
            handle.wait()
        assert time.monotonic() - start < DETECT_S
        assert 0 < len(info.value.invalid_block_ids) < 24


def test_frozen_owner_is_lost_after_the_heartbeat_timeout(reader: tuple[TransferEngine, Any]) -> None:
    """SIGSTOP: the process and its sockets live on, but nothing answers (a hung or cut-off host)."""
    engine, _ = reader
    with OwnerProcess([OwnerSpec(GEO, 23, {**STAGING, "debug_pack_delay_s": 0.2})]) as owner:
        peer = engine.connect(owner.addresses[0])
        handle = engine.read(peer, np.arange(24), np.arange(8, 32), path="packed")
        os.kill(owner.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(PeerLostError, match="heartbeat"):
                handle.wait()
            assert time.monotonic() - start < DETECT_S
        finally:
            os.kill(owner.pid, signal.SIGCONT)


def test_calls_to_a_lost_peer_fail_at_once(reader: tuple[TransferEngine, Any]) -> None:
    engine, _ = reader
    with OwnerProcess([OwnerSpec(GEO, 24, STAGING)]) as owner:
        peer = engine.connect(owner.addresses[0])
        port = int(owner.addresses[0].rsplit(":", 1)[1])
        owner.kill()
        with pytest.raises(PeerLostError):
            engine.read(peer, [0], [0], path="packed").wait()
        calls: list[Callable[[], Any]] = [lambda: engine.read(peer, [0], [0], path="direct"),
                                          lambda: engine.read(peer, [0], [0], path="packed"),
                                          lambda: engine.claim(peer, fake_handle(port))]
        for call in calls:
            start = time.monotonic()
            with pytest.raises(PeerLostError, match="connect"):
                call()
            assert time.monotonic() - start < LOST_S
        assert elapsed(lambda: engine.ping(peer)) < LOST_S
        assert not engine.ping(peer)


def test_claim_to_an_owner_that_died_fails_fast(reader: tuple[TransferEngine, Any]) -> None:
    engine, _ = reader
    with OwnerProcess([OwnerSpec(GEO, 25, STAGING)]) as owner:
        peer = engine.connect(owner.addresses[0])
        port = int(owner.addresses[0].rsplit(":", 1)[1])
        owner.kill()

        def claim() -> None:
            with pytest.raises(PeerLostError):
                engine.claim(peer, fake_handle(port))

        assert elapsed(claim) < DETECT_S


def test_connect_to_a_dead_address_fails_fast(reader: tuple[TransferEngine, Any]) -> None:
    engine, _ = reader

    def connect() -> None:
        with pytest.raises(PeerUnreachableError, match="refused"):
            engine.connect(f"tcp://127.0.0.1:{free_port()}")

    assert elapsed(connect) < DETECT_S
    assert engine.stats()["peers"] == 0


def test_an_owner_back_on_the_same_address_is_reachable_again(reader: tuple[TransferEngine, Any]) -> None:
    engine, cache = reader
    port = free_port()
    spec = OwnerSpec(GEO, 26, {**STAGING, "port": port})
    with OwnerProcess([spec]) as owner:
        peer = engine.connect(owner.addresses[0])
        owner.kill()
    with pytest.raises(PeerLostError):
        engine.read(peer, [0], [0]).wait()
    with OwnerProcess([spec]) as again:
        assert again.addresses[0] == f"tcp://127.0.0.1:{port}"
        fresh = engine.connect(again.addresses[0])
        assert fresh is not peer and fresh.lost is None
        engine.read(fresh, [7, 8], [2, 3], path="direct").wait(10)
        want = block_bytes(build_cache(GEO, spec.seed), [2, 3])
        assert np.array_equal(block_bytes(cache, [7, 8]), want)


def test_a_lost_peer_is_never_reported_as_a_transfer_success(reader: tuple[TransferEngine, Any]) -> None:
    """Errors for lost peers are TransferErrors that name every destination block."""
    engine, _ = reader
    with OwnerProcess([OwnerSpec(GEO, 27, STAGING)]) as owner:
        peer = engine.connect(owner.addresses[0])
        owner.kill()
        with pytest.raises(TransferError) as info:
            engine.read(peer, [9, 10], [0, 1], path="direct").wait()
    assert isinstance(info.value, PeerLostError)
    assert info.value.invalid_block_ids == (9, 10)


def test_a_dead_owner_left_alone_costs_the_reader_nothing(reader: tuple[TransferEngine, Any]) -> None:
    """A reader never reconnects to an owner that went away. Reconnecting every 100 ms queued ~14 monitor events
    a second that nobody read once the peer was lost; at 1,000 libzmq's I/O thread blocked, every socket of the
    engine stopped and closing one froze the whole process (a prefill's worker, ~70 s after its decode was
    closed). Here: a dead owner's connections stay silent however long the reader leaves them alone."""
    engine, _ = reader
    with OwnerProcess([OwnerSpec(GEO, 28, STAGING)]) as owner:
        peer = engine.connect(owner.addresses[0])
        engine.read(peer, [1, 2], [3, 4], path="packed").wait(10)  # an idle packed stream is kept too
        stream = peer.checkout(engine._zmq)
        owner.kill()
        time.sleep(0.5)
        assert peer.watch() is not None and stream.watch() is not None
        seen = (peer.conn.link.events, stream.link.events)
        time.sleep(2.0)  # reconnecting, ~28 more events each
        peer.conn.watch()
        stream.watch()
        assert (peer.conn.link.events, stream.link.events) == seen, "a lost connection kept reconnecting"
        assert max(seen) <= 8, seen
        stream.close()
