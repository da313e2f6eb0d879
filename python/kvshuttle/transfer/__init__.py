"""kvshuttle.transfer: read paged KV blocks from a peer over NIXL (direct or packed), with a side channel.

See :mod:`kvshuttle.transfer.engine` for the owner/reader walk-through and
:class:`~kvshuttle.transfer.EngineConfig` for the timeouts that bound failure detection.
"""

from __future__ import annotations

from .board import PUBLISH_KEY, HandleBoard
from .claims import ClaimAuthority, ClaimRefusedError, ClaimTicket
from .config import EngineConfig
from .control import demote_retention, release_retention, renew_retention, take_published
from .engine import TransferEngine
from .errors import (
    BlockRangeError,
    DiskTierError,
    IncompatiblePeerError,
    NixlUnavailableError,
    PeerAuthError,
    PeerLostError,
    PeerUnreachableError,
    ProtocolError,
    RemoteError,
    SideChannelError,
    StagingExhaustedError,
    StagingTooSmallError,
    TierLostError,
    TransferArgumentError,
    TransferCancelledError,
    TransferError,
    TransferTimeoutError,
)
from .layered import LayeredTransfer, LayerProgress
from .owner import OwnerRole, ReadNotice
from .peer import Peer
from .quarantine import QuarantineStats, Settlement
from .reader import ReaderRole
from .transfer_handle import TransferHandle, TransferState, TransferTelemetry

__all__ = [
    "PUBLISH_KEY",
    "BlockRangeError",
    "ClaimAuthority",
    "ClaimRefusedError",
    "ClaimTicket",
    "DiskTierError",
    "EngineConfig",
    "HandleBoard",
    "IncompatiblePeerError",
    "LayerProgress",
    "LayeredTransfer",
    "NixlUnavailableError",
    "OwnerRole",
    "Peer",
    "PeerAuthError",
    "PeerLostError",
    "PeerUnreachableError",
    "ProtocolError",
    "QuarantineStats",
    "ReadNotice",
    "ReaderRole",
    "RemoteError",
    "Settlement",
    "SideChannelError",
    "StagingExhaustedError",
    "StagingTooSmallError",
    "TierLostError",
    "TransferArgumentError",
    "TransferCancelledError",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferTelemetry",
    "TransferTimeoutError",
    "demote_retention",
    "release_retention",
    "renew_retention",
    "take_published",
]
