"""Read planning over vLLM 0.32 caches: whole pages (or their contiguous runs) as the direct read's pieces,
walk groups from the local addresses (a block of all layers is one run in the block-major layouts), the
fewest descriptors, the right bytes moved, and a named error when the two caches' pieces differ."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import VLLM_CASES, Geo, make_cache
from kvshuttle import LayoutError
from kvshuttle.core.arrays import host_bytes
from kvshuttle.core.pages import direct_difference, direct_pieces
from kvshuttle.core.plan import SideGeometry, plan_read
from test_plan import BACKENDS, PATTERNS, check_plan, id_pattern

CASE_IDS = [f"{k.removeprefix('vllm_')}-{lay}" for k, lay in VLLM_CASES]


def vgeo(kind: str, layout: str, **sizes: int) -> Geo:
    base = {"num_layers": 3, "num_blocks": 12, "block_size": 8, "num_heads": 4, "head_size": 6}
    return Geo(kind, "NHD", "float32", layout=layout, **{**base, **sizes})


def execute(plan, local, remote, lids, rids) -> None:
    """Run the plan with memmove and check every local block now holds its remote block, nothing else."""
    before = local.clone()
    for (la, n, _), (ra, _, _) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
        host_bytes(la, n)[:] = host_bytes(ra, n)
    others = np.setdiff1d(np.arange(local.geo.num_blocks), lids)
    for layer in range(local.geo.num_layers):
        got = local.canonical(layer)
        np.testing.assert_array_equal(got[:, lids], remote.canonical(layer)[:, rids])
        np.testing.assert_array_equal(got[:, others], before.canonical(layer)[:, others])


@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=CASE_IDS)
def test_pieces_and_walk_groups(rng, kind, layout):
    geo = vgeo(kind, layout)
    side = SideGeometry.from_cache(make_cache(rng, geo).cache())
    page = geo.num_heads * geo.block_size * 2 * geo.row_bytes
    if layout in ("LHBNC", "BHLNC"):  # a layer's page is split by other blocks / layers: one piece per head
        assert (side.planes_per_layer, side.piece_bytes) == (geo.num_heads, page // geo.num_heads)
    else:
        assert (side.planes_per_layer, side.piece_bytes) == (1, page)
    groups = side.walk_groups
    if layout.startswith("B"):  # every layer's part of block n lies in block n's stretch: one walk group
        assert groups.shape == (1, side.num_planes)
    else:
        assert groups.shape == (side.num_planes, 1)
    assert side.piece_format == direct_pieces(make_cache(rng, geo).cache().geometry).format


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=CASE_IDS)
def test_fewest_descriptors_move_the_right_bytes(rng, kind, layout, pattern, backend):
    geo = vgeo(kind, layout)
    local, remote = make_cache(rng, geo), make_cache(rng, geo.with_(num_blocks=15))
    lside = SideGeometry.from_cache(local.cache(), device_id=1)
    rside = SideGeometry.from_cache(remote.cache(), device_id=2)
    lids, rids = id_pattern(rng, pattern, 9, lside, rside)
    plan = plan_read(lside, lids, rside, rids, backend=backend)
    check_plan(plan, lside, lids, rside, rids)  # every piece once, the brute-force minimum of descriptors
    execute(plan, local, remote, lids, rids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["vllm_cpu_attn", "vllm_flash_attn"])
def test_block_major_block_is_one_descriptor(rng, kind, backend):
    """BLHNC: all layers' pages of a block are one run, so contiguous ids are one descriptor in all and
    scattered ids one per block; layer-major LBHNC needs one per layer and run."""
    blhnc, lbhnc = vgeo(kind, "BLHNC", num_layers=4), vgeo(kind, "LBHNC", num_layers=4)
    local, remote = make_cache(rng, blhnc), make_cache(rng, blhnc)
    lside, rside = (SideGeometry.from_cache(c.cache()) for c in (local, remote))
    run = np.arange(2, 10)
    plan = plan_read(lside, run, rside, run + 1, backend=backend)
    assert plan.num_descriptors == 1 and plan.total_bytes == 8 * 4 * lside.piece_bytes
    scattered_l, scattered_r = np.array([0, 3, 6, 9]), np.array([11, 1, 7, 4])
    assert plan_read(lside, scattered_l, rside, scattered_r, backend=backend).num_descriptors == 4
    layer_major = SideGeometry.from_cache(make_cache(rng, lbhnc).cache())
    assert plan_read(layer_major, run, layer_major, run, backend=backend).num_descriptors == 4
    # BLHNC and LBHNC pages hold the same rows: they read each other directly
    assert lside.piece_format == layer_major.piece_format
    mixed = make_cache(rng, lbhnc)
    plan = plan_read(SideGeometry.from_cache(mixed.cache()), scattered_l, rside, scattered_r, backend=backend)
    execute(plan, mixed, remote, scattered_l, scattered_r)


def test_descriptor_across_layers_stays_in_one_region(rng):
    """Layer-major views of one allocation: the last block of layer l and block 0 of layer l + 1 are adjacent,
    so a read of both coalesces across the layers; the cache registers the allocation as one region."""
    geo = vgeo("vllm_cpu_attn", "LBHNC", num_layers=2)
    local, remote = make_cache(rng, geo), make_cache(rng, geo)
    lside, rside = (SideGeometry.from_cache(c.cache()) for c in (local, remote))
    last = geo.num_blocks - 1
    plan = plan_read(lside, [last, 0], rside, [last, 0])
    (region,) = local.cache().regions()
    assert plan.num_descriptors == 3 and plan.local[:, 1].tolist() == [lside.piece_bytes, 2 * lside.piece_bytes,
                                                                         lside.piece_bytes]
    for start, n, _ in plan.local.tolist():
        assert region[0] <= start and start + n <= region[0] + region[1]
    execute(plan, local, remote, np.array([0, last]), np.array([0, last]))


@pytest.mark.parametrize(("a", "b"), [
    (("vllm_cpu_attn", "LBHNC"), ("vllm_flash_attn", "LBHNC")),  # same page size, rows elsewhere
    (("vllm_flash_attn", "LBHNC"), ("vllm_flash_attn", "LBNHC")),  # token order inside the page
    (("vllm_cpu_attn", "LBHNC"), ("flash_attn", "HND")),
    (("flash_attn", "NHD"), ("flash_attn", "HND")),
])
def test_pieces_that_hold_rows_differently_are_refused(rng, a, b):
    def side_of(spec):
        kind, how = spec
        geo = vgeo(kind, how) if kind.startswith("vllm") else Geo(kind, how, "float32", num_layers=3,
                                                                     num_blocks=12, block_size=8, num_heads=4,
                                                                     head_size=6)
        cache = make_cache(rng, geo).cache()
        return SideGeometry.from_cache(cache), cache.geometry

    (left, lg), (right, rg) = side_of(a), side_of(b)
    assert direct_difference(lg, rg) is not None and "differently" in direct_difference(lg, rg)
    with pytest.raises(LayoutError):
        plan_read(left, [0, 1], right, [2, 3])
    with pytest.raises(LayoutError):
        plan_read(right, [0, 1], left, [2, 3])


def test_dense_kinds_keep_reading_each_other(rng):
    """flash_attn and flashinfer pieces are the same dense NHD pieces: one format, direct reads still work."""
    fa, fi = (Geo(k, "NHD", "bf16", num_layers=2, num_blocks=10) for k in ("flash_attn", "flashinfer"))
    local, remote = make_cache(rng, fa), make_cache(rng, fi)
    lside, rside = SideGeometry.from_cache(local.cache()), SideGeometry.from_cache(remote.cache())
    assert lside.piece_format == rside.piece_format and direct_difference(local.cache().geometry,
                                                                           remote.cache().geometry) is None
    assert lside.piece_bytes == fa.piece_bytes and lside.plane_bases.tolist() == local.cache().plane_bases.tolist()
    lids, rids = np.array([1, 2, 3, 7]), np.array([9, 0, 4, 5])
    execute(plan_read(lside, lids, rside, rids), local, remote, lids, rids)
