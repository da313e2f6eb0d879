"""Shared fixtures and helpers: random paged caches laid out as vLLM allocates them, and byte oracles.

Every cache layer is built on one flat ``uint8`` buffer (its physical memory, filled with random non-zero
bytes) viewed as the element dtype, reshaped to the physical shape and transposed to vLLM's logical
shape, so the strides tell the token order:

* flash_attn  logical ``[2, N, B, H, D]``; HND physical ``[2, N, H, B, D]``
* flashinfer  logical ``[N, 2, B, H, D]``; HND physical ``[N, 2, H, B, D]``
* mla         logical ``[N, B, D]`` (one head: NHD and HND are the same bytes)
* vllm_*      vLLM 0.32: all layers views of one flat allocation, ``[N, H, B, 2D]`` per layer, strides from a
              ``KVCacheLayout`` (``Geo.layout``; the token order follows from it), see ``vllm_views.py``

Tests compare raw bytes only (never values: bf16/fp8 NaN patterns are arbitrary bytes here).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import kvshuttle
import vllm_views
from kvshuttle import PagedKVCache, StagingLayout

try:  # the real 2-byte / 1-byte float types when available; same-size integers otherwise
    import ml_dtypes

    BF16: Any = np.dtype(ml_dtypes.bfloat16)
    FP8: Any = np.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:  # pragma: no cover - depends on the environment
    BF16 = np.dtype(np.uint16)
    FP8 = np.dtype(np.uint8)

KINDS = ("flash_attn", "flashinfer", "mla")
VLLM_KINDS = vllm_views.VLLM_KINDS
# Every vLLM kind with every KVCacheLayout its views can have (CPU_ATTN: tokens and content adjacent).
VLLM_CASES = [(k, lay) for k in VLLM_KINDS
              for lay in (vllm_views.CPU_LAYOUTS if k == "vllm_cpu_attn" else tuple(vllm_views.LAYOUTS))]
ORDERS = ("NHD", "HND")
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bf16": BF16, "fp8": FP8}
POISON = 0xA5

Bytes = npt.NDArray[np.uint8]


# ----------------------------------------------------------------------------------------------- markers
def _cuda_usable() -> bool:
    if not kvshuttle.build_info()["gpu_available"]:
        return False
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "shared_engines(*names): an e2e case's engines leased from the session's pool "
                                       "(tests/e2e/engine_pool.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    if _cuda_usable():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, the CUDA build and torch or cupy with CUDA")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


# ------------------------------------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class Geo:
    """One cache's geometry as the tests describe it (kind, physical order, dtype name, sizes; vLLM 0.32
    kinds: the KVCacheLayout, which sets the order)."""

    kind: str = "flash_attn"
    order: str = "NHD"
    dtype: str = "float16"
    num_layers: int = 2
    num_blocks: int = 8
    block_size: int = 16
    num_heads: int = 4
    head_size: int = 8
    layout: str = "LBHNC"

    def __post_init__(self) -> None:
        if self.is_vllm:
            object.__setattr__(self, "order", vllm_views.token_order(self.layout))

    def with_(self, **changes: Any) -> Geo:
        return replace(self, **changes)

    @property
    def is_vllm(self) -> bool:
        return self.kind.startswith("vllm_")

    @property
    def vllm_byte_shape(self) -> tuple[int, ...]:
        """The logical [L, N, H, B, C-bytes] of the one allocation of a vLLM 0.32 cache."""
        return vllm_views.logical_byte_shape(self.num_layers, self.num_blocks, self.num_heads, self.block_size,
                                             self.row_bytes)

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return int(self.np_dtype.itemsize)

    @property
    def planes(self) -> int:
        return 1 if self.kind == "mla" else 2

    @property
    def heads(self) -> int:
        return 1 if self.kind == "mla" else self.num_heads

    @property
    def row_bytes(self) -> int:
        return self.head_size * self.itemsize

    @property
    def logical_shape(self) -> tuple[int, ...]:
        n, b, h, d = self.num_blocks, self.block_size, self.num_heads, self.head_size
        if self.is_vllm:
            return (n, h, b, 2 * d)
        return {"flash_attn": (2, n, b, h, d), "flashinfer": (n, 2, b, h, d), "mla": (n, b, d)}[self.kind]

    @property
    def physical_shape(self) -> tuple[int, ...]:
        shape = self.logical_shape
        return tuple(shape[i] for i in self.perm)  # perm swaps B and H: its own inverse

    @property
    def perm(self) -> tuple[int, ...]:
        """Axes of the physical array that give the logical view (the same tuple inverts it)."""
        if self.kind == "mla" or self.order == "NHD":
            return tuple(range(len(self.logical_shape)))
        return (0, 1, 3, 2, 4)

    @property
    def layer_nbytes(self) -> int:
        return math.prod(self.logical_shape) * self.itemsize

    @property
    def piece_bytes(self) -> int:
        return self.block_size * self.heads * self.row_bytes


def torch_dtype(name: str) -> Any:
    torch = pytest.importorskip("torch")
    return {"float32": torch.float32, "float16": torch.float16, "bf16": torch.bfloat16,
            "fp8": torch.float8_e4m3fn}[name]


def random_bytes(rng: np.random.Generator, nbytes: int) -> Bytes:
    """Random bytes, never zero (a forgotten copy never looks right by accident)."""
    return rng.integers(1, 256, size=nbytes, dtype=np.uint8)


def numpy_layer(raw: Bytes, geo: Geo) -> npt.NDArray[Any]:
    """The logical-shape numpy view of one layer's physical buffer."""
    return raw.view(geo.np_dtype).reshape(geo.physical_shape).transpose(geo.perm)


