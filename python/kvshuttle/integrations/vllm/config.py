"""The connector's settings, read from ``kv_connector_extra_config``: vLLM's key names where the meaning is the
same, ``kvshuttle_*`` for ours. Every value is checked at start-up; a bad one is a ConnectorConfigError that
names the key (a misconfigured engine must not start and then hang requests)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..._values import is_int
from ...errors import KVShuttleError, shown
from ...policy import PolicyConfig
from ...retention.errors import RetentionArgumentError
from ...retention.eviction import EVICTION_POLICIES
from ...retention.terms import (
    DEFAULT_BUDGET_FRACTION,
    DEFAULT_MAX_TTL_S,
    DEFAULT_PREFILL_TTL_S,
    DEFAULT_READ_MODE,
    DEFAULT_RETAIN,
    DEFAULT_TTL_S,
    READ_MODES,
    RETAIN,
    ReadMode,
    Retain,
    RetentionTerms,
)
from ...retention.tiers import DEFAULT_DISK_TTL_S, DEFAULT_TIER_TTL_S, DISK_TIER, TierTerms
from ...transfer.config import PATHS, Path
from ...trust import DeploymentSecret

# How a read is loaded: "async" (vLLM waits for the whole read, then schedules the suffix in a later step),
# "layered" (the suffix is computed in the same step, layer i as soon as layer i's KV landed), or "auto"
LoadMode = Literal["async", "layered", "auto"]
LOAD_MODES: tuple[LoadMode, ...] = ("async", "layered", "auto")
MAX_CONCURRENT_LOADS = 64  # each load is a thread of the worker process
WILDCARDS = ("0.0.0.0", "::", "[::]", "*")  # bind addresses that listen everywhere: no address to advertise


class ConnectorConfigError(KVShuttleError, ValueError):
    """A ``kv_connector_extra_config`` value kvshuttle cannot use; the message names the key and what it takes."""


@dataclass(frozen=True)
class ShuttleConfig:
    """Everything the scheduler and worker sides need (identical in both processes)."""

    bidirectional: bool = False  # bidirectional_kv_xfer: decode keeps finished requests' blocks for prefill
    threshold_tokens: int = 64  # kv_recompute_threshold (vLLM semantics: <= 0 means always read)
    # The retention terms (retention/terms.py has their defaults and meaning; terms() gathers them)
    decode_ttl_s: float = DEFAULT_TTL_S  # decoder_kv_blocks_ttl: how long decode keeps a finished request's blocks
    prefill_ttl_s: float = DEFAULT_PREFILL_TTL_S  # kv_lease_duration: how long prefill keeps a prompt for decode
    backends: tuple[str, ...] = ("UCX",)  # backends: NIXL plugins
    reads: ReadMode = DEFAULT_READ_MODE  # kvshuttle_reads: "multi_read" or "use_once"
    budget_blocks: int | None = None  # kvshuttle_retention_budget_blocks: most blocks kept for later turns
    budget_fraction: float = DEFAULT_BUDGET_FRACTION  # kvshuttle_retention_budget_fraction: else this share of all
    retain: Retain = DEFAULT_RETAIN  # kvshuttle_retain: "granted" (only with a router's kvshuttle_grant) or "always"
    max_ttl_s: float = DEFAULT_MAX_TTL_S  # kvshuttle_max_ttl_s: no retention (or renewal) lasts longer than this
    path: Path = "auto"  # kvshuttle_path
    host: str = "127.0.0.1"  # kvshuttle_host (or VLLM_NIXL_SIDE_CHANNEL_HOST): where the side channel listens
    advertise_host: str | None = None  # kvshuttle_advertise_host: the address written into handles (default: host)
    port: int = 0  # kvshuttle_port: 0 picks a free port
    load_timeout_s: float = 10.0  # kvshuttle_load_timeout_s: from the scheduling decision to the end of the load
    # kvshuttle_peer_timeout_s: an owner silent this long is lost (its reads recompute); raise it on hosts whose
    # cores are oversubscribed, where a busy owner's heartbeats can be late
    peer_timeout_s: float = 1.0
    max_concurrent_loads: int = 4  # kvshuttle_max_concurrent_loads: loads the worker runs at once
    load_mode: LoadMode = "async"  # kvshuttle_load_mode
    # kvshuttle_layered_timeout_s: the longest a layer-pipelined load may hold up the step's forward pass (every
    # request in the batch waits for it); past it the load is cancelled and its blocks recomputed
    layered_timeout_s: float = 2.0
    # kvshuttle_transfer_cpus: CPUs the worker's transfer threads run on (cpu_pinning.py); default: the engine's
    transfer_cpus: tuple[int, ...] | None = None
    digest_key: str = ""  # kvshuttle_digest_key: mixed into every block digest (default: the model)
    cost_model: Mapping[str, float] | None = None  # kvshuttle_cost_model: PolicyConfig cost inputs
    # kvshuttle_secret_file: the deployment secret's file (else KVSHUTTLE_SECRET[_FILE], else the local secret);
    # a path, never the secret: this config travels on vLLM's command line
    secret_file: str | None = None
    allowed_owners: tuple[str, ...] | None = None  # kvshuttle_allowed_owners: hosts / host:port reads may come from
    # kvshuttle_content_index: the deployment's content index (redis://...): this decode publishes its retentions
    # there, and a request reaching this prefill without a handle looks its prompt up there; None: off
    content_index: str | None = field(default=None, repr=False)  # (a URL may hold a password)
    # kvshuttle_content_index_wait_s: the longest a request waits for its lookup before it recomputes
    content_index_wait_s: float = 0.1
    # kvshuttle_host_tier_blocks: host-memory slots (one KV block each) a retention is demoted into when its hot
    # TTL ends or the budget evicts it, instead of ending (0: no host tier); kvshuttle_host_tier_ttl_s: its life
    # there from the demotion; kvshuttle_host_tier_eviction: the tier's own eviction order when it is full
    host_tier_blocks: int = 0
    host_tier_ttl_s: float = DEFAULT_TIER_TTL_S
    host_tier_eviction: str = "lru"
    # kvshuttle_disk_tier_bytes: the most bytes of files that retentions leaving the host tier move on to (0: none;
    # needs a host tier), under kvshuttle_disk_tier_dir (the operator's: a directory of this process's own in it,
    # removed at exit and, after a crash, by the next start); kvshuttle_disk_tier_ttl_s, _eviction: as the host's
    disk_tier_dir: str | None = None
    disk_tier_bytes: int = 0
    disk_tier_ttl_s: float = DEFAULT_DISK_TTL_S
    disk_tier_eviction: str = "lru"

    def deployment_secret(self) -> DeploymentSecret:
        """The secret both sides authenticate with (TrustError names what is wrong)."""
        return DeploymentSecret.from_file(self.secret_file) if self.secret_file else DeploymentSecret.resolve()

    def policy(self) -> PolicyConfig:
        extra = self.digest_key.encode()
        if self.cost_model is not None:
            cost: dict[str, Any] = dict(self.cost_model)
            return PolicyConfig(kind="cost", extra_key=extra, **cost)
        return PolicyConfig.from_vllm_threshold(self.threshold_tokens, extra_key=extra)

    def terms(self) -> RetentionTerms:
        """The decode's retention terms (a prefill's forward retentions are use-once for ``prefill_ttl_s``)."""
        return RetentionTerms(ttl_s=self.decode_ttl_s, max_ttl_s=self.max_ttl_s, read_mode=self.reads,
                              budget_blocks=self.budget_blocks, budget_fraction=self.budget_fraction,
                              retain=self.retain, tier=self.tier_terms(), disk=self.disk_terms())

    def tier_terms(self) -> TierTerms | None:
        """The host tier's terms (None: no host tier)."""
        if not self.host_tier_blocks:
            return None
        return TierTerms(self.host_tier_blocks, self.host_tier_ttl_s, self.host_tier_eviction)

    def disk_terms(self) -> TierTerms | None:
        """The disk tier's terms (None: no disk tier)."""
        if not self.disk_tier_bytes:
            return None
        return TierTerms(ttl_s=self.disk_tier_ttl_s, eviction=self.disk_tier_eviction, name=DISK_TIER,
                         capacity_bytes=self.disk_tier_bytes)

    def retention_budget(self, num_blocks: int) -> int:
        """The most blocks the worker's ledger keeps, for an engine with ``num_blocks`` KV blocks."""
        budget = self.terms().budget(num_blocks)
        assert budget is not None  # the engine's size is known: a fraction of it at least
        return budget

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], *, model: str = "") -> ShuttleConfig:
        known = {"bidirectional_kv_xfer", "kv_recompute_threshold", "decoder_kv_blocks_ttl", "kv_lease_duration",
                 "backends", "num_threads", "kvshuttle_reads", "kvshuttle_retention_budget_blocks", "kvshuttle_path",
                 "kvshuttle_host", "kvshuttle_port", "kvshuttle_load_timeout_s", "kvshuttle_digest_key",
                 "kvshuttle_cost_model", "kvshuttle_retention_budget_fraction", "kvshuttle_retain",
                 "kvshuttle_max_ttl_s", "kvshuttle_advertise_host", "kvshuttle_max_concurrent_loads",
                 "kvshuttle_secret_file", "kvshuttle_allowed_owners", "kvshuttle_peer_timeout_s",
                 "kvshuttle_load_mode", "kvshuttle_layered_timeout_s", "kvshuttle_transfer_cpus",
                 "kvshuttle_content_index", "kvshuttle_content_index_wait_s", "kvshuttle_host_tier_blocks",
                 "kvshuttle_host_tier_ttl_s", "kvshuttle_host_tier_eviction", "kvshuttle_disk_tier_dir",
                 "kvshuttle_disk_tier_bytes", "kvshuttle_disk_tier_ttl_s", "kvshuttle_disk_tier_eviction"}
        unknown = sorted(k for k in extra if k.startswith("kvshuttle_") and k not in known)
        if unknown:
            raise ConnectorConfigError(f"unknown kv_connector_extra_config keys {unknown}; kvshuttle takes "
                                       f"{sorted(k for k in known if k.startswith('kvshuttle_'))}")
        budget = extra.get("kvshuttle_retention_budget_blocks")
        fraction = extra.get("kvshuttle_retention_budget_fraction")
        if budget is not None and fraction is not None:
            raise ConnectorConfigError("set kvshuttle_retention_budget_blocks or kvshuttle_retention_budget_fraction, "
                                       "not both")
        cost = extra.get("kvshuttle_cost_model")
        if cost is not None and not (isinstance(cost, Mapping) and all(isinstance(v, (int, float)) for v in
                                                                           cost.values())):
            raise ConnectorConfigError("kvshuttle_cost_model must map PolicyConfig cost fields to numbers, e.g. "
                                       '{"kv_bytes_per_token": 32768, "bandwidth_bytes_per_s": 3e9, '
                                       '"prefill_tokens_per_s": 500}')
        config = cls(
            bidirectional=_bool(extra, "bidirectional_kv_xfer", False),
            threshold_tokens=_int(extra, "kv_recompute_threshold", 64, minimum=-(2**31)),
            decode_ttl_s=_seconds(extra, "decoder_kv_blocks_ttl", DEFAULT_TTL_S),
            prefill_ttl_s=_seconds(extra, "kv_lease_duration", DEFAULT_PREFILL_TTL_S),
            backends=_backends(extra.get("backends", ["UCX"])),
            reads=_choice(extra, "kvshuttle_reads", DEFAULT_READ_MODE, READ_MODES),
            budget_blocks=None if budget is None else _int(extra, "kvshuttle_retention_budget_blocks", 0, minimum=1),
            budget_fraction=_fraction(extra, "kvshuttle_retention_budget_fraction", DEFAULT_BUDGET_FRACTION),
            retain=_choice(extra, "kvshuttle_retain", DEFAULT_RETAIN, RETAIN),
            max_ttl_s=_seconds(extra, "kvshuttle_max_ttl_s", DEFAULT_MAX_TTL_S),
            path=_choice(extra, "kvshuttle_path", "auto", PATHS),
            host=_host(extra.get("kvshuttle_host") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "127.0.0.1",
                       "kvshuttle_host", wildcard=True),
            advertise_host=None if extra.get("kvshuttle_advertise_host") is None else _host(
                extra["kvshuttle_advertise_host"], "kvshuttle_advertise_host", wildcard=False),
            port=_int(extra, "kvshuttle_port", 0, minimum=0),
            load_timeout_s=_seconds(extra, "kvshuttle_load_timeout_s", 10.0),
            peer_timeout_s=_seconds(extra, "kvshuttle_peer_timeout_s", 1.0),
            max_concurrent_loads=_int(extra, "kvshuttle_max_concurrent_loads", 4, minimum=1),
            load_mode=_choice(extra, "kvshuttle_load_mode", "async", LOAD_MODES),
            layered_timeout_s=_seconds(extra, "kvshuttle_layered_timeout_s", 2.0),
            transfer_cpus=_cpus(extra.get("kvshuttle_transfer_cpus")),
            digest_key=str(extra.get("kvshuttle_digest_key", model)),
            cost_model=None if cost is None else {str(k): float(v) for k, v in cost.items()},
            secret_file=_optional_text(extra, "kvshuttle_secret_file"),
            allowed_owners=_owners(extra.get("kvshuttle_allowed_owners")),
            content_index=_index_url(extra),
            content_index_wait_s=_seconds(extra, "kvshuttle_content_index_wait_s", 0.1),
            host_tier_blocks=_int(extra, "kvshuttle_host_tier_blocks", 0, minimum=0),
            host_tier_ttl_s=_seconds(extra, "kvshuttle_host_tier_ttl_s", DEFAULT_TIER_TTL_S),
            host_tier_eviction=_choice(extra, "kvshuttle_host_tier_eviction", "lru", tuple(sorted(EVICTION_POLICIES))),
            disk_tier_dir=_optional_text(extra, "kvshuttle_disk_tier_dir"),
            disk_tier_bytes=_int(extra, "kvshuttle_disk_tier_bytes", 0, minimum=0),
            disk_tier_ttl_s=_seconds(extra, "kvshuttle_disk_tier_ttl_s", DEFAULT_DISK_TTL_S),
            disk_tier_eviction=_choice(extra, "kvshuttle_disk_tier_eviction", "lru", tuple(sorted(EVICTION_POLICIES))),
        )
        if bool(config.disk_tier_bytes) != bool(config.disk_tier_dir) or (config.disk_tier_bytes and
                                                                          not config.host_tier_blocks):
            raise ConnectorConfigError("a disk tier needs kvshuttle_disk_tier_bytes > 0, kvshuttle_disk_tier_dir and "
                                       "a host tier (kvshuttle_host_tier_blocks > 0): set all three, or none")
        try:
            config.policy()
        except KVShuttleError as exc:
            raise ConnectorConfigError(f"kvshuttle_cost_model: {exc}") from exc
        try:
            config.terms()
        except RetentionArgumentError as exc:  # the keys were checked one by one: a term the checks above miss
            raise ConnectorConfigError(f"retention terms: {exc}") from exc
        if config.port > 65535:
            raise ConnectorConfigError(f"kvshuttle_port must be a TCP port (0..65535), got {config.port}")
        if config.max_concurrent_loads > MAX_CONCURRENT_LOADS:
            raise ConnectorConfigError(f"kvshuttle_max_concurrent_loads must be at most {MAX_CONCURRENT_LOADS} (each "
                                       f"is a thread), got {config.max_concurrent_loads}")
        for key, ttl in (("decoder_kv_blocks_ttl", config.decode_ttl_s), ("kv_lease_duration", config.prefill_ttl_s)):
            if ttl > config.max_ttl_s:
                raise ConnectorConfigError(f"{key} ({ttl:g} s) is longer than kvshuttle_max_ttl_s "
                                           f"({config.max_ttl_s:g} s): raise kvshuttle_max_ttl_s or shorten {key}")
        if config.host in WILDCARDS and config.advertise_host is None:
            raise ConnectorConfigError(f"kvshuttle_host {config.host!r} listens on every address: set "
                                       "kvshuttle_advertise_host to the address readers reach this engine at")
        return config


