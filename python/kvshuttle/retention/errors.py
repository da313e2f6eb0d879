"""Named retention errors. Each says what happened and what the caller should do about it.

Refusals of a handle (claim, renew) derive from :class:`HandleUnavailableError` and carry ``reason``; the
reader's answer to every one of them is the same: recompute the prefix locally and forget the handle.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import KVShuttleError


class RetentionError(KVShuttleError):
    """Base class of the retention ledger's errors."""


class RetentionArgumentError(RetentionError, ValueError):
    """``retain`` or the ledger's constructor got arguments that cannot describe a retention (a caller bug)."""


class NoTierError(RetentionArgumentError):
    """``demote`` on a ledger without a tier (``RetentionTerms.tier``): there is nowhere to move the retention; it
    stays as it was."""


class RetentionRefusedError(RetentionError, RuntimeError):
    """``retain`` kept nothing. ``caller_frees``: the request's blocks the caller must free itself, as it would
    without retention; the others are already held by live handles and stay with the ledger."""

    reason = "refused"

    def __init__(self, message: str, caller_frees: Iterable[int] = ()) -> None:
        self.caller_frees: tuple[int, ...] = tuple(caller_frees)
        super().__init__(message)


class BudgetExceededError(RetentionRefusedError):
    """Retaining would exceed the memory budget even after evicting every handle not being read."""

    reason = "budget"


class HandleUnavailableError(RetentionError, LookupError):
    """A handle cannot be claimed or renewed; the reader recomputes and drops the handle."""

    reason = "unavailable"

    def __init__(self, handle_id: str, detail: str = "") -> None:
        self.handle_id = handle_id
        text = f"retention handle {handle_id[:12]}... is {self.reason}"
        super().__init__(f"{text}{': ' + detail if detail else ''}; recompute the prefix locally and drop the handle")


class UnknownHandleError(HandleUnavailableError):
    """This decode never issued the handle, or ended it too long ago to remember why."""

    reason = "unknown"


class HandleExpiredError(HandleUnavailableError):
    """The handle's TTL ran out (renew it earlier, e.g. from the router's heartbeat)."""

    reason = "expired"


class HandleEvictedError(HandleUnavailableError):
    """The handle was evicted (least recently touched) to keep retained memory under the budget."""

    reason = "evicted"


class HandleReleasedError(HandleUnavailableError):
    """The handle was released (explicitly, or with its conversation)."""

    reason = "released"


class HandleConsumedError(HandleUnavailableError):
    """A use-once handle was already read (or its read is being completed)."""

    reason = "consumed"


class HandleInUseError(HandleUnavailableError):
    """A use-once handle has a read in flight: another reader won the race."""

    reason = "in_use"


class StaleHandleError(HandleUnavailableError):
    """Blocks of the handle went back to decode's allocator (their generation moved): they may hold other KV.
    Raised by ``complete`` too: then discard what was read."""

    reason = "stale"


class HandleDemotingError(HandleUnavailableError):
    """The handle's blocks are being copied into the next tier (host, or disk), or wait for reads in flight or
    for room there: its claims are served again once the copy completed."""

    reason = "demoting"


class HandleTierFullError(HandleUnavailableError):
    """The handle left the hot cache (TTL or budget), or the host tier for the disk tier, and the tier it was
    going to had no room for it."""

    reason = "tier_full"


class HandleTierEvictedError(HandleUnavailableError):
    """The handle was evicted from its last tier (host, or disk) to make room for a later demotion."""

    reason = "tier_evicted"


class HandleTierExpiredError(HandleUnavailableError):
    """The handle's TTL in its last tier (host, or disk) ran out."""

    reason = "tier_expired"


class HandleTierLostError(HandleUnavailableError):
    """The handle's copy in the disk tier could not be read back whole (its file deleted or truncated behind the
    ledger's back, a read error): nothing of it was served."""

    reason = "tier_lost"


class TamperedHandleError(RetentionError, ValueError):
    """The presented generation, block ids or digests differ from what decode issued: never serve it."""

    reason = "tampered"

    def __init__(self, handle_id: str, detail: str) -> None:
        self.handle_id = handle_id
        super().__init__(f"retention handle {handle_id[:12]}... does not match what decode issued ({detail}); "
                         "recompute the prefix locally and check the router's handle store")


class ClaimLostError(RetentionError, LookupError):
    """``complete`` of a claim that is no longer live (timed out, already completed or aborted): the blocks were
    not pinned for the whole read, so discard what was read and recompute."""

    def __init__(self, claim_id: str, why: str) -> None:
        self.claim_id = claim_id
        super().__init__(f"claim {claim_id[:12]}... is not live ({why}); discard the blocks read and recompute "
                         "(raise claim_timeout_s if reads legitimately take this long)")


class ClaimLimitError(RetentionError, RuntimeError):
    """One reader holds ``max_claims_per_reader`` open claims already: finish some (or recompute)."""


UNAVAILABLE: dict[str, type[HandleUnavailableError]] = {
    cls.reason: cls
    for cls in (UnknownHandleError, HandleExpiredError, HandleEvictedError, HandleReleasedError,
                HandleConsumedError, HandleInUseError, StaleHandleError, HandleDemotingError, HandleTierFullError,
                HandleTierEvictedError, HandleTierExpiredError, HandleTierLostError)
}
