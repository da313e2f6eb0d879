"""The ledger's records: a retained handle, a retained block, a granted claim, and small helpers on them."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


class RetainedRecord:
    __slots__ = ("block_ids", "block_size", "claims", "conversation_id", "demote", "digests", "done", "ended",
                 "expiry", "generation", "handle_id", "heaped", "moving", "num_tokens", "once", "readers",
                 "request_id", "reused", "slots", "tier", "tp_size")

    def __init__(self, handle_id: str, request_id: str, conversation_id: str | None, block_ids: tuple[int, ...],
                 digests: tuple[bytes, ...], num_tokens: int, block_size: int, tp_size: int, expiry: float) -> None:
        self.handle_id, self.request_id, self.conversation_id = handle_id, request_id, conversation_id
        self.block_ids, self.digests, self.num_tokens = block_ids, digests, num_tokens
        self.block_size, self.tp_size, self.expiry = block_size, tp_size, expiry
        self.generation = 0
        self.claims = 0  # reads in flight
        self.ended: str | None = None  # an END_REASONS entry once it can no longer be claimed
        self.reused: set[int] = set()  # its blocks that went back to the owner: a read in flight of one is stale
        self.once = False  # use-once: `readers` claims at most, and `readers` completed reads free it
        self.readers = 0  # use-once: the reader ranks expected, fixed by the first granted claim (0: none yet)
        self.done = 0  # use-once: reads completed so far
        self.tier = "hot"  # where its bytes are: the hot cache, or a tier once its demotion copy completed
        self.slots: tuple[int, ...] = ()  # its tier slots, parallel to block_ids
        self.moving: tuple[int, ...] = ()  # its slots in the next tier while the copy there is in flight
        self.demote: str | None = None  # the end reason a demotion replaces, while it waits for reads or copies
        self.heaped = True  # whether the expiry heap holds an entry for it (a sweep popped it: no)

    def slot_problem(self, readers: int) -> tuple[str, str] | None:
        """Why this use-once handle cannot take one more claim expecting ``readers`` readers: ("tampered" or
        "in_use", detail), or None when it can."""
        if self.readers and readers != self.readers:
            return "tampered", f"readers={readers} presented, {self.readers} named by its first claim"
        expected = self.readers or readers
        if self.claims < expected - self.done:
            return None
        if expected == 1:
            return "in_use", "another reader holds the use-once claim"
        return "in_use", (f"all {expected} reader claims are taken ({self.claims} in flight, {self.done} "
                          "completed)")

    def valid(self, index: int) -> int:
        """Tokens of block ``index`` that hold KV."""
        return min(self.block_size, self.num_tokens - index * self.block_size)


class BlockRecord:
    """A retained block: its live holders and what the most complete of them says it holds."""

    __slots__ = ("digest", "holders", "index", "valid")

    def __init__(self, index: int, digest: bytes, valid: int, holder: RetainedRecord) -> None:
        self.index, self.digest, self.valid = index, digest, valid
        self.holders = [holder]  # few (turns of one conversation): a list beats a set in memory


@dataclass(frozen=True)
class Claim:
    """A granted read: the blocks stay pinned until ``complete``/``abort`` or ``deadline`` (monotonic clock)."""

    claim_id: str
    handle_id: str
    generation: int
    block_ids: tuple[int, ...]  # the blocks the reader presented (a prefix of the handle's), or all of them
    num_tokens: int  # tokens whose KV those blocks hold
    deadline: float
    reader: str
    tier: str = "hot"  # where the claimed bytes are: "hot" (the cache), "host" (the tier's slots) or "disk" (packed)
    slots: tuple[int, ...] = ()  # a tier claim's slots, parallel to block_ids (what a direct read of the tier reads)


class OpenClaim:
    __slots__ = ("claim", "handle", "open", "packed")

    def __init__(self, claim: Claim, handle: RetainedRecord) -> None:
        self.claim, self.handle, self.open = claim, handle, True
        self.packed = False  # a tier claim's bytes were packed from the tier (or, the reader says, read from it)


def same_as_issued(presented: tuple[Any, ...], issued: tuple[Any, ...]) -> bool:
    """Element-wise equality that never raises: an element with no truth value (an array) is simply not equal."""
    try:
        return presented == issued
    except (TypeError, ValueError):
        return False


def extends_chain(record: BlockRecord, index: int, digest: bytes, valid: int) -> bool:
    """Whether a new holder's view of a retained block is compatible with the record (see module docstring)."""
    return record.index == index and (valid > record.valid or (valid == record.valid and digest == record.digest))


def remember_end(tombstones: OrderedDict[str, str], key: str, reason: str, cap: int) -> None:
    tombstones[key] = reason
    while len(tombstones) > cap:
        tombstones.popitem(last=False)
