"""Layout model: geometry derived from vLLM-shaped arrays, validation errors, and the reference oracle
anchored to direct indexing of the user's original arrays."""

from __future__ import annotations

import numpy as np
import pytest

import kvshuttle
from conftest import (
    DTYPES,
    KINDS,
    ORDERS,
    Geo,
    assert_bytes_equal,
    assert_caches_equal,
    make_cache,
    oracle_pack,
    oracle_unpack,
    poisoned,
    random_bytes,
    random_ids,
    staging_layout,
)
from kvshuttle import (
    CacheGeometry,
    CacheKind,
    LayoutError,
    PagedKVCache,
    StagingLayout,
    TokenOrder,
    pack,
    staging_nbytes,
    unpack,
)

# (kind, physical order): MLA has one head, so "HND" is the same bytes declared as HND.
KIND_ORDERS = [(k, o) for k in KINDS for o in ORDERS]


def _expected_strides(geo: Geo) -> tuple[int, int]:
    """(block_stride, plane_stride) in bytes for a dense vLLM allocation."""
    if geo.kind == "flash_attn":
        return geo.piece_bytes, geo.num_blocks * geo.piece_bytes
    if geo.kind == "flashinfer":
        return 2 * geo.piece_bytes, geo.piece_bytes
    return geo.piece_bytes, 0


# -------------------------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_geometry(rng, kind, order, dtype):
    geo = Geo(kind, order, dtype, num_layers=3, num_blocks=5, block_size=4, num_heads=3, head_size=6)
    host = make_cache(rng, geo)
    cache = host.cache()
    g = cache.geometry
    assert isinstance(g, CacheGeometry)
    assert g.kind is CacheKind(kind)
    assert g.order is TokenOrder(order)
    assert (g.num_layers, g.num_blocks, g.block_size) == (3, 5, 4)
    assert (g.num_heads, g.head_size) == (geo.heads, 6)
    assert g.dtype == str(geo.np_dtype)
    assert g.itemsize == geo.itemsize
    assert g.device == "cpu"
    assert not cache.is_cuda
    assert (g.block_stride, g.plane_stride) == _expected_strides(geo)
    assert g.planes_per_layer == geo.planes
    assert g.num_planes == 3 * geo.planes
    assert g.row_bytes == 6 * geo.itemsize
    assert g.piece_bytes == 4 * geo.heads * 6 * geo.itemsize
    assert g.bytes_per_token == 3 * geo.planes * geo.heads * 6 * geo.itemsize
    assert kind in g.describe()


@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_order_detected_from_strides(rng, kind, order):
    host = make_cache(rng, Geo(kind, order, num_heads=3, block_size=4))
    detected = host.cache(order=None).geometry.order
    assert detected is (TokenOrder.NHD if kind == "mla" else TokenOrder(order))


@pytest.mark.parametrize(("kind", "order"), [(k, o) for k in ("flash_attn", "flashinfer") for o in ORDERS])
def test_explicit_order_mismatch(rng, kind, order):
    host = make_cache(rng, Geo(kind, order, num_heads=3, block_size=4))
    other = "HND" if order == "NHD" else "NHD"
    with pytest.raises(LayoutError, match="strides say"):
        host.cache(order=other)


@pytest.mark.parametrize("declared", ORDERS)
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
@pytest.mark.parametrize(("heads", "block"), [(1, 4), (3, 1)])
def test_one_head_or_one_slot_accepts_both_orders(rng, kind, order, declared, heads, block):
    host = make_cache(rng, Geo(kind, order, num_heads=heads, block_size=block))
    assert host.cache(order=declared).geometry.order is TokenOrder(declared)


@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_plane_bases(rng, kind, order):
    geo = Geo(kind, order, num_layers=3, num_blocks=4, block_size=2, num_heads=2, head_size=4)
    host = make_cache(rng, geo)
    bases = host.cache().plane_bases
    assert bases.dtype == np.uint64
    assert bases.shape == (3 * geo.planes,)
    want = []
    for layer in host.layers:
        for plane in range(geo.planes):
            first = {"flash_attn": lambda x, p: x[p], "flashinfer": lambda x, p: x[0, p],
                     "mla": lambda x, p: x}[kind](layer, plane)
            want.append(first.ctypes.data)  # address of element [0...] of that plane
    assert bases.tolist() == want


