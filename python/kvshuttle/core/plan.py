"""Read planning: NIXL descriptor arrays (addr, len, dev) for both sides of a paged KV-cache read.

Piece (plane p, i-th id) of the local cache, ``local.plane_bases[p] + local_ids[i] * local.block_stride``,
is read from ``remote.plane_bases[p] + remote_ids[i] * remote.block_stride``; every piece is
``piece_bytes`` long. Consecutive pieces merge into one descriptor when they continue exactly where the
previous descriptor ended on *both* sides.

Pieces are enumerated in local address order, so the descriptor count is the minimum possible: a local
descriptor is a run of pieces adjacent in local memory, and the only breaks are those forced by either
side. The order is derived from the local geometry (never from a kind flag): planes that are separate
regions (FlashAttention, MLA) are walked plane by plane, planes interleaved inside a block (FlashInfer's
K and V) are walked layer by layer, block by block, plane by plane. Ids are sorted by local id first.
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

Descriptors = npt.NDArray[np.uint64]
Ids = npt.NDArray[np.int64]

_WIRE_KEYS = ("plane_bases", "planes_per_layer", "block_stride", "piece_bytes", "num_blocks", "device_id")


@dataclass(frozen=True, eq=False)
class SideGeometry:
    """What the planner needs from one side's paged cache; travels in the handshake.

    ``to_wire``/``from_wire`` give a plain dict of ints and lists of ints (msgpack- and json-able).
    """

    plane_bases: npt.NDArray[np.uint64]  # [num_layers * planes_per_layer]: layer * planes_per_layer + plane
    planes_per_layer: int
    block_stride: int  # bytes between consecutive blocks of one plane
    piece_bytes: int  # bytes of one (plane, block) piece
    num_blocks: int
    device_id: int = 0  # NIXL devId of every descriptor on this side (0 for DRAM)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plane_bases", _addresses(self.plane_bases))
        for name in _WIRE_KEYS[1:]:
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
        g = cache.geometry
        return cls(cache.plane_bases.copy(), g.planes_per_layer, g.block_stride, g.piece_bytes, g.num_blocks,
                   device_id)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {k: getattr(self, k) for k in _WIRE_KEYS[1:]}
        wire["plane_bases"] = [int(b) for b in self.plane_bases]
        return wire

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SideGeometry:
        if not isinstance(d, Mapping):
            raise LayoutError(f"geometry from the peer must be a dict, got {type(d).__name__}")
        missing = [k for k in _WIRE_KEYS if k not in d]
        if missing:
            raise LayoutError(f"geometry from the peer lacks {missing}")
        return cls(**{k: d[k] for k in _WIRE_KEYS})

    @property
    def num_planes(self) -> int:
        return int(self.plane_bases.size)

    def _key(self) -> tuple[int, ...]:
        return (self.planes_per_layer, self.block_stride, self.piece_bytes, self.num_blocks, self.device_id,
                *self.plane_bases.tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SideGeometry):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @cached_property
    def enumeration_units(self) -> Ids:
        """Plane indices ``[units, planes_per_unit]`` in local address order (see the module docstring).

        Units are single planes when every plane is a separate region, else whole layers with their planes
        inside each block; LayoutError when pieces overlap or layers interleave (no address order to walk).
        """
        for per_unit in dict.fromkeys((1, self.planes_per_layer)):
            units = _address_ordered_units(self, per_unit)
            if units is not None:
                return units
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


def _address_ordered_units(side: SideGeometry, per_unit: int) -> Ids | None:
    """Units of ``per_unit`` planes of one layer whose pieces, walked unit, block, plane, rise in address.

    None when they do not: planes of a unit overlap or reach past a block, or two units' spans overlap.
    """
    bases = side.plane_bases.tolist()
    units = [sorted(range(first, first + per_unit), key=bases.__getitem__)
             for first in range(0, side.num_planes, per_unit)]
    piece, stride = side.piece_bytes, side.block_stride
    block_extent = 0  # bytes from a unit's first plane to the end of its last plane, in one block
    for unit in units:
        offsets = [bases[p] - bases[unit[0]] for p in unit]
        if any(nxt < prev + piece for prev, nxt in pairwise(offsets)):
            return None
        block_extent = max(block_extent, offsets[-1] + piece)
    if side.num_blocks > 1 and block_extent > stride:
        return None
    span = (side.num_blocks - 1) * stride + block_extent
    units.sort(key=lambda unit: bases[unit[0]])
    if any(bases[nxt[0]] < bases[prev[0]] + span for prev, nxt in pairwise(units)):
        return None
    return np.array(units, dtype=np.int64).reshape(len(units), per_unit)


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """Descriptor arrays of one read: row k of ``local`` receives row k of ``remote``."""

    local: Descriptors  # uint64 [n, 3] (addr, len, dev)
    remote: Descriptors  # uint64 [n, 3]
    num_pieces: int  # (plane, block) pieces before coalescing: len(ids) * planes

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
            "needs the same block size, heads, head size, dtype and layer count on both sides"
        )


def native_available() -> bool:
    """Whether the native planner is built (else ``backend="auto"`` plans with the numpy reference)."""
    return native.available()


def _native_spec(local: SideGeometry, remote: SideGeometry, units: Ids) -> native.ReadPlanSpec:
    spec = native.ext.ReadPlanSpec()
    spec.num_units, spec.planes_per_unit = units.shape
    spec.piece_bytes = local.piece_bytes
    spec.local_block_stride, spec.local_device = local.block_stride, local.device_id
    spec.remote_block_stride, spec.remote_device = remote.block_stride, remote.device_id
    return spec


def _native_rows(spec: native.ReadPlanSpec, units: Ids, local: SideGeometry, local_ids: Ids, remote: SideGeometry,
                 remote_ids: Ids) -> tuple[Descriptors, Descriptors] | None:
    """Both row arrays, or None when the ids are not sorted by local id and valid (native check)."""
    return native.ext.plan_read_descriptors(
        spec, units, local.plane_bases, local_ids, remote.plane_bases, remote_ids, local.num_blocks,
        remote.num_blocks,
    )


def plan_read(
    local: SideGeometry, local_ids: BlockIds, remote: SideGeometry, remote_ids: BlockIds, *,
    backend: Backend = "auto",
) -> ReadPlan:
    """Descriptors reading remote blocks ``remote_ids`` into local blocks ``local_ids`` (pairwise).

    ``backend="auto"`` uses the native planner when it is built, else the numpy reference; both produce
    identical arrays. Raises LayoutError when the sides' pieces or plane counts differ (or the local
    pieces overlap), BlockIdError for ids that are out of range, of different counts, or repeat a local
    block, BackendError for an unknown or unbuilt backend. Nothing is modified.
    """
    backend = native.check_backend(backend)
    _check_sides(local, remote)
    lids, rids = as_ids(local_ids, "local"), as_ids(remote_ids, "remote")
    if lids.size != rids.size:
        raise BlockIdError(f"{lids.size} local block ids but {rids.size} remote ones; pass one per block")
    units = local.enumeration_units
    num_pieces = int(lids.size) * local.num_planes
    if backend == "native" or (backend == "auto" and native_available()):
        if not native_available():
            raise BackendError("the native planner is not built: rebuild, or use backend='reference'")
        spec = _native_spec(local, remote, units)
        # The native pass checks ids already sorted by local id and valid (the common case) itself;
        # anything else is sorted, or rejected with a named error, here.
        rows = _native_rows(spec, units, local, lids, remote, rids)
        if rows is None:
            lids, rids = _sorted_pairs(local, lids, remote, rids)
            rows = _native_rows(spec, units, local, lids, remote, rids)
        if rows is None:  # pragma: no cover - the two checks disagree: a bug
            raise AssertionError("the native planner refused ids the Python checks accepted")
        lrows, rrows = rows
    else:
        lids, rids = _sorted_pairs(local, lids, remote, rids)
        lrows, rrows = reference.plan_read(
            units, local.piece_bytes, local.plane_bases, lids, local.block_stride, local.device_id,
            remote.plane_bases, rids, remote.block_stride, remote.device_id,
        )
    return ReadPlan(local=lrows, remote=rrows, num_pieces=num_pieces)
