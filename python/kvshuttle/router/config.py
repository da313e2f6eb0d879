"""The router's settings: backends, the TTL pair, tenants, the handle store, and their checks.

A decode backend is ``URL`` or ``URL,kv=HOST:PORT``: the optional suffix is that decode's kvshuttle side
channel (``kvshuttle_host`` / ``kvshuttle_port`` of its connector), where a streaming turn's handle is taken
once the stream ends (vLLM puts ``kv_transfer_params`` only on non-streaming responses).
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from ..errors import shown
from ..policy.kv_handle import PREFIX
from ..retention.errors import RetentionArgumentError
from ..retention.terms import (
    DEFAULT_ROUTER_TTL_S,
    DEFAULT_TTL_S,
    READ_MODE_ALIASES,
    READ_MODES,
    ROUTER_READ_MODE,
    ReadMode,
    as_read_mode,
)
from ..trust import DeploymentSecret, is_loopback
from .errors import RouterConfigError
from .redact import redact_url, register, url_secrets
from .session_keys import SessionKeySources

Connector = Literal["kvshuttle", "nixl"]
Reads = ReadMode  # the retention words; "multi" is still accepted for multi_read on input (check())
Balance = Literal["round_robin", "least_loaded"]
Affinity = Literal["conversation", "none"]
CacheSalt = Literal["auto", "tenant", "conversation", "off"]
CONNECTORS: tuple[Connector, ...] = ("kvshuttle", "nixl")
READS: tuple[Reads, ...] = READ_MODES
BALANCES: tuple[Balance, ...] = ("round_robin", "least_loaded")
AFFINITIES: tuple[Affinity, ...] = ("conversation", "none")
CACHE_SALTS: tuple[CacheSalt, ...] = ("auto", "tenant", "conversation", "off")
DEFAULT_TENANT = "default"  # every request's tenant when neither a tenant header nor API keys are configured
SECRET_FIELDS = ("api_keys", "backend_api_key", "admin_key", "secret")  # never shown by repr


@dataclass(frozen=True)
class BackendSpec:
    """One vLLM server: its base URL (``http://host:port``, no path) and, for a decode, its side channel."""

    url: str  # never with credentials: it names the backend in logs, /health and /metrics
    kv_address: str | None = None  # "tcp://host:port", where take_published / release reach it
    # "Basic ..." from a URL's user:password@ (kept out of url, repr and every log line)
    auth: str | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.url.removeprefix("http://").removeprefix("https://")


def parse_backend(text: str) -> BackendSpec:
    """``http://host:port[,kv=HOST:PORT]`` -> BackendSpec; RouterConfigError names what is wrong."""
    url, _, rest = text.partition(",")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RouterConfigError(f"a backend is http(s)://host:port[,kv=HOST:PORT], got {shown(redact_url(text))}")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise RouterConfigError(f"bad port in backend {shown(redact_url(text))}") from None
    if parts.path.rstrip("/") not in ("", "/v1") or parts.query or parts.fragment:
        raise RouterConfigError(f"a backend URL is scheme://host:port (optionally /v1), got {shown(redact_url(text))}")
    kv = None
    if rest:
        key, _, value = rest.partition("=")
        host, _, port = value.rpartition(":")
        if key != "kv" or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RouterConfigError(f"the suffix of a backend is ,kv=HOST:PORT, got {shown(rest)}")
        kv = f"tcp://{host}:{int(port)}"
    host_port = parts.netloc.rpartition("@")[2]
    auth = None
    if "@" in parts.netloc:  # credentials go in a header of their own, never in what names the backend
        register(url_secrets(url))
        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        register([auth, auth.removeprefix("Basic ")])
    return BackendSpec(f"{parts.scheme}://{host_port}", kv, auth)


def load_api_keys(path: str | Path) -> dict[str, str]:
    """An API-key file: a JSON object mapping each key to its tenant (``{"sk-a": "team-a", ...}``).

    Errors name the file and the problem, never its content (a JSON error's position only)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise RouterConfigError(f"cannot read the API-key file {path}: {why}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        where = f" (line {exc.lineno} column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise RouterConfigError(f"cannot read the API-key file {path}: not JSON{where}") from None
    if not isinstance(data, dict) or not data or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in data.items()):
        raise RouterConfigError(f"{path} must hold a non-empty JSON object of key -> tenant strings")
    return dict(data)


@dataclass(repr=False)
class RouterConfig:
    """Everything a router needs; :meth:`check` validates it (the CLI and tests build it directly).

    ``repr`` shows the store URL without its password and no key or secret at all."""

    prefill: list[BackendSpec]
    decode: list[BackendSpec]
    connector: Connector = "kvshuttle"
    store: str = "memory"  # "memory" or "redis://host:port/db"
    ttl_s: float = DEFAULT_ROUTER_TTL_S  # the router's handle TTL; below the decode's retention so a stored handle
    decode_ttl_s: float = DEFAULT_TTL_S  # is live; the decode's retention (decoder_kv_blocks_ttl): set together
    max_conversations: int = 100_000  # memory store: least recently used conversations dropped beyond this
    sweep_interval_s: float = 5.0  # memory store: expired handles removed on this timer, not only on traffic
    tenant_header: str | None = None  # e.g. "X-Tenant" set by a trusted gateway
    # Where a turn's conversation key comes from, in order: the body's conversation_id, then the session headers
    # of common multi-turn clients (router/session_keys.py)
    session_keys: SessionKeySources = field(default_factory=SessionKeySources)
    api_keys: dict[str, str] = field(default_factory=dict)  # API key -> tenant; then keys are required
    # How a stored handle is read when the handle does not say: use_once takes it atomically (right for either
    # decode mode), multi_read keeps it for concurrent turns (only for decodes with kvshuttle_reads multi_read)
    reads: Reads = ROUTER_READ_MODE
    balance: Balance = "round_robin"  # turns without a conversation (or every turn with affinity "none")
    # "conversation": a conversation's turns stay on the prefill and decode that served it (their prefix caches
    # hold it), else on its rendezvous-hash home; reverse reads cover the turns that land elsewhere.
    affinity: Affinity = "conversation"
    # A chat turn whose new messages are estimated at most this many tokens goes straight to the decode that
    # holds the conversation, which computes it from its own prefix cache (no prefill, no transfer). 0: never.
    decode_local_max_tokens: int = 0
    # After a chat turn, send its history to the prefill of the next turn as a 1-token background request, so
    # that prefill's own prefix cache holds it when the next turn comes (router/prewarm.py). At most
    # prewarm_max_in_flight per prefill.
    prewarm: bool = False
    # False: prefills never get a decode handle (only their own prefix caches serve later turns; the baseline
    # of `kvshuttle bench placement`), and decodes keep nothing for them.
    reverse_reads: bool = True
    prewarm_max_in_flight: int = 2
    # Soft TTL classes: after an answer that ended with finish_reason "stop" (the conversation waits on a person),
    # ask its decode to demote the retention into its host tier at once (router/demotions.py); "tool_calls" and
    # any other finish leave it hot. kvshuttle decodes only.
    demote_on_stop: bool = False
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
    max_store_bytes: int = 256 << 20  # memory store: approximate bytes of stored handles; LRU beyond
    # Clients (docs/SECURITY.md): bodies are read whole, bounded, before a turn takes an admission slot.
    max_body_bytes: int = 4 << 20  # a larger request body is a 413
    body_timeout_s: float = 30.0  # the whole body must arrive within this (408), however it trickles
    client_write_timeout_s: float = 30.0  # one write to a client; a client not reading is cut, its backend closed
    client_idle_timeout_s: float = 75.0  # a kept-alive client connection idle this long is closed
    # What one tenant may make the router hold (router/admission.py); with one shared tenant (no --api-keys or
    # --tenant-header) the tenant bounds are the router's own.
    tenant_max_requests: int = 64  # inside at once: reading a body, waiting or served (429 beyond)
    tenant_max_in_flight: int = 32  # served at once; more wait (other tenants' turns pass them)
    tenant_max_bytes: int = 64 << 20  # bodies held, at their parsed estimate (429 beyond)
    max_held_bytes: int = 512 << 20  # bodies held over every tenant (503 beyond)
    max_parsed_bytes: int = 32 << 20  # one body's parsed estimate (413 body_too_complex beyond, never parsed)
    # Stored handles per tenant (None: a quarter of the store's bounds when tenants are configured): a tenant
    # over its quota loses its own least recently used conversations (released on their decode), not others'.
    tenant_max_conversations: int | None = None
    tenant_max_store_bytes: int | None = None
    shutdown_grace_s: float = 5.0  # SIGTERM: turns being served get this long; waiting ones are refused at once
    # vLLM's cache_salt on every prefill, decode and pre-warm request: "tenant" (a keyed hash of the tenant, so
    # no tenant's prefix-cache hit or timing tells another anything), "conversation" (of tenant and
    # conversation), "off", or "auto": "tenant" when tenants are configured, else "off".
    cache_salt: CacheSalt = "auto"
    # A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json with chat_template): chat turns'
    # prompts are built from the ids the decode generated (router/token_exact.py). None: off.
    token_exact: str | None = None
    token_exact_max_tokens: int = 65_536  # a longer conversation (prompt and answer ids) is not kept
    # True: fall back where the template renders the kept turns differently now (token_ids.TEMPLATE_REWRITES);
    # False: keep the ids the model saw (lenient)
    token_exact_strict: bool = True
    admin_key: str | None = None  # with API keys, /health and /metrics need it (Bearer), or the admin listener
    # The deployment secret: verifies decode handles before they are stored, signs retention grants and
    # authenticates side-channel calls. None: DeploymentSecret.resolve() when the router starts.
    secret: DeploymentSecret | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        shown_fields = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SECRET_FIELDS:
                text = f"<{len(value)} keys>" if f.name == "api_keys" else ("<set>" if value else "None")
            elif f.name == "store":
                text = repr(redact_url(value) if value != "memory" else value)
            else:
                text = repr(value)
            shown_fields.append(f"{f.name}={text}")
        return f"RouterConfig({', '.join(shown_fields)})"

    def check(self) -> RouterConfig:
        if not self.prefill or not self.decode:
            raise RouterConfigError("the router needs at least one --prefill and one --decode backend")
        if self.connector not in CONNECTORS:
            raise RouterConfigError(f"--connector is one of {CONNECTORS}, got {shown(self.connector)}")
        try:
            self.reads = as_read_mode(self.reads, "--reads", aliases=True)  # a deployment's old "multi" still works
        except RetentionArgumentError:
            raise RouterConfigError(f"--reads is one of {READS}, got {shown(self.reads)}") from None
        if self.balance not in BALANCES:
            raise RouterConfigError(f"--balance is one of {BALANCES}, got {shown(self.balance)}")
        if self.affinity not in AFFINITIES:
            raise RouterConfigError(f"--affinity is one of {AFFINITIES}, got {shown(self.affinity)}")
        if type(self.decode_local_max_tokens) is not int or not 0 <= self.decode_local_max_tokens <= 1 << 20:
            raise RouterConfigError(f"decode_local_max_tokens must be an int in [0, 1048576], got "
                                    f"{shown(self.decode_local_max_tokens)}")
        for name in ("ttl_s", "decode_ttl_s", "sweep_interval_s", "connect_timeout_s", "prefill_timeout_s",
                     "read_timeout_s", "health_interval_s", "publish_timeout_s", "store_timeout_s", "body_timeout_s",
                     "client_write_timeout_s", "client_idle_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise RouterConfigError(f"{name} must be a positive number of seconds, got {shown(value)}")
        if self.ttl_s >= self.decode_ttl_s:
            # A handle the router still holds must still be retained on the decode, or the next prefill's
            # claim is refused and the turn recomputes after a wasted round trip.
            raise RouterConfigError(f"the router TTL ({self.ttl_s:g} s) must be below the decode's retention "
                                    f"({self.decode_ttl_s:g} s, decoder_kv_blocks_ttl); e.g. "
                                    f"{DEFAULT_ROUTER_TTL_S:g} and {DEFAULT_TTL_S:g}")
        if not isinstance(self.max_conversations, int) or self.max_conversations <= 0:
            raise RouterConfigError(f"max_conversations must be a positive int, got {shown(self.max_conversations)}")
        for name in ("max_store_bytes", "max_body_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise RouterConfigError(f"{name} must be a positive int (bytes), got {shown(value)}")
        if self.secret is not None and not isinstance(self.secret, DeploymentSecret):
            raise RouterConfigError(f"secret must be a kvshuttle.trust.DeploymentSecret, got "
                                    f"{type(self.secret).__name__}")
        for name in ("prewarm", "reverse_reads", "demote_on_stop"):
            if type(getattr(self, name)) is not bool:
                raise RouterConfigError(f"{name} must be a bool, got {shown(getattr(self, name))}")
        if type(self.prewarm_max_in_flight) is not int or not 0 < self.prewarm_max_in_flight <= 1024:
            raise RouterConfigError(f"prewarm_max_in_flight must be an int in [1, 1024], got "
                                    f"{shown(self.prewarm_max_in_flight)}")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight <= 0:
            raise RouterConfigError(f"max_in_flight must be a positive int, got {shown(self.max_in_flight)}")
        if not isinstance(self.retries, int) or not 0 <= self.retries <= 10:
            raise RouterConfigError(f"retries must be an int in [0, 10], got {shown(self.retries)}")
        for name in ("tenant_max_requests", "tenant_max_in_flight", "tenant_max_bytes", "max_held_bytes",
                     "max_parsed_bytes"):
            if type(getattr(self, name)) is not int or getattr(self, name) <= 0:
                raise RouterConfigError(f"{name} must be a positive int, got {shown(getattr(self, name))}")
        for name in ("tenant_max_conversations", "tenant_max_store_bytes"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                raise RouterConfigError(f"{name} must be a positive int or None, got {shown(value)}")
        if not isinstance(self.shutdown_grace_s, (int, float)) or not 0 <= self.shutdown_grace_s < math.inf:
            raise RouterConfigError(f"shutdown_grace_s must be a number of seconds >= 0, got "
                                    f"{shown(self.shutdown_grace_s)}")
        if self.token_exact is not None and (not isinstance(self.token_exact, str) or not self.token_exact):
            raise RouterConfigError(f"token_exact is a tokenizer directory or None, got {shown(self.token_exact)}")
        if type(self.token_exact_max_tokens) is not int or not 0 < self.token_exact_max_tokens <= 1 << 22:
            raise RouterConfigError(f"token_exact_max_tokens must be an int in [1, 4194304], got "
                                    f"{shown(self.token_exact_max_tokens)}")
        if type(self.token_exact_strict) is not bool:
            raise RouterConfigError(f"token_exact_strict must be a bool, got {shown(self.token_exact_strict)}")
        if self.cache_salt not in CACHE_SALTS:
            raise RouterConfigError(f"--cache-salt is one of {CACHE_SALTS}, got {shown(self.cache_salt)}")
        if self.tenant_header is not None and self.api_keys:
            raise RouterConfigError("use either --tenant-header or --api-keys, not both")
        if self.store != "memory" and not self.store.startswith(("redis://", "rediss://", "unix://")):
            raise RouterConfigError(f"--store is 'memory' or a redis:// URL, got {shown(redact_url(self.store))}")
        if self.demote_on_stop and self.connector != "kvshuttle":
            raise RouterConfigError("--demote-on-stop asks a kvshuttle decode's side channel; vLLM's NixlConnector "
                                    "has none (use --connector kvshuttle)")
        if self.connector == "nixl" and any(d.kv_address for d in self.decode):
            raise RouterConfigError("kv=HOST:PORT is kvshuttle's decode side channel; vLLM's NixlConnector has "
                                    "none (drop the suffix or use --connector kvshuttle)")
        return self

    def read_mode_of(self, params: dict[str, Any] | None) -> Reads:
        """A stored handle's read mode: its own word (``kvshuttle_reads``, under the MAC checked before it was
        stored), else this router's ``reads`` (vLLM's NixlConnector, decodes before handle wire version 4)."""
        word = params.get(PREFIX + "reads") if params else None
        return word if isinstance(word, str) and word in READ_MODES else self.reads

    def sole_user(self, params: dict[str, Any] | None) -> bool:
        """Whether the turn that looked up this handle took it from the store, so no other turn can use it and the
        turn releases it once it has no use for it (superseded, unread): a lookup takes every handle when ``reads``
        is use_once, and a handle that is use-once itself whatever the setting (it has one reader: the taker)."""
        return self.reads == "use_once" or self.read_mode_of(params) == "use_once"

    @property
    def tenants(self) -> bool:
        """Whether requests have tenants of their own (API keys or a gateway's header), not one shared."""
        return bool(self.api_keys) or self.tenant_header is not None

    @property
    def salt_mode(self) -> CacheSalt:
        """The cache-salt mode in effect (``auto`` resolved)."""
        if self.cache_salt == "auto":
            return "tenant" if self.tenants else "off"
        return self.cache_salt

    def store_quota(self) -> tuple[int, int]:
        """(conversations, bytes) one tenant may keep in the memory store or Redis."""
        share = 4 if self.tenants else 1
        return (self.tenant_max_conversations or max(1, self.max_conversations // share),
                self.tenant_max_store_bytes or max(1, self.max_store_bytes // share))


def check_exposure(host: str, config: RouterConfig, allow_shared_tenant: bool = False) -> None:
    """RouterConfigError for a bind other hosts can reach while every client would be one tenant.

    With neither API keys nor a trusted tenant header, all clients share the tenant ``default``: anyone who can
    reach the router can continue (and read back the KV of) any conversation whose id they know or guess.
    """
    if is_loopback(host) or config.api_keys or config.tenant_header is not None or allow_shared_tenant:
        return
    raise RouterConfigError(
        f"--host {host or '(all interfaces)'} is reachable from other hosts, but without tenants every client "
        "shares one and can continue any conversation whose id it knows: configure --api-keys FILE (a JSON "
        "object of bearer key -> tenant) or --tenant-header NAME (set by a trusted gateway that strips it from "
        "clients), or pass --allow-shared-tenant to accept one shared tenant (e.g. behind a gateway that "
        "authenticates every client)")


def read_mode_flag(text: str) -> str:
    """``--reads``: the retention words; the old ``multi`` maps to ``multi_read`` with a FutureWarning."""
    return as_read_mode(text, "--reads", aliases=True) if text in READ_MODE_ALIASES else text
