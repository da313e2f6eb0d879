"""pack / unpack: validate once, then run the native CPU or CUDA path, or the numpy reference.

Validation happens before any byte moves, so a bad call raises a named error and leaves the destination
untouched. The CPU path is synchronous; the CUDA path is enqueued on ``stream`` (default: the current
torch or cupy stream of the arrays' framework) and returns before the copy finishes.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._values import is_int
from ..errors import BackendError, BlockIdError, LayoutError, StagingError, shown
from . import native, reference
from .arrays import ArrayView, describe, host_bytes
from .blocks import BlockIds, blocks_hold_tokens, check_ids
from .layout import CacheGeometry, PagedKVCache, StagingLayout, TokenOrder
from .native import Backend


@dataclass(frozen=True)
class CopyPlan:
    """One validated pack or unpack: everything both backends need."""

    cache: PagedKVCache
    block_ids: npt.NDArray[np.int64]
    staging: ArrayView
    layout: StagingLayout
    num_tokens: int
    head_offset: int

    def native_spec(self) -> native.PagedCopySpec:
        spec = native.ext.PagedCopySpec(_spec_template(self.cache.geometry, self.layout, self.head_offset))
        spec.staging_addr, spec.staging_bytes = self.staging.address, self.staging.nbytes
        spec.num_tokens = self.num_tokens
        return spec


@functools.lru_cache(maxsize=64)
def _spec_template(g: CacheGeometry, layout: StagingLayout, head_offset: int) -> native.PagedCopySpec:
    """What every copy of one geometry, layout and head offset shares: setting it costs more than a copy of it.

    Never handed out: :meth:`CopyPlan.native_spec` copies it before filling in the staging and token count."""
    native.require()
    ext = native.ext
    spec = ext.PagedCopySpec()
    spec.num_layers, spec.planes_per_layer = g.num_layers, g.planes_per_layer
    spec.num_blocks, spec.block_stride = g.num_blocks, g.block_stride
    spec.block_size, spec.num_heads, spec.head_offset = g.block_size, g.num_heads, head_offset
    spec.token_stride, spec.head_stride = g.token_stride, g.head_stride
    spec.staging_block_size, spec.staging_heads = layout.block_size, layout.num_heads
    spec.staging_order = ext.TokenOrder.NHD if layout.order is TokenOrder.NHD else ext.TokenOrder.HND
    spec.row_bytes = g.row_bytes
    return spec


def staging_nbytes(cache: PagedKVCache | CacheGeometry, num_tokens: int, layout: StagingLayout | None = None) -> int:
    """Bytes a staging buffer needs for ``num_tokens`` tokens in ``layout`` (default: the cache's own)."""
    if isinstance(cache, PagedKVCache):
        geometry = cache.geometry
    elif isinstance(cache, CacheGeometry):
        geometry = cache
    else:
        raise LayoutError(f"pass a PagedKVCache or its CacheGeometry, not {type(cache).__name__}")
    if not is_int(num_tokens) or num_tokens < 0:
        raise BlockIdError(f"num_tokens must be a non-negative integer, got {shown(num_tokens)}")
    return _layout(layout, geometry).nbytes(geometry, int(num_tokens))


def _layout(layout: object, geometry: CacheGeometry, num_heads: int | None = None) -> StagingLayout:
    if layout is None:
        return StagingLayout.like(geometry, num_heads)
    if not isinstance(layout, StagingLayout):
        raise LayoutError(f"layout must be a StagingLayout or None, not {type(layout).__name__}")
    return layout


def _check_block_ids(block_ids: BlockIds, geometry: CacheGeometry, num_tokens: int | None) -> tuple[
    npt.NDArray[np.int64], int
]:
    ids = check_ids(block_ids, geometry.num_blocks)
    tokens = ids.size * geometry.block_size if num_tokens is None else num_tokens
    if not is_int(tokens):  # 40.5 is not 40 tokens, True is not 1
        raise BlockIdError(f"num_tokens must be an integer, got {shown(num_tokens)}")
    if not blocks_hold_tokens(int(ids.size), geometry.block_size, tokens):
        raise BlockIdError(
            f"{ids.size} blocks of {geometry.block_size} tokens cannot hold exactly {shown(tokens)} tokens "
            "(pass one block per started block of tokens)"
        )
    return ids, int(tokens)


def plan_copy(
    cache: PagedKVCache, block_ids: BlockIds, staging: Any, *, num_tokens: int | None = None,
    layout: StagingLayout | None = None, head_offset: int = 0, staging_written: bool,
) -> CopyPlan:
    """Validate one pack (``staging_written=True``) or unpack; raise a named error on any problem."""
    if not isinstance(cache, PagedKVCache):
        raise LayoutError("pass a PagedKVCache (PagedKVCache.from_arrays(layers, kind))")
    g = cache.geometry
    if not is_int(head_offset):
        raise LayoutError(f"head_offset must be an integer, got {shown(head_offset)}")
    head_offset = int(head_offset)
    layout = _layout(layout, g, g.num_heads - head_offset if 0 < head_offset < g.num_heads else None)
    if not 0 <= head_offset <= g.num_heads - layout.num_heads:
        raise LayoutError(
            f"heads [{shown(head_offset)}, {shown(head_offset + layout.num_heads)}) are outside the cache's "
            f"{g.num_heads}; pass a head_offset and layout.num_heads that fit"
        )
    ids, tokens = _check_block_ids(block_ids, g, num_tokens)
    view = describe(staging)
    if view.device != g.device:
        raise StagingError(f"staging is on {view.device} but the cache is on {g.device}")
    if not view.is_c_contiguous():
        raise StagingError("staging must be C-contiguous")
    if staging_written and not view.writeable:
        raise StagingError("staging is read-only")
    if not staging_written and not all(layer.writeable for layer in cache.layers):
        raise LayoutError("the destination cache is read-only")
    need = layout.nbytes(g, tokens)
    if view.nbytes < need:
        raise StagingError(f"staging holds {view.nbytes} bytes; {tokens} tokens in {layout} need {need}")
    return CopyPlan(cache, ids, view, layout, tokens, head_offset)


def current_stream(cache: PagedKVCache) -> int:
    """The calling thread's current CUDA stream of the framework that owns ``cache`` (torch or cupy; 0: the
    default stream), where that framework's writes of the cache are ordered."""
    owner = cache.layers[0].owner
    if type(owner).__module__.startswith("torch"):
        torch = sys.modules["torch"]
        return int(torch.cuda.current_stream(owner.device).cuda_stream)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(owner, cupy.ndarray):
        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def _run(plan: CopyPlan, pack: bool, backend: Backend, stream: int | None) -> None:
    backend = native.check_backend(backend)
    if stream is not None and not (is_int(stream) and 0 <= stream < 2**64):
        raise BackendError(f"stream must be a CUDA stream handle (an int) or None, got {shown(stream)}")
    ext = native.ext
    if plan.cache.is_cuda:
        if backend == "reference" or not native.cuda_built():
            raise BackendError("CUDA arrays need the native CUDA build (install with KVSHUTTLE_CUDA=ON)")
        ext.paged_copy_cuda(
            plan.native_spec(), plan.cache.plane_bases, plan.block_ids,
            ext.Direction.PACK if pack else ext.Direction.UNPACK,
            current_stream(plan.cache) if stream is None else int(stream),
        )
        return
    if backend == "reference" or (backend == "auto" and not native.available()):
        staged = host_bytes(plan.staging.address, plan.staging.nbytes)
        if pack:
            reference.pack(plan.cache, plan.block_ids, staged, plan.layout, plan.num_tokens, plan.head_offset)
        else:
            reference.unpack(staged, plan.cache, plan.block_ids, plan.layout, plan.num_tokens, plan.head_offset)
        return
    native.require()
    ext.paged_copy_cpu(plan.native_spec(), plan.cache.plane_bases, plan.block_ids,
                       ext.Direction.PACK if pack else ext.Direction.UNPACK)


def submit_host_copy(copier: native.AsyncCopier, plan: CopyPlan, pack: bool) -> native.CopyTicket:
    """Queue a validated host copy on ``copier``'s native worker; the caller keeps both sides alive until done."""
    native.require()
    ext = native.ext
    return copier.submit(plan.native_spec(), plan.cache.plane_bases, plan.block_ids,
                         ext.Direction.PACK if pack else ext.Direction.UNPACK)


def pack(
    cache: PagedKVCache, block_ids: BlockIds, staging: Any, *, num_tokens: int | None = None,
    layout: StagingLayout | None = None, head_offset: int = 0, stream: int | None = None,
    backend: Backend = "auto",
) -> None:
    """Gather blocks ``block_ids`` (any order) of every layer into the contiguous ``staging`` buffer.

    Args:
        cache: the source caches.
        block_ids: paged block ids, in sequence order; block i holds tokens [i*B, (i+1)*B).
        staging: a C-contiguous array on the cache's device with at least :func:`staging_nbytes` bytes.
        num_tokens: tokens to copy (default: every slot of every block); the last block may be partial.
        layout: the staging layout (default: the cache's own); a different order, block size or head count
            transforms on the way.
        head_offset: first cache head copied when ``layout.num_heads`` is a slice (tensor-parallel shard).
        stream: CUDA stream handle for device caches.
        backend: ``"native"``, ``"reference"`` or ``"auto"`` (native when built).
    """
    plan = plan_copy(cache, block_ids, staging, num_tokens=num_tokens, layout=layout,
                     head_offset=head_offset, staging_written=True)
    _run(plan, True, backend, stream)


def unpack(
    staging: Any, cache: PagedKVCache, block_ids: BlockIds, *, num_tokens: int | None = None,
    layout: StagingLayout | None = None, head_offset: int = 0, stream: int | None = None,
    backend: Backend = "auto",
) -> None:
    """Scatter a staging buffer (in ``layout``) into blocks ``block_ids`` of every layer: the inverse of pack.

    Slots past ``num_tokens`` in the last block and heads outside the slice are left untouched.
    """
    plan = plan_copy(cache, block_ids, staging, num_tokens=num_tokens, layout=layout,
                     head_offset=head_offset, staging_written=False)
    _run(plan, False, backend, stream)
