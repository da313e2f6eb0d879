"""What travels on the side channel: msgpack dicts, the handshake payload, the compatibility check.

Every message is one msgpack map with an ``"op"`` key. The handshake (``hello``) carries the NIXL agent
metadata, the planner's :class:`~kvshuttle.plan.SideGeometry` and the cache's logical geometry
(:class:`~kvshuttle.CacheGeometry`), so the reader can check compatibility before any byte moves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from ..core.layout import CacheGeometry, cache_kind, token_order
from ..core.pages import direct_difference
from ..core.plan import SideGeometry
from ..errors import KVShuttleError, shown
from ._nixl import MemType
from .errors import IncompatiblePeerError, ProtocolError

# 4: CURVE-authenticated channel, packs bound to claims, claims bound to the connection, hello checks the version
PROTOCOL_VERSION = 4
NOTIF_PREFIX = b"kvshuttle:done:"
# What one message may expand into when decoded: msgpack turns a 1-byte empty map into a 64-byte dict, so the
# byte cap alone does not bound memory. Every kvshuttle message has a handful of lists and maps. One long string
# costs what it weighs (a handle's hex digests: 64 KiB at 2,048 blocks), so strings are bounded by the message.
MAX_CONTAINERS = 4096
MAX_STR_BYTES = 64 << 20


def encode(message: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


class _Budget:
    """Counts the lists and maps a decode builds; raising from msgpack's hooks stops the decode there."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_CONTAINERS

    def container(self, value: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ValueError(f"more than {MAX_CONTAINERS} lists and maps")
        return value


def decode(data: bytes) -> dict[str, Any]:
    """One side-channel message, with its expansion bounded (ProtocolError for anything else)."""
    budget = _Budget()
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=False, list_hook=budget.container,
                                  object_hook=budget.container, max_str_len=MAX_STR_BYTES, max_ext_len=0)
    except Exception as exc:
        raise ProtocolError(f"undecodable side-channel message ({type(exc).__name__}: {str(exc)[:200]}); are both "
                            "sides the same kvshuttle version?") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("side-channel message without an 'op'; run the same kvshuttle on both sides")
    return message


def field(message: dict[str, Any], name: str, kind: type, low: int | None = None, high: int | None = None) -> Any:
    """``message[name]``, of exactly type ``kind`` (bool is no int) and, for ints, in ``[low, high]``."""
    value: Any = message.get(name)
    if type(value) is not kind:
        raise ProtocolError(f"side-channel field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    number = int(value) if isinstance(value, int) else 0
    if (low is not None and number < low) or (high is not None and number > high):
        raise ProtocolError(f"side-channel field {name!r} = {shown(value)} is outside [{low}, {high}]")
    return value


def geometry_to_wire(g: CacheGeometry) -> dict[str, Any]:
    """A cache's geometry as plain msgpack-able values (enums as their strings)."""
    return {**asdict(g), "kind": g.kind.value, "order": g.order.value}


def geometry_from_wire(d: Any) -> CacheGeometry:
    try:
        values = {name: d[name] for name in CacheGeometry.__dataclass_fields__}
        values["kind"], values["order"] = cache_kind(values["kind"]), token_order(values["order"])
        return CacheGeometry(**values)
    except (KeyError, TypeError, ValueError, KVShuttleError) as exc:
        raise ProtocolError(f"peer cache geometry is malformed ({exc}); run the same kvshuttle on both "
                            "sides") from exc


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
    cache: CacheGeometry
    mem_type: MemType  # where the peer's cache lives
    staging: StagingInfo
    tier: SideGeometry | None = None  # the direct-read pieces of the peer's host tier (host memory), if it has one

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "op": "hello", "protocol": PROTOCOL_VERSION, "agent": self.agent_name, "metadata": self.metadata,
            "side": self.side.to_wire(), "cache": geometry_to_wire(self.cache), "mem_type": self.mem_type,
            "staging": self.staging.to_wire(),
        }
        if self.tier is not None:  # absent without a tier: the handshake an older reader knows
            wire["tier"] = self.tier.to_wire()
        return wire

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
            mem_type: MemType = "VRAM" if d["mem_type"] == "VRAM" else "DRAM"
            tier = SideGeometry.from_wire(d["tier"]) if d.get("tier") is not None else None
            return cls(str(d["agent"]), bytes(d["metadata"]), SideGeometry.from_wire(d["side"]),
                       geometry_from_wire(d["cache"]), mem_type, staging, tier)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed handshake from peer ({exc})") from exc


def check_compatible(local: CacheGeometry, remote: CacheGeometry) -> None:
    """Raise IncompatiblePeerError when no path (direct or packed) can move blocks between the caches."""
    problems = []
    if local.dtype != remote.dtype or local.itemsize != remote.itemsize:
        problems.append(f"dtype {local.dtype} here vs {remote.dtype} on the peer")
    if local.head_size != remote.head_size:
        problems.append(f"head size {local.head_size} here vs {remote.head_size} on the peer")
    if local.num_layers != remote.num_layers:
        problems.append(f"{local.num_layers} layers here vs {remote.num_layers} on the peer")
    if local.planes_per_layer != remote.planes_per_layer:
        problems.append(f"layout {local.kind.value} here vs {remote.kind.value} on the peer (MLA latent vs K/V planes)")
    if problems:
        raise IncompatiblePeerError(
            "the peer's KV cache is incompatible: " + "; ".join(problems)
            + ". Both sides must serve the same model with the same KV cache dtype; recompute instead"
        )


def layout_difference(local: CacheGeometry, remote: CacheGeometry) -> str | None:
    """Why a byte-for-byte (direct) read cannot work, or None when the pieces are identical."""
    diffs = []
    if local.order != remote.order and not (local.planes_per_layer == 1 or (local.num_heads == remote.num_heads == 1)):
        diffs.append(f"token order {remote.order.value} -> {local.order.value}")
    if local.block_size != remote.block_size:
        diffs.append(f"block size {remote.block_size} -> {local.block_size}")
    if local.num_heads != remote.num_heads:
        diffs.append(f"heads {remote.num_heads} -> {local.num_heads}")
    if not diffs:  # same order, block size and heads, but are the rows where the other side expects them?
        pages = direct_difference(local, remote)
        if pages is not None:
            diffs.append(pages)
    return ", ".join(diffs) or None
