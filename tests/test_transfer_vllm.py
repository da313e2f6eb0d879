"""Transfers of vLLM 0.32 caches between two real processes over NIXL (UCX, DRAM): the observed CPU geometry
(fp32, 8 KV heads, head 64, block 32, CPU_ATTN, one allocation viewed per layer) on both sides, read direct
(whole pages as descriptors) and packed; packed reads across kinds and block sizes (flash_attn <->
vllm_flash_attn); CPU_ATTN blocks (K column-major inside) move only whole, and transforms of them are refused."""

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
from transfer_helpers import OwnerProcess, OwnerSpec, ReaderPool, block_bytes, build_cache

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


VFA = replace(CPU, kind="vllm_flash_attn", layout="BLNHC")
ACROSS = [
    # (owner cache, reader geometry, local head offset, remote head offset, heads moved)
    ("fa_hnd", VFA, 0, 0, None),  # same sizes, another kind
    ("vfa_blnhc", replace(CPU, kind="flash_attn", order="NHD", block_size=16, num_blocks=24), 0, 0, None),
    ("fa_hnd", replace(VFA, num_heads=4), 0, 4, None),  # TP2 reader of a TP1 owner
    ("vfa_blnhc", replace(VFA, block_size=64, num_blocks=6), 0, 0, None),
    ("cpu", replace(CPU, num_heads=4), 0, 4, None),  # CPU_ATTN head slice: whole (block, head) regions
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


REFUSED = [
    ("fa_hnd", CPU),  # another kind into CPU_ATTN
    ("cpu", replace(CPU, kind="flash_attn", order="NHD", block_size=16, num_blocks=24)),  # CPU_ATTN out, re-chunked
    ("cpu", replace(CPU, block_size=64, num_blocks=6)),  # CPU_ATTN to CPU_ATTN of another block size
]


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_cpu_attn_blocks_are_never_transformed(owner, readers, case):
    """vLLM's CPU kernels store K column-major inside a block: re-chunking or re-laying its token rows would
    write wrong K (measured: a decode with 64-token blocks reading a prefill's 32-token blocks answered
    differently from local recompute). Refused before anything moves."""
    name, geo = REFUSED[case]
    reader = readers.get(geo)
    reader.poison()
    with pytest.raises(IncompatiblePeerError, match="column-major"):
        reader.engine.read(reader.peer(index(name)), list(range(128 // geo.block_size)),
                           list(range(128 // OWNERS[name].block_size)), num_tokens=128, path="packed")
    assert all((raw == 0xA5).all() for raw in reader.cache.raws)


def test_cpu_attn_partial_last_block_moves_whole(owner, readers):
    """A CPU_ATTN block's K columns interleave every token: the last, partial block is copied whole."""
    reader = readers.get(CPU)
    lids, rids = np.array([3, 7, 1]), np.array([9, 2, 5])
    reader.poison()
    handle = reader.engine.read(reader.peer(index("cpu")), lids, rids, num_tokens=2 * 32 + 5, path="packed")
    handle.wait(30)
    assert np.array_equal(block_bytes(reader.cache, lids), block_bytes(source("cpu"), rids))


def test_nothing_left_after_reads(owner, readers):
    for reader in readers:
        stats = reader.engine.stats()
        assert stats["xfer_handles"] == stats["stuck_xfer_handles"] == stats["active_transfers"] == 0
        assert stats["staging_free"] == stats["staging_chunks"]
    for stats in owner.call("stats"):
        assert stats["xfer_handles"] == 0 and stats["owner_jobs"] == 0
