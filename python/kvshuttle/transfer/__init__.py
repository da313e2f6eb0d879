"""kvshuttle.transfer: read paged KV blocks from a peer over NIXL (direct or packed), with a side channel.

See :mod:`kvshuttle.transfer.engine` for the owner/reader walk-through.
"""

from __future__ import annotations

from .claims import ClaimAuthority, ClaimRefusedError, ClaimTicket
from .engine import EngineConfig, Peer, ReadNotice, TransferEngine
from .errors import (
    BlockRangeError,
    IncompatiblePeerError,
    NixlUnavailableError,
    PeerLostError,
    PeerUnreachableError,
    ProtocolError,
    RemoteError,
    SideChannelError,
    StagingExhaustedError,
    StagingTooSmallError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
)
from .transfer_handle import TransferHandle, TransferState, TransferTelemetry

__all__ = [
    "BlockRangeError",
    "ClaimAuthority",
    "ClaimRefusedError",
    "ClaimTicket",
    "EngineConfig",
    "IncompatiblePeerError",
    "NixlUnavailableError",
    "Peer",
    "PeerLostError",
    "PeerUnreachableError",
    "ProtocolError",
    "ReadNotice",
    "RemoteError",
    "SideChannelError",
    "StagingExhaustedError",
    "StagingTooSmallError",
    "TransferCancelledError",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferTelemetry",
    "TransferTimeoutError",
]
