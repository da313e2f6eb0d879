"""The streaming copy path (non-temporal stores from several pages at once, csrc/cpu/run_copier.h) against the
numpy reference, byte for byte over whole poisoned destinations.

Caches of the other pack tests are far below the 16 MiB above which the native pack streams, so their packs
run memcpy only, and unpacks always stream by default; here both thresholds are lowered to 0 bytes, and one
test raises the unpack threshold to run unpacks through memcpy. Each test runs with 1 to 4 lanes fixed (one
source page at a time or several in turn; one row at a time or row lanes). Buffers are page-aligned (torch's and vLLM's
allocations are), so line-aligned rows take the row-lane path, and shifted by a few bytes, so heads and tails
of runs go through memcpy; block ids are permuted, so runs come from scattered blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from conftest import (
    POISON,
    TRANSFORMS,
    VLLM_CASES,
    Geo,
    HostCache,
    assert_bytes_equal,
    make_cache,
    random_bytes,
    random_ids,
    transform,
)
from kvshuttle import _native, pack, staging_nbytes, unpack

PAGE = 4096
TAIL = 64 + 37  # staging bytes past the used part, which must stay as they were


DIRECTIONS = (_native.Direction.PACK, _native.Direction.UNPACK)


def set_thresholds(nbytes: int) -> None:
    for direction in DIRECTIONS:
        _native.set_streaming_min_bytes(nbytes, direction)


@pytest.fixture(autouse=True, params=[1, 2, 3, 4], ids=lambda lanes: f"lanes{lanes}")
def streaming(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test with each lane count fixed (the tuner picks 1 or 4 per kind of copy; 2 and 3 an operator may
    fix), so each streams the same way in both directions whatever the tuner measured earlier in the run."""
    set_thresholds(0)
    for direction in DIRECTIONS:
        _native.set_copy_lanes(request.param, direction)
    try:
        yield
    finally:
        set_thresholds(-1)
        for direction in DIRECTIONS:
            _native.set_copy_lanes(0, direction)


