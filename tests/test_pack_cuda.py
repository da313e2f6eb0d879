"""CUDA pack/unpack against the CPU numpy reference, byte for byte (needs a GPU; skipped otherwise).

Each case builds a random cache in host memory, uploads the same bytes to the GPU (torch, or cupy),
runs the native CUDA kernel there, synchronizes, downloads every destination byte and compares it with
the reference run on the host copy. Destinations start poisoned, so untouched bytes are checked too.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvshuttle
import vllm_views
from conftest import (
    DTYPES,
    KINDS,
    ORDERS,
    POISON,
    TRANSFORMS,
    VLLM_CASES,
    Geo,
    HostCache,
    assert_bytes_equal,
    assert_caches_equal,
    make_cache,
    poisoned,
    random_bytes,
    random_ids,
    staging_layout,
    torch_dtype,
    transform,
)
from kvshuttle import BackendError, PagedKVCache, StagingError, StagingLayout, TokenOrder, pack, unpack

pytestmark = pytest.mark.cuda

KIND_ORDERS = [(k, o) for k in KINDS for o in ORDERS]
TAIL = 29


class TorchDevice:
    name = "torch"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA")
        self.torch = torch

    def upload(self, data: np.ndarray, offset: int = 0):
        """A device uint8 vector holding ``data``, starting ``offset`` bytes into its allocation."""
        buf = self.torch.zeros(data.size + offset, dtype=self.torch.uint8, device="cuda")
        view = buf[offset:]
        view.copy_(self.torch.from_numpy(np.ascontiguousarray(data)))
        return view

    def download(self, x) -> np.ndarray:
        self.sync()
        return x.cpu().numpy().copy()

    def layer(self, raw, geo: Geo):
        return raw.view(torch_dtype(geo.dtype)).reshape(geo.physical_shape).permute(*geo.perm)

    def vllm_layers(self, raw, geo: Geo):
        """vLLM 0.32's per-layer views of one device allocation (torch.as_strided, then .view(dtype))."""
        return vllm_views.torch_views(raw, geo.vllm_byte_shape, geo.layout, torch_dtype(geo.dtype))

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def new_stream(self):
        return self.torch.cuda.Stream()

    def stream_handle(self, stream) -> int:
        return int(stream.cuda_stream)

    def use_stream(self, stream):
        return self.torch.cuda.stream(stream)

    def wait_for_default(self, stream) -> None:
        stream.wait_stream(self.torch.cuda.current_stream())


class CupyDevice:
    name = "cupy"
    # cupy has no bfloat16 / float8: the same bytes as unsigned integers of the same size.
    def __init__(self) -> None:
        self.dtypes = {"float32": np.float32, "float16": np.float16, "bf16": np.uint16, "fp8": np.uint8}
        self.cp = pytest.importorskip("cupy")
        try:
            if self.cp.cuda.runtime.getDeviceCount() == 0:
                pytest.skip("cupy sees no GPU")
        except self.cp.cuda.runtime.CUDARuntimeError:
            pytest.skip("cupy sees no GPU")

    def upload(self, data: np.ndarray, offset: int = 0):
        buf = self.cp.zeros(data.size + offset, dtype=self.cp.uint8)
        view = buf[offset:]
        view[...] = self.cp.asarray(np.ascontiguousarray(data))
        return view

    def download(self, x) -> np.ndarray:
        self.sync()
        return self.cp.asnumpy(x)

    def layer(self, raw, geo: Geo):
        return raw.view(self.dtypes[geo.dtype]).reshape(geo.physical_shape).transpose(geo.perm)

    def vllm_layers(self, raw, geo: Geo):
        return vllm_views.cupy_views(raw, geo.vllm_byte_shape, geo.layout, self.dtypes[geo.dtype])

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()

    def new_stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def stream_handle(self, stream) -> int:
        return int(stream.ptr)

    def use_stream(self, stream):
        return stream

    def wait_for_default(self, stream) -> None:
        self.sync()


