"""Transfers between two real processes over NIXL (UCX, DRAM): an owner ("decode") process serves paged
caches built from seeds; this process ("prefill") reads blocks back through the direct and packed paths
and compares bytes against the owner's data regenerated from the same seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")
pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from conftest import POISON, Geo
from kvshuttle.transfer import (
    IncompatiblePeerError,
    TransferState,
)
from kvshuttle.transfer.path_model import PathModel
from transfer_helpers import LocalReader, OwnerProcess, OwnerSpec, ReaderPool, block_bytes, build_cache, token_bytes

BASE = Geo(kind="flash_attn", order="NHD", dtype="float16", num_layers=2, num_blocks=32, block_size=16,
           num_heads=4, head_size=32)  # 4 KiB pieces
CHUNK = 32 << 10  # two blocks of BASE per staging chunk: many chunks per read
CONFIG = {"staging_chunk_bytes": CHUNK, "staging_chunks": 6, "connect_timeout_s": 10.0}
LAYOUTS = {
    "fa_nhd": BASE,
    "fa_hnd": replace(BASE, order="HND"),
    "fi_nhd": replace(BASE, kind="flashinfer"),
    "fi_hnd": replace(BASE, kind="flashinfer", order="HND"),
    "mla": replace(BASE, kind="mla", head_size=64),
    "fa_nhd_2heads": replace(BASE, num_heads=2),
    "fa_hnd_bs32": replace(BASE, order="HND", block_size=32, num_blocks=16),
    "fa_nhd_big": replace(BASE, num_heads=8, head_size=256, num_blocks=8),  # 64 KiB pieces
}
NAMES = list(LAYOUTS)


def seed_of(name: str) -> int:
    return 1000 + NAMES.index(name)


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    specs = [OwnerSpec(LAYOUTS[name], seed_of(name), CONFIG) for name in NAMES]
    with OwnerProcess(specs) as proc:
        yield proc


@pytest.fixture(scope="module")
def readers(owner: OwnerProcess) -> Iterator[ReaderPool]:
    pool = ReaderPool(owner, CONFIG, NAMES)
    yield pool
    pool.close()


def check_read(reader: LocalReader, source_name: str, lids: Any, rids: Any, num_tokens: int, *,
               local_head_offset: int = 0, remote_head_offset: int = 0, heads: int | None = None) -> None:
    """The read tokens equal the owner's; every other byte of the local cache is untouched."""
    source = build_cache(LAYOUTS[source_name], seed_of(source_name))
    h = heads or min(reader.cache.geo.heads, source.geo.heads)
    got = token_bytes(reader.cache, lids, num_tokens, local_head_offset, h)
    want = token_bytes(source, rids, num_tokens, remote_head_offset, h)
    assert np.array_equal(got, want), "read tokens differ from the owner's bytes"


def untouched(reader: LocalReader, lids: Any) -> None:
    others = np.setdiff1d(np.arange(reader.cache.geo.num_blocks), lids)
    assert (block_bytes(reader.cache, others) == POISON).all(), "a block outside the read was written"


# ----------------------------------------------------------------------------------------------- handshake
def test_handshake_exchanges_geometry_and_reports_port(owner: OwnerProcess,
                                                       readers: ReaderPool) -> None:
    reader = readers.get(BASE)
    for address in owner.addresses:
        host, port = address.removeprefix("tcp://").split(":")
        assert host == "127.0.0.1" and int(port) > 0
    peer = reader.peer("fa_hnd")
    assert peer.info.cache.order == "HND" and peer.info.cache.num_blocks == BASE.num_blocks
    assert peer.info.cache.dtype == "float16" and peer.info.cache.num_layers == 2
    assert peer.info.side.piece_bytes == BASE.piece_bytes
    assert peer.layout_difference is not None and "order" in peer.layout_difference
    assert reader.peer("fa_nhd").layout_difference is None
    assert reader.engine.ping(peer)
    assert reader.engine.connect(owner.addresses[1]) is peer  # one peer per owner agent


# ---------------------------------------------------------------------------------------------- direct
@pytest.mark.parametrize("name", ["fa_nhd", "fa_hnd", "fi_nhd", "fi_hnd", "mla"])
@pytest.mark.parametrize("mode", ["initialize", "prepped"])
def test_direct_read_is_byte_exact(owner: OwnerProcess, readers: ReaderPool, name: str,
                                   mode: str) -> None:
    geo = LAYOUTS[name]
    reader = readers.get(geo, direct_mode=mode)
    rng = np.random.default_rng(seed_of(name))
    lids, rids = rng.permutation(geo.num_blocks)[:12], rng.permutation(geo.num_blocks)[:12]
    reader.poison()
    handle = reader.engine.read(reader.peer(name), lids, rids, path="direct")
    tel = handle.wait(10)
    assert handle.path == "direct" and handle.state is TransferState.DONE and handle.invalid_block_ids == ()
    check_read(reader, name, lids, rids, 12 * geo.block_size)
    untouched(reader, lids)
    assert tel.path == "direct" and tel.bytes == 12 * geo.planes * geo.num_layers * geo.piece_bytes
    assert 1 <= tel.descriptors <= tel.pieces == 12 * geo.planes * geo.num_layers
    assert tel.transfer_time_s >= tel.post_time_s >= 0 and tel.bytes_per_descriptor > 0


