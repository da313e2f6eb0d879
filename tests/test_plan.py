"""Read planning: descriptor arrays cover exactly the right piece pairs, in the fewest descriptors possible,
identically from the native planner and the numpy reference; bad input raises named errors.

"Fewest possible" is computed here by brute force, independently of the planner: sort every
(local address, remote address) piece pair by local address and count the places where either side does
not continue the previous piece.
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import msgpack
import numpy as np
import pytest

from conftest import KINDS, ORDERS, Geo, canonical_bytes, make_cache, random_ids
from kvshuttle import BackendError, BlockIdError, KVShuttleError, LayoutError
from kvshuttle.core import plan as kv_plan
from kvshuttle.core.arrays import host_bytes
from kvshuttle.core.plan import ReadPlan, SideGeometry, plan_read

needs_native = pytest.mark.skipif(not kv_plan.native_available(), reason="native planner not built")
BACKENDS = [pytest.param("native", marks=needs_native), "reference"]
Pairs = list[tuple[int, int]]


# ------------------------------------------------------------------------------------ synthetic geometry
def make_side(rng: np.random.Generator, kind: str, layers: int, blocks: int, piece: int, *, pad: int = 0,
              gaps: bool = True, shuffle: bool = True, v_first: bool = False, base: int = 1 << 32,
              device: int = 0) -> SideGeometry:
    """Fake addresses laid out like vLLM's caches: FA keeps K and V as separate regions per layer,
    FlashInfer interleaves them inside each block, MLA has one plane. ``pad`` bytes follow every block
    (a non-dense layout); layers sit in random memory order with random gaps unless told otherwise."""
    planes = 1 if kind == "mla" else 2
    if kind == "flashinfer":
        stride, offsets = planes * piece + pad, [piece, 0] if v_first else [0, piece]
        layer_bytes = blocks * stride
    else:
        stride = piece + pad
        offsets = [p * blocks * stride for p in range(planes)]
        layer_bytes = planes * blocks * stride
    order = rng.permutation(layers) if shuffle else np.arange(layers)
    starts, at = [0] * layers, base
    for layer in order:
        starts[layer] = at
        at += layer_bytes + (int(rng.integers(0, 4)) * 64 if gaps else 0)
    bases = [starts[layer] + off for layer in range(layers) for off in offsets]
    return SideGeometry(np.array(bases, dtype=np.uint64), planes, stride, piece, blocks, device)


def run_ids(rng: np.random.Generator, count: int, local_blocks: int, remote_blocks: int,
            max_run: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` id pairs made of runs of 1..max_run ids consecutive on both sides, placed in random order
    with random gaps on each side, then shuffled pair-wise (the planner must not depend on input order)."""
    lengths: list[int] = []
    while sum(lengths) < count:
        lengths.append(min(int(rng.integers(1, max_run + 1)), count - sum(lengths)))

    def place(blocks: int) -> list[int]:
        spare = blocks - count
        cuts = np.sort(rng.integers(0, spare + 1, size=len(lengths)))
        gaps = np.diff(np.concatenate([[0], cuts]))
        starts, at = [0] * len(lengths), 0
        for run, gap in zip(rng.permutation(len(lengths)), gaps, strict=True):
            at += int(gap)
            starts[run] = at
            at += lengths[run]
        return [s + k for s, n in zip(starts, lengths, strict=True) for k in range(n)]

    local, remote = np.array(place(local_blocks)), np.array(place(remote_blocks))
    order = rng.permutation(count)
    return local[order], remote[order]


def id_pattern(rng: np.random.Generator, pattern: str, count: int, local: SideGeometry,
               remote: SideGeometry) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "contiguous":
        lo = int(rng.integers(0, local.num_blocks - count + 1))
        ro = int(rng.integers(0, remote.num_blocks - count + 1))
        return np.arange(lo, lo + count), np.arange(ro, ro + count)
    if pattern == "permuted":
        return random_ids(rng, local.num_blocks, count), random_ids(rng, remote.num_blocks, count)
    max_run = {"short_runs": 3, "long_runs": 12, "mixed_runs": count}[pattern]
    return run_ids(rng, count, local.num_blocks, remote.num_blocks, max_run)