@pytest.fixture(params=["torch", "cupy"], scope="module")
def dev(request):
    if request.param == "torch":
        pytest.importorskip("torch")
        return TorchDevice()
    return CupyDevice()


class DeviceCache:
    """The GPU twin of a HostCache: the same bytes per layer (or in the one allocation of a vLLM 0.32 cache),
    at ``offset`` bytes into each allocation."""

    def __init__(self, dev, host: HostCache, offset: int = 0) -> None:
        self.dev, self.geo = dev, host.geo
        self.raws = [dev.upload(r, offset) for r in host.raws]
        if host.geo.is_vllm:
            self.layers = dev.vllm_layers(self.raws[0], host.geo)
        else:
            self.layers = [dev.layer(r, host.geo) for r in self.raws]

    def cache(self) -> PagedKVCache:
        return PagedKVCache.from_arrays(self.layers, self.geo.kind, self.geo.order)

    def download(self) -> list[np.ndarray]:
        return [self.dev.download(r) for r in self.raws]


def gpu_pack(dev, host: HostCache, ids, *, layout=None, num_tokens=None, head_offset=0, stream=None,
             cache_offset=0, staging_offset=0):
    """Pack on the GPU and on the host (reference); compare the whole poisoned staging. Returns it."""
    tokens = len(ids) * host.geo.block_size if num_tokens is None else num_tokens
    need = kvshuttle.staging_nbytes(host.cache(), tokens, layout)
    want = poisoned(need + TAIL)
    pack(host.cache(), ids, want, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
         backend="reference")
    gpu = DeviceCache(dev, host, cache_offset)
    staging = dev.upload(poisoned(need + TAIL), staging_offset)
    dev.sync()
    pack(gpu.cache(), ids, staging, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
         stream=stream)
    assert_bytes_equal(dev.download(staging), want, "staging (CUDA vs reference)")
    assert_caches_equal(gpu.download(), host.raws, "source cache after pack")
    return want[:need]


def gpu_unpack(dev, staging: np.ndarray, dest: HostCache, ids, *, layout=None, num_tokens=None,
               head_offset=0, stream=None, cache_offset=0, staging_offset=0):
    """Unpack on the GPU and on the host (reference) into identical caches; compare every byte."""
    gpu = DeviceCache(dev, dest, cache_offset)
    staged = dev.upload(staging, staging_offset)
    dev.sync()
    unpack(staged, gpu.cache(), ids, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
           stream=stream)
    unpack(staging, dest.cache(), ids, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
           backend="reference")
    assert_caches_equal(gpu.download(), dest.raws, "cache (CUDA vs reference)")
    assert_bytes_equal(dev.download(staged), staging, "staging after unpack")


def check_both(dev, rng, geo: Geo, ids, **kwargs):
    staging = gpu_pack(dev, make_cache(rng, geo), ids, **kwargs)
    unpack_kwargs = {k: v for k, v in kwargs.items() if k not in ("cache_offset", "staging_offset")}
    gpu_unpack(dev, random_bytes(rng, staging.size + TAIL), make_cache(rng, geo), ids, **unpack_kwargs,
               cache_offset=kwargs.get("cache_offset", 0), staging_offset=kwargs.get("staging_offset", 0))


# ------------------------------------------------------------------------------------------------- tests
def test_build_info_reports_the_gpu():
    info = kvshuttle.build_info()
    assert info["native"] is True
    assert info["cuda"] is True
    assert info["gpu_available"] is True
    assert info["cuda_archs"]
    assert info["cuda_runtime_version"] > 0


@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_pack_and_unpack(dev, rng, kind, order, dtype, partial):
    geo = Geo(kind, order, dtype, num_layers=2, num_blocks=10, block_size=16, num_heads=4, head_size=8)
    ids = random_ids(rng, 10, 6)
    check_both(dev, rng, geo, ids, num_tokens=5 * 16 + 3 if partial else None)


