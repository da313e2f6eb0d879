"""Claims over the side channel: the reader asks the owner's retention authority before a READ.

The owner's engine is given a :class:`ClaimAuthority` (``kvshuttle.retention.RetentionLedger`` is one); the
transfer layer does not import it, so transfer and retention stay siblings. A claim checks the handle's
generation, expiry and content (block ids, digests) and pins the blocks until the reader reports the read
done (``complete``) or failed (``abort``), or the claim times out. Any refusal reaches the reader as a
:class:`ClaimRefusedError` naming the owner's reason: the reader recomputes. A claim may say how many reader
ranks will claim the same handle on this owner rank (``readers``, tensor parallelism): a use-once handle then
ends after that many completed reads instead of the first.

A retention may sit in a tier of host memory instead of the hot cache (demoted, ``retention/tiers.py``): its claim
reply then names the tier and the claim's slots there (``tier``, ``slots``; absent for the hot cache). The reader
reads it from the tier: packed (the owner packs from the slots) or direct from the slots of the tier it learned at
the handshake (``PeerInfo.tier``) and then says so when it reports the read (``tier_read``). A read of the hot
cache by block id would read blocks that went back at the demotion: the owner refuses to confirm it.

``demote_retention`` asks the owner to move a retention into its tier now (a router that knows the conversation
waits on a person): the authority's ``demote``; an unknown or ended handle, or an owner without a tier
(``NoTierError``), is refused by name and nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .._values import is_int
from ..core.ranks import MAX_READERS
from ..errors import KVShuttleError
from ..policy.kv_handle import KVHandle
from ..trust import DeploymentSecret
from .errors import ProtocolError, TransferError
from .wire import field

MAX_CLAIM_BLOCKS = 1 << 17  # 2M tokens in 16-token blocks: far past any context, short of a memory attack


class GrantedClaim(Protocol):
    @property
    def claim_id(self) -> str: ...

    @property
    def block_ids(self) -> tuple[int, ...]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def tier(self) -> str: ...

    @property
    def slots(self) -> tuple[int, ...]: ...


class ClaimAuthority(Protocol):
    """What the owner consults on a claim (implemented by ``kvshuttle.retention.RetentionLedger``)."""

    def claim(self, handle_id: str, generation: int, block_ids: Sequence[int] | None = None,
              digests: Sequence[bytes] | None = None, *, reader: str = "", readers: int = 1) -> GrantedClaim: ...

    def complete(self, claim_id: str, tier_read: bool = False) -> object: ...

    def abort(self, claim_id: str) -> bool: ...

    def claimed_blocks(self, claim_id: str) -> tuple[int, ...]: ...

    def claimed_slots(self, claim_id: str) -> tuple[int, ...] | None: ...

    def claimed_tier(self, claim_id: str) -> tuple[str, str]: ...

    def tier_lost(self, claim_id: str) -> bool: ...

    def renew(self, handle_id: str, ttl_s: float | None = None) -> KVHandle: ...

    def release(self, handle_id: str) -> bool: ...

    def demote(self, handle_id: str) -> bool: ...


class ClaimRefusedError(TransferError):
    """The owner refused the claim (expired, evicted, stale, consumed, tampered...) or lost it: recompute.

    ``reason`` is the owner's error class name (e.g. ``HandleExpiredError``).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


HOT = "hot"  # the claim's blocks are in the owner's cache (read direct or packed)


@dataclass(frozen=True)
class ClaimTicket:
    """A granted claim, as the reader sees it. ``tier``: where the owner holds the blocks; anything but "hot"
    (the host tier: "host") is read packed (the owner packs it from the tier) or, where the owner named its
    ``slots`` (parallel to ``block_ids``) and the tier's pieces match this side's, direct from the tier's slots."""

    claim_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    tier: str = HOT
    slots: tuple[int, ...] = ()

    @property
    def packed_only(self) -> bool:
        """Whether only a packed read can read these blocks (in a tier whose slots the owner did not name)."""
        return self.tier != HOT and not self.slots

    def slots_of(self, block_ids: Any) -> list[int]:
        """The tier slots holding ``block_ids`` (of this claim); KeyError for a block the claim does not cover."""
        where = dict(zip(self.block_ids, self.slots, strict=True))
        return [where[int(b)] for b in block_ids]


def claim_request(handle: KVHandle, num_blocks: int | None, readers: int = 1) -> dict[str, Any]:
    """The side-channel message claiming the first ``num_blocks`` blocks of ``handle`` (all when None); the
    owner knows the claimant by its authenticated connection, not by anything the message says. ``readers``:
    how many reader ranks will claim this handle on this owner rank (a use-once handle ends after that many
    completed reads); sent only when it is not 1, so an owner that predates it serves TP=1 readers as before."""
    count = len(handle.block_ids) if num_blocks is None else num_blocks
    message: dict[str, Any] = {"op": "claim", "handle_id": handle.handle_id, "generation": handle.generation,
                               "block_ids": list(handle.block_ids[:count]), "digests": list(handle.digests[:count])}
    if readers != 1:
        message["readers"] = readers
    return message