@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_regions_are_whole_layers(rng, kind, order):
    host = make_cache(rng, Geo(kind, order, num_layers=3))
    assert host.cache().regions() == [(r.ctypes.data, r.nbytes) for r in host.raws]


def test_layers_as_views_of_one_allocation(rng):
    """vLLM may carve all layers out of one buffer: [L, 2, N, B, H, D]; each layer[l] is a layer. The layers
    touch inside one allocation, so they are one region (a descriptor may run from one into the next)."""
    geo = Geo("flash_attn", "NHD", num_layers=3)
    big = random_bytes(rng, 3 * geo.layer_nbytes).view(np.float16).reshape(3, *geo.logical_shape)
    cache = PagedKVCache.from_arrays(list(big), "flash_attn")
    assert cache.regions() == [(big.ctypes.data, 3 * geo.layer_nbytes)]
    assert [cache.layer_span(i) for i in range(3)] == [(big[i].ctypes.data, geo.layer_nbytes) for i in range(3)]
    apart = PagedKVCache.from_arrays([big[0], big[2]], "flash_attn")  # a gap between them: two regions
    assert apart.regions() == [(big[0].ctypes.data, geo.layer_nbytes), (big[2].ctypes.data, geo.layer_nbytes)]


def test_touching_separate_allocations_stay_separate_regions(rng):
    """Two allocations that happen to be adjacent must not be registered as one region."""
    geo = Geo("flash_attn", "NHD", num_layers=2)
    buf = random_bytes(rng, 2 * geo.layer_nbytes)
    first = buf[: geo.layer_nbytes].view(np.float16).reshape(geo.logical_shape)
    second = np.frombuffer(memoryview(buf)[geo.layer_nbytes:], np.float16).reshape(geo.logical_shape)
    cache = PagedKVCache.from_arrays([first, second], "flash_attn")
    assert cache.regions() == [(first.ctypes.data, geo.layer_nbytes), (second.ctypes.data, geo.layer_nbytes)]


def test_block_strided_view_regions(rng):
    """Every other block of a bigger cache: a valid cache whose span ends after the last used block."""
    geo = Geo("flash_attn", "NHD", num_layers=1, num_blocks=8)
    host = make_cache(rng, geo)
    view = host.layers[0][:, ::2]
    cache = PagedKVCache.from_arrays([view], "flash_attn")
    g = cache.geometry
    assert (g.num_blocks, g.block_stride, g.plane_stride) == (4, 2 * geo.piece_bytes, 8 * geo.piece_bytes)
    start = host.raws[0].ctypes.data
    assert cache.regions() == [(start, 8 * geo.piece_bytes + 6 * geo.piece_bytes + geo.piece_bytes)]
    ids = np.array([3, 0, 2])
    staging = poisoned(staging_nbytes(cache, 3 * geo.block_size))
    pack(cache, ids, staging, backend="native")
    want = poisoned(staging.size)
    oracle_pack(host, 2 * ids, want, staging_layout(geo), 3 * geo.block_size)
    assert_bytes_equal(staging, want)


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize(("kind", "order"), [(k, o) for k in ("flash_attn", "flashinfer") for o in ORDERS])
def test_head_slice_view_is_a_strided_cache(rng, kind, order, backend):
    """A head slice of a cache is a valid strided cache (HND: still dense per block; NHD: rows at the full
    token stride); packing it equals packing the slice of the whole cache."""
    geo = Geo(kind, order, num_layers=2, num_heads=4, block_size=4, head_size=5)
    host = make_cache(rng, geo)
    sliced = [layer[..., 1:3, :] for layer in host.layers]
    cache = PagedKVCache.from_arrays(sliced, kind)
    g = cache.geometry
    assert (g.num_heads, g.order, g.dense_pieces) == (2, TokenOrder(order), order == "HND")
    ids = random_ids(rng, geo.num_blocks, 3)
    got = poisoned(staging_nbytes(cache, 11))
    pack(cache, ids, got, num_tokens=11, backend=backend)
    want = poisoned(got.size)
    oracle_pack(host, ids, want, staging_layout(geo, num_heads=2), 11, head_offset=1)
    assert_bytes_equal(got, want)


