"""What travels on the side channel: msgpack dicts, the handshake payload, the compatibility check.

Every message is one msgpack map with an ``"op"`` key. The handshake (``hello``) carries the NIXL agent
metadata, the planner's :class:`~kvshuttle.plan.SideGeometry` and the cache's logical geometry
(:class:`CacheInfo`), so the reader can check compatibility before any byte moves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from ..core.layout import CacheGeometry, CacheKind
from ..core.plan import SideGeometry
from .errors import IncompatiblePeerError, ProtocolError

PROTOCOL_VERSION = 1
NOTIF_PREFIX = b"kvshuttle:done:"


def encode(message: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


def decode(data: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"undecodable side-channel message ({exc}); are both sides kvshuttle?") from exc
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("side-channel message without an 'op'; run the same kvshuttle on both sides")
    return message


@dataclass(frozen=True)
class CacheInfo:
    """The logical geometry of one side's paged cache (what the compatibility check compares)."""

    kind: str
    order: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    dtype: str
    itemsize: int
    mem_type: str  # "DRAM" or "VRAM"

    @classmethod
    def from_geometry(cls, g: CacheGeometry, mem_type: str) -> CacheInfo:
        return cls(g.kind.value, g.order.value, g.num_layers, g.num_blocks, g.block_size, g.num_heads,
                   g.head_size, g.dtype, g.itemsize, mem_type)

    @property
    def is_mla(self) -> bool:
        return self.kind == CacheKind.MLA.value

    @property
    def row_bytes(self) -> int:
        return self.head_size * self.itemsize

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> CacheInfo:
        try:
            return cls(**{k: d[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"peer cache geometry lacks a field ({exc}); upgrade both sides") from exc


@dataclass(frozen=True)
class StagingInfo:
    """The owner's registered staging pool: ``slots`` chunks of ``slot_bytes`` (0 slots: no packed path)."""

    slot_bytes: int
    slots: int
    mem_type: str = "DRAM"
    device_id: int = 0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PeerInfo:
    """Everything a reader learns about an owner at the handshake."""

    agent_name: str
    metadata: bytes
    side: SideGeometry
    cache: CacheInfo
    staging: StagingInfo

    def to_wire(self) -> dict[str, Any]:
        return {
            "op": "hello", "protocol": PROTOCOL_VERSION, "agent": self.agent_name, "metadata": self.metadata,
            "side": self.side.to_wire(), "cache": self.cache.to_wire(), "staging": self.staging.to_wire(),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PeerInfo:
        if d.get("protocol") != PROTOCOL_VERSION:
            raise IncompatiblePeerError(
                f"peer speaks kvshuttle side-channel protocol {d.get('protocol')}, this side "
                f"{PROTOCOL_VERSION}; run the same kvshuttle version on both sides"
            )
        try:
            st = d["staging"]
            staging = StagingInfo(int(st["slot_bytes"]), int(st["slots"]), str(st["mem_type"]),
                                  int(st["device_id"]))
            return cls(str(d["agent"]), bytes(d["metadata"]), SideGeometry.from_wire(d["side"]),
                       CacheInfo.from_wire(d["cache"]), staging)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed handshake from peer ({exc})") from exc


def check_compatible(local: CacheInfo, remote: CacheInfo) -> None:
    """Raise IncompatiblePeerError when no path (direct or packed) can move blocks between the caches."""
    problems = []
    if local.dtype != remote.dtype or local.itemsize != remote.itemsize:
        problems.append(f"dtype {local.dtype} here vs {remote.dtype} on the peer")
    if local.head_size != remote.head_size:
        problems.append(f"head size {local.head_size} here vs {remote.head_size} on the peer")
    if local.num_layers != remote.num_layers:
        problems.append(f"{local.num_layers} layers here vs {remote.num_layers} on the peer")
    if local.is_mla != remote.is_mla:
        problems.append(f"layout {local.kind} here vs {remote.kind} on the peer (MLA latent vs K/V planes)")
    if problems:
        raise IncompatiblePeerError(
            "the peer's KV cache is incompatible: " + "; ".join(problems)
            + ". Both sides must serve the same model with the same KV cache dtype; recompute instead"
        )


def layout_difference(local: CacheInfo, remote: CacheInfo) -> str | None:
    """Why a byte-for-byte (direct) read cannot work, or None when the pieces are identical."""
    diffs = []
    if local.order != remote.order and not (local.is_mla or (local.num_heads == remote.num_heads == 1)):
        diffs.append(f"token order {remote.order} -> {local.order}")
    if local.block_size != remote.block_size:
        diffs.append(f"block size {remote.block_size} -> {local.block_size}")
    if local.num_heads != remote.num_heads:
        diffs.append(f"heads {remote.num_heads} -> {local.num_heads}")
    return ", ".join(diffs) or None