def test_direct_read_coalesces_contiguous_runs(owner: OwnerProcess, readers: ReaderPool) -> None:
    reader = readers.get(BASE)
    lids, rids = np.arange(4, 20), np.arange(10, 26)
    reader.poison()
    tel = reader.engine.read(reader.peer("fa_nhd"), lids, rids, path="direct").wait(10)
    check_read(reader, "fa_nhd", lids, rids, 16 * BASE.block_size)
    # one descriptor per (layer, plane) at most: 16 blocks merge into one run on both sides
    assert tel.descriptors <= BASE.num_layers * 2 < tel.pieces
    assert tel.bytes_per_descriptor >= 16 * BASE.piece_bytes


def test_partial_last_block_and_empty_read(owner: OwnerProcess, readers: ReaderPool) -> None:
    reader = readers.get(BASE)
    reader.poison()
    lids, rids = [3, 9, 1], [0, 31, 5]
    reader.engine.read(reader.peer("fa_nhd"), lids, rids, num_tokens=40, path="direct").wait(10)
    check_read(reader, "fa_nhd", lids, rids, 40)
    empty = reader.engine.read(reader.peer("fa_nhd"), [], [])
    assert empty.poll() is TransferState.DONE and empty.wait(1).bytes == 0


# ---------------------------------------------------------------------------------------------- packed
@pytest.mark.parametrize("name", ["fa_nhd", "fa_hnd", "fi_nhd", "fi_hnd", "mla"])
def test_packed_read_is_byte_exact(owner: OwnerProcess, readers: ReaderPool, name: str) -> None:
    geo = LAYOUTS[name]
    reader = readers.get(geo)
    rng = np.random.default_rng(seed_of(name) + 1)
    lids, rids = rng.permutation(geo.num_blocks)[:13], rng.permutation(geo.num_blocks)[:13]
    tokens = 12 * geo.block_size + 5  # the last block is partial
    reader.poison()
    handle = reader.engine.read(reader.peer(name), lids, rids, num_tokens=tokens, path="packed")
    tel = handle.wait(20)
    check_read(reader, name, lids, rids, tokens)
    untouched(reader, lids)
    assert tel.path == "packed" and tel.chunks == tel.descriptors > 1
    assert tel.bytes_per_descriptor <= CHUNK and tel.pieces == 13 * geo.planes * geo.num_layers
    assert reader.engine.stats()["staging_free"] == CONFIG["staging_chunks"]


MIXED = [
    # (owner cache, reader geometry, local head offset, remote head offset, heads moved)
    ("fa_nhd", replace(BASE, kind="flashinfer", order="HND", block_size=32, num_blocks=16), 0, 0, None),
    ("fa_hnd_bs32", replace(BASE, block_size=8, num_blocks=64), 0, 0, None),
    ("fi_hnd", replace(BASE, order="NHD", block_size=16), 0, 0, None),
    ("fa_nhd", replace(BASE, num_heads=2, order="HND"), 0, 2, None),  # TP2 reader of a TP1 owner
    ("fa_nhd_2heads", replace(BASE, num_heads=4), 2, 0, None),  # TP1 reader of one TP2 shard
    ("fa_hnd", replace(BASE, num_heads=4, block_size=32, num_blocks=16), 1, 2, 2),
]


