"""The lane tuner (csrc/include/kvshuttle/lane_tuner.h): which lane count streams each kind of host copy fastest.

Its rules are driven here with rates fed by hand (deterministic: counters, no clock), then the process's tuner
is checked on real streamed packs and unpacks, which must stay byte-exact whatever it picks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from conftest import Geo, assert_bytes_equal, make_cache, random_ids
from kvshuttle import _native, pack, staging_nbytes, unpack

D = _native.Direction
ONE, FOUR = _native.LaneTuner.candidates
WARMUP, WINDOW = _native.LaneTuner.warmup, _native.LaneTuner.window
GB = 1e9


def spec(row_bytes: int = 256, heads: int = 8) -> _native.PagedCopySpec:
    s = _native.PagedCopySpec()
    s.num_layers, s.planes_per_layer, s.block_size, s.num_heads = 2, 2, 16, heads
    s.row_bytes, s.token_stride, s.head_stride = row_bytes, heads * row_bytes, row_bytes
    s.staging_block_size, s.staging_heads = 16, heads
    return s


def shape(direction: _native.Direction = D.PACK, threads: int = 2, **kw: int) -> _native.CopyShape:
    return _native.CopyShape.of(spec(**kw), direction, threads)


def warm(tuner: _native.LaneTuner, key: _native.CopyShape, rates: dict[int, float], prior: int = FOUR) -> list[int]:
    """The choices of the warm-up decisions, each recorded at ``rates[lanes]``."""
    chosen = []
    for _ in range(2 * WARMUP):
        lanes = tuner.choose(key, prior, True)
        chosen.append(lanes)
        tuner.record(key, lanes, rates[lanes])
    return chosen


def test_constants() -> None:
    assert (ONE, FOUR) == (1, 4)
    assert WARMUP >= 2 and WINDOW >= 2 * WARMUP - 1 and _native.LaneTuner.max_shapes >= 16


def test_warm_up_alternates_from_the_prior() -> None:
    tuner = _native.LaneTuner()
    assert warm(tuner, shape(), {ONE: 10 * GB, FOUR: 5 * GB}) == [FOUR, ONE] * WARMUP
    assert warm(_native.LaneTuner(), shape(), {ONE: 10 * GB, FOUR: 5 * GB}, prior=ONE) == [ONE, FOUR] * WARMUP


@pytest.mark.parametrize(("rates", "faster"), [({ONE: 12 * GB, FOUR: 9 * GB}, ONE),
                                               ({ONE: 8 * GB, FOUR: 11 * GB}, FOUR)])
def test_the_higher_median_wins(rates: dict[int, float], faster: int) -> None:
    tuner = _native.LaneTuner(explore_every=0)
    key = shape()
    warm(tuner, key, rates)
    assert [tuner.choose(key, FOUR, True) for _ in range(20)] == [faster] * 20
    (t,) = tuner.snapshot()
    assert t.lanes == faster and t.decisions == 2 * WARMUP + 20
    assert t.timed == [WARMUP, WARMUP]
    assert t.median_gbps == pytest.approx([rates[ONE] / GB, rates[FOUR] / GB])
    assert t.shape.direction == D.PACK and t.shape.row_bytes == 256 and t.shape.threads == 2


def test_median_is_robust_to_outliers_and_follows_a_change() -> None:
    tuner = _native.LaneTuner(explore_every=0)
    key = shape()
    warm(tuner, key, {ONE: 10 * GB, FOUR: 8 * GB})
    tuner.record(key, ONE, 1 * GB)  # one slow spell: the median of 4 rates does not move below 8 GB/s
    assert tuner.choose(key, FOUR, True) == ONE
    for _ in range(WINDOW):  # the host changed: 1 lane now streams at 6 GB/s
        tuner.record(key, ONE, 6 * GB)
    assert tuner.choose(key, FOUR, True) == FOUR
    assert tuner.snapshot()[0].median_gbps[0] == pytest.approx(6.0)  # the window forgot the older rates


def test_every_nth_decision_explores_the_slower() -> None:
    tuner = _native.LaneTuner(explore_every=4)
    key = shape()
    warm(tuner, key, {ONE: 12 * GB, FOUR: 9 * GB})  # decisions 1..6
    chosen = [tuner.choose(key, FOUR, True) for _ in range(10)]  # decisions 7..16
    assert chosen == [ONE, FOUR, ONE, ONE, ONE, FOUR, ONE, ONE, ONE, FOUR]


def test_untimed_copies_take_the_best_known_and_do_not_count() -> None:
    tuner = _native.LaneTuner(explore_every=2)
    key = shape()
    assert tuner.choose(key, FOUR, False) == FOUR  # nothing measured: the prior
    assert tuner.snapshot()[0].decisions == 0
    warm(tuner, key, {ONE: 12 * GB, FOUR: 9 * GB})
    assert [tuner.choose(key, FOUR, False) for _ in range(5)] == [ONE] * 5  # never explores
    assert tuner.snapshot()[0].decisions == 2 * WARMUP


def test_kinds_of_copy_are_tuned_apart() -> None:
    tuner = _native.LaneTuner(explore_every=0)
    keys = [shape(), shape(D.UNPACK), shape(threads=1), shape(row_bytes=128), shape(heads=1)]
    for i, key in enumerate(keys):
        warm(tuner, key, {ONE: 9 * GB, FOUR: 12 * GB} if i % 2 else {ONE: 12 * GB, FOUR: 9 * GB})
    assert [tuner.choose(k, FOUR, True) for k in keys] == [ONE, FOUR, ONE, FOUR, ONE]
    assert len(tuner.snapshot()) == len(keys)
    tuner.reset()
    assert tuner.snapshot() == [] and tuner.choose(keys[0], FOUR, False) == FOUR


def test_kinds_past_the_cap_take_the_prior() -> None:
    tuner = _native.LaneTuner()
    cap = _native.LaneTuner.max_shapes
    for row in range(cap):
        tuner.choose(shape(row_bytes=64 * (row + 1)), FOUR, True)
    extra = shape(row_bytes=64 * (cap + 1))
    for _ in range(2 * WARMUP + 1):
        assert tuner.choose(extra, ONE, True) == ONE
        tuner.record(extra, FOUR, 99 * GB)
    assert len(tuner.snapshot()) == cap


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan")])
def test_rates_that_are_not_positive_are_ignored(rate: float) -> None:
    tuner = _native.LaneTuner()
    key = shape()
    tuner.choose(key, FOUR, True)
    tuner.record(key, FOUR, rate)
    assert tuner.snapshot()[0].timed == [0, 0]


def test_fixed_lanes_are_clamped() -> None:
    try:
        _native.set_copy_lanes(9, D.PACK)
        _native.set_copy_lanes(-3, D.UNPACK)
        assert _native.copy_lanes(D.PACK) == 4 and _native.copy_lanes(D.UNPACK) == 0
    finally:
        _native.set_copy_lanes(0, D.PACK)
    assert _native.copy_lanes(D.PACK) == 0  # the default: tuned


@pytest.fixture
def process_tuner() -> Iterator[None]:
    """Streamed copies from 0 bytes, the process's tuner emptied before and after."""
    for direction in (D.PACK, D.UNPACK):
        _native.set_streaming_min_bytes(0, direction)
    _native.reset_copy_tuning()
    try:
        yield
    finally:
        for direction in (D.PACK, D.UNPACK):
            _native.set_streaming_min_bytes(-1, direction)
            _native.set_copy_lanes(0, direction)
        _native.reset_copy_tuning()