def _index_url(extra: Mapping[str, Any]) -> str | None:
    url = _optional_text(extra, "kvshuttle_content_index")
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConnectorConfigError(f"kvshuttle_content_index must be a Redis URL (redis://host:port/db), got "
                                   f"{shown(url[:80])}")
    return url


def _optional_text(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is not None and not (isinstance(value, str) and value):
        raise ConnectorConfigError(f"{key} must be a non-empty string, got {shown(value)}")
    return value


def _cpus(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and value and all(is_int(v) and 0 <= v < 65536 for v in value)):
        raise ConnectorConfigError(f"kvshuttle_transfer_cpus must be a list of CPU numbers, got {shown(value)}")
    return tuple(sorted({int(v) for v in value}))


def _owners(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value)):
        raise ConnectorConfigError(f"kvshuttle_allowed_owners must be a list of hosts or host:port strings, got "
                                   f"{shown(value)}")
    return tuple(value)


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise ConnectorConfigError(f"{key} must be true or false, got {shown(value)}")
    return value


def _int(extra: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConnectorConfigError(f"{key} must be an integer >= {minimum}, got {shown(value)}")
    return value


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):  # an int too large for a float too
        seconds = math.nan
    if isinstance(value, bool) or not (math.isfinite(seconds) and seconds > 0):
        raise ConnectorConfigError(f"{key} must be a positive number of seconds, got {shown(value)}")
    return seconds


