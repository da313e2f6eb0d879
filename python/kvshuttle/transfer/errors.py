"""Named transfer errors. Each says what went wrong and what to do; a failed read names its bad blocks.

Every error raised for a read carries ``invalid_block_ids``: the *destination* (local) block ids that do
not hold the requested data and must be recomputed (or read again). Blocks not listed were written
completely. Errors raised before any read started (connect, handshake, configuration) have none.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import BackendError, BlockIdError, KVShuttleError, StagingError


class TransferError(KVShuttleError, RuntimeError):
    """A transfer could not start or did not complete.

    Attributes:
        invalid_block_ids: local block ids whose content is not the requested data (recompute them).
    """

    def __init__(self, message: str, invalid_block_ids: Iterable[int] = ()) -> None:
        self.invalid_block_ids: tuple[int, ...] = tuple(int(b) for b in invalid_block_ids)
        if self.invalid_block_ids:
            shown = ", ".join(str(b) for b in self.invalid_block_ids[:16])
            more = "" if len(self.invalid_block_ids) <= 16 else f", ... ({len(self.invalid_block_ids)} in all)"
            message = f"{message} [invalid local blocks: {shown}{more}]"
        super().__init__(message)


class NixlUnavailableError(TransferError, BackendError):
    """NIXL is not installed, or a configured NIXL backend (e.g. LIBFABRIC) could not be created."""


class SideChannelError(TransferError, OSError):
    """The side channel could not bind its address (port in use?); pass port=0 to pick a free port."""


class TransferArgumentError(TransferError, ValueError):
    """An argument to the engine is malformed (address, path, token or head count, timeout): fix the call."""


class PeerUnreachableError(TransferError):
    """Nothing answers on the peer's side channel (connection refused, or no answer within the timeout)."""


class PeerAuthError(PeerUnreachableError):
    """The authenticated handshake failed: the other side does not hold this deployment's secret (or runs a
    kvshuttle without authentication). Nothing was sent to it; configure the same KVSHUTTLE_SECRET on both."""


class IncompatiblePeerError(TransferError):
    """The two caches cannot exchange blocks (dtype, head size, layer count, MLA vs K/V, path)."""


class PeerLostError(TransferError):
    """The peer's connection dropped (process gone), its heartbeat stopped, or its NIXL agent disconnected.

    A lost peer stays lost: call ``engine.connect(address)`` again to reach an owner that came back.
    """


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not finish before its deadline; it was cancelled."""


class TransferCancelledError(TransferError):
    """The transfer was cancelled by the caller."""


class BlockRangeError(TransferError, BlockIdError):
    """Block ids out of range, repeated, or not matching the token count, on either side."""


class StagingExhaustedError(TransferError):
    """No free staging chunk on the owner or the reader for a packed read."""


class StagingTooSmallError(TransferError, StagingError):
    """A staging slot cannot hold one granule of the read (whole blocks on both sides): raise staging_chunk_bytes."""


class RemoteError(TransferError):
    """The owner refused or failed a request for a reason not covered by a more specific error."""


class ProtocolError(TransferError):
    """A side-channel message did not have the expected shape (mismatched kvshuttle versions?)."""


class TierLostError(TransferError):
    """The owner could not read a retention's disk tier copy back whole (its file deleted or truncated behind the
    owner's back, a read error): nothing was served, the owner ended the retention (its claims now say
    ``HandleTierLostError``); recompute."""


class DiskTierError(TransferArgumentError):
    """The disk tier's directory cannot hold it (missing, not a directory, not writable): name another
    (``kvshuttle_disk_tier_dir``) or run without a disk tier."""
