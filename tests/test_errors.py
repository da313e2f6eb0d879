"""Bad input raises a named kvshuttle error and leaves the destination untouched, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import (
    POISON,
    Geo,
    assert_bytes_equal,
    assert_caches_equal,
    make_cache,
    poisoned,
    random_bytes,
)
from kvshuttle import (
    BackendError,
    BlockIdError,
    KVShuttleError,
    LayoutError,
    NativeMemoryError,
    PagedKVCache,
    StagingError,
    StagingLayout,
    TokenOrder,
    pack,
    staging_nbytes,
    unpack,
)
from kvshuttle.core import ops as kv_ops

GEO = Geo("flash_attn", "NHD", "float16", num_layers=2, num_blocks=8, block_size=4, num_heads=3, head_size=5)
BACKENDS = ["native", "reference", "auto"]


@pytest.fixture
def host(rng):
    return make_cache(rng, GEO)


def staging_for(tokens: int) -> np.ndarray:
    """A poisoned staging buffer with room for ``tokens`` tokens of GEO (and as much again)."""
    units = -(-tokens // GEO.block_size)
    return poisoned(2 * units * GEO.num_layers * GEO.planes * GEO.piece_bytes)


def rejected(exc, direction, host, ids, staging, **kwargs):
    """Run one bad pack or unpack; it must raise ``exc`` and change neither the staging nor the cache."""
    cache_before, staging_before = host.snapshot(), np.array(staging, copy=True)
    with pytest.raises(exc) as info:
        if direction == "pack":
            pack(host.cache(), ids, staging, **kwargs)
        else:
            unpack(staging, host.cache(), ids, **kwargs)
    assert isinstance(info.value, KVShuttleError)
    assert str(info.value)  # says what is wrong
    assert_caches_equal(host.raws, cache_before, "cache after a rejected call")
    assert_bytes_equal(np.asarray(staging).view(np.uint8).reshape(-1),
                       staging_before.view(np.uint8).reshape(-1), "staging after a rejected call")
    return info.value


directions = pytest.mark.parametrize("direction", ["pack", "unpack"])
backends = pytest.mark.parametrize("backend", BACKENDS)


# ------------------------------------------------------------------------------------------ block ids
@backends
@directions
@pytest.mark.parametrize("ids", [[-1], [8], [0, 8], [3, 100], [2**40], np.array([7, -3], np.int32),
                                 np.array([2**63], np.uint64)])
def test_out_of_range_ids(host, direction, backend, ids):
    rejected(BlockIdError, direction, host, ids, staging_for(8), backend=backend)


@backends
@directions
@pytest.mark.parametrize("ids", [[1, 2, 1], [0, 0], [5, 4, 3, 2, 1, 5]])
def test_duplicate_ids(host, direction, backend, ids):
    err = rejected(BlockIdError, direction, host, ids, staging_for(24), backend=backend)
    assert "more than once" in str(err)


@backends
@directions
@pytest.mark.parametrize("ids", [[0.0, 1.0], np.array([1.5]), ["a", "b"], [True, False], [None], [[0, 1]],
                                 np.zeros((2, 1), np.int64)], ids=lambda x: repr(x)[:20])
def test_ids_not_a_1d_integer_sequence(host, direction, backend, ids):
    rejected(BlockIdError, direction, host, ids, staging_for(8), backend=backend)


@backends
@directions
@pytest.mark.parametrize(("ids", "tokens"), [
    ([0, 1], 9),  # more tokens than two blocks hold
    ([0, 1], 4),  # fits in one block: the second id is extra
    ([0, 1], 0),
    ([3], 0),
    ([], 1),
    ([0, 1, 2], -1),
])
def test_token_count_must_match_ids(host, direction, backend, ids, tokens):
    rejected(BlockIdError, direction, host, ids, staging_for(12), num_tokens=tokens, backend=backend)


@backends
def test_negative_token_count_without_ids(host, backend):
    rejected(BlockIdError, "pack", host, [], staging_for(4), num_tokens=-1, backend=backend)


# ------------------------------------------------------------------------------------------- staging
@backends
@directions
@pytest.mark.parametrize("missing", [1, 100])
def test_staging_too_small(host, direction, backend, missing):
    need = staging_nbytes(host.cache(), 11)
    err = rejected(StagingError, direction, host, [4, 6, 1], poisoned(need - missing), num_tokens=11,
                   backend=backend)
    assert str(need) in str(err)
    layout = StagingLayout(2, 1, TokenOrder.HND)
    need = staging_nbytes(host.cache(), 11, layout)
    rejected(StagingError, direction, host, [4, 6, 1], poisoned(need - missing), num_tokens=11,
             layout=layout, backend=backend)


@backends
def test_read_only_staging_for_pack(host, backend):
    staging = staging_for(8)
    staging.flags.writeable = False
    err = rejected(StagingError, "pack", host, [2, 5], staging, backend=backend)
    assert "read-only" in str(err)


@backends
def test_read_only_staging_is_fine_for_unpack(host, backend):
    staging = random_bytes(np.random.default_rng(1), staging_nbytes(host.cache(), 8))
    staging.flags.writeable = False
    unpack(staging, host.cache(), [2, 5], backend=backend)
    assert_bytes_equal(host.canonical(0)[:, 2].reshape(-1), staging[: 2 * GEO.piece_bytes])


@backends
@directions
@pytest.mark.parametrize("make", ["every_other_byte", "fortran", "column", "reversed"])
def test_non_contiguous_staging(host, direction, backend, make):
    need = staging_nbytes(host.cache(), 8)
    base = poisoned(4 * need)
    staging = {"every_other_byte": base[::2],
               "fortran": base.reshape(16, -1).T,
               "column": base.reshape(-1, 2)[:, :1],
               "reversed": base[::-1]}[make]
    assert staging.nbytes >= need
    err = rejected(StagingError, direction, host, [2, 5], staging, backend=backend)
    assert "contiguous" in str(err)
    assert (base == POISON).all()


@backends
@directions
def test_staging_not_an_array(host, direction, backend):
    rejected(LayoutError, direction, host, [2, 5], bytearray(4096), backend=backend)


# ---------------------------------------------------------------------------------- layout / heads
@backends
@directions
@pytest.mark.parametrize(("layout", "head_offset"), [
    (None, -1),
    (None, 3),
    (None, 7),
    (StagingLayout(4, 2, TokenOrder.NHD), 2),
    (StagingLayout(4, 4, TokenOrder.NHD), 0),
    (StagingLayout(4, 1, TokenOrder.HND), 3),
])
def test_head_slice_or_layout_out_of_range(host, direction, backend, layout, head_offset):
    rejected(LayoutError, direction, host, [2, 5], staging_for(64), layout=layout, head_offset=head_offset,
             backend=backend)


@pytest.mark.parametrize(("block_size", "heads", "order"), [(0, 3, "NHD"), (4, 0, "NHD"), (-4, 3, "HND"),
                                                          (4, 3, "NDH")])
def test_invalid_staging_layout(block_size, heads, order):
    with pytest.raises(LayoutError):
        StagingLayout(block_size, heads, order)


@pytest.mark.parametrize("change", [{"dtype": "bf16"}, {"num_blocks": 9}, {"head_size": 4}, {"order": "HND"}])
def test_layers_of_different_dtype_or_shape(rng, change):
    first = make_cache(rng, GEO.with_(num_layers=1)).layers[0]
    second = make_cache(rng, GEO.with_(num_layers=1, **change)).layers[0]
    with pytest.raises(LayoutError, match="differs"):
        PagedKVCache.from_arrays([first, second], GEO.kind)


@directions
@pytest.mark.parametrize("backend", ["cuda", "Native", "", None, "torch"])
def test_bad_backend_name(host, direction, backend):
    err = rejected(BackendError, direction, host, [2, 5], staging_for(8), backend=backend)
    assert "backend" in str(err)


def test_pack_checks_before_it_copies(host):
    """Every check runs before any byte moves: a bad backend after a good plan still changes nothing."""
    staging = staging_for(8)
    plan = kv_ops.plan_copy(host.cache(), [2, 5], staging, staging_written=True)
    before = staging.copy()
    with pytest.raises(BackendError):
        kv_ops._run(plan, True, "gpu", None)  # type: ignore[arg-type]
    assert_bytes_equal(staging, before)


# ---------------------------------------------------------------------- raw native entry point
@pytest.fixture
def native():
    return pytest.importorskip("kvshuttle._native")


def _plan(host, ids=(2, 5, 7), tokens=10):
    staging = staging_for(tokens)
    plan = kv_ops.plan_copy(host.cache(), list(ids), staging, num_tokens=tokens, staging_written=True)
    return plan, staging


@pytest.mark.parametrize("direction", ["PACK", "UNPACK"])
@pytest.mark.parametrize(("ids", "match"), [
    ([2, 5, 8], "outside"),
    ([2, -1, 7], "outside"),
    ([2, 5, 2], "repeated"),
    ([7, 7, 7], "repeated"),
    ([2, 5], "block ids for"),
    ([2, 5, 7, 1], "block ids for"),
])
def test_native_entry_point_checks_ids(host, native, direction, ids, match):
    plan, staging = _plan(host)
    before, cache_before = staging.copy(), host.snapshot()
    with pytest.raises(BlockIdError, match=match):
        native.paged_copy_cpu(plan.native_spec(), plan.cache.plane_bases, np.array(ids, np.int64),
                              getattr(native.Direction, direction))
    assert_bytes_equal(staging, before)
    assert_caches_equal(host.raws, cache_before)


@pytest.mark.parametrize(("field", "value", "error", "match"), [
    ("num_tokens", -1, BlockIdError, "num_tokens"),
    ("staging_bytes", -1, StagingError, "staging holds"),
    ("head_offset", 1, LayoutError, "head slice"),
    ("head_offset", -1, LayoutError, "head slice"),
    ("staging_heads", 0, LayoutError, "positive"),
    ("staging_block_size", 0, LayoutError, "positive"),
    ("block_stride", 1, LayoutError, "block_stride"),
    ("num_layers", 0, LayoutError, "num_layers"),
    ("planes_per_layer", 3, LayoutError, "planes"),
    ("row_bytes", 0, LayoutError, "positive"),
    ("num_blocks", -1, LayoutError, "num_blocks"),
])
def test_native_entry_point_checks_spec(host, native, field, value, error, match):
    plan, staging = _plan(host)
    spec = plan.native_spec()
    setattr(spec, field, value if field != "staging_bytes" else spec.required_staging_bytes() + value)
    before = staging.copy()
    with pytest.raises(error, match=match):
        native.paged_copy_cpu(spec, plan.cache.plane_bases, plan.block_ids, native.Direction.PACK)
    assert_bytes_equal(staging, before)


@pytest.mark.parametrize("plane_count_change", [-1, 1])
def test_native_entry_point_checks_plane_table_length(host, native, plane_count_change):
    plan, staging = _plan(host)
    bases = plan.cache.plane_bases
    bases = bases[:-1] if plane_count_change < 0 else np.append(bases, bases[-1])
    before = staging.copy()
    with pytest.raises(LayoutError, match="plane table"):
        native.paged_copy_cpu(plan.native_spec(), bases, plan.block_ids, native.Direction.PACK)
    assert_bytes_equal(staging, before)


def test_native_cuda_entry_point_without_cuda_is_a_backend_error(host, native):
    if native.build_info().cuda:
        pytest.skip("built with CUDA")
    plan, _ = _plan(host)
    with pytest.raises(BackendError, match="without CUDA"):
        native.paged_copy_cuda(plan.native_spec(), plan.cache.plane_bases, plan.block_ids, native.Direction.PACK)


def test_native_errors_are_the_python_classes(native):
    """The extension raises kvshuttle.errors' classes themselves (so `except kvshuttle.LayoutError` works)."""
    with pytest.raises(LayoutError) as info:
        native.paged_copy_cpu(native.PagedCopySpec(), np.zeros(0, np.uint64), np.zeros(0, np.int64),
                              native.Direction.PACK)
    assert type(info.value) is LayoutError and isinstance(info.value, KVShuttleError)