def _fraction(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        share = float(value)
    except (TypeError, ValueError, OverflowError):  # an int too large for a float too
        share = math.nan
    if isinstance(value, bool) or not (math.isfinite(share) and 0 < share <= 1):
        raise ConnectorConfigError(f"{key} must be a share of the KV blocks in (0, 1], got {shown(value)}")
    return share


def _host(value: Any, key: str, *, wildcard: bool) -> str:
    """A host name or address; ``wildcard``: a bind address such as 0.0.0.0 is allowed."""
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value) or "/" in value:
        raise ConnectorConfigError(f"{key} must be a host name or IP address, got {shown(value)}")
    if not wildcard and value in WILDCARDS:
        raise ConnectorConfigError(f"{key} must be an address readers can reach, not the wildcard {value!r}")
    return value


def _choice(extra: Mapping[str, Any], key: str, default: Any, choices: tuple[Any, ...]) -> Any:
    value = extra.get(key, default)
    if not (isinstance(value, str) and value in choices):
        raise ConnectorConfigError(f"{key} must be one of {list(choices)}, got {shown(value)}")
    return value


def _backends(value: Any) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if not (isinstance(names, (list, tuple)) and names and all(isinstance(n, str) and n for n in names)):
        raise ConnectorConfigError(f"backends must be a list of NIXL plugin names such as ['UCX'], got "
                                   f"{shown(value)}")
    return tuple(names)