def test_staging_nbytes(rng):
    geo = Geo("flashinfer", "NHD", "float32", num_layers=3, block_size=16, num_heads=4, head_size=8)
    cache = make_cache(rng, geo).cache()
    row = 8 * 4
    assert staging_nbytes(cache, 0) == 0
    assert staging_nbytes(cache, 1) == 1 * 6 * 16 * 4 * row
    assert staging_nbytes(cache, 33) == 3 * 6 * 16 * 4 * row
    assert staging_nbytes(cache.geometry, 33) == staging_nbytes(cache, 33)
    layout = StagingLayout(5, 2, TokenOrder.HND)
    assert staging_nbytes(cache, 33, layout) == 7 * 6 * 5 * 2 * row
    assert layout.num_units(33) == 7
    assert StagingLayout.like(cache.geometry) == StagingLayout(16, 4, TokenOrder.NHD)
    assert StagingLayout.like(cache.geometry, 3) == StagingLayout(16, 3, TokenOrder.NHD)


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("kind", "shape"), [
    ("flash_attn", (2, 4, 4, 8)),
    ("flash_attn", (2, 4, 4, 2, 8, 1)),
    ("flashinfer", (4, 2, 4, 8)),
    ("mla", (4, 4, 1, 8, 1)),
    ("mla", (4, 8)),
])
def test_wrong_ndim(kind, shape):
    with pytest.raises(LayoutError, match="dimensions"):
        PagedKVCache.from_arrays([np.ones(shape, np.float16)], kind)


def test_flash_attn_needs_two_planes_first():
    with pytest.raises(LayoutError, match=r"\[2, N, B, H, D\]"):
        PagedKVCache.from_arrays([np.ones((3, 4, 4, 2, 8), np.float16)], "flash_attn")
    with pytest.raises(LayoutError):  # a flashinfer-shaped tensor declared as flash_attn
        PagedKVCache.from_arrays([np.ones((4, 2, 4, 2, 8), np.float16)], "flash_attn")


def test_flashinfer_needs_two_planes_second():
    with pytest.raises(LayoutError, match=r"\[N, 2, B, H, D\]"):
        PagedKVCache.from_arrays([np.ones((4, 3, 4, 2, 8), np.float16)], "flashinfer")
    with pytest.raises(LayoutError):
        PagedKVCache.from_arrays([np.ones((2, 4, 4, 2, 8), np.float16)], "flashinfer")


@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_head_size_step_rejected(rng, kind, order):
    """Rows are D contiguous elements: a step over the head dim is not a cache."""
    host = make_cache(rng, Geo(kind, order, head_size=8))
    with pytest.raises(LayoutError, match="contiguous"):
        PagedKVCache.from_arrays([x[..., ::2] for x in host.layers], kind)


@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_head_size_slice_is_rows_of_fewer_elements(rng, kind, order):
    """The first 4 of 8 elements of every row are rows of 4 at the same strides (how vLLM 0.32 splits K off
    V inside its content dim); pack gathers exactly those bytes."""
    geo = Geo(kind, order, "bf16", num_layers=2, head_size=8, num_heads=3, block_size=4)
    host = make_cache(rng, geo)
    cache = PagedKVCache.from_arrays([x[..., :4] for x in host.layers], kind, geo.order)
    assert (cache.geometry.head_size, cache.geometry.dense_pieces) == (4, False)
    ids = random_ids(rng, geo.num_blocks, 3)
    got = poisoned(staging_nbytes(cache, 3 * geo.block_size))
    pack(cache, ids, got, backend="native")
    want = poisoned(got.size)
    pack(cache, ids, want, backend="reference")
    assert_bytes_equal(got, want)
    full = poisoned(staging_nbytes(host.cache(), 3 * geo.block_size))
    oracle_pack(host, ids, full, staging_layout(geo), 3 * geo.block_size)
    rows = full.reshape(-1, geo.row_bytes)[:, : 4 * geo.itemsize]
    assert_bytes_equal(got, rows)


def test_transposed_tokens_are_a_strided_cache(rng):
    """A transpose swapping blocks and slots gives blocks that interleave (block stride < piece): a valid
    strided geometry (vLLM's LHBNC has such blocks), not an error."""
    geo = Geo("flash_attn", "NHD", num_heads=4, block_size=4, head_size=8, num_blocks=6)
    host = make_cache(rng, geo)
    weird = host.layers[0].transpose(0, 2, 1, 3, 4)  # [2, B, N, H, D]: 4 "blocks" of 6 "tokens"
    g = PagedKVCache.from_arrays([weird], "flash_attn").geometry
    assert (g.num_blocks, g.block_size, g.block_stride, g.token_stride) == (4, 6, 4 * geo.row_bytes,
                                                                            geo.piece_bytes)