def torch_layer(raw: Any, geo: Geo) -> Any:
    """The logical-shape torch view of one layer's physical uint8 torch buffer (CPU or CUDA)."""
    return raw.view(torch_dtype(geo.dtype)).reshape(geo.physical_shape).permute(*geo.perm)


def logical_bytes(raw: Bytes, geo: Geo) -> Bytes:
    """A uint8 view of one layer in the logical shape plus a trailing itemsize axis."""
    return raw.reshape(*geo.physical_shape, geo.itemsize).transpose(*geo.perm, len(geo.perm))


def canonical_bytes(raw: Bytes, geo: Geo) -> Bytes:
    """A uint8 view ``[P, N, B, H, D, itemsize]`` of one layer, from direct indexing of the logical view."""
    view = logical_bytes(raw, geo)
    if geo.kind == "flash_attn":
        return view
    if geo.kind == "flashinfer":
        return view.transpose(1, 0, 2, 3, 4, 5)
    return view[None, :, :, None]


class HostCache:
    """A numpy (or torch CPU) cache whose layers are views of flat uint8 buffers ``raws`` (one per layer; one
    for all layers of a vLLM 0.32 cache)."""

    def __init__(self, geo: Geo, raws: list[Bytes], framework: str = "numpy") -> None:
        self.geo = geo
        self.raws = raws
        self.framework = framework
        if geo.is_vllm:
            self.byte_layers = vllm_views.numpy_byte_views(raws[0], geo.vllm_byte_shape, geo.layout)
        if framework == "numpy":
            self.layers: list[Any] = ([b.view(geo.np_dtype) for b in self.byte_layers] if geo.is_vllm
                                      else [numpy_layer(r, geo) for r in raws])
        elif framework == "torch":
            torch = pytest.importorskip("torch")
            self.layers = ([*vllm_views.torch_views(torch.from_numpy(raws[0]), geo.vllm_byte_shape, geo.layout,
                                                    torch_dtype(geo.dtype))] if geo.is_vllm
                           else [torch_layer(torch.from_numpy(r), geo) for r in raws])
        else:  # pragma: no cover - test bug
            raise ValueError(framework)

    def cache(self, order: str | None = "auto") -> PagedKVCache:
        """The PagedKVCache; ``order="auto"`` passes the physical order explicitly (needed for MLA/HND)."""
        declared = self.geo.order if order == "auto" else order
        return PagedKVCache.from_arrays(self.layers, self.geo.kind, declared)

    def snapshot(self) -> list[Bytes]:
        return [r.copy() for r in self.raws]

    def clone(self) -> HostCache:
        """Another allocation with the same bytes."""
        return HostCache(self.geo, self.snapshot(), self.framework)

    def canonical(self, layer: int) -> Bytes:
        """``[P, N, B, H, D, itemsize]`` bytes of one layer, a view (writes land in the cache)."""
        if self.geo.is_vllm:
            return vllm_views.canonical_planes(self.byte_layers[layer], self.geo.kind, self.geo.head_size,
                                               self.geo.itemsize)
        return canonical_bytes(self.raws[layer], self.geo)


def make_cache(rng: np.random.Generator | None, geo: Geo, *, fill: int | None = None,
               framework: str = "numpy") -> HostCache:
    """A cache of ``geo`` filled with random non-zero bytes (or the byte ``fill``)."""
    raws = []
    for _ in range(1 if geo.is_vllm else geo.num_layers):
        nbytes = geo.num_layers * geo.layer_nbytes if geo.is_vllm else geo.layer_nbytes
        if fill is None:
            assert rng is not None
            raws.append(random_bytes(rng, nbytes))
        else:
            raws.append(np.full(nbytes, fill, dtype=np.uint8))
    return HostCache(geo, raws, framework)


def poisoned(nbytes: int, fill: int = POISON) -> Bytes:
    return np.full(nbytes, fill, dtype=np.uint8)


def random_ids(rng: np.random.Generator, num_blocks: int, count: int) -> npt.NDArray[np.int64]:
    """``count`` distinct block ids in random order."""
    return rng.permutation(num_blocks)[:count].astype(np.int64)


