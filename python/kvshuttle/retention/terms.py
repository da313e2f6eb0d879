"""Retention terms: what a decode promises to keep, for how long, for how many reads, and what goes first.

Every retention default lives here, once: the TTL, the longest TTL a renewal may reach, the read mode, the budget
(blocks, or a share of the engine's blocks), the eviction order and the grant requirement. The ledger keeps the
bookkeeping and asks its :class:`RetentionTerms` the decisions (when a retention ends, what to evict); the vLLM
connector's config, the router's config and the planner take their defaults from the constants below.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from .._values import as_float
from ..errors import shown
from ..policy.kv_handle import READ_MODES as READ_MODES  # re-exported: the retention words are the handle's
from ..policy.kv_handle import ReadMode as ReadMode
from ._checks import check_count, check_positive
from .errors import RetentionArgumentError
from .eviction import EVICTION_POLICIES, EvictionPolicy
from .tiers import DISK_TIER, HOST_TIER, TierTerms

# Words accepted on input for a deployment's sake, never produced: the router's --reads said "multi" before.
READ_MODE_ALIASES: dict[str, ReadMode] = {"multi": "multi_read"}
# "granted": keep blocks only for requests carrying a router's grant (a direct client cannot make an engine hold
# memory); "always": behind a proxy that sends no grants (vLLM's own)
Retain = Literal["granted", "always"]
RETAIN: tuple[Retain, ...] = ("granted", "always")

DEFAULT_TTL_S = 480.0  # decode's retention (decoder_kv_blocks_ttl): a pause of 8 minutes between turns
DEFAULT_MAX_TTL_S = 3600.0  # what a renewal may ask for at most: an hour of idle conversation
DEFAULT_PREFILL_TTL_S = 30.0  # prefill keeps a prompt's blocks this long for its decode (kv_lease_duration)
# A retried turn can read again; "use_once" is vLLM's behaviour (the first read frees the blocks)
DEFAULT_READ_MODE: ReadMode = "multi_read"
# The router's --reads: a lookup takes a stored handle atomically, right for either decode mode (a multi-read
# handle taken is only not shared with a concurrent turn); a use-once handle is taken whatever the setting.
ROUTER_READ_MODE: ReadMode = "use_once"
# The router forgets a handle this long before the decode does, so a stored handle is still live when used.
ROUTER_TTL_MARGIN_S = 30.0
DEFAULT_ROUTER_TTL_S = DEFAULT_TTL_S - ROUTER_TTL_MARGIN_S
# Without a budget in blocks, retention holds at most this share of an engine's KV blocks: what a decode keeps
# for later turns is memory its running requests cannot use, so they always keep at least 75% of it.
DEFAULT_BUDGET_FRACTION = 0.25
DEFAULT_EVICTION = "lru"
DEFAULT_RETAIN: Retain = "granted"


def as_read_mode(value: object, name: str = "read_mode", *, aliases: bool = False) -> ReadMode:
    """``value`` as a read mode; ``aliases``: an old word (``multi``) is accepted with a FutureWarning."""
    if isinstance(value, str):
        if value in READ_MODES:
            return value
        if aliases and value in READ_MODE_ALIASES:
            mode = READ_MODE_ALIASES[value]
            warnings.warn(f"{name} {value!r} is deprecated: use {mode!r}", FutureWarning, stacklevel=2)
            return mode
    raise RetentionArgumentError(f"{name} {shown(value)}: use 'multi_read' or 'use_once'")


@dataclass(frozen=True)
class RetentionTerms:
    """The terms of a decode's retentions; invalid values are a RetentionArgumentError naming the field."""

    ttl_s: float = DEFAULT_TTL_S  # a retention's life unless its retain names another
    max_ttl_s: float = DEFAULT_MAX_TTL_S  # no renewal reaches past this (never less than ttl_s)
    read_mode: ReadMode = DEFAULT_READ_MODE  # unless a retain names another (a prefill's forward handle)
    budget_blocks: int | None = None  # most distinct blocks kept; None: budget_fraction of the engine's blocks
    budget_fraction: float = DEFAULT_BUDGET_FRACTION  # applies only where the engine's block count is known
    eviction: str = DEFAULT_EVICTION  # a name in EVICTION_POLICIES
    retain: Retain = DEFAULT_RETAIN  # the grant requirement
    tier: TierTerms | None = None  # where a retention goes instead of ending by TTL or eviction (None: it ends)
    disk: TierTerms | None = None  # where one goes on leaving ``tier`` (name "disk"; needs ``tier``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ttl_s", check_positive("ttl_s", self.ttl_s))
        object.__setattr__(self, "max_ttl_s", check_positive("max_ttl_s", self.max_ttl_s))
        as_read_mode(self.read_mode)
        if self.budget_blocks is not None:
            check_count("budget_blocks", self.budget_blocks)
        fraction = as_float(self.budget_fraction)  # None for a non-number, a bool, an int too large for a float
        if fraction is None or not 0 < fraction <= 1:  # NaN fails both comparisons
            raise RetentionArgumentError(f"budget_fraction must be a share of the KV blocks in (0, 1], got "
                                         f"{shown(self.budget_fraction)}")
        object.__setattr__(self, "budget_fraction", fraction)
        if not (isinstance(self.eviction, str) and self.eviction in EVICTION_POLICIES):
            raise RetentionArgumentError(f"eviction {shown(self.eviction)}: use one of {sorted(EVICTION_POLICIES)}")
        if not (isinstance(self.retain, str) and self.retain in RETAIN):
            raise RetentionArgumentError(f"retain {shown(self.retain)}: use 'granted' or 'always'")
        for field, name in (("tier", HOST_TIER), ("disk", DISK_TIER)):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, TierTerms) and value.name == name):
                raise RetentionArgumentError(f"{field} must be None or a TierTerms named {name!r}, got "
                                             f"{shown(value)}")
        if self.disk is not None and self.tier is None:
            raise RetentionArgumentError("a disk tier takes what leaves the host tier: give tier too")

    def overridden(self, **values: Any) -> RetentionTerms:
        """These terms with the values given that are not None (checked again)."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise RetentionArgumentError(f"no retention term {unknown}; the terms are {sorted(names)}")
        given = {k: v for k, v in values.items() if v is not None}
        return replace(self, **given) if given else self

    # ------------------------------------------------------------------------ when a retention ends
    @property
    def longest(self) -> float:
        """The longest a renewal may extend a retention to (``max_ttl_s``, or ``ttl_s`` when that is longer)."""
        return max(self.max_ttl_s, self.ttl_s)

    def lifetime(self, ttl_s: float | None = None) -> float:
        """A new retention's TTL: ``ttl_s`` when the retain names one (an issuer's choice), else the terms'."""
        return self.ttl_s if ttl_s is None else check_positive("ttl_s", ttl_s)

    def renewal(self, ttl_s: float | None = None) -> float:
        """What a renewal asking ``ttl_s`` (None: the terms' TTL) gets: at most :attr:`longest`."""
        return self.ttl_s if ttl_s is None else min(check_positive("ttl_s", ttl_s), self.longest)

    @property
    def tiers(self) -> tuple[TierTerms, ...]:
        """The tiers a retention leaving the hot cache goes through, in order (host, then disk)."""
        return tuple(t for t in (self.tier, self.disk) if t is not None)

    def handle_ttl(self, ttl_s: float | None = None) -> float:
        """The TTL a handle names for a retention of ``ttl_s`` hot seconds (None: the terms'): its whole life,
        each tier's TTL added (it may end earlier, by eviction or a full tier, and its claims then say so). An
        issuer outside the ledger (vLLM's scheduler) writes this into the handle it issues."""
        return self.lifetime(ttl_s) + sum(t.ttl_s for t in self.tiers)

    @staticmethod
    def renewed(expiry: float, now: float, ttl: float) -> float:
        """A renewal never shortens a retention."""
        return max(expiry, now + ttl)

    @staticmethod
    def expired(expiry: float, now: float) -> bool:
        """The end is exclusive: at ``now == expiry`` the retention is gone."""
        return now >= expiry

    def use_once(self, mode: ReadMode | None = None) -> bool:
        """Whether a retention retained with ``mode`` (None: the terms' read mode) ends after its reads."""
        return (self.read_mode if mode is None else as_read_mode(mode, "mode")) == "use_once"

    @staticmethod
    def consumed(done: int, readers: int) -> bool:
        """A use-once retention ends once every reader rank it expects completed its read."""
        return done >= readers

    # ------------------------------------------------------------------------------- what to evict
    def budget(self, num_blocks: int | None = None) -> int | None:
        """The most blocks to keep: ``budget_blocks``, else ``budget_fraction`` of an engine's ``num_blocks``
        (at least 1), else (the engine's size unknown) no bound."""
        if self.budget_blocks is not None:
            return self.budget_blocks
        if num_blocks is None:
            return None
        return max(1, math.floor(self.budget_fraction * check_count("num_blocks", num_blocks)))

    def eviction_policy(self) -> EvictionPolicy:
        """A fresh policy of the terms' eviction order (one per ledger)."""
        return EVICTION_POLICIES[self.eviction]()