def test_reversed_blocks_rejected(rng):
    host = make_cache(rng, Geo("flash_attn", "NHD"))
    with pytest.raises(LayoutError, match="overlap"):
        PagedKVCache.from_arrays([x[:, ::-1] for x in host.layers], "flash_attn")


def test_empty_dimension_rejected():
    with pytest.raises(LayoutError):
        PagedKVCache.from_arrays([np.ones((2, 0, 4, 2, 8), np.float16)], "flash_attn")
    with pytest.raises(LayoutError):
        PagedKVCache.from_arrays([np.ones((3, 2, 4, 8), np.float16)[:, :, :0]], "mla")


@pytest.mark.parametrize("change", ["dtype", "shape", "order"])
def test_layers_must_match(rng, change):
    geo = Geo("flash_attn", "NHD", "float16", num_heads=4, block_size=4)
    first = make_cache(rng, geo.with_(num_layers=1)).layers[0]
    other = {"dtype": geo.with_(dtype="bf16"),
             "shape": geo.with_(num_blocks=geo.num_blocks + 1),
             "order": geo.with_(order="HND")}[change]
    second = make_cache(rng, other.with_(num_layers=1)).layers[0]
    with pytest.raises(LayoutError, match="layer 1 differs"):
        PagedKVCache.from_arrays([first, second], "flash_attn")


@pytest.mark.parametrize("kind", KINDS)
def test_same_array_twice_rejected(rng, kind):
    host = make_cache(rng, Geo(kind, "NHD", num_layers=2))
    with pytest.raises(LayoutError, match="share memory"):
        PagedKVCache.from_arrays([host.layers[0], host.layers[1], host.layers[0]], kind)


def test_overlapping_layer_views_rejected(rng):
    geo = Geo("flash_attn", "NHD", num_layers=1)
    buf = random_bytes(rng, geo.layer_nbytes + geo.piece_bytes)
    a = buf[: geo.layer_nbytes].view(np.float16).reshape(geo.logical_shape)
    b = buf[geo.piece_bytes:].view(np.float16).reshape(geo.logical_shape)
    with pytest.raises(LayoutError, match="share memory"):
        PagedKVCache.from_arrays([a, b], "flash_attn")


def test_empty_layer_list():
    with pytest.raises(LayoutError, match="at least one layer"):
        PagedKVCache.from_arrays([], "flash_attn")


@pytest.mark.parametrize("obj", [[[1.0, 2.0]], "abc", 3.0, memoryview(b"abcd")])
def test_unsupported_object(obj):
    with pytest.raises(LayoutError, match="expected a numpy array"):
        PagedKVCache.from_arrays([obj], "mla")


def test_pack_needs_a_paged_cache(rng):
    host = make_cache(rng, Geo())
    with pytest.raises(LayoutError, match="PagedKVCache"):
        pack(host.layers, [0], poisoned(1 << 16))  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "order"), [("paged", None), ("flash_attn", "NDH")])
def test_unknown_kind_or_order_is_layout_error(rng, kind, order):
    host = make_cache(rng, Geo("flash_attn", "NHD"))
    with pytest.raises(LayoutError):
        PagedKVCache.from_arrays(host.layers, kind, order)


# ---------------------------------------------- the reference is anchored to the user's original arrays
ANCHOR_TRANSFORMS = {
    "identity": {},
    "staging_hnd_bs5": {"block_size": 5, "order": "HND"},
    "staging_nhd_bs24": {"block_size": 24, "order": "NHD"},
    "head_slice": {"head_offset": 1, "num_heads": 2},
}


def _transform(kind, name):
    """Staging layout options and head offset of a named transform (MLA has one head: no slice)."""
    opts = dict(ANCHOR_TRANSFORMS[name])
    head_offset = opts.pop("head_offset", 0)
    if kind == "mla":
        opts.pop("num_heads", None)
        head_offset = 0
    return opts, head_offset