@pytest.mark.parametrize("head_size", [1, 3, 5, 7])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_odd_head_sizes(dev, rng, kind, order, dtype, head_size):
    """Rows of 1..14 bytes: the kernel falls back to 1-, 2- or 4-byte vectors."""
    geo = Geo(kind, order, dtype, num_layers=2, num_blocks=7, block_size=4, num_heads=3, head_size=head_size)
    ids = random_ids(rng, 7, 5)
    check_both(dev, rng, geo, ids, num_tokens=4 * 4 + 3)
    other = "HND" if order == "NHD" else "NHD"
    layout = staging_layout(geo, block_size=3, order=other, num_heads=min(2, geo.heads))
    check_both(dev, rng, geo, ids, layout=layout, num_tokens=4 * 4 + 2,
               head_offset=geo.heads - layout.num_heads)


@pytest.mark.parametrize("tokens", [None, 5 * 16 + 9, 4 * 16 + 1], ids=["full", "partial9", "partial1"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_transforms(dev, rng, kind, order, name, tokens):
    geo = Geo(kind, order, "bf16", num_layers=2, num_blocks=8, block_size=16, num_heads=4, head_size=8)
    layout, head_offset = transform(geo, name)
    ids = random_ids(rng, 8, 5 if tokens == 4 * 16 + 1 else 6)
    check_both(dev, rng, geo, ids, layout=layout, num_tokens=tokens, head_offset=head_offset)


@pytest.mark.parametrize(("dtype", "head_size", "cache_offset", "staging_offset"), [
    ("float16", 8, 0, 0),     # 16-byte vectors
    ("float16", 8, 8, 0),     # 8
    ("float16", 8, 0, 4),     # 4
    ("float16", 8, 2, 0),     # 2
    ("fp8", 8, 0, 1),         # 1: odd staging address
    ("fp8", 16, 3, 0),        # 1: odd cache address
    ("float32", 3, 4, 12),    # 12-byte rows: 4
])
@pytest.mark.parametrize("name", ["identity", "head_slice_bs24_flip"])
def test_alignment(dev, rng, dtype, head_size, cache_offset, staging_offset, name):
    geo = Geo("flashinfer", "HND", dtype, num_layers=2, num_blocks=8, block_size=16, num_heads=4,
              head_size=head_size)
    layout, head_offset = transform(geo, name)
    ids = random_ids(rng, 8, 5)
    check_both(dev, rng, geo, ids, layout=layout, num_tokens=4 * 16 + 7, head_offset=head_offset,
               cache_offset=cache_offset, staging_offset=staging_offset)


@pytest.mark.parametrize(("kind", "order"), KIND_ORDERS)
def test_round_trip_across_layouts(dev, rng, kind, order):
    """Prefill cache (this kind/order, block 32) -> staging HND/32 -> decode cache (flash_attn NHD, block 16)
    on the GPU; the decode cache holds the same tokens."""
    src_geo = Geo(kind, order, "bf16", num_layers=2, num_blocks=6, block_size=32, num_heads=4, head_size=8)
    dst_geo = src_geo.with_(kind="flash_attn" if kind != "mla" else "mla", order="NHD", num_blocks=11,
                            block_size=16)
    src, dst = make_cache(rng, src_geo), make_cache(None, dst_geo, fill=POISON)
    tokens = 3 * 32 + 7
    src_ids, dst_ids = random_ids(rng, 6, 4), random_ids(rng, 11, 7)
    layout = StagingLayout(32, src_geo.heads, TokenOrder.HND)
    staging = gpu_pack(dev, src, src_ids, layout=layout, num_tokens=tokens)
    gpu_unpack(dev, staging, dst, dst_ids, layout=layout, num_tokens=tokens)
    t = np.arange(tokens)
    for layer in range(2):
        s = src.canonical(layer)[:, src_ids[t // 32], t % 32]
        d = dst.canonical(layer)[:, dst_ids[t // 16], t % 16]
        assert_bytes_equal(d, s, "tokens after the round trip")


@pytest.mark.parametrize("how", ["explicit", "current"])
def test_stream(dev, rng, how):
    geo = Geo("flash_attn", "HND", "bf16", num_layers=3, num_blocks=64, block_size=16, num_heads=8,
              head_size=64)
    host = make_cache(rng, geo)
    ids = random_ids(rng, 64, 40)
    layout = staging_layout(geo, block_size=32, order="NHD")
    tokens = 40 * 16 - 5
    need = kvshuttle.staging_nbytes(host.cache(), tokens, layout)
    want = poisoned(need)
    pack(host.cache(), ids, want, num_tokens=tokens, layout=layout, backend="reference")
    gpu = DeviceCache(dev, host)
    staging = dev.upload(poisoned(need))
    stream = dev.new_stream()
    dev.wait_for_default(stream)
    if how == "explicit":
        pack(gpu.cache(), ids, staging, num_tokens=tokens, layout=layout, stream=dev.stream_handle(stream))
    else:
        with dev.use_stream(stream):
            pack(gpu.cache(), ids, staging, num_tokens=tokens, layout=layout)
    stream.synchronize()
    assert_bytes_equal(dev.download(staging), want)
    # And back through the same stream into a poisoned cache.
    dest = make_cache(None, geo, fill=POISON)
    gpu_dest = DeviceCache(dev, dest)
    dev.wait_for_default(stream)
    if how == "explicit":
        unpack(staging, gpu_dest.cache(), ids, num_tokens=tokens, layout=layout,
               stream=dev.stream_handle(stream))
    else:
        with dev.use_stream(stream):
            unpack(staging, gpu_dest.cache(), ids, num_tokens=tokens, layout=layout)
    stream.synchronize()
    unpack(want, dest.cache(), ids, num_tokens=tokens, layout=layout, backend="reference")
    assert_caches_equal(gpu_dest.download(), dest.raws)


def test_large(dev, rng):
    """Thousands of pieces (one CTA each) and 64 KiB pieces."""
    geo = Geo("flash_attn", "NHD", "float16", num_layers=4, num_blocks=256, block_size=16, num_heads=8,
              head_size=128)
    ids = random_ids(rng, 256, 250)
    check_both(dev, rng, geo, ids, num_tokens=249 * 16 + 3)
    layout, head_offset = transform(geo, "head_slice_bs24_flip")
    check_both(dev, rng, geo, ids, layout=layout, num_tokens=249 * 16 + 3, head_offset=head_offset)


def test_empty_ids(dev, rng):
    host = make_cache(rng, Geo("flashinfer", "HND"))
    gpu = DeviceCache(dev, host)
    staging = dev.upload(poisoned(64))
    pack(gpu.cache(), [], staging)
    unpack(staging, gpu.cache(), [])
    assert (dev.download(staging) == POISON).all()
    assert_caches_equal(gpu.download(), host.raws)


@pytest.mark.parametrize("direction", ["pack", "unpack"])
def test_errors_leave_the_gpu_untouched(dev, rng, direction):
    host = make_cache(rng, Geo("flash_attn", "NHD", num_blocks=8))
    gpu = DeviceCache(dev, host)
    need = kvshuttle.staging_nbytes(host.cache(), 32)
    staging = dev.upload(poisoned(need))
    cases = [
        (StagingError, {"staging": poisoned(need)}),  # host staging with a device cache
        (BackendError, {"backend": "reference"}),      # the numpy reference cannot touch device memory
        (kvshuttle.BlockIdError, {"ids": [0, 8]}),
        (StagingError, {"staging": staging[: need - 1]}),
    ]
    for exc, change in cases:
        args = {"ids": [3, 1], "staging": staging, "backend": "auto", **change}
        with pytest.raises(exc):
            if direction == "pack":
                pack(gpu.cache(), args["ids"], args["staging"], backend=args["backend"])
            else:
                unpack(args["staging"], gpu.cache(), args["ids"], backend=args["backend"])
        assert (dev.download(staging) == POISON).all()
        assert_caches_equal(gpu.download(), host.raws)
    before = host.snapshot()
    with pytest.raises(StagingError):  # and a device staging with a host cache
        if direction == "pack":
            pack(host.cache(), [3, 1], staging)
        else:
            unpack(staging, host.cache(), [3, 1])
    assert (dev.download(staging) == POISON).all()
    assert_caches_equal(host.raws, before)


# ------------------------------------------------------------------------------------- vLLM 0.32 caches
VLLM_IDS = [f"{k.removeprefix('vllm_')}-{lay}" for k, lay in VLLM_CASES]


def vllm_geo(kind: str, layout: str, dtype: str = "bf16", **sizes: int) -> Geo:
    base = {"num_layers": 3, "num_blocks": 10, "block_size": 16, "num_heads": 4, "head_size": 8}
    return Geo(kind, "NHD", dtype, layout=layout, **{**base, **sizes})


@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=VLLM_IDS)
def test_vllm_pack_and_unpack(dev, rng, kind, layout, dtype, partial):
    """Interleaved K/V rows at vLLM's strides, every KVCacheLayout: CUDA equals the reference."""
    geo = vllm_geo(kind, layout, dtype)
    ids = random_ids(rng, 10, 6)
    check_both(dev, rng, geo, ids, num_tokens=5 * 16 + 3 if partial else None)


@pytest.mark.parametrize("name", ["flip_order", "bs24", "bs5_flip", "head_slice", "head_slice_bs24_flip",
                                  "head_first_bs48"])
@pytest.mark.parametrize(("kind", "layout"), VLLM_CASES, ids=VLLM_IDS)
def test_vllm_transforms(dev, rng, kind, layout, name):
    geo = vllm_geo(kind, layout, num_layers=2, num_blocks=8)
    staging, head_offset = transform(geo, name)
    ids = random_ids(rng, 8, 6)
    check_both(dev, rng, geo, ids, layout=staging, num_tokens=5 * 16 + 9, head_offset=head_offset)


@pytest.mark.parametrize(("dtype", "head_size", "cache_offset", "staging_offset"), [
    ("float32", 64, 0, 0),    # 16-byte vectors: rows of 256 B, K/V 256 B apart
    ("float16", 4, 0, 0),     # 8-byte rows: 8-byte vectors
    ("float16", 8, 4, 0),     # 4
    ("fp8", 5, 0, 0),         # odd rows and strides: 1
    ("bf16", 8, 2, 6),        # 2
])
@pytest.mark.parametrize(("kind", "layout"), [("vllm_cpu_attn", "LBHNC"), ("vllm_flash_attn", "LBHNC"),
                                              ("vllm_flashinfer", "BHLNC")])
def test_vllm_alignment(dev, rng, kind, layout, dtype, head_size, cache_offset, staging_offset):
    """The vector width must divide the token and head strides too (FlashAttention's rows are 2D apart)."""
    geo = vllm_geo(kind, layout, dtype, head_size=head_size, num_layers=2, num_blocks=8)
    ids = random_ids(rng, 8, 5)
    for name in ("identity", "head_slice_bs24_flip"):
        staging, head_offset = transform(geo, name)
        check_both(dev, rng, geo, ids, layout=staging, num_tokens=4 * 16 + 7, head_offset=head_offset,
                   cache_offset=cache_offset, staging_offset=staging_offset)


def test_vllm_observed_cpu_geometry_large(dev, rng):
    """fp32, 8 heads, head 64, block 32 (CPU_ATTN's page format on a GPU): 128 KiB pages, hundreds of pieces."""
    geo = vllm_geo("vllm_cpu_attn", "LBHNC", "float32", num_layers=4, num_blocks=96, block_size=32,
                   num_heads=8, head_size=64)
    ids = random_ids(rng, 96, 90)
    check_both(dev, rng, geo, ids, num_tokens=89 * 32 + 3)
    check_both(dev, rng, geo, ids, layout=staging_layout(geo, block_size=16, order="NHD", num_heads=4),
               num_tokens=89 * 32 + 3, head_offset=4)