def test_the_process_tuner_learns_from_real_copies_and_stays_byte_exact(rng, process_tuner) -> None:
    """Copies of >= 4 MiB are timed: after the warm-up both candidates are measured, the choice is the faster
    median, and every pack and unpack along the way matched the numpy reference."""
    geo = Geo("flash_attn", "NHD", "bf16", num_layers=2, num_blocks=96, block_size=16, num_heads=8, head_size=128)
    host = make_cache(rng, geo)
    cache = host.cache()
    ids = random_ids(rng, 96, 80)  # 80 blocks x 4 planes x 32 KiB = 10 MiB: timed
    need = staging_nbytes(cache, 80 * 16)
    assert need >= 4 << 20
    want = np.empty(need, np.uint8)
    pack(cache, ids, want, backend="reference")
    staged = np.empty(need, np.uint8)
    for _ in range(2 * WARMUP + 2):
        staged[:] = 0xA5
        pack(cache, ids, staged)
        assert_bytes_equal(staged, want, "staging")
        dest = make_cache(rng, geo)
        expect = make_cache(None, geo, fill=0)
        for got, src in zip(expect.raws, dest.raws, strict=True):
            got[:] = src
        unpack(staged, dest.cache(), ids)
        unpack(staged, expect.cache(), ids, backend="reference")
        for layer, (got, exp) in enumerate(zip(dest.raws, expect.raws, strict=True)):
            assert_bytes_equal(got, exp, f"cache buffer {layer}")
    rows = {t.shape.direction: t for t in _native.copy_tuning()}
    assert set(rows) == {D.PACK, D.UNPACK}
    for t in rows.values():
        assert t.decisions == 2 * WARMUP + 2 and sum(t.timed) == t.decisions
        assert min(t.timed) >= WARMUP and min(t.median_gbps) > 0
        assert t.lanes == (ONE if t.median_gbps[0] >= t.median_gbps[1] else FOUR)

    _native.set_copy_lanes(ONE, D.PACK)  # fixed: not timed, not decided
    pack(cache, ids, staged)
    assert_bytes_equal(staged, want, "staging (fixed lanes)")
    assert {t.shape.direction: t.decisions for t in _native.copy_tuning()}[D.PACK] == 2 * WARMUP + 2


def test_small_copies_are_not_timed(rng, process_tuner) -> None:
    geo = Geo("flash_attn", "NHD", "bf16", num_layers=2, num_blocks=12, block_size=16, num_heads=4, head_size=64)
    cache = make_cache(rng, geo).cache()
    ids = random_ids(rng, 12, 7)
    staged = np.empty(staging_nbytes(cache, 7 * 16), np.uint8)
    for _ in range(3):
        pack(cache, ids, staged)
    assert all(t.decisions == 0 and t.timed == [0, 0] for t in _native.copy_tuning())
