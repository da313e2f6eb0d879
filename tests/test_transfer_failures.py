"""Transfer failures with real processes: unreachable and killed owners, timeouts, cancellation, bad ids,
incompatible caches, exhausted staging, an unloadable backend, and no leaks over 1,000 transfers.

Every failure must name the local blocks that hold no valid data, and leave no NIXL handle, staging
chunk or owner job behind.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")
pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from conftest import POISON, Geo, make_cache
from kvshuttle.transfer import (
    BlockRangeError,
    EngineConfig,
    IncompatiblePeerError,
    NixlUnavailableError,
    PeerLostError,
    PeerUnreachableError,
    SideChannelError,
    StagingExhaustedError,
    TransferCancelledError,
    TransferEngine,
    TransferError,
    TransferHandle,
    TransferState,
    TransferTimeoutError,
)
from transfer_helpers import OwnerProcess, OwnerSpec, block_bytes, build_cache, token_bytes

GEO = Geo(kind="flash_attn", order="NHD", dtype="float16", num_layers=2, num_blocks=32, block_size=16,
          num_heads=4, head_size=32)
CHUNK = 32 << 10  # two blocks per chunk
BASE_CONFIG = {"staging_chunk_bytes": CHUNK, "staging_chunks": 6, "connect_timeout_s": 10.0}
SLOW = {**BASE_CONFIG, "debug_pack_delay_s": 0.15}
OWNERS = {
    "normal": OwnerSpec(GEO, 11, BASE_CONFIG),
    "slow": OwnerSpec(GEO, 12, SLOW),
    "tiny": OwnerSpec(GEO, 13, {**SLOW, "staging_chunks": 1}),
    "leased": OwnerSpec(GEO, 14, {**BASE_CONFIG, "staging_chunks": 2, "staging_lease_s": 0.5}),
}
NAMES = list(OWNERS)
READER_CONFIG = BASE_CONFIG


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    with OwnerProcess(list(OWNERS.values())) as proc:
        yield proc


def address(owner: OwnerProcess, name: str) -> str:
    return owner.addresses[NAMES.index(name)]


@pytest.fixture
def reader() -> Iterator[tuple[TransferEngine, Any]]:
    cache = make_cache(np.random.default_rng(3), GEO)
    engine = TransferEngine(cache.cache(), EngineConfig(**READER_CONFIG))
    try:
        yield engine, cache
    finally:
        engine.close()


def assert_clean(engine: TransferEngine, owner: OwnerProcess | None = None) -> None:
    """No live transfer handle, active transfer or borrowed staging chunk, here and on the owner."""
    stats = engine.stats()
    assert stats["xfer_handles"] == stats["stuck_xfer_handles"] == stats["active_transfers"] == 0, stats
    assert stats["staging_free"] == stats["staging_chunks"], stats
    if owner is None:
        return
    deadline = time.monotonic() + 5
    while True:  # the owner learns of aborts asynchronously
        remote = owner.call("stats")
        if all(s["owner_jobs"] == 0 and s["staging_free"] == s["staging_chunks"] for s in remote):
            return
        assert time.monotonic() < deadline, remote
        time.sleep(0.05)


def assert_partial(cache: Any, handle: TransferHandle, error: TransferError, source: Any, lids: Any,
                   rids: Any) -> None:
    """The error lists exactly the blocks not written; every block not listed is byte-exact."""
    assert error.invalid_block_ids == handle.invalid_block_ids
    assert set(error.invalid_block_ids) <= {int(b) for b in lids}
    valid = [i for i, b in enumerate(lids) if int(b) not in set(error.invalid_block_ids)]
    bs = GEO.block_size
    got = token_bytes(cache, np.asarray(lids)[valid], len(valid) * bs)
    want = token_bytes(source, np.asarray(rids)[valid], len(valid) * bs)
    assert np.array_equal(got, want), "a block reported valid does not hold the owner's bytes"
    invalid = list(error.invalid_block_ids)
    if invalid:
        assert (block_bytes(cache, invalid) == POISON).any(), "invalid blocks should not all be complete"


# ----------------------------------------------------------------------------------- connect / handshake
def test_unreachable_peer_is_a_named_error_quickly(reader: tuple[TransferEngine, Any]) -> None:
    engine, _ = reader
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(PeerUnreachableError, match="is the owner running"):
        engine.connect(f"tcp://127.0.0.1:{port}", timeout=0.5)
    assert time.monotonic() - start < 3
    assert engine.stats()["peers"] == 0


@pytest.mark.parametrize("change, message", [
    ({"dtype": "float32"}, "dtype float32 here vs float16"),
    ({"head_size": 64}, "head size 64 here vs 32"),
    ({"num_layers": 3}, "3 layers here vs 2"),
    ({"kind": "mla", "head_size": 32}, "layout mla here vs flash_attn"),
])
def test_incompatible_geometry_is_refused_at_handshake(owner: OwnerProcess, change: dict[str, Any],
                                                       message: str) -> None:
    cache = make_cache(np.random.default_rng(0), replace(GEO, **change))
    with TransferEngine(cache.cache(), EngineConfig(**READER_CONFIG)) as engine:
        with pytest.raises(IncompatiblePeerError, match=message):
            engine.connect(address(owner, "normal"))
        assert engine.stats()["peers"] == 0


def test_port_in_use_is_a_named_error(owner: OwnerProcess) -> None:
    port = int(address(owner, "normal").rsplit(":", 1)[1])
    cache = make_cache(np.random.default_rng(0), GEO)
    with TransferEngine(cache.cache(), EngineConfig(port=port)) as engine, \
            pytest.raises(SideChannelError, match="port=0"):
        engine.serve()


def test_unloadable_backend_is_a_clear_error() -> None:
    cache = make_cache(np.random.default_rng(0), GEO)
    with pytest.raises(NixlUnavailableError, match="LIBFABRIC"):
        TransferEngine(cache.cache(), EngineConfig(backends=("LIBFABRIC",)))


# --------------------------------------------------------------------------------------------- block ids
@pytest.mark.parametrize("lids, rids, tokens, message", [
    ([0, 32], [0, 1], None, "local block id 32 is outside"),
    ([0, 1], [0, 99], None, "remote block id 99 is outside"),
    ([4, 4], [0, 1], None, "appears more than once"),
    ([0, -1], [0, 1], None, "outside"),
    ([0, 1, 2], [0, 1], 48, "2 remote blocks of 16 tokens cannot hold exactly 48"),
    ([0, 1], [0, 1], 10, "2 local blocks of 16 tokens cannot hold exactly 10"),
])
@pytest.mark.parametrize("path", ["direct", "packed"])
def test_bad_block_ids_name_the_destination_blocks(owner: OwnerProcess, reader: tuple[TransferEngine, Any],
                                                   lids: list[int], rids: list[int], tokens: int | None,
                                                   message: str, path: Any) -> None:
    engine, cache = reader
    peer = engine.connect(address(owner, "normal"))
    before = cache.snapshot()
    with pytest.raises(BlockRangeError, match=message) as info:
        engine.read(peer, lids, rids, num_tokens=tokens, path=path)
    assert info.value.invalid_block_ids == tuple(lids)
    assert isinstance(info.value, IndexError)  # also a kvshuttle BlockIdError
    assert all(np.array_equal(a, b) for a, b in zip(cache.snapshot(), before, strict=True))
    assert_clean(engine)


# --------------------------------------------------------------------------------------------- staging
def test_owner_staging_exhausted(owner: OwnerProcess, reader: tuple[TransferEngine, Any]) -> None:
    engine, cache = reader
    peer = engine.connect(address(owner, "tiny"))
    # The first read holds the owner's one staging chunk for its 10 chunks (>= 1.5 s of pack delay), a window
    # wide enough that the second request reaches the owner inside it even on a loaded CI machine.
    first = engine.read(peer, np.arange(0, 20), np.arange(0, 20), path="packed")
    second = engine.read(peer, np.arange(24, 28), np.arange(24, 28), path="packed")
    with pytest.raises(StagingExhaustedError, match="staging chunks on the owner are in use") as info:
        second.wait(10)
    assert info.value.invalid_block_ids == tuple(range(24, 28))
    first.wait(20)
    source = build_cache(GEO, OWNERS["tiny"].seed)
    assert np.array_equal(token_bytes(cache, range(20), 320), token_bytes(source, range(20), 320))
    assert_clean(engine, owner)


def test_reader_staging_exhausted(owner: OwnerProcess) -> None:
    cache = make_cache(np.random.default_rng(0), GEO)
    config = EngineConfig(**{**READER_CONFIG, "staging_chunks": 2, "pipeline_depth": 2})
    with TransferEngine(cache.cache(), config) as engine:
        peer = engine.connect(address(owner, "slow"))
        first = engine.read(peer, np.arange(8), np.arange(8), path="packed")
        with pytest.raises(StagingExhaustedError, match="on the reader") as info:
            engine.read(peer, [20, 21], [20, 21], path="packed")
        assert info.value.invalid_block_ids == (20, 21)
        first.wait(20)
        assert_clean(engine, owner)


# --------------------------------------------------------------------------------- timeout and cancel
def _slow_read(engine: TransferEngine, owner: OwnerProcess, **kwargs: Any) -> tuple[TransferHandle, Any, Any]:
    peer = engine.connect(address(owner, "slow"))
    lids, rids = np.arange(2, 22), np.random.default_rng(1).permutation(32)[:20]  # 10 chunks, 0.15 s each
    return engine.read(peer, lids, rids, path="packed", **kwargs), lids, rids


def test_wait_timeout_cancels_and_names_unwritten_blocks(owner: OwnerProcess,
                                                         reader: tuple[TransferEngine, Any]) -> None:
    engine, cache = reader
    for raw in cache.raws:
        raw[:] = POISON
    handle, lids, rids = _slow_read(engine, owner)
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="did not finish within") as info:
        handle.wait(0.5)
    assert time.monotonic() - start < 2
    assert handle.state is TransferState.FAILED and isinstance(info.value, TimeoutError)
    assert 0 < len(info.value.invalid_block_ids) < len(lids)  # some chunks landed, the rest are named
    assert_partial(cache, handle, info.value, build_cache(GEO, OWNERS["slow"].seed), lids, rids)
    assert_clean(engine, owner)


def test_read_deadline_fails_the_transfer(owner: OwnerProcess, reader: tuple[TransferEngine, Any]) -> None:
    engine, _ = reader
    handle, lids, _ = _slow_read(engine, owner, timeout=0.3)
    with pytest.raises(TransferTimeoutError, match="passed its deadline") as info:
        handle.wait(10)
    assert set(info.value.invalid_block_ids) <= set(lids.tolist()) and info.value.invalid_block_ids
    assert_clean(engine, owner)


def test_cancel_stops_the_transfer(owner: OwnerProcess, reader: tuple[TransferEngine, Any]) -> None:
    engine, cache = reader
    for raw in cache.raws:
        raw[:] = POISON
    handle, lids, rids = _slow_read(engine, owner)
    deadline = time.monotonic() + 10
    while handle.chunks_done < 1:  # type: ignore[attr-defined]  # cancel mid-way, after one chunk landed
        assert time.monotonic() < deadline and handle.poll() is TransferState.PENDING
        handle._outcome.finished.wait(0.01)
    handle.cancel()
    assert handle.poll() is TransferState.CANCELLED
    with pytest.raises(TransferCancelledError) as info:
        handle.wait(1)
    assert_partial(cache, handle, info.value, build_cache(GEO, OWNERS["slow"].seed), lids, rids)
    handle.cancel()  # idempotent
    assert_clean(engine, owner)
    again = engine.read(engine.connect(address(owner, "normal")), [0, 1], [0, 1], path="packed")
    assert again.wait(10).bytes > 0


def test_owner_reclaims_staging_from_a_reader_that_vanished(owner: OwnerProcess) -> None:
    """A reader that asks for packing and never releases (it died): the lease returns the staging."""
    import zmq

    from kvshuttle.transfer.side_channel import Connection
    from kvshuttle.trust import DeploymentSecret

    index = NAMES.index("leased")
    context = zmq.Context()
    conn = Connection(context, address(owner, "leased"), secret=DeploymentSecret.resolve())  # a member, then gone
    try:
        conn.send({"op": "pack", "tid": "ghost", "ids": [0, 1, 2, 3, 4, 5], "num_tokens": 96,
                   "layout": {"block_size": 16, "num_heads": 4, "order": "NHD"}, "head_offset": 0,
                   "chunk_tokens": 32, "window": 2})
        seen = set()
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:  # two chunks packed, then it waits for releases
            message = conn.receive(0.1)
            if message is not None and message["op"] == "ready":
                seen.add(message["chunk"])
        assert seen == {0, 1}
        busy = owner.call("stats")[index]
        assert busy["owner_jobs"] == 1 and busy["staging_free"] == 0
    finally:
        conn.close()
        context.term()
    deadline = time.monotonic() + 5
    while owner.call("stats")[index]["owner_jobs"]:
        assert time.monotonic() < deadline, "the owner never reclaimed the staging of a vanished reader"
        time.sleep(0.05)
    assert owner.call("stats")[index]["staging_free"] == 2


def test_close_cancels_transfers_in_flight(owner: OwnerProcess) -> None:
    cache = make_cache(np.random.default_rng(0), GEO)
    engine = TransferEngine(cache.cache(), EngineConfig(**READER_CONFIG))
    handle, _, _ = _slow_read(engine, owner)
    engine.close()
    assert handle.state is TransferState.CANCELLED
    with pytest.raises(TransferCancelledError):
        handle.wait(1)
    with pytest.raises(TransferError, match="closed"):
        engine.read(engine.connect(address(owner, "normal")), [0], [0])
    engine.close()  # idempotent
    assert_clean(engine, owner)


# ----------------------------------------------------------------------------------------- dead owner
def test_owner_killed_mid_transfer(reader: tuple[TransferEngine, Any]) -> None:
    engine, cache = reader
    for raw in cache.raws:
        raw[:] = POISON
    spec = OwnerSpec(GEO, 21, SLOW)
    with OwnerProcess([spec]) as doomed:
        peer = engine.connect(doomed.addresses[0])
        lids, rids = np.arange(0, 24), np.arange(8, 32)
        handle = engine.read(peer, lids, rids, path="packed")
        deadline = time.monotonic() + 10
        while handle.chunks_done < 2:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline and handle.poll() is TransferState.PENDING
            handle._outcome.finished.wait(0.01)
        doomed.kill()
        start = time.monotonic()
        with pytest.raises(PeerLostError) as info:
            handle.wait(10)
        assert time.monotonic() - start < 2  # EngineConfig's failure-detection bound
        assert_partial(cache, handle, info.value, build_cache(GEO, spec.seed), lids, rids)
        assert 0 < len(info.value.invalid_block_ids) < len(lids)
        with pytest.raises(PeerLostError) as direct:
            engine.read(peer, [30, 31], [0, 1], path="direct").wait(5)
        assert direct.value.invalid_block_ids == (30, 31)
        with pytest.raises(PeerUnreachableError):
            engine.connect(doomed.addresses[0], timeout=0.5)
        assert not engine.ping(peer, timeout=0.2)
    engine.disconnect(peer)
    with pytest.raises(PeerLostError, match="not connected"):
        engine.read(peer, [0], [0])
    assert_clean(engine)


# ------------------------------------------------------------------------------------------------ leaks
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_thousand_transfers_leak_no_handles_or_memory(owner: OwnerProcess,
                                                      reader: tuple[TransferEngine, Any]) -> None:
    engine, _ = reader
    peer = engine.connect(address(owner, "normal"))
    rng = np.random.default_rng(5)

    def one(i: int) -> None:
        ids = rng.permutation(32)[:4]
        path = "packed" if i % 10 == 0 else "direct"
        engine.read(peer, ids, ids[::-1], path=path).wait(10)

    for i in range(200):  # warm-up: allocator pools, UCX endpoints, rkey caches
        one(i)
    before = _rss_bytes()
    for i in range(1000):
        one(i)
    grown = _rss_bytes() - before
    assert grown < 4 << 20, f"RSS grew by {grown / 2**20:.1f} MiB over 1,000 transfers"
    assert_clean(engine, owner)
    got = owner.call("notifs", wait=2.0, at_least=1200)[NAMES.index("normal")]
    assert len(got) >= 1200  # every transfer notified the owner


# ------------------------------------------------------------------------------ handles that cannot leak
def eventually_clean(engine: TransferEngine, owner: OwnerProcess) -> None:
    """assert_clean, after giving a stopped pipeline thread its last poll (50 ms) to hand everything back."""
    deadline = time.monotonic() + 2
    while True:
        try:
            assert_clean(engine, owner)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@pytest.mark.parametrize("path", ["direct", "packed"])
def test_dropped_pending_reads_leave_nothing_behind(owner: OwnerProcess, reader: tuple[TransferEngine, Any],
                                                    path: str) -> None:
    engine, _ = reader
    peer = engine.connect(address(owner, "slow"))
    owner.call("notifs")  # drop older tests' notifications
    states = []
    for start in (0, 12):
        handle = engine.read(peer, np.arange(start, start + 12), np.arange(12), path=path)
        states.append(handle.state)
        del handle  # dropped without wait(), cancel() or release()
    gc.collect()
    eventually_clean(engine, owner)
    if path == "packed":  # stopped by the finalizer, not left to finish: the owner heard of no completion
        assert states == [TransferState.PENDING] * 2
        assert owner.call("notifs", wait=1.0)[NAMES.index("slow")] == []


def test_release_and_with_blocks_free_a_pending_read(owner: OwnerProcess, reader: tuple[TransferEngine, Any]) -> None:
    engine, _ = reader
    peer = engine.connect(address(owner, "slow"))
    handle = engine.read(peer, np.arange(12), np.arange(12), path="packed")
    assert handle.state is TransferState.PENDING
    handle.release()
    assert handle.state is TransferState.CANCELLED
    assert engine.stats()["staging_free"] == engine.stats()["staging_chunks"]  # at once, on this side
    handle.release()  # idempotent
    with engine.read(peer, np.arange(12), np.arange(12), path="packed") as pending:
        assert pending.state is TransferState.PENDING
    assert pending.state is TransferState.CANCELLED
    with engine.read(peer, [1, 2], [3, 4], path="direct") as done:
        done.wait(10)
    assert done.state is TransferState.DONE  # release() after the end changes nothing
    eventually_clean(engine, owner)


def test_nixl_object_kinds_are_distinct_types(reader: tuple[TransferEngine, Any]) -> None:
    from kvshuttle.transfer._nixl import NixlDescList, NixlRegistration, NixlXfer

    engine, _ = reader
    registration = engine._registrations[0]
    assert type(registration) is NixlRegistration
    assert len({NixlRegistration, NixlDescList, NixlXfer}) == 3
    assert not issubclass(NixlXfer, NixlRegistration) and not issubclass(NixlDescList, NixlXfer)