def placed(data: np.ndarray, shift: int) -> np.ndarray:
    """A copy of ``data`` starting ``shift`` bytes after a page boundary."""
    raw = np.empty(data.size + PAGE + shift, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE + shift
    out = raw[start: start + data.size]
    out[:] = data
    return out


def placed_cache(host: HostCache, shift: int) -> HostCache:
    return HostCache(host.geo, [placed(r, shift) for r in host.raws], host.framework)


def check_pack_unpack(rng: np.random.Generator, geo: Geo, ids: np.ndarray, *, layout=None, num_tokens=None,
                      head_offset: int = 0, shift: int = 0) -> None:
    """Pack and unpack with both backends into identical (shifted) buffers: every byte must agree."""
    host = placed_cache(make_cache(rng, geo), shift)
    cache = host.cache()
    tokens = len(ids) * geo.block_size if num_tokens is None else num_tokens
    need = staging_nbytes(cache, tokens, layout)
    staged = {}
    for backend in ("native", "reference"):
        buf = placed(np.full(need + TAIL, POISON, np.uint8), shift)
        pack(cache, ids, buf[: need + TAIL], num_tokens=num_tokens, layout=layout, head_offset=head_offset,
             backend=backend)
        staged[backend] = buf
    assert_bytes_equal(staged["native"], staged["reference"], "staging (native vs reference)")
    assert (staged["native"][need:] == POISON).all()

    source = placed(random_bytes(rng, need), shift)
    dest = placed_cache(make_cache(rng, geo), shift)
    want = placed_cache(dest, shift)
    unpack(source, dest.cache(), ids, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
           backend="native")
    unpack(source, want.cache(), ids, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
           backend="reference")
    for layer, (got, expected) in enumerate(zip(dest.raws, want.raws, strict=True)):
        assert_bytes_equal(got, expected, f"cache buffer {layer} (native vs reference)")


def test_thresholds_are_settable_per_direction() -> None:
    _native.set_streaming_min_bytes(12345, _native.Direction.PACK)
    _native.set_streaming_min_bytes(678, _native.Direction.UNPACK)
    assert _native.streaming_min_bytes(_native.Direction.PACK) == 12345
    assert _native.streaming_min_bytes(_native.Direction.UNPACK) == 678
    set_thresholds(-1)
    assert _native.streaming_min_bytes(_native.Direction.PACK) == 16 << 20
    assert _native.streaming_min_bytes(_native.Direction.UNPACK) == 0  # unpacks stream by default


@pytest.mark.parametrize("shift", [0, 5], ids=["aligned", "shift5"])
@pytest.mark.parametrize(("kind", "order"), [("flash_attn", "NHD"), ("mla", "NHD")])
def test_unpack_through_memcpy(rng, kind, order, shift):
    """Unpacks below a raised threshold take the memcpy path, byte-exact like the streamed one."""
    _native.set_streaming_min_bytes(1 << 40, _native.Direction.UNPACK)
    geo = Geo(kind, order, "bf16", num_layers=2, num_blocks=12, block_size=16, num_heads=4, head_size=64)
    check_pack_unpack(rng, geo, random_ids(rng, 12, 7), shift=shift)
    check_pack_unpack(rng, geo, random_ids(rng, 12, 7), num_tokens=6 * 16 + 5, shift=shift)
    for name in ("flip_order", "head_slice"):
        layout, offset = transform(geo, name)
        check_pack_unpack(rng, geo, random_ids(rng, 12, 6), layout=layout, num_tokens=5 * 16 + 9,
                          head_offset=offset, shift=shift)


@pytest.mark.parametrize("shift", [0, 16, 5], ids=["aligned", "shift16", "shift5"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "float32"])
@pytest.mark.parametrize(("kind", "order"), [("flash_attn", "NHD"), ("flash_attn", "HND"),
                                             ("flashinfer", "NHD"), ("mla", "NHD")])
def test_dense_kinds(rng, kind, order, dtype, shift):
    """Whole pieces of 64 B to 16 KiB, several of them over a 4 KiB chunk."""
    for head_size in (16, 64, 3):
        geo = Geo(kind, order, dtype, num_layers=2, num_blocks=12, block_size=16, num_heads=4,
                  head_size=head_size)
        check_pack_unpack(rng, geo, random_ids(rng, 12, 7), shift=shift)
        check_pack_unpack(rng, geo, random_ids(rng, 12, 7), num_tokens=6 * 16 + 5, shift=shift)


@pytest.mark.parametrize("shift", [0, 16], ids=["aligned", "shift16"])
@pytest.mark.parametrize("name", ["flip_order", "bs24", "head_slice", "head_slice_bs24_flip", "bs1"])
@pytest.mark.parametrize(("kind", "order"), [("flash_attn", "NHD"), ("flash_attn", "HND")])
def test_transforms(rng, kind, order, name, shift):
    assert name in TRANSFORMS
    geo = Geo(kind, order, "bf16", num_layers=2, num_blocks=10, block_size=16, num_heads=4, head_size=64)
    layout, offset = transform(geo, name)
    check_pack_unpack(rng, geo, random_ids(rng, 10, 6), layout=layout, num_tokens=5 * 16 + 9,
                      head_offset=offset, shift=shift)


@pytest.mark.parametrize("shift", [0, 16], ids=["aligned", "shift16"])
@pytest.mark.parametrize("head_size", [64, 128, 40])
@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=[f"{k}-{lay}" for k, lay in VLLM_CASES])
def test_vllm_pages(rng, kind, layout, head_size, shift):
    """vLLM 0.32 pages: FlashAttention rows of K and V interleaved (copied in row lanes when line-aligned),
    CPU_ATTN head regions; with 8 heads a row-lane step holds 4 heads, with 6 a step is partial."""
    for heads in (8, 6):
        geo = Geo(kind, "NHD", "bf16", layout=layout, num_layers=2, num_blocks=9, block_size=16,
                  num_heads=heads, head_size=head_size)
        check_pack_unpack(rng, geo, random_ids(rng, 9, 5), shift=shift)
        if kind != "vllm_cpu_attn":
            check_pack_unpack(rng, geo, random_ids(rng, 9, 5), num_tokens=4 * 16 + 3, shift=shift)


@pytest.mark.parametrize("shift", [0, 16], ids=["aligned", "shift16"])
@pytest.mark.parametrize("head_size", [32, 96, 160, 224, 288, 2080])
def test_staggered_lanes_cover_every_line_once(rng, head_size, shift):
    """Lanes start at different lines of their runs and wrap around (csrc/cpu/run_copier.h). Runs of 1 to 9 lines
    (single rows of one bf16 head of 32..288 elements, the order flipped), of 16 to 144 lines (a head's tokens),
    and of 4 KiB chunks plus a partial one (2080: 4,160 B rows) must still have each line copied exactly once, in
    both directions and with every lane count, from full and partial blocks."""
    geo = Geo("flash_attn", "HND", "bf16", num_layers=2, num_blocks=10, block_size=16, num_heads=2,
              head_size=head_size)
    check_pack_unpack(rng, geo, random_ids(rng, 10, 7), shift=shift)
    check_pack_unpack(rng, geo, random_ids(rng, 10, 6), num_tokens=5 * 16 + 3, shift=shift)
    layout, offset = transform(geo, "flip_order")
    check_pack_unpack(rng, geo, random_ids(rng, 10, 5), layout=layout, num_tokens=4 * 16 + 7, head_offset=offset,
                      shift=shift)