def staging_layout(geo: Geo, block_size: int | None = None, num_heads: int | None = None,
                   order: str | None = None) -> StagingLayout:
    return StagingLayout(block_size or geo.block_size, num_heads or geo.heads,
                         kvshuttle.TokenOrder(order or geo.order))


# name -> (staging block size, staging order ("flip" = the other one), staging heads, head offset)
TRANSFORMS = {
    "identity": (None, None, None, 0),
    "flip_order": (None, "flip", None, 0),
    "smaller_block": (8, None, None, 0),
    "larger_block": (32, None, None, 0),
    "bs24": (24, None, None, 0),
    "bs5_flip": (5, "flip", None, 0),
    "bs1": (1, None, None, 0),
    "head_slice": (None, None, 2, 1),
    "head_slice_tail": (None, None, 1, 3),
    "head_slice_bs24_flip": (24, "flip", 3, 1),
    "head_first_bs48": (48, None, 2, 0),
}


def transform(geo: Geo, name: str) -> tuple[StagingLayout, int]:
    block, order, heads, offset = TRANSFORMS[name]
    if order == "flip":
        order = "HND" if geo.order == "NHD" else "NHD"
    if geo.kind == "mla":
        heads, offset = None, 0
    return staging_layout(geo, block_size=block, order=order, num_heads=heads), offset


# ------------------------------------------------------------------------------------------ byte oracles
def _staging_tokens(staging: Bytes, geo: Geo, layout: StagingLayout, num_tokens: int) -> Bytes:
    """A view ``[U, L, P, Bs, Hs, D, itemsize]`` of the used part of a staging byte buffer."""
    units = -(-num_tokens // layout.block_size)
    piece = (layout.block_size, layout.num_heads) if layout.order is kvshuttle.TokenOrder.NHD else (
        layout.num_heads, layout.block_size)
    shape = (units, geo.num_layers, geo.planes, *piece, geo.head_size, geo.itemsize)
    used = staging[: math.prod(shape)].reshape(shape)
    return used if layout.order is kvshuttle.TokenOrder.NHD else used.transpose(0, 1, 2, 4, 3, 5, 6)


def _positions(geo: Geo, layout: StagingLayout, ids: npt.NDArray[np.int64], num_tokens: int) -> tuple[
    npt.NDArray[np.intp], ...
]:
    t = np.arange(num_tokens)
    return ids[t // geo.block_size], t % geo.block_size, t // layout.block_size, t % layout.block_size


def oracle_pack(cache: HostCache, ids: Any, staging: Bytes, layout: StagingLayout,
                num_tokens: int, head_offset: int = 0) -> None:
    """Write what pack must produce into ``staging`` by indexing the user's logical arrays directly."""
    geo, ids = cache.geo, np.asarray(ids, dtype=np.int64)
    blocks, slots, units, ks = _positions(geo, layout, ids, num_tokens)
    out = _staging_tokens(staging, geo, layout, num_tokens)
    heads = slice(head_offset, head_offset + layout.num_heads)
    for layer in range(geo.num_layers):
        tokens = cache.canonical(layer)[:, blocks, slots, heads]  # [P, T, Hs, D, is]
        out[units, layer, :, ks] = tokens.transpose(1, 0, 2, 3, 4)


def oracle_unpack(staging: Bytes, cache: HostCache, ids: Any, layout: StagingLayout,
                  num_tokens: int, head_offset: int = 0) -> None:
    """Write what unpack must produce into ``cache`` (in place) by indexing its logical arrays."""
    geo, ids = cache.geo, np.asarray(ids, dtype=np.int64)
    blocks, slots, units, ks = _positions(geo, layout, ids, num_tokens)
    src = _staging_tokens(staging, geo, layout, num_tokens)
    heads = slice(head_offset, head_offset + layout.num_heads)
    for layer in range(geo.num_layers):
        canon = cache.canonical(layer)
        canon[:, blocks, slots, heads] = src[units, layer, :, ks].transpose(1, 0, 2, 3, 4)


def assert_bytes_equal(got: Bytes, want: Bytes, what: str = "buffer") -> None:
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    assert got.shape == want.shape, f"{what}: {got.shape} bytes vs {want.shape}"
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (
        f"{what}: {bad.size} of {got.size} bytes differ, first at offset {bad[0]} "
        f"(got {got[bad[0]]:#04x}, want {want[bad[0]]:#04x})"
    )


def assert_caches_equal(got: list[Bytes], want: list[Bytes], what: str = "cache") -> None:
    assert len(got) == len(want)
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bytes_equal(g, w, f"{what} layer {layer}")


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the test id: reproducible, different per parametrization."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def native_threads() -> Any:
    """Set the native thread count for one test (every copy split over all of them, however small); restore the
    defaults (usable cores, bytes per thread) after."""
    native = pytest.importorskip("kvshuttle._native")
    native.set_bytes_per_thread(0)
    yield native.set_num_threads
    native.set_num_threads(0)
    native.set_bytes_per_thread(-1)