# ----------------------------------------------------------------------------------------- the oracles
def piece_pairs(local: SideGeometry, lids: Any, remote: SideGeometry, rids: Any) -> Pairs:
    lb, rb = local.plane_bases.tolist(), remote.plane_bases.tolist()
    return [(lb[p] + int(li) * local.block_stride, rb[p] + int(ri) * remote.block_stride)
            for p in range(local.num_planes) for li, ri in zip(lids, rids, strict=True)]


def min_descriptors(pairs: Pairs, piece: int) -> int:
    ordered = sorted(pairs)
    breaks = sum(c != a + piece or d != b + piece for (a, b), (c, d) in pairwise(ordered))
    return len(ordered) and 1 + breaks


def expand(plan: ReadPlan, piece: int) -> Pairs:
    """The piece pairs the descriptors move, one per piece of each descriptor."""
    pairs: Pairs = []
    for (la, ln, _), (ra, rn, _) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
        assert ln == rn and ln > 0 and ln % piece == 0, (ln, rn)
        pairs += [(la + k * piece, ra + k * piece) for k in range(ln // piece)]
    return pairs


def check_plan(plan: ReadPlan, local: SideGeometry, lids: Any, remote: SideGeometry, rids: Any) -> None:
    """Shape, dtype, devices, coverage (every pair once) and minimality against the brute force."""
    for rows in (plan.local, plan.remote):
        assert rows.dtype == np.uint64 and rows.ndim == 2 and rows.shape[1] == 3
    assert np.all(plan.local[:, 2] == local.device_id) and np.all(plan.remote[:, 2] == remote.device_id)
    want = piece_pairs(local, lids, remote, rids)
    assert sorted(expand(plan, local.piece_bytes)) == sorted(want)
    assert plan.num_descriptors == min_descriptors(want, local.piece_bytes)
    assert plan.num_pieces == len(want)
    assert plan.total_bytes == len(want) * local.piece_bytes


# ------------------------------------------------------------------------------------- minimal coverage
PATTERNS = ["contiguous", "permuted", "short_runs", "long_runs", "mixed_runs"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("kind", KINDS)
def test_fewest_descriptors_cover_every_piece(rng, kind, pattern, backend):
    for gaps, shuffle in [(False, False), (True, True), (False, True)]:
        layers, blocks = int(rng.integers(1, 5)), int(rng.integers(24, 64))
        piece = 64 * int(rng.integers(1, 5))
        local = make_side(rng, kind, layers, blocks, piece, gaps=gaps, shuffle=shuffle)
        remote = make_side(rng, kind, layers, blocks + int(rng.integers(0, 9)), piece, gaps=gaps,
                           shuffle=shuffle, base=1 << 40, device=3)
        lids, rids = id_pattern(rng, pattern, int(rng.integers(1, blocks - 4)), local, remote)
        check_plan(plan_read(local, lids, remote, rids, backend=backend), local, lids, remote, rids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_and_padded_layouts_are_still_minimal(rng, backend):
    """Local FlashAttention reading remote FlashInfer (and back), V before K, padding after blocks."""
    for _ in range(30):
        kinds = [str(k) for k in rng.choice(["flash_attn", "flashinfer"], size=2)]
        layers, blocks = int(rng.integers(1, 4)), int(rng.integers(8, 40))
        piece = 32 * int(rng.integers(1, 4))
        sides = [make_side(rng, k, layers, blocks, piece, pad=int(rng.choice([0, 0, 32])),
                           v_first=bool(rng.integers(0, 2)), gaps=bool(rng.integers(0, 2)),
                           base=(1 << 36) * (i + 1), device=i) for i, k in enumerate(kinds)]
        pattern = str(rng.choice(PATTERNS))
        lids, rids = id_pattern(rng, pattern, int(rng.integers(1, blocks)), sides[0], sides[1])
        plan = plan_read(sides[0], lids, sides[1], rids, backend=backend)
        check_plan(plan, sides[0], lids, sides[1], rids)


@needs_native
def test_native_and_reference_write_identical_arrays(rng):
    for _ in range(150):
        kind = str(rng.choice(KINDS))
        layers, blocks = int(rng.integers(1, 6)), int(rng.integers(2, 80))
        piece = 16 * int(rng.integers(1, 9))
        high = bool(rng.integers(0, 2))  # addresses above 2**63 as well
        local = make_side(rng, kind, layers, blocks, piece, pad=int(rng.choice([0, 0, 16])),
                          v_first=bool(rng.integers(0, 2)), gaps=bool(rng.integers(0, 2)),
                          base=(1 << 63) + (1 << 20) if high else 4096, device=int(rng.integers(0, 8)))
        remote = make_side(rng, kind, layers, int(rng.integers(blocks, blocks + 9)), piece,
                           pad=int(rng.choice([0, 0, 16])), gaps=bool(rng.integers(0, 2)),
                           base=1 << 44, device=int(rng.integers(0, 8)))
        count = int(rng.integers(0, blocks + 1))
        lids, rids = id_pattern(rng, str(rng.choice(PATTERNS)), count, local, remote)
        native = plan_read(local, lids, remote, rids, backend="native")
        ref = plan_read(local, lids, remote, rids, backend="reference")
        for got, want in [(native.local, ref.local), (native.remote, ref.remote)]:
            assert got.dtype == want.dtype == np.uint64 and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------- known counts
QWEN_LAYERS, QWEN_BLOCKS, QWEN_PIECE, QWEN_READ = 64, 4096, 32 * 1024, 1536


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen3_32b_shape_counts(rng, backend):
    """24k tokens of Qwen3-32B, FA layout: 196,608 pieces; 128 descriptors when the ids are one run."""
    local = make_side(rng, "flash_attn", QWEN_LAYERS, QWEN_BLOCKS, QWEN_PIECE, base=1 << 40)
    remote = make_side(rng, "flash_attn", QWEN_LAYERS, QWEN_BLOCKS, QWEN_PIECE, base=1 << 46, device=1)
    lids, rids = np.arange(100, 100 + QWEN_READ), np.arange(7, 7 + QWEN_READ)
    plan = plan_read(local, lids, remote, rids, backend=backend)
    assert plan.num_pieces == 196_608 and plan.num_descriptors == 128
    assert np.all(plan.local[:, 1] == QWEN_READ * QWEN_PIECE)
    assert plan.bytes_per_descriptor == QWEN_READ * QWEN_PIECE
    spaced = np.arange(0, 2 * QWEN_READ, 2)  # no two local ids adjacent: nothing can merge
    plan = plan_read(local, rng.permutation(spaced), remote, rng.permutation(QWEN_BLOCKS)[:QWEN_READ],
                     backend=backend)
    assert plan.num_descriptors == 196_608 and plan.bytes_per_descriptor == QWEN_PIECE


@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_back_to_back_caches_are_one_descriptor(rng, backend):
    for kind in KINDS:
        local = make_side(rng, kind, 3, 16, 128, gaps=False, shuffle=False)
        remote = make_side(rng, kind, 3, 16, 128, gaps=False, shuffle=False, base=1 << 40)
        ids = np.arange(16)
        assert plan_read(local, ids, remote, ids, backend=backend).num_descriptors == 1
        if kind == "flash_attn":  # read into the other region order: K, V regions no longer follow
            assert plan_read(local, ids, remote, ids[::-1], backend=backend).num_descriptors == 6 * 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_flashinfer_merges_k_v_and_blocks(rng, backend):
    local = make_side(rng, "flashinfer", 4, 32, 256)
    remote = make_side(rng, "flashinfer", 4, 40, 256, base=1 << 40)
    plan = plan_read(local, np.arange(5, 25), remote, np.arange(12, 32), backend=backend)
    assert plan.num_descriptors == 4 and np.all(plan.local[:, 1] == 20 * 2 * 256)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pair_order_does_not_change_the_plan(rng, backend):
    local = make_side(rng, "flash_attn", 3, 64, 128)
    remote = make_side(rng, "flash_attn", 3, 64, 128, base=1 << 40)
    lids, rids = run_ids(rng, 40, 64, 64, 6)
    first = plan_read(local, lids, remote, rids, backend=backend)
    order = rng.permutation(40)
    again = plan_read(local, list(lids[order]), remote, rids[order].astype(np.int32), backend=backend)
    np.testing.assert_array_equal(first.local, again.local)
    np.testing.assert_array_equal(first.remote, again.remote)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_read(rng, backend):
    side = make_side(rng, "mla", 2, 8, 64)
    plan = plan_read(side, [], side, np.array([], dtype=np.int32), backend=backend)
    assert plan.local.shape == plan.remote.shape == (0, 3) and plan.local.dtype == np.uint64
    counts = (plan.num_pieces, plan.num_descriptors, plan.total_bytes, plan.bytes_per_descriptor)
    assert counts == (0, 0, 0, 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_remote_ids_may_repeat(rng, backend):
    side = make_side(rng, "flash_attn", 2, 8, 64)
    lids, rids = [1, 2, 3], [5, 5, 5]
    check_plan(plan_read(side, lids, side, rids, backend=backend), side, lids, side, rids)


# ------------------------------------------------------------------------------------ real caches
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_descriptors_move_the_right_bytes_between_real_caches(rng, kind, order, backend):
    """Execute the plan with memmove on two host caches: every local block gets its remote block."""
    geo = Geo(kind, order, "float16", num_layers=3, num_blocks=12, block_size=4, num_heads=2, head_size=8)
    local, remote = make_cache(rng, geo), make_cache(rng, geo.with_(num_blocks=15))
    local_side = SideGeometry.from_cache(local.cache(), device_id=2)
    remote_side = SideGeometry.from_cache(remote.cache())
    np.testing.assert_array_equal(local_side.plane_bases, local.cache().plane_bases)
    assert (local_side.block_stride, local_side.piece_bytes) == (local.cache().geometry.block_stride,
                                                               geo.piece_bytes)
    lids, rids = run_ids(rng, 9, 12, 15, 4)
    plan = plan_read(local_side, lids, remote_side, rids, backend=backend)
    check_plan(plan, local_side, lids, remote_side, rids)
    before = local.snapshot()
    for (la, n, _), (ra, _, _) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
        host_bytes(la, n)[:] = host_bytes(ra, n)
    untouched = np.setdiff1d(np.arange(12), lids)
    for layer in range(geo.num_layers):
        got = local.canonical(layer)
        np.testing.assert_array_equal(got[:, lids], remote.canonical(layer)[:, rids])
        np.testing.assert_array_equal(got[:, untouched], canonical_bytes(before[layer], geo)[:, untouched])


def test_enumeration_order_follows_local_addresses(rng):
    fa = make_side(rng, "flash_attn", 3, 8, 64, shuffle=True)
    units = fa.walk_groups
    assert units.shape == (6, 1) and np.all(np.diff(fa.plane_bases[units[:, 0]].astype(np.int64)) > 0)
    fi = make_side(rng, "flashinfer", 3, 8, 64, v_first=True, shuffle=False)
    np.testing.assert_array_equal(fi.walk_groups, [[1, 0], [3, 2], [5, 4]])
    assert make_side(rng, "mla", 2, 8, 64).walk_groups.shape == (2, 1)


# ----------------------------------------------------------------------------------------- the wire
def test_wire_round_trip_through_msgpack_and_json(rng):
    side = make_side(rng, "flashinfer", 3, 8, 64, base=(1 << 63) + 4096, device=5)
    side = SideGeometry(side.plane_bases, side.planes_per_layer, side.block_stride, side.piece_bytes,
                        side.num_blocks, side.device_id, "f0rmat")
    wire = side.to_wire()
    assert all(isinstance(v, int) for k, v in wire.items() if k not in ("plane_bases", "piece_format"))
    assert wire["piece_format"] == "f0rmat"
    for codec in (lambda d: msgpack.unpackb(msgpack.packb(d)), lambda d: json.loads(json.dumps(d))):
        back = SideGeometry.from_wire(codec(wire))
        assert back == side and hash(back) == hash(side)
        np.testing.assert_array_equal(back.walk_groups, side.walk_groups)
    assert SideGeometry.from_wire({**wire, "device_id": 6}) != side
    assert SideGeometry.from_wire({**wire, "piece_format": "other"}) != side
    assert SideGeometry.from_wire({k: v for k, v in wire.items() if k != "piece_format"}).piece_format == ""


def test_plane_bases_are_a_private_read_only_copy():
    bases = np.array([4096, 8192], dtype=np.uint64)
    side = SideGeometry(bases, 2, 128, 64, 4)
    bases[0] = 0
    assert side.plane_bases[0] == 4096 and not side.plane_bases.flags.writeable


@pytest.mark.parametrize("wire, fragment", [
    ({"planes_per_layer": 2}, "lacks"),
    ({"plane_bases": [4096, -1]}, "non-negative"),
    ({"plane_bases": [[4096, 8192]]}, "1-D"),
    ({"plane_bases": [4096.0, 8192.0]}, "integers"),
    ({"plane_bases": ["a", "b"]}, "integers"),
    ({"plane_bases": [2**64, 0]}, "64-bit"),
    ({"plane_bases": []}, "whole layers"),
    ({"plane_bases": [4096, 8192, 12288]}, "whole layers"),
    ({"planes_per_layer": 0}, "whole layers"),
    ({"piece_bytes": 0}, "piece_bytes > 0"),
    ({"num_blocks": 0}, "num_blocks > 0"),
    ({"block_stride": -64}, "block_stride >= 0"),
    ({"device_id": -1}, "device_id >= 0"),
    ({"block_stride": 32}, "blocks overlap"),
    ({"num_blocks": 2.0}, "integer"),
    ({"device_id": True}, "integer"),
    ({"piece_format": 5}, "piece_format"),
    ({"piece_format": "x" * 65}, "piece_format"),
    ({"plane_bases": [2**64 - 8192, 2**64 - 256]}, "64-bit address space"),
])
def test_bad_geometry_is_a_layout_error(wire, fragment):
    good = {"plane_bases": [4096, 4096 + 64 * 8], "planes_per_layer": 2, "block_stride": 64,
            "piece_bytes": 64, "num_blocks": 8, "device_id": 0}
    bad = {k: v for k, v in {**good, **wire}.items() if not (fragment == "lacks" and k == "num_blocks")}
    with pytest.raises(LayoutError, match=fragment):
        SideGeometry.from_wire(bad)


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_reads_raise_named_errors(rng, backend):
    side = make_side(rng, "flash_attn", 2, 8, 64)
    cases: list[tuple[type[KVShuttleError], str, Any, Any, Any]] = [
        (LayoutError, "piece_bytes", make_side(rng, "flash_attn", 2, 8, 128), [0], [0]),
        (LayoutError, "planes", make_side(rng, "flash_attn", 3, 8, 64), [0], [0]),
        (LayoutError, "planes_per_layer", make_side(rng, "mla", 4, 8, 64), [0], [0]),
        (BlockIdError, "2 local block ids but 1", side, [0, 1], [0]),
        (BlockIdError, "local block id 8 is outside", side, [8], [0]),
        (BlockIdError, "local block id -1 is outside", side, [-1], [0]),
        (BlockIdError, "remote block id 9 is outside", side, [0], [9]),
        (BlockIdError, "local block id 3 appears more than once", side, [3, 1, 3], [0, 1, 2]),
        (BlockIdError, "1-D sequence of integers", side, [[0]], [[0]]),
        (BlockIdError, "1-D sequence of integers", side, [0.0], [0]),
        (BlockIdError, "not a block id", side, np.array([2**64 - 1], dtype=np.uint64), [0]),
        (BlockIdError, "remote block id 8 is outside", side, [2, 1], [8, 0]),  # unsorted: checked after
    ]
    for exc, fragment, remote, lids, rids in cases:
        with pytest.raises(exc, match=fragment):
            plan_read(side, lids, remote, rids, backend=backend)
    with pytest.raises(LayoutError, match="SideGeometry"):
        plan_read(side, [0], side.to_wire(), [0], backend=backend)  # type: ignore[arg-type]


def test_overlapping_local_pieces_have_no_order_to_plan(rng):
    shared = SideGeometry([4096, 4096 + 64], 1, 64, 64, 4)  # plane 1 starts inside plane 0's block 1
    ok = make_side(rng, "mla", 2, 4, 64)
    with pytest.raises(LayoutError, match="overlap or interleave"):
        plan_read(shared, [0], ok, [0])
    plan_read(ok, [0], shared, [0])  # the remote side only supplies addresses


def test_unknown_backend_and_missing_native(rng, monkeypatch):
    side = make_side(rng, "mla", 1, 4, 64)
    with pytest.raises(BackendError, match="backend must be"):
        plan_read(side, [0], side, [0], backend="gpu")  # type: ignore[arg-type]
    monkeypatch.setattr(kv_plan.native, "ext", None)
    with pytest.raises(BackendError, match="not built"):
        plan_read(side, [0], side, [0], backend="native")
    assert plan_read(side, [0, 1], side, [2, 3]).num_descriptors == 1  # auto falls back to the reference


# ------------------------------------------------------------------------------- native entry point
@needs_native
def test_native_entry_point_guards_its_memory_accesses(rng):
    native = kv_plan.native.ext
    side = make_side(rng, "flash_attn", 1, 4, 64)
    spec = native.ReadPlanSpec()
    spec.num_walk_groups, spec.planes_per_walk_group, spec.piece_bytes = 2, 1, 64
    spec.local_block_stride = spec.remote_block_stride = 64
    ids, bases, units = np.array([0, 1], dtype=np.int64), side.plane_bases, np.array([0, 1])
    for bad_units, exc_text in [(np.array([0, 2]), "outside the base tables"), (np.array([-1, 0]), "outside"),
                                (np.array([0]), "expected num_walk_groups")]:
        with pytest.raises(LayoutError, match=exc_text):
            native.plan_read_descriptors(spec, bad_units, bases, ids, bases, ids, 4, 4)
    with pytest.raises(BlockIdError, match="differ in length"):
        native.plan_read_descriptors(spec, units, bases, ids, bases, ids[:1], 4, 4)
    assert native.plan_read_descriptors(spec, units, bases, ids, bases, ids, 4, 4) is not None
    for lids, rids in [([1, 0], [0, 1]), ([1, 1], [0, 1]), ([0, 4], [0, 1]), ([-1, 0], [0, 1]),
                       ([0, 1], [0, 4]), ([0, 1], [-1, 0])]:  # unsorted, repeated, out of range
        got = native.plan_read_descriptors(spec, units, bases, np.array(lids), bases, np.array(rids), 4, 4)
        assert got is None, (lids, rids)
    spec.piece_bytes = 0
    with pytest.raises(LayoutError, match="piece_bytes > 0"):
        native.plan_read_descriptors(spec, units, bases, ids, bases, ids, 4, 4)


@needs_native
def test_large_plans_own_their_rows(rng):
    """Big row arrays come from a buffer cache: a live plan must never share memory with a later one."""
    local = make_side(rng, "flash_attn", 8, 4096, 256)
    remote = make_side(rng, "flash_attn", 8, 4096, 256, base=1 << 40)
    plans, copies = [], []
    for _ in range(4):
        lids, rids = random_ids(rng, 4096, 4000), random_ids(rng, 4096, 4000)  # >= 1 MiB of rows
        plan = plan_read(local, lids, remote, rids, backend="native")
        plans.append(plan)
        copies.append((plan.local.copy(), plan.remote.copy()))
    for i, plan in enumerate(plans):
        for j in range(i):
            assert not np.shares_memory(plan.local, plans[j].local)
            assert not np.shares_memory(plan.local, plans[j].remote)
    del plans[1:3]
    for _ in range(3):
        plan_read(local, random_ids(rng, 4096, 4000), remote, random_ids(rng, 4096, 4000), backend="native")
    for plan, (lrows, rrows) in zip(plans, [copies[0], copies[3]], strict=True):
        np.testing.assert_array_equal(plan.local, lrows)
        np.testing.assert_array_equal(plan.remote, rrows)
        plan.local[0, 0] += 1  # plain writable numpy arrays


@needs_native
def test_a_large_bound_with_few_rows_is_trimmed(rng):
    """50,000 back-to-back one-block MLA planes: a bound of 50,000 rows, one row written."""
    planes, piece = 50_000, 64
    local = SideGeometry(4096 + piece * np.arange(planes, dtype=np.uint64), 1, piece, piece, 1)
    remote = SideGeometry((1 << 40) + piece * np.arange(planes, dtype=np.uint64), 1, piece, piece, 1)
    plan = plan_read(local, [0], remote, [0], backend="native")
    assert plan.local.shape == (1, 3) and plan.local[0].tolist() == [4096, planes * piece, 0]
    assert plan.local.base is None or plan.local.base.nbytes < 1 << 20
