"""Layer-by-layer direct reads (groundwork for layer-pipelined loads, issue 17).

First the split itself (``core.layers``) on real cache geometries: every byte of a read plan lands in exactly one
group, paired with the same remote byte, and no descriptor crosses a layer (vLLM 0.32 allocates every layer in one
buffer, so a contiguous read coalesces across layers and must be cut). Then real NIXL reads between processes,
waited for layer by layer, byte for byte against the owner's bytes, poisoned destinations and permuted ids, and
refusals: block-major caches, differing layouts, a dead owner.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from conftest import POISON, Geo, make_cache
from kvshuttle.core.layers import layer_spans, split_by_layer
from kvshuttle.core.plan import SideGeometry, plan_read
from kvshuttle.errors import LayoutError
from transfer_helpers import LocalReader, OwnerProcess, OwnerSpec, block_bytes, build_cache

GEOS = {
    "fa_nhd": Geo(kind="flash_attn", num_layers=4, num_blocks=16, block_size=16, num_heads=4, head_size=16),
    "cpu_lbhnc": Geo(kind="vllm_cpu_attn", layout="LBHNC", dtype="float32", num_layers=4, num_blocks=16,
                     block_size=16, num_heads=2, head_size=16),
    "fa032_lbnhc": Geo(kind="vllm_flash_attn", layout="LBNHC", dtype="float16", num_layers=3, num_blocks=16,
                       block_size=16, num_heads=4, head_size=16),
    "mla": Geo(kind="mla", num_layers=5, num_blocks=16, block_size=16, num_heads=1, head_size=32),
}
BLOCK_MAJOR = Geo(kind="vllm_cpu_attn", layout="BLHNC", dtype="float32", num_layers=4, num_blocks=16, block_size=16,
                  num_heads=2, head_size=16)
CONFIG = {"connect_timeout_s": 10.0}


def side_of(geo: Geo, seed: int) -> SideGeometry:
    return SideGeometry.from_cache(make_cache(np.random.default_rng(seed), geo).cache(), 0)


def remote_of(rows: np.ndarray[Any, Any], remote: np.ndarray[Any, Any], addr: int) -> int:
    """The remote byte an original plan pairs with local byte ``addr``."""
    k = int(np.searchsorted(rows[:, 0], addr, side="right")) - 1
    assert k >= 0 and addr < int(rows[k, 0] + rows[k, 1]), "a split row covers bytes the plan did not"
    return int(remote[k, 0]) + addr - int(rows[k, 0])


@pytest.mark.parametrize("name", list(GEOS))
@pytest.mark.parametrize("ids", ["all", "runs", "scattered"])
def test_split_covers_every_byte_once_and_never_crosses_a_layer(name: str, ids: str) -> None:
    geo = GEOS[name]
    local, remote = side_of(geo, 1), side_of(geo, 2)
    rng = np.random.default_rng(3)
    if ids == "all":  # one contiguous run: in a one-buffer cache every layer coalesces into few descriptors
        lids, rids = np.arange(geo.num_blocks), np.arange(geo.num_blocks)
    elif ids == "runs":
        lids, rids = np.arange(2, 12), rng.permutation(geo.num_blocks)[:10]
    else:
        lids, rids = rng.permutation(geo.num_blocks)[:7], rng.permutation(geo.num_blocks)[:7]
    plan = plan_read(local, lids, remote, rids)
    order = np.argsort(plan.local[:, 0])
    rows, paired = plan.local[order], plan.remote[order]
    starts, ends = layer_spans(local)
    num_layers = geo.num_layers
    for groups in sorted({1, 2, num_layers}):
        parts = split_by_layer(plan, local, groups)
        assert [list(layers) for layers, _ in parts] == [list(r) for r in _ranges(num_layers, groups)]
        assert sum(p.total_bytes for _, p in parts) == plan.total_bytes
        assert sum(p.num_pieces for _, p in parts) == plan.num_pieces
        covered = []
        for layers, part in parts:
            assert np.array_equal(part.local[:, 1], part.remote[:, 1])
            for (addr, length, _), (raddr, _, _) in zip(part.local.tolist(), part.remote.tolist(), strict=True):
                inside = [layer for layer in range(num_layers) if starts[layer] <= addr and addr + length <=
                          ends[layer]]
                assert len(inside) == 1 and inside[0] in layers, (name, groups, addr, length)
                assert raddr == remote_of(rows, paired, addr)
                covered.append((addr, length))
        covered.sort()
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(covered)), "bytes twice"
    if name == "cpu_lbhnc" and ids == "all":  # the case the cut exists for
        assert plan.num_descriptors < num_layers <= split_by_layer(plan, local, num_layers)[0][1].num_descriptors \
            * num_layers


def _ranges(num_layers: int, groups: int) -> list[range]:
    bounds = [round(g * num_layers / groups) for g in range(groups + 1)]
    return [range(bounds[g], bounds[g + 1]) for g in range(groups)]


def test_block_major_layers_and_bad_group_counts_are_refused() -> None:
    side = side_of(BLOCK_MAJOR, 1)
    plan = plan_read(side, np.arange(4), side_of(BLOCK_MAJOR, 2), np.arange(4))
    with pytest.raises(LayoutError, match="interleave"):
        split_by_layer(plan, side, 2)
    fa = side_of(GEOS["fa_nhd"], 1)
    fa_plan = plan_read(fa, np.arange(4), side_of(GEOS["fa_nhd"], 2), np.arange(4))
    for bad in (0, 5, True, 2.0, "2", None):
        with pytest.raises(LayoutError, match="groups"):
            split_by_layer(fa_plan, fa, bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- real NIXL reads
SERVED = {**GEOS, "block_major": BLOCK_MAJOR, "fa_hnd": GEOS["fa_nhd"].with_(order="HND")}
NAMES = list(SERVED)


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    pytest.importorskip("nixl._api")
    specs = [OwnerSpec(SERVED[name], 100 + k, CONFIG) for k, name in enumerate(NAMES)]
    with OwnerProcess(specs) as proc:
        yield proc


@pytest.fixture(scope="module")
def readers(owner: OwnerProcess) -> Iterator[dict[str, LocalReader]]:
    made = {name: LocalReader(SERVED[name], owner, CONFIG, names=NAMES) for name in ("block_major", *GEOS)}
    yield made
    for reader in made.values():
        reader.engine.close()


def layer_bytes(cache: Any, ids: Any, layer: int) -> Any:
    return block_bytes(cache, ids)[layer]


@pytest.mark.parametrize("name", list(GEOS))
def test_layers_land_byte_for_byte_and_are_waited_for_one_by_one(owner: OwnerProcess,
                                                                 readers: dict[str, LocalReader], name: str) -> None:
    reader, geo = readers[name], GEOS[name]
    source = build_cache(geo, 100 + NAMES.index(name))
    rng = np.random.default_rng(7)
    for groups in (None, 2):
        lids, rids = rng.permutation(geo.num_blocks)[:9], rng.permutation(geo.num_blocks)[:9]
        reader.poison()
        with reader.engine.read_layers(reader.peer(name), lids, rids, groups=groups) as transfer:
            assert len(transfer.groups) == (geo.num_layers if groups is None else 2)
            for layer in reversed(range(geo.num_layers)):  # any order: each waits for its own group only
                transfer.wait_layer(layer, timeout=10)
                assert np.array_equal(layer_bytes(reader.cache, lids, layer), layer_bytes(source, rids, layer))
            telemetry = transfer.wait(10)
            assert transfer.invalid_block_ids == ()
        assert telemetry.bytes == 9 * geo.planes * geo.num_layers * geo.piece_bytes
        others = np.setdiff1d(np.arange(geo.num_blocks), lids)
        assert (block_bytes(reader.cache, others) == POISON).all(), "a block outside the read was written"
    assert reader.engine.stats()["active_transfers"] == 0


def test_refusals_leave_the_cache_untouched(owner: OwnerProcess, readers: dict[str, LocalReader]) -> None:
    from kvshuttle.transfer import IncompatiblePeerError, PeerLostError, TransferArgumentError

    block_major = readers["block_major"]
    block_major.poison()
    with pytest.raises(IncompatiblePeerError, match="interleave"):
        block_major.engine.read_layers(block_major.peer("block_major"), [0, 1], [2, 3])
    assert all((raw == POISON).all() for raw in block_major.cache.raws)
    reader = readers["fa_nhd"]
    reader.poison()
    with pytest.raises(IncompatiblePeerError, match="identical block layouts"):
        reader.engine.read_layers(reader.peer("fa_hnd"), [0], [0])  # same model, tokens in another order
    for bad in ({"groups": 0}, {"groups": 5}, {"groups": True}, {"notify": "x"}):
        with pytest.raises(TransferArgumentError):
            reader.engine.read_layers(reader.peer("fa_nhd"), [0, 1], [0, 1], **bad)
    with pytest.raises(TransferArgumentError, match="layer must be"), \
            reader.engine.read_layers(reader.peer("fa_nhd"), [0], [0]) as transfer:
        transfer.wait_layer(4)
    reader.poison()
    with OwnerProcess([OwnerSpec(GEOS["fa_nhd"], 100, CONFIG)]) as doomed:
        peer = reader.engine.connect(doomed.addresses[0])
        doomed.kill()
        with pytest.raises(PeerLostError):  # seen at once on the side channel, or on the first wait
            reader.engine.read_layers(peer, [0, 1], [0, 1]).wait_layer(0, timeout=5)
    assert reader.engine.stats()["active_transfers"] == 0