def test_native_out_of_memory_is_a_named_error(host, native):
    """std::bad_alloc (here: a seen-mask for 2**62 blocks) is NativeMemoryError, a BackendError and a MemoryError."""
    plan, staging = _plan(host)
    spec = plan.native_spec()
    spec.num_blocks = 2**62
    before = staging.copy()
    with pytest.raises(NativeMemoryError, match="host memory") as info:
        native.paged_copy_cpu(spec, plan.cache.plane_bases, plan.block_ids, native.Direction.PACK)
    assert isinstance(info.value, BackendError) and isinstance(info.value, MemoryError)
    assert_bytes_equal(staging, before)


def test_native_entry_point_accepts_the_valid_spec(host, native):
    plan, staging = _plan(host)
    spec = plan.native_spec()
    assert spec.required_staging_bytes() == staging_nbytes(host.cache(), 10)
    native.paged_copy_cpu(spec, plan.cache.plane_bases, plan.block_ids, native.Direction.PACK)
    want = poisoned(staging.size)
    pack(host.cache(), [2, 5, 7], want, num_tokens=10, backend="reference")
    assert_bytes_equal(staging, want)


# ------------------------------------------------------------- edge cases found in review
@backends
def test_unpack_into_read_only_cache(host, backend):
    for layer in host.layers:
        layer.flags.writeable = False
    staging = random_bytes(np.random.default_rng(2), staging_nbytes(host.cache(), 8))
    rejected(KVShuttleError, "unpack", host, [2, 5], staging, backend=backend)