def _readers(message: dict[str, Any]) -> int:
    """A claim's ``readers`` (1 when absent): an int (not a bool) in 1..MAX_READERS, else ProtocolError."""
    if "readers" not in message:
        return 1
    readers: int = field(message, "readers", int, 1, MAX_READERS)
    return readers


def _ttl(message: dict[str, Any]) -> float | None:
    ttl = message.get("ttl_s")
    if ttl is None:
        return None
    if type(ttl) not in (int, float) or not 0 < ttl < 1e9:
        raise ProtocolError("renew_retention's 'ttl_s' must be a positive number of seconds (or absent)")
    return float(ttl)


def serve_claim(authority: ClaimAuthority | None, message: dict[str, Any], *, reader: str,
                secret: DeploymentSecret) -> dict[str, Any]:
    """The owner's answer to claim, claim_done, renew_retention, release_retention and demote_retention from an
    authenticated peer (``reader``: its connection, which open claims are counted against); renewed handles are
    signed."""
    if authority is None:
        return {"op": "refused", "reason": "NoRetention",
                "message": "this owner keeps no retention ledger; recompute"}
    op = message["op"]
    try:
        if op == "claim":
            ids, digests = field(message, "block_ids", list), field(message, "digests", list)
            if len(ids) > MAX_CLAIM_BLOCKS or len(digests) > MAX_CLAIM_BLOCKS:
                raise ProtocolError(f"a claim names at most {MAX_CLAIM_BLOCKS} blocks")
            # Lists straight from msgpack: the authority compares them with what it issued, element-wise.
            granted = authority.claim(field(message, "handle_id", str), field(message, "generation", int),
                                      ids, digests, reader=reader, readers=_readers(message))
            reply = {"op": "claimed", "claim_id": granted.claim_id, "block_ids": list(granted.block_ids),
                     "num_tokens": granted.num_tokens}
            if granted.tier != HOT:  # absent for the hot cache: the reply an older reader knows
                reply["tier"], reply["slots"] = granted.tier, list(granted.slots)
            return reply
        if op == "renew_retention":  # clamped to the authority's maximum TTL
            renewed = authority.renew(field(message, "handle_id", str), _ttl(message))
            return {"op": "renewed", "kv_transfer_params": renewed.to_kv_transfer_params(secret)}
        if op == "release_retention":
            return {"op": "released", "released": bool(authority.release(field(message, "handle_id", str)))}
        if op == "demote_retention":  # False: in a tier already, or no room there (it stays hot)
            return {"op": "demoted", "demoted": bool(authority.demote(field(message, "handle_id", str)))}
        claim_id = field(message, "claim_id", str)
        if field(message, "ok", bool):
            authority.complete(claim_id, message.get("tier_read") is True)
        else:
            authority.abort(claim_id)
        return {"op": "claim_done"}
    except ProtocolError as exc:
        return {"op": "refused", "reason": "MalformedClaim", "message": f"malformed {op} message: {exc}"}
    except KVShuttleError as exc:
        return {"op": "refused", "reason": type(exc).__name__, "message": str(exc)}
    except (KeyError, TypeError, ValueError) as exc:
        return {"op": "refused", "reason": "MalformedClaim", "message": f"malformed {op} message: {exc}"}


def ticket_from_reply(reply: dict[str, Any], address: str) -> ClaimTicket:
    if reply.get("op") != "claimed":
        raise ClaimRefusedError(f"owner at {address} refused the claim: {reply.get('message')}",
                                str(reply.get("reason", "Unknown")))
    tier = reply.get("tier", HOT)
    if not isinstance(tier, str) or not 0 < len(tier) <= 16:
        raise ClaimRefusedError(f"owner at {address} named no tier a claim can be in: {str(tier)[:20]!r}", "Malformed")
    block_ids, slots = tuple(reply["block_ids"]), reply.get("slots", [])
    if tier == HOT or not isinstance(slots, list) or len(slots) != len(block_ids) or not all(
            is_int(s) and 0 <= s < 2**31 for s in slots):
        slots = []  # read packed: the owner packs from wherever its slots are
    return ClaimTicket(str(reply["claim_id"]), block_ids, int(reply["num_tokens"]), tier, tuple(int(s) for s in slots))


def check_done_reply(reply: dict[str, Any], address: str) -> None:
    if reply.get("op") != "claim_done":
        raise ClaimRefusedError(f"owner at {address} could not confirm the read: {reply.get('message')}; "
                                "discard the blocks read and recompute", str(reply.get("reason", "Unknown")))
