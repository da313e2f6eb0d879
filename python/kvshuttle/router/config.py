"""The router's settings: backends, the TTL pair, tenants, the handle store, and their checks.

A decode backend is ``URL`` or ``URL,kv=HOST:PORT``: the optional suffix is that decode's kvshuttle side
channel (``kvshuttle_host`` / ``kvshuttle_port`` of its connector), where a streaming turn's handle is taken
once the stream ends (vLLM puts ``kv_transfer_params`` only on non-streaming responses).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from ..errors import shown
from .errors import RouterConfigError

Connector = Literal["kvshuttle", "nixl"]
Reads = Literal["use_once", "multi"]
Balance = Literal["round_robin", "least_loaded"]
CONNECTORS: tuple[Connector, ...] = ("kvshuttle", "nixl")
READS: tuple[Reads, ...] = ("use_once", "multi")
BALANCES: tuple[Balance, ...] = ("round_robin", "least_loaded")
DEFAULT_TENANT = "default"  # every request's tenant when neither a tenant header nor API keys are configured


@dataclass(frozen=True)
class BackendSpec:
    """One vLLM server: its base URL (``http://host:port``, no path) and, for a decode, its side channel."""

    url: str
    kv_address: str | None = None  # "tcp://host:port", where take_published / release reach it

    @property
    def name(self) -> str:
        return self.url.removeprefix("http://").removeprefix("https://")


def parse_backend(text: str) -> BackendSpec:
    """``http://host:port[,kv=HOST:PORT]`` -> BackendSpec; RouterConfigError names what is wrong."""
    url, _, rest = text.partition(",")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RouterConfigError(f"a backend is http(s)://host:port[,kv=HOST:PORT], got {shown(text)}")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise RouterConfigError(f"bad port in backend {shown(text)}") from None
    if parts.path.rstrip("/") not in ("", "/v1") or parts.query or parts.fragment:
        raise RouterConfigError(f"a backend URL is scheme://host:port (optionally /v1), got {shown(text)}")
    kv = None
    if rest:
        key, _, value = rest.partition("=")
        host, _, port = value.rpartition(":")
        if key != "kv" or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RouterConfigError(f"the suffix of a backend is ,kv=HOST:PORT, got {shown(rest)}")
        kv = f"tcp://{host}:{int(port)}"
    base = f"{parts.scheme}://{parts.netloc}"
    return BackendSpec(base, kv)


def load_api_keys(path: str | Path) -> dict[str, str]:
    """An API-key file: a JSON object mapping each key to its tenant (``{"sk-a": "team-a", ...}``)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RouterConfigError(f"cannot read the API-key file {path}: {exc}") from exc
    if not isinstance(data, dict) or not data or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in data.items()):
        raise RouterConfigError(f"{path} must hold a non-empty JSON object of key -> tenant strings")
    return dict(data)


@dataclass
class RouterConfig:
    """Everything a router needs; :meth:`check` validates it (the CLI and tests build it directly)."""

    prefill: list[BackendSpec]
    decode: list[BackendSpec]
    connector: Connector = "kvshuttle"
    store: str = "memory"  # "memory" or "redis://host:port/db"
    ttl_s: float = 450.0  # the router's handle TTL; below the decode's retention so a stored handle is live
    decode_ttl_s: float = 480.0  # the decode's retention (decoder_kv_blocks_ttl): configured together
    max_conversations: int = 100_000  # memory store: least recently used conversations dropped beyond this
    sweep_interval_s: float = 5.0  # memory store: expired handles removed on this timer, not only on traffic
    tenant_header: str | None = None  # e.g. "X-Tenant" set by a trusted gateway
    api_keys: dict[str, str] = field(default_factory=dict)  # API key -> tenant; then keys are required
    reads: Reads = "use_once"  # must match the decode's kvshuttle_reads (use_once: vLLM's behaviour)
    balance: Balance = "round_robin"
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 600.0  # one prefill request (max_tokens=1) end to end
    read_timeout_s: float = 600.0  # longest silence between two chunks of a decode's answer
    health_interval_s: float = 5.0
    max_in_flight: int = 128  # turns handled at once; more wait (queueing beats a lagging event loop)
    retries: int = 1  # further backends tried per role after a failure (never with a use-once handle)
    publish_timeout_s: float = 5.0  # how long to wait for a streamed turn's handle on the decode's board
    backend_api_key: str | None = None  # sent to backends as a bearer token (else the client's is forwarded)
    redis_key_prefix: str = "kvshuttle:router:"
    store_timeout_s: float = 2.0  # one Redis exchange; past it the turn recomputes (3 in a row: Redis skipped 1 s)

    def check(self) -> RouterConfig:
        if not self.prefill or not self.decode:
            raise RouterConfigError("the router needs at least one --prefill and one --decode backend")
        if self.connector not in CONNECTORS:
            raise RouterConfigError(f"--connector is one of {CONNECTORS}, got {shown(self.connector)}")
        if self.reads not in READS:
            raise RouterConfigError(f"--reads is one of {READS}, got {shown(self.reads)}")
        if self.balance not in BALANCES:
            raise RouterConfigError(f"--balance is one of {BALANCES}, got {shown(self.balance)}")
        for name in ("ttl_s", "decode_ttl_s", "sweep_interval_s", "connect_timeout_s", "prefill_timeout_s",
                     "read_timeout_s", "health_interval_s", "publish_timeout_s", "store_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise RouterConfigError(f"{name} must be a positive number of seconds, got {shown(value)}")
        if self.ttl_s >= self.decode_ttl_s:
            # A handle the router still holds must still be retained on the decode, or the next prefill's
            # claim is refused and the turn recomputes after a wasted round trip.
            raise RouterConfigError(f"the router TTL ({self.ttl_s:g} s) must be below the decode's retention "
                                    f"({self.decode_ttl_s:g} s, decoder_kv_blocks_ttl); e.g. 450 and 480")
        if not isinstance(self.max_conversations, int) or self.max_conversations <= 0:
            raise RouterConfigError(f"max_conversations must be a positive int, got {shown(self.max_conversations)}")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight <= 0:
            raise RouterConfigError(f"max_in_flight must be a positive int, got {shown(self.max_in_flight)}")
        if not isinstance(self.retries, int) or not 0 <= self.retries <= 10:
            raise RouterConfigError(f"retries must be an int in [0, 10], got {shown(self.retries)}")
        if self.tenant_header is not None and self.api_keys:
            raise RouterConfigError("use either --tenant-header or --api-keys, not both")
        if self.store != "memory" and not self.store.startswith(("redis://", "rediss://", "unix://")):
            raise RouterConfigError(f"--store is 'memory' or a redis:// URL, got {shown(self.store)}")
        if self.connector == "nixl" and any(d.kv_address for d in self.decode):
            raise RouterConfigError("kv=HOST:PORT is kvshuttle's decode side channel; vLLM's NixlConnector has "
                                    "none (drop the suffix or use --connector kvshuttle)")
        return self
