"""Transfers of vLLM 0.32 caches between two real processes over NIXL (UCX, DRAM): the observed CPU geometry
(fp32, 8 KV heads, head 64, block 32, CPU_ATTN, one allocation viewed per layer) on both sides, read direct
(whole pages as descriptors) and packed, and packed reads across kinds (vllm_cpu_attn <-> flash_attn)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("nixl._api")
pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from conftest import Geo
from kvshuttle import LayoutError
from kvshuttle.transfer import IncompatiblePeerError, TransferState
from transfer_helpers import OwnerProcess, OwnerSpec, ReaderPool, build_cache

CPU = Geo("vllm_cpu_attn", dtype="float32", num_layers=2, num_blocks=12, block_size=32, num_heads=8, head_size=64,
          layout="LBHNC")  # 128 KiB pages
PAGE = CPU.num_heads * CPU.block_size * 2 * CPU.row_bytes
CONFIG = {"staging_chunk_bytes": 4 * CPU.num_layers * PAGE, "staging_chunks": 4, "connect_timeout_s": 10.0}
OWNERS = {
    "cpu": CPU,
    "cpu_blhnc": replace(CPU, layout="BLHNC"),
    "fa_hnd": replace(CPU, kind="flash_attn", order="HND"),  # vLLM before 0.32, same sizes
    "vfa_blnhc": replace(CPU, kind="vllm_flash_attn", layout="BLNHC"),
}
NAMES = list(OWNERS)


def index(name: str) -> int:
    return NAMES.index(name)


def source(name: str):
    return build_cache(OWNERS[name], 500 + index(name))


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    specs = [OwnerSpec(OWNERS[name], 500 + index(name), CONFIG) for name in NAMES]
    with OwnerProcess(specs) as proc:
        yield proc


@pytest.fixture(scope="module")
def readers(owner: OwnerProcess) -> Iterator[ReaderPool]:
    pool = ReaderPool(owner, CONFIG, NAMES)
    yield pool
    pool.close()


# ---------------------------------------------------------------------------------------------- direct
@pytest.mark.parametrize("mode", ["initialize", "prepped"])
@pytest.mark.parametrize(("name", "layout"), [("cpu", "LBHNC"), ("cpu_blhnc", "LBHNC"), ("cpu", "BLHNC"),
                                              ("vfa_blnhc", "BLNHC")])
def test_direct_read_of_pages_is_byte_exact(owner, readers, name, layout, mode):
    """Whole pages move as they lie; the ids include the last and the first block, whose pages of two
    adjacent layers coalesce into one descriptor inside the one registered allocation."""
    geo = replace(OWNERS[name], layout=layout)
    reader = readers.get(geo, direct_mode=mode)
    rng = np.random.default_rng(len(layout) + index(name))
    last = geo.num_blocks - 1
    lids = np.concatenate([[last, 0], rng.permutation(np.arange(1, last))[:7]])
    rids = np.concatenate([[last, 0], rng.permutation(np.arange(1, last))[:7]])
    reader.poison()
    handle = reader.engine.read(reader.peer(index(name)), lids, rids, path="direct")
    tel = handle.wait(20)
    assert handle.state is TransferState.DONE and tel.path == "direct"
    reader.check_tokens(source(name), lids, rids, 9 * geo.block_size)
    assert tel.bytes == 9 * geo.num_layers * PAGE
    assert 1 <= tel.descriptors <= tel.pieces == 9 * geo.num_layers  # one piece per page


def test_block_major_read_is_one_descriptor(owner, readers):
    geo = OWNERS["cpu_blhnc"]
    reader = readers.get(geo)
    lids, rids = np.arange(2, 10), np.arange(3, 11)
    reader.poison()
    tel = reader.engine.read(reader.peer(index("cpu_blhnc")), lids, rids, path="direct").wait(20)
    reader.check_tokens(source("cpu_blhnc"), lids, rids, 8 * geo.block_size)
    assert tel.descriptors == 1 and tel.bytes_per_descriptor == 8 * geo.num_layers * PAGE


def test_auto_reads_big_pages_direct(owner, readers):
    reader = readers.get(CPU)
    reader.poison()
    handle = reader.engine.read(reader.peer(index("cpu")), [5, 1], [2, 9])
    assert handle.path == "direct" and ">= threshold" in handle.wait(20).reason
    reader.check_tokens(source("cpu"), [5, 1], [2, 9], 2 * CPU.block_size)


def test_direct_read_between_different_pages_is_refused(owner, readers):
    """vllm_cpu_attn and flash_attn HND blocks hold the same tokens in other places: never copied as bytes."""
    reader = readers.get(CPU)
    reader.poison()
    with pytest.raises((LayoutError, IncompatiblePeerError)):
        reader.engine.read(reader.peer(index("fa_hnd")), [0, 1], [0, 1], path="direct")
    assert (reader.cache.raws[0] == 0xA5).all()


# ---------------------------------------------------------------------------------------------- packed
@pytest.mark.parametrize("name", ["cpu", "cpu_blhnc", "vfa_blnhc"])
def test_packed_read_is_byte_exact(owner, readers, name):
    geo = OWNERS[name]
    reader = readers.get(geo)
    rng = np.random.default_rng(index(name) + 40)
    lids, rids = rng.permutation(geo.num_blocks)[:9], rng.permutation(geo.num_blocks)[:9]
    tokens = 8 * geo.block_size + 7  # the last block is partial
    reader.poison()
    handle = reader.engine.read(reader.peer(index(name)), lids, rids, num_tokens=tokens, path="packed")
    tel = handle.wait(30)
    reader.check_tokens(source(name), lids, rids, tokens)
    assert tel.path == "packed" and tel.chunks > 1
    assert reader.engine.stats()["staging_free"] == CONFIG["staging_chunks"]


ACROSS = [
    # (owner cache, reader geometry, local head offset, remote head offset, heads moved)
    ("cpu", replace(CPU, kind="flash_attn", order="HND"), 0, 0, None),  # same sizes, another kind
    ("cpu", replace(CPU, kind="flash_attn", order="NHD", block_size=16, num_blocks=24), 0, 0, None),
    ("fa_hnd", CPU, 0, 0, None),
    ("fa_hnd", replace(CPU, layout="BLHNC", num_heads=4), 0, 4, None),  # TP2 reader of a TP1 owner
    ("vfa_blnhc", replace(CPU, block_size=64, num_blocks=6), 0, 0, None),
]


@pytest.mark.parametrize("case", range(len(ACROSS)))
def test_packed_read_across_kinds(owner, readers, case):
    name, geo, local_off, remote_off, heads = ACROSS[case]
    reader = readers.get(geo)
    rng = np.random.default_rng(case)
    tokens = 5 * 32 + 11
    src = OWNERS[name]
    lids = rng.permutation(geo.num_blocks)[: -(-tokens // geo.block_size)]
    rids = rng.permutation(src.num_blocks)[: -(-tokens // src.block_size)]
    reader.poison()
    handle = reader.engine.read(reader.peer(index(name)), lids, rids, num_tokens=tokens, path="packed",
                                num_heads=heads, local_head_offset=local_off, remote_head_offset=remote_off)
    tel = handle.wait(30)
    assert tel.path == "packed"
    reader.check_tokens(source(name), lids, rids, tokens, local_head_offset=local_off,
                        remote_head_offset=remote_off, heads=heads)


def test_nothing_left_after_reads(owner, readers):
    for reader in readers:
        stats = reader.engine.stats()
        assert stats["xfer_handles"] == stats["stuck_xfer_handles"] == stats["active_transfers"] == 0
        assert stats["staging_free"] == stats["staging_chunks"]
    for stats in owner.call("stats"):
        assert stats["xfer_handles"] == 0 and stats["owner_jobs"] == 0