@pytest.mark.parametrize("transform", list(ANCHOR_TRANSFORMS))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_reference_pack_matches_direct_indexing(rng, kind, order, transform):
    geo = Geo(kind, order, "bf16", num_layers=2, num_blocks=9, block_size=8, num_heads=3, head_size=5)
    opts, head_offset = _transform(kind, transform)
    host = make_cache(rng, geo)
    cache = host.cache()
    layout = staging_layout(geo, **opts)
    ids = random_ids(rng, geo.num_blocks, 5)
    tokens = 4 * geo.block_size + 3
    got = poisoned(staging_nbytes(cache, tokens, layout) + 7)
    pack(cache, ids, got, num_tokens=tokens, layout=layout, head_offset=head_offset, backend="reference")
    want = poisoned(got.size)
    oracle_pack(host, ids, want, layout, tokens, head_offset)
    assert_bytes_equal(got, want, "staging")
    # Spelled out for one token: staging unit u, layer l, plane p, slot k, head h.
    t = 2 * geo.block_size + 1
    u, k = divmod(t, layout.block_size)
    piece = layout.block_size * layout.num_heads * geo.row_bytes
    for layer in range(geo.num_layers):
        for plane in range(geo.planes):
            logical = host.layers[layer]
            src = {"flash_attn": lambda x, p: x[p, ids[t // geo.block_size], t % geo.block_size, head_offset],
                   "flashinfer": lambda x, p: x[ids[t // geo.block_size], p, t % geo.block_size, head_offset],
                   "mla": lambda x, p: x[ids[t // geo.block_size], t % geo.block_size]}[kind](logical, plane)
            row = (k * layout.num_heads if layout.order is TokenOrder.NHD else k)
            start = ((u * geo.num_layers + layer) * geo.planes + plane) * piece + row * geo.row_bytes
            assert got[start: start + geo.row_bytes].tobytes() == src.tobytes()


@pytest.mark.parametrize("transform", list(ANCHOR_TRANSFORMS))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_reference_unpack_matches_direct_indexing(rng, kind, order, transform):
    geo = Geo(kind, order, "fp8", num_layers=2, num_blocks=9, block_size=8, num_heads=3, head_size=7)
    opts, head_offset = _transform(kind, transform)
    dest = make_cache(rng, geo)
    want = dest.clone()
    layout = staging_layout(geo, **opts)
    ids = random_ids(rng, geo.num_blocks, 4)
    tokens = 3 * geo.block_size + 5
    staging = random_bytes(rng, staging_nbytes(dest.cache(), tokens, layout))
    unpack(staging, dest.cache(), ids, num_tokens=tokens, layout=layout, head_offset=head_offset,
           backend="reference")
    oracle_unpack(staging, want, ids, layout, tokens, head_offset)
    assert_caches_equal(dest.raws, want.raws)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_torch_cpu_tensors(rng, kind, order, dtype):
    """Torch CPU tensors (real bfloat16 / float8_e4m3fn) describe the same memory as numpy views."""
    pytest.importorskip("torch")
    geo = Geo(kind, order, dtype, num_layers=2, num_blocks=6, block_size=4, num_heads=3, head_size=5)
    host = make_cache(rng, geo, framework="torch")
    cache = host.cache()
    assert cache.geometry.order is TokenOrder(order)
    assert cache.regions() == [(r.ctypes.data, r.nbytes) for r in host.raws]
    ids = random_ids(rng, geo.num_blocks, 3)
    for backend in ("native", "reference"):
        got = poisoned(staging_nbytes(cache, 10))
        pack(cache, ids, got, num_tokens=10, backend=backend)
        want = poisoned(got.size)
        oracle_pack(host, ids, want, staging_layout(geo), 10)
        assert_bytes_equal(got, want, backend)


def test_build_info():
    info = kvshuttle.build_info()
    assert {"version", "native", "cuda", "cuda_archs", "gpu_available", "num_threads"} <= set(info)
    assert info["version"] == kvshuttle.__version__
    assert info["native"] is True
    assert info["num_threads"] >= 1
    native = kvshuttle.core.native.ext
    assert info["cuda"] is bool(native.build_info().cuda)
    assert isinstance(info["cuda_archs"], list)
    if info["cuda"]:
        assert info["cuda_archs"] and all(a.isdigit() for a in info["cuda_archs"])
        assert info["cuda_runtime_version"] > 0
    else:
        assert info["cuda_archs"] == []
        assert not info["gpu_available"]
        with pytest.raises(kvshuttle.BackendError, match="without CUDA"):
            native.paged_copy_cuda(native.PagedCopySpec(), np.zeros(0, np.uint64), np.zeros(0, np.int64),
                                   native.Direction.PACK, 0)
    assert info["gpu_available"] == (info["cuda"] and native.cuda_device_count() > 0)