@backends
@directions
def test_zero_byte_staging_for_no_tokens(host, direction, backend):
    staging = np.empty(staging_nbytes(host.cache(), 0), np.uint8)
    before = host.snapshot()
    if direction == "pack":
        pack(host.cache(), [], staging, backend=backend)
    else:
        unpack(staging, host.cache(), [], backend=backend)
    assert_caches_equal(host.raws, before)


@backends
def test_contiguous_staging_with_unit_axis(host, backend):
    need = staging_nbytes(host.cache(), 8)
    staging = poisoned(4 * (need + 8)).reshape(4, need + 8)[1:2, :need]
    assert staging.flags.c_contiguous
    pack(host.cache(), [2, 5], staging, backend=backend)
    want = poisoned(need)
    pack(host.cache(), [2, 5], want, backend="reference")
    assert_bytes_equal(staging[0, :need], want)


@backends
@pytest.mark.parametrize("order", ["NHD"])
def test_staging_layout_order_as_string(host, backend, order):
    want, got = staging_for(8), staging_for(8)
    pack(host.cache(), [2, 5], want, layout=StagingLayout(4, 3, TokenOrder(order)), backend="reference")
    try:
        pack(host.cache(), [2, 5], got, layout=StagingLayout(4, 3, order), backend=backend)  # type: ignore[arg-type]
    except KVShuttleError:
        return  # rejecting the string would be fine too
    assert_bytes_equal(got, want)
