"""Claims over the side channel: the reader asks the owner's retention authority before a READ.

The owner's engine is given a :class:`ClaimAuthority` (``kvshuttle.retention.RetentionLedger`` is one); the
transfer layer does not import it, so transfer and retention stay siblings. A claim checks the handle's
generation, expiry and content (block ids, digests) and pins the blocks until the reader reports the read
done (``complete``) or failed (``abort``), or the claim times out. Any refusal reaches the reader as a
:class:`ClaimRefusedError` naming the owner's reason: the reader recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import KVShuttleError
from ..policy.kv_handle import KVHandle
from .errors import TransferError


class GrantedClaim(Protocol):
    @property
    def claim_id(self) -> str: ...

    @property
    def block_ids(self) -> tuple[int, ...]: ...

    @property
    def num_tokens(self) -> int: ...


class ClaimAuthority(Protocol):
    """What the owner consults on a claim (implemented by ``kvshuttle.retention.RetentionLedger``)."""

    def claim(self, handle_id: str, generation: int, block_ids: Sequence[int] | None = None,
              digests: Sequence[bytes] | None = None, *, reader: str = "") -> GrantedClaim: ...

    def complete(self, claim_id: str) -> object: ...

    def abort(self, claim_id: str) -> bool: ...

    def renew(self, handle_id: str, ttl_s: float | None = None) -> KVHandle: ...

    def release(self, handle_id: str) -> bool: ...


class ClaimRefusedError(TransferError):
    """The owner refused the claim (expired, evicted, stale, consumed, tampered...) or lost it: recompute.

    ``reason`` is the owner's error class name (e.g. ``HandleExpiredError``).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ClaimTicket:
    """A granted claim, as the reader sees it."""

    claim_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


def claim_request(handle: KVHandle, num_blocks: int | None, reader: str) -> dict[str, Any]:
    """The side-channel message claiming the first ``num_blocks`` blocks of ``handle`` (all when None)."""
    count = len(handle.block_ids) if num_blocks is None else num_blocks
    return {"op": "claim", "handle_id": handle.handle_id, "generation": handle.generation,
            "block_ids": list(handle.block_ids[:count]), "digests": list(handle.digests[:count]),
            "reader": reader}


def serve_claim(authority: ClaimAuthority | None, message: dict[str, Any]) -> dict[str, Any]:
    """The owner's answer to ``claim`` and ``claim_done`` messages."""
    if authority is None:
        return {"op": "refused", "reason": "NoRetention",
                "message": "this owner keeps no retention ledger; recompute"}
    try:
        if message["op"] == "claim":
            # Lists straight from msgpack: the authority compares them with what it issued, element-wise.
            granted = authority.claim(str(message["handle_id"]), int(message["generation"]), message["block_ids"],
                                      message["digests"], reader=str(message.get("reader", "")))
            return {"op": "claimed", "claim_id": granted.claim_id, "block_ids": list(granted.block_ids),
                    "num_tokens": granted.num_tokens}
        if message["op"] == "renew_retention":  # whoever holds the unguessable handle id may keep it alive...
            ttl = message.get("ttl_s")
            renewed = authority.renew(str(message["handle_id"]), None if ttl is None else float(ttl))
            return {"op": "renewed", "kv_transfer_params": renewed.to_kv_transfer_params()}
        if message["op"] == "release_retention":  # ...or let it go early
            return {"op": "released", "released": bool(authority.release(str(message["handle_id"])))}
        claim_id = str(message["claim_id"])
        if message.get("ok"):
            authority.complete(claim_id)
        else:
            authority.abort(claim_id)
        return {"op": "claim_done"}
    except KVShuttleError as exc:
        return {"op": "refused", "reason": type(exc).__name__, "message": str(exc)}
    except (KeyError, TypeError, ValueError) as exc:
        return {"op": "refused", "reason": "MalformedClaim", "message": f"malformed claim message: {exc}"}


def ticket_from_reply(reply: dict[str, Any], address: str) -> ClaimTicket:
    if reply.get("op") != "claimed":
        raise ClaimRefusedError(f"owner at {address} refused the claim: {reply.get('message')}",
                                str(reply.get("reason", "Unknown")))
    return ClaimTicket(str(reply["claim_id"]), tuple(reply["block_ids"]), int(reply["num_tokens"]))


def check_done_reply(reply: dict[str, Any], address: str) -> None:
    if reply.get("op") != "claim_done":
        raise ClaimRefusedError(f"owner at {address} could not confirm the read: {reply.get('message')}; "
                                "discard the blocks read and recompute", str(reply.get("reason", "Unknown")))
