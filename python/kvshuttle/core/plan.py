"""Read planning: NIXL descriptor arrays (addr, len, dev) for both sides of a paged KV-cache read.

Piece (column p, i-th id) of the local cache, ``local.plane_bases[p] + local_ids[i] * local.block_stride``,
is read from ``remote.plane_bases[p] + remote_ids[i] * remote.block_stride``; every piece is
``piece_bytes`` long. A column is one plane of one layer when the plane's block is one contiguous piece
(every dense layout), or a layer's whole page (all its planes in one block) when its planes interleave row by
row (vLLM 0.32), or each contiguous run of that page (:mod:`kvshuttle.core.pages`). Consecutive pieces merge
into one descriptor when they continue exactly where the previous descriptor ended on *both* sides.

Pieces are enumerated in local address order, so the descriptor count is the minimum possible: a local
descriptor is a run of pieces adjacent in local memory, and the only breaks are those forced by either
side. The order is derived from the local geometry (never from a kind flag): the columns are split into
*walk groups*, each walked block by block, column by column. Columns that are separate regions
(FlashAttention, MLA, vLLM 0.32's layer-major layouts) are groups of one; planes interleaved inside a block
(FlashInfer's K and V) are walked layer by layer; layers interleaved inside a block (vLLM's block-major
BLHNC: every layer's page of block n in one stretch) are one group, so a block of all layers is one run.
Ids are sorted by local id first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from .._values import is_int
from ..errors import BackendError, BlockIdError, LayoutError, shown
from . import native, reference
from .blocks import BlockIds, as_ids, check_ids
from .layout import PagedKVCache
from .native import Backend as Backend  # re-exported: callers spell it plan.Backend
from .pages import direct_pieces

Descriptors = npt.NDArray[np.uint64]
Ids = npt.NDArray[np.int64]

_WIRE_KEYS = ("plane_bases", "planes_per_layer", "block_stride", "piece_bytes", "num_blocks", "device_id",
              "piece_format")


@dataclass(frozen=True, eq=False)
class SideGeometry:
    """What the planner needs from one side's paged cache; travels in the handshake.

    The "planes" here are the piece columns of the module docstring (a layer's K and V planes for every
    dense layout). ``piece_format`` identifies what the bytes of a piece mean (:mod:`kvshuttle.core.pages`;
    empty when unknown): a read needs equal formats on both sides. ``to_wire``/``from_wire`` give a plain
    dict of ints, a string and a list of ints (msgpack- and json-able).
    """

    plane_bases: npt.NDArray[np.uint64]  # [num_layers * planes_per_layer]: layer * planes_per_layer + column
    planes_per_layer: int  # piece columns per layer
    block_stride: int  # bytes between consecutive blocks of one column
    piece_bytes: int  # bytes of one (column, block) piece
    num_blocks: int
    device_id: int = 0  # NIXL devId of every descriptor on this side (0 for DRAM)
    piece_format: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "plane_bases", _addresses(self.plane_bases))
        if not isinstance(self.piece_format, str) or len(self.piece_format) > 64:
            raise LayoutError(f"piece_format must be a short string, got {shown(self.piece_format)}")
        for name in _WIRE_KEYS[1:-1]:
            value = getattr(self, name)
            # Signed 64-bit, as the native planner's fields (and every peer's msgpack) carry them.
            if not (is_int(value) and -(2**63) <= value < 2**63):
                raise LayoutError(f"{name} must be a 64-bit integer, got {shown(value)}")
            object.__setattr__(self, name, int(value))
        num_planes = self.plane_bases.size
        if self.planes_per_layer <= 0 or num_planes == 0 or num_planes % self.planes_per_layer:
            raise LayoutError(
                f"{num_planes} plane bases do not make whole layers of {self.planes_per_layer} planes"
            )
        if self.piece_bytes <= 0 or self.num_blocks <= 0 or self.block_stride < 0 or self.device_id < 0:
            raise LayoutError(
                "need piece_bytes > 0, num_blocks > 0, block_stride >= 0, device_id >= 0; got "
                f"{self.piece_bytes}, {self.num_blocks}, {self.block_stride}, {self.device_id}"
            )
        if self.num_blocks > 1 and self.block_stride < self.piece_bytes:
            raise LayoutError(
                f"blocks overlap: block_stride {self.block_stride} < piece_bytes {self.piece_bytes}"
            )
        last_byte = int(self.plane_bases.max()) + (self.num_blocks - 1) * self.block_stride + self.piece_bytes
        if last_byte > 2**64:
            raise LayoutError("the cache would end past the 64-bit address space; plane_bases are wrong")

    @classmethod
    def from_cache(cls, cache: PagedKVCache, device_id: int = 0) -> SideGeometry:
        """The direct-read pieces of ``cache`` (:func:`kvshuttle.core.pages.direct_pieces`)."""
        g = cache.geometry
        pieces = direct_pieces(g)
        layer_bases = np.array([layer.address for layer in cache.layers], dtype=np.uint64)
        bases = (layer_bases[:, None] + np.array(pieces.offsets, dtype=np.uint64)[None, :]).reshape(-1)
        return cls(bases, len(pieces.offsets), g.block_stride, pieces.nbytes, g.num_blocks, device_id,
                   pieces.format)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {k: getattr(self, k) for k in _WIRE_KEYS[1:]}
        wire["plane_bases"] = [int(b) for b in self.plane_bases]
        return wire

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SideGeometry:
        if not isinstance(d, Mapping):
            raise LayoutError(f"geometry from the peer must be a dict, got {type(d).__name__}")
        missing = [k for k in _WIRE_KEYS[:-1] if k not in d]
        if missing:
            raise LayoutError(f"geometry from the peer lacks {missing}")
        return cls(**{k: d[k] for k in _WIRE_KEYS if k in d})

    @property
    def num_planes(self) -> int:
        return int(self.plane_bases.size)

    def _key(self) -> tuple[int | str, ...]:
        return (self.planes_per_layer, self.block_stride, self.piece_bytes, self.num_blocks, self.device_id,
                self.piece_format, *self.plane_bases.tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SideGeometry):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @cached_property
    def walk_groups(self) -> Ids:
        """Column indices ``[groups, columns_per_group]`` in local address order (see the module docstring).

        Groups are single columns when every column is a separate region, else whole layers with their
        columns inside each block, else every column when all layers share each block's stretch;
        LayoutError when pieces overlap (no address order to walk).
        """
        for per_group in dict.fromkeys((1, self.planes_per_layer, self.num_planes)):
            groups = _address_ordered_walk_groups(self, per_group)
            if groups is not None:
                return groups
        raise LayoutError(
            "pieces of this geometry overlap or interleave across layers: no address order to plan in"
        )


def _addresses(values: Any) -> npt.NDArray[np.uint64]:
    """A read-only 1-D uint64 copy of ``values``; LayoutError for anything but non-negative 64-bit ints."""
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError):  # ragged nesting, objects numpy cannot hold
        raise LayoutError(f"plane_bases must be a 1-D sequence of integers, got {shown(values)}") from None
    if arr.size == 0:
        arr = arr.astype(np.uint64)
    if arr.dtype == object:  # Python ints past int64 (addresses in the upper half of the space), or junk
        flat = arr.reshape(-1).tolist()
        if not all(is_int(v) and 0 <= v < 2**64 for v in flat):
            raise LayoutError("plane_bases must be non-negative 64-bit addresses")
        arr = np.array(flat, dtype=np.uint64).reshape(arr.shape)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise LayoutError(f"plane_bases must be a 1-D sequence of integers, got {arr.dtype} {arr.shape}")
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        raise LayoutError(f"plane_bases must be non-negative addresses, got {arr.min()}")
    bases = np.array(arr, dtype=np.uint64, copy=True)
    bases.flags.writeable = False
    return bases


def _address_ordered_walk_groups(side: SideGeometry, per_group: int) -> Ids | None:
    """Walk groups of ``per_group`` consecutive columns whose pieces, walked group, block, column, rise in
    address.

    None when they do not: columns of a group overlap or reach past a block, or two groups' spans overlap.
    """
    bases = side.plane_bases.tolist()
    groups = [sorted(range(first, first + per_group), key=bases.__getitem__)
              for first in range(0, side.num_planes, per_group)]
    piece, stride = side.piece_bytes, side.block_stride
    block_extent = 0  # bytes from a group's first column to the end of its last column, in one block
    for group in groups:
        offsets = [bases[p] - bases[group[0]] for p in group]
        if any(nxt < prev + piece for prev, nxt in pairwise(offsets)):
            return None
        block_extent = max(block_extent, offsets[-1] + piece)
    if side.num_blocks > 1 and block_extent > stride:
        return None
    span = (side.num_blocks - 1) * stride + block_extent
    groups.sort(key=lambda group: bases[group[0]])
    if any(bases[nxt[0]] < bases[prev[0]] + span for prev, nxt in pairwise(groups)):
        return None
    return np.array(groups, dtype=np.int64).reshape(len(groups), per_group)


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """Descriptor arrays of one read: row k of ``local`` receives row k of ``remote``."""

    local: Descriptors  # uint64 [n, 3] (addr, len, dev)
    remote: Descriptors  # uint64 [n, 3]
    num_pieces: int  # (column, block) pieces before coalescing: len(ids) * columns

    @property
    def num_descriptors(self) -> int:
        return int(self.local.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.local[:, 1].sum(dtype=np.uint64))

    @property
    def bytes_per_descriptor(self) -> float:
        return self.total_bytes / self.num_descriptors if self.num_descriptors else 0.0


def _sorted_pairs(local: SideGeometry, local_ids: Ids, remote: SideGeometry,
                  remote_ids: Ids) -> tuple[Ids, Ids]:
    """The id pairs, validated, sorted by local id; BlockIdError when a local id repeats."""
    local_ids = check_ids(local_ids, local.num_blocks, "local", unique=False)
    remote_ids = check_ids(remote_ids, remote.num_blocks, "remote", unique=False)
    if local_ids.size > 1 and np.any(local_ids[1:] < local_ids[:-1]):
        order = np.argsort(local_ids, kind="stable")
        local_ids, remote_ids = local_ids[order], remote_ids[order]
    repeated = local_ids[1:] == local_ids[:-1]
    if repeated.any():
        raise BlockIdError(f"local block id {local_ids[1:][repeated][0]} appears more than once")
    return local_ids, remote_ids


def _check_sides(local: SideGeometry, remote: SideGeometry) -> None:
    if not isinstance(local, SideGeometry) or not isinstance(remote, SideGeometry):
        raise LayoutError("pass SideGeometry for both sides (SideGeometry.from_cache / from_wire)")
    mine = (local.piece_bytes, local.num_planes, local.planes_per_layer)
    theirs = (remote.piece_bytes, remote.num_planes, remote.planes_per_layer)
    if mine != theirs:
        raise LayoutError(
            f"(piece_bytes, planes, planes_per_layer) differ: local {mine}, remote {theirs}; a plain read "
            "needs the same block size, heads, head size, dtype, layer count and page layout on both sides"
        )
    if local.piece_format != remote.piece_format:
        raise LayoutError(
            f"the pieces of the two caches hold their rows differently (piece format {local.piece_format!r} "
            f"vs {remote.piece_format!r}: another kind, token order or vLLM layout); read packed instead"
        )


def native_available() -> bool:
    """Whether the native planner is built (else ``backend="auto"`` plans with the numpy reference)."""
    return native.available()


def _native_spec(local: SideGeometry, remote: SideGeometry, groups: Ids) -> native.ReadPlanSpec:
    spec = native.ext.ReadPlanSpec()
    spec.num_walk_groups, spec.planes_per_walk_group = groups.shape
    spec.piece_bytes = local.piece_bytes
    spec.local_block_stride, spec.local_device = local.block_stride, local.device_id
    spec.remote_block_stride, spec.remote_device = remote.block_stride, remote.device_id
    return spec


def _native_rows(spec: native.ReadPlanSpec, groups: Ids, local: SideGeometry, local_ids: Ids,
                 remote: SideGeometry, remote_ids: Ids) -> tuple[Descriptors, Descriptors] | None:
    """Both row arrays, or None when the ids are not sorted by local id and valid (native check)."""
    return native.ext.plan_read_descriptors(
        spec, groups, local.plane_bases, local_ids, remote.plane_bases, remote_ids, local.num_blocks,
        remote.num_blocks,
    )


def plan_read(
    local: SideGeometry, local_ids: BlockIds, remote: SideGeometry, remote_ids: BlockIds, *,
    backend: Backend = "auto",
) -> ReadPlan:
    """Descriptors reading remote blocks ``remote_ids`` into local blocks ``local_ids`` (pairwise).

    ``backend="auto"`` uses the native planner when it is built, else the numpy reference; both produce
    identical arrays. Raises LayoutError when the sides' pieces, column counts or piece formats differ (or
    the local pieces overlap), BlockIdError for ids that are out of range, of different counts, or repeat a local
    block, BackendError for an unknown or unbuilt backend. Nothing is modified.
    """
    backend = native.check_backend(backend)
    _check_sides(local, remote)
    lids, rids = as_ids(local_ids, "local"), as_ids(remote_ids, "remote")
    if lids.size != rids.size:
        raise BlockIdError(f"{lids.size} local block ids but {rids.size} remote ones; pass one per block")
    groups = local.walk_groups
    num_pieces = int(lids.size) * local.num_planes
    if backend == "native" or (backend == "auto" and native_available()):
        if not native_available():
            raise BackendError("the native planner is not built: rebuild, or use backend='reference'")
        spec = _native_spec(local, remote, groups)
        # The native pass checks ids already sorted by local id and valid (the common case) itself;
        # anything else is sorted, or rejected with a named error, here.
        rows = _native_rows(spec, groups, local, lids, remote, rids)
        if rows is None:
            lids, rids = _sorted_pairs(local, lids, remote, rids)
            rows = _native_rows(spec, groups, local, lids, remote, rids)
        if rows is None:  # pragma: no cover - the two checks disagree: a bug
            raise AssertionError("the native planner refused ids the Python checks accepted")
        lrows, rrows = rows
    else:
        lids, rids = _sorted_pairs(local, lids, remote, rids)
        lrows, rrows = reference.plan_read(
            groups, local.piece_bytes, local.plane_bases, lids, local.block_stride, local.device_id,
            remote.plane_bases, rids, remote.block_stride, remote.device_id,
        )
    return ReadPlan(local=lrows, remote=rrows, num_pieces=num_pieces)