@pytest.mark.parametrize("case", range(len(MIXED)))
def test_packed_read_between_different_layouts(owner: OwnerProcess, readers: ReaderPool,
                                               case: int) -> None:
    name, geo, local_off, remote_off, heads = MIXED[case]
    source = LAYOUTS[name]
    reader = readers.get(geo)
    rng = np.random.default_rng(case)
    tokens = 200
    lids = rng.permutation(geo.num_blocks)[: -(-tokens // geo.block_size)]
    rids = rng.permutation(source.num_blocks)[: -(-tokens // source.block_size)]
    reader.poison()
    handle = reader.engine.read(reader.peer(name), lids, rids, num_tokens=tokens, num_heads=heads,
                                local_head_offset=local_off, remote_head_offset=remote_off)
    tel = handle.wait(20)
    assert tel.path == "packed" and "differ" in tel.reason
    check_read(reader, name, lids, rids, tokens, local_head_offset=local_off, remote_head_offset=remote_off,
               heads=heads)


# --------------------------------------------------------------------------------------- path choice
def test_auto_path_follows_descriptor_size_and_layouts(owner: OwnerProcess,
                                                       readers: ReaderPool) -> None:
    reader = readers.get(BASE)
    peer = reader.peer("fa_nhd")
    big_geo = LAYOUTS["fa_nhd_big"]
    big = readers.get(big_geo)
    big_peer = big.peer("fa_nhd_big")
    saved = peer.path_model, big_peer.path_model
    # Fresh models: earlier tests' reads of these shapes were measured, and measurements override the prior.
    peer.path_model, big_peer.path_model = (PathModel(m.threshold_bytes) for m in saved)
    try:
        scattered = reader.engine.read(peer, [5, 1, 9, 3], [8, 2, 30, 17])
        assert scattered.path == "packed" and "< threshold" in scattered.wait(10).reason
        contiguous = reader.engine.read(peer, np.arange(16), np.arange(16, 32))
        assert contiguous.path == "direct" and "coalesce" in contiguous.wait(10).reason
        handle = big.engine.read(big_peer, [2, 0], [5, 7])
        assert handle.path == "direct" and ">= threshold" in handle.wait(10).reason
    finally:
        peer.path_model, big_peer.path_model = saved
    differing = reader.engine.read(reader.peer("fa_hnd"), [0, 1], [0, 1])
    assert differing.path == "packed" and "order" in differing.wait(10).reason
    with pytest.raises(IncompatiblePeerError, match="path='packed'") as info:
        reader.engine.read(reader.peer("fa_hnd"), [0, 1], [0, 1], path="direct")
    assert info.value.invalid_block_ids == (0, 1)


def test_owner_receives_completion_notifications(owner: OwnerProcess, readers: ReaderPool) -> None:
    reader = readers.get(BASE)
    owner.call("notifs")  # drain what earlier tests left
    direct = reader.engine.read(reader.peer("fa_nhd"), [1, 2], [3, 4], path="direct", notify=b"req-1")
    packed = reader.engine.read(reader.peer("fa_nhd"), [5, 6], [7, 8], path="packed", notify=b"req-2")
    direct.wait(10)
    packed.wait(10)
    got = owner.call("notifs", wait=5.0, at_least=2)[NAMES.index("fa_nhd")]
    assert {(tid, tag) for _, tid, tag in got} == {(direct.transfer_id, b"req-1"),
                                                   (packed.transfer_id, b"req-2")}
    assert {agent for agent, _, _ in got} == {reader.engine.name}


def test_no_handles_or_staging_left_after_reads(owner: OwnerProcess, readers: ReaderPool) -> None:
    assert list(readers), "the module's reads ran first"
    for reader in readers:
        stats = reader.engine.stats()
        assert stats["xfer_handles"] == stats["stuck_xfer_handles"] == stats["active_transfers"] == 0
        assert stats["staging_free"] == stats["staging_chunks"]
    for stats in owner.call("stats"):
        assert stats["xfer_handles"] == 0 and stats["owner_jobs"] == 0
        assert stats["staging_free"] == stats["staging_chunks"]


def test_bench_transfer_runs_and_verifies() -> None:
    """The benchmark's plumbing at a tiny size (the numbers themselves are not asserted)."""
    import argparse

    from kvshuttle.bench import transfer as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--shape", "qwen3-32b-tp8", "--layers", "1", "--blocks", "8", "--spare-blocks", "8",
                              "--repeat", "1", "--chunk-mib", "1"])
    result = bench.run(args)
    assert [r["pattern"] for r in result["results"]] == ["scattered", "contiguous"]
    for row in result["results"]:
        assert all(row["verified"].values()) and set(row["gbps"]) == {*bench.METHODS, "memcpy"}
    assert "layers scaled to 1" in result["note"] and bench.format_table(result)


def test_reads_feed_the_peers_path_model_and_auto_follows_it(owner: OwnerProcess, readers: ReaderPool) -> None:
    """Forced reads are measured into the peer's model; auto then takes the path the model says is faster,
    against the threshold's prior either way, and says so."""
    reader = readers.get(BASE)
    peer = reader.peer("fa_nhd")
    saved = peer.path_model
    peer.path_model = model = PathModel(saved.threshold_bytes, explore_every=0)
    try:
        lids, rids = [5, 1, 9, 3, 20, 11], [8, 2, 30, 17, 4, 25]  # scattered 4 KiB pieces: prior says packed
        per_run = float(BASE.piece_bytes)
        total = len(lids) * BASE.planes * BASE.num_layers * BASE.piece_bytes
        assert model.estimate("direct", per_run, total) is None
        reader.engine.read(peer, lids, rids, path="direct").wait(10)
        reader.engine.read(peer, lids, rids, path="packed").wait(10)
        direct, packed = model.estimate("direct", per_run, total), model.estimate("packed", per_run, total)
        assert direct is not None and packed is not None and direct > 0 and packed > 0
        for _ in range(10):  # direct now measures far faster
            model.record("direct", per_run, total, total / 1e12)
        handle = reader.engine.read(peer, lids, rids)
        assert handle.path == "direct" and "measured faster" in handle.wait(10).reason
        for _ in range(20):  # and now packed does
            model.record("packed", per_run, total, total / 1e14)
        handle = reader.engine.read(peer, lids, rids)
        assert handle.path == "packed" and "measured faster" in handle.wait(10).reason
        before = model.estimate("packed", per_run, total)
        reader.engine.read(peer, lids, rids, num_heads=2, path="packed").wait(10)  # unlike any auto read
        assert model.estimate("packed", per_run, total) == before
    finally:
        peer.path_model = saved
