"""The connector's settings, read from ``kv_connector_extra_config``: vLLM's key names where the meaning is the
same, ``kvshuttle_*`` for ours. Every value is checked at start-up; a bad one is a ConnectorConfigError that
names the key (a misconfigured engine must not start and then hang requests)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import KVShuttleError, shown
from ...policy import PolicyConfig
from ...retention.ledger import MODES, Mode
from ...transfer.config import PATHS, Path


class ConnectorConfigError(KVShuttleError, ValueError):
    """A ``kv_connector_extra_config`` value kvshuttle cannot use; the message names the key and what it takes."""


@dataclass(frozen=True)
class ShuttleConfig:
    """Everything the scheduler and worker sides need (identical in both processes)."""

    bidirectional: bool = False  # bidirectional_kv_xfer: decode keeps finished requests' blocks for prefill
    threshold_tokens: int = 64  # kv_recompute_threshold (vLLM semantics: <= 0 means always read)
    decode_ttl_s: float = 480.0  # decoder_kv_blocks_ttl: how long decode keeps a finished request's blocks
    prefill_ttl_s: float = 30.0  # kv_lease_duration: how long prefill keeps a prompt's blocks for decode
    backends: tuple[str, ...] = ("UCX",)  # backends: NIXL plugins
    reads: Mode = "multi_read"  # kvshuttle_reads: "multi_read" (a retried turn reads again) or "use_once"
    budget_blocks: int | None = None  # kvshuttle_retention_budget_blocks: most blocks kept for later turns
    path: Path = "auto"  # kvshuttle_path
    host: str = "127.0.0.1"  # kvshuttle_host (or VLLM_NIXL_SIDE_CHANNEL_HOST): where readers reach this worker
    port: int = 0  # kvshuttle_port: 0 picks a free port
    load_timeout_s: float = 10.0  # kvshuttle_load_timeout_s: claim + read + confirm of one request
    digest_key: str = ""  # kvshuttle_digest_key: mixed into every block digest (default: the model)
    cost_model: Mapping[str, float] | None = None  # kvshuttle_cost_model: PolicyConfig cost inputs

    def policy(self) -> PolicyConfig:
        extra = self.digest_key.encode()
        if self.cost_model is not None:
            cost: dict[str, Any] = dict(self.cost_model)
            return PolicyConfig(kind="cost", extra_key=extra, **cost)
        return PolicyConfig.from_vllm_threshold(self.threshold_tokens, extra_key=extra)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], *, model: str = "") -> ShuttleConfig:
        known = {"bidirectional_kv_xfer", "kv_recompute_threshold", "decoder_kv_blocks_ttl", "kv_lease_duration",
                 "backends", "num_threads", "kvshuttle_reads", "kvshuttle_retention_budget_blocks", "kvshuttle_path",
                 "kvshuttle_host", "kvshuttle_port", "kvshuttle_load_timeout_s", "kvshuttle_digest_key",
                 "kvshuttle_cost_model"}
        unknown = sorted(k for k in extra if k.startswith("kvshuttle_") and k not in known)
        if unknown:
            raise ConnectorConfigError(f"unknown kv_connector_extra_config keys {unknown}; kvshuttle takes "
                                       f"{sorted(k for k in known if k.startswith('kvshuttle_'))}")
        budget = extra.get("kvshuttle_retention_budget_blocks")
        cost = extra.get("kvshuttle_cost_model")
        if cost is not None and not (isinstance(cost, Mapping) and all(isinstance(v, (int, float)) for v in
                                                                           cost.values())):
            raise ConnectorConfigError("kvshuttle_cost_model must map PolicyConfig cost fields to numbers, e.g. "
                                       '{"kv_bytes_per_token": 32768, "bandwidth_bytes_per_s": 3e9, '
                                       '"prefill_tokens_per_s": 500}')
        config = cls(
            bidirectional=_bool(extra, "bidirectional_kv_xfer", False),
            threshold_tokens=_int(extra, "kv_recompute_threshold", 64, minimum=-(2**31)),
            decode_ttl_s=_seconds(extra, "decoder_kv_blocks_ttl", 480.0),
            prefill_ttl_s=_seconds(extra, "kv_lease_duration", 30.0),
            backends=_backends(extra.get("backends", ["UCX"])),
            reads=_choice(extra, "kvshuttle_reads", "multi_read", MODES),
            budget_blocks=None if budget is None else _int(extra, "kvshuttle_retention_budget_blocks", 0, minimum=1),
            path=_choice(extra, "kvshuttle_path", "auto", PATHS),
            host=str(extra.get("kvshuttle_host") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "127.0.0.1"),
            port=_int(extra, "kvshuttle_port", 0, minimum=0),
            load_timeout_s=_seconds(extra, "kvshuttle_load_timeout_s", 10.0),
            digest_key=str(extra.get("kvshuttle_digest_key", model)),
            cost_model=None if cost is None else {str(k): float(v) for k, v in cost.items()},
        )
        try:
            config.policy()
        except KVShuttleError as exc:
            raise ConnectorConfigError(f"kvshuttle_cost_model: {exc}") from exc
        if config.port > 65535:
            raise ConnectorConfigError(f"kvshuttle_port must be a TCP port (0..65535), got {config.port}")
        return config


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
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (math.isfinite(seconds) and seconds > 0):
        raise ConnectorConfigError(f"{key} must be a positive number of seconds, got {shown(value)}")
    return seconds


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
