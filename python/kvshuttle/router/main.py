"""``kvshuttle router``: run the multi-turn router (see :mod:`kvshuttle.router.proxy`).

Prints ``kvshuttle router: listening on http://HOST:PORT`` once it serves (``--port 0`` picks a free port) and
stops cleanly on SIGINT / SIGTERM. Secrets (the Redis URL's password, the backends' key) come from the
environment or a file as well as flags (flags are visible to other users in ``ps``); every log line masks them.
A bind other hosts can reach needs tenants (``--api-keys`` or ``--tenant-header``) or ``--allow-shared-tenant``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from typing import Any

from ..retention.terms import DEFAULT_ROUTER_TTL_S, DEFAULT_TTL_S, ROUTER_READ_MODE
from .config import (
    AFFINITIES,
    BALANCES,
    CACHE_SALTS,
    CONNECTORS,
    READS,
    RouterConfig,
    check_exposure,
    load_api_keys,
    parse_backend,
    read_mode_flag,
)
from .errors import RouterConfigError
from .redact import (
    ADMIN_KEY_ENV,
    BACKEND_API_KEY_ENV,
    REDIS_URL_ENV,
    RedactingFilter,
    has_password,
    one_source,
    read_secret_file,
    register,
    scrub,
    url_secrets,
)
from .session_keys import SessionKeyError, SessionKeySources

_SIZE = re.compile(r"(\d+)\s*([kmg]?)(i?b)?", re.IGNORECASE)


def byte_size(text: str) -> int:
    """``4194304``, ``4M``, ``4MiB``, ``256m``, ``1G`` -> bytes (binary multiples)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"a size is a positive number of bytes, optionally K, M or G, got {text!r}")
    return int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2).lower()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers, http://host:port")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL[,kv=HOST:PORT]",
                        help="decode servers; kv=HOST:PORT is the decode's kvshuttle side channel (streamed turns "
                             "learn their handle there)")
    parser.add_argument("--connector", choices=CONNECTORS, default="kvshuttle",
                        help="the engines' connector: kvshuttle (streams learn handles) or nixl (vLLM's "
                             "NixlConnector: only non-streamed turns carry a handle to the next)")
    parser.add_argument("--store", default=None,
                        help="'memory' (default unless a Redis URL is configured), 'redis' (the URL from "
                             f"--redis-url-file, {REDIS_URL_ENV} or --redis-url) or a redis:// URL")
    parser.add_argument("--redis-url", help=f"the shared store's URL (a password here shows in ps: prefer "
                                            f"{REDIS_URL_ENV} or --redis-url-file)")
    parser.add_argument("--redis-url-file", metavar="PATH", help="a file holding the shared store's URL")
    parser.add_argument("--store-timeout", type=float, default=2.0,
                        help="seconds one Redis exchange may take; past it the turn recomputes")
    parser.add_argument("--ttl", type=float, default=DEFAULT_ROUTER_TTL_S,
                        help="seconds a handle is kept (below --decode-ttl)")
    parser.add_argument("--decode-ttl", type=float, default=DEFAULT_TTL_S,
                        help="the decode's retention, decoder_kv_blocks_ttl (checked: --ttl must be below it)")
    parser.add_argument("--max-conversations", type=int, default=100_000, help="memory store bound (LRU beyond)")
    parser.add_argument("--max-store-bytes", type=byte_size, default=256 << 20,
                        help="memory store bound in serialized bytes of handles (LRU beyond); default 256M")
    tenants = parser.add_mutually_exclusive_group()
    tenants.add_argument("--tenant-header", help="request header naming the tenant (set by a trusted gateway)")
    tenants.add_argument("--api-keys", help="JSON file {api_key: tenant}; then every request needs a known key")
    parser.add_argument("--session-key", default=None, metavar="SOURCES",
                        help="where a turn's conversation key comes from, first present wins: comma-separated "
                             "'body:conversation_id' and header names (default: body:conversation_id, "
                             "X-Conversation-Id, X-Session-ID, X-Session-Affinity, X-Dynamo-Session-ID, x-user-id)")
    parser.add_argument("--allow-shared-tenant", action="store_true",
                        help="serve a non-loopback --host without --api-keys or --tenant-header (one tenant for all)")
    parser.add_argument("--reads", type=read_mode_flag, choices=READS, default=ROUTER_READ_MODE,
                        help="for handles that do not say: use_once takes a handle atomically; multi_read keeps it "
                             "(only with decodes whose kvshuttle_reads is multi_read; 'multi' is deprecated)")
    parser.add_argument("--balance", choices=BALANCES, default="round_robin",
                        help="for turns without a conversation (or every turn with --affinity none)")
    parser.add_argument("--affinity", choices=AFFINITIES, default="conversation",
                        help="conversation: a conversation stays on the prefill and decode that served it (their "
                             "prefix caches hold it), else on its rendezvous-hash home")
    parser.add_argument("--decode-local-max-tokens", type=int, default=0, metavar="N",
                        help="a chat turn adding at most about N tokens is computed on the decode that holds the "
                             "conversation (no prefill, no transfer); 0: never")
    parser.add_argument("--no-reverse-reads", dest="reverse_reads", action="store_false",
                        help="never hand prefills a decode handle: only their own prefix caches serve later turns")
    parser.add_argument("--prewarm", action="store_true",
                        help="after a chat turn, warm the next turn's prefill with the history (1-token request)")
    parser.add_argument("--prewarm-max-in-flight", type=int, default=2, metavar="N",
                        help="pre-warms in flight per prefill at most (more are skipped)")
    parser.add_argument("--demote-on-stop", action="store_true",
                        help="after an answer that ended with finish_reason stop (waiting on a person), ask its "
                             "decode to move the conversation into its host tier at once (tool_calls: kept hot)")
    parser.add_argument("--token-exact", default=None, metavar="TOKENIZER_DIR",
                        help="build chat turns' prompts from the ids the decode generated, so its answer blocks "
                             "are read back (a Hugging Face tokenizer directory: tokenizer.json and "
                             "tokenizer_config.json with chat_template; needs kvshuttle[token-exact])")
    parser.add_argument("--token-exact-max-tokens", type=int, default=65_536, metavar="N",
                        help="longest conversation (prompt and answer ids) kept for the token-exact path")
    parser.add_argument("--token-exact-lenient", dest="token_exact_strict", action="store_false",
                        help="keep the ids the model saw even where the template now renders the kept turns "
                             "differently (default: render as usual then)")
    parser.add_argument("--max-in-flight", type=int, default=128,
                        help="turns handled at once; more wait their turn (bounds the event loop's lag)")
    parser.add_argument("--retries", type=int, default=1, help="other backends tried per role after a failure")
    parser.add_argument("--publish-timeout", type=float, default=5.0,
                        help="seconds to wait for a streamed turn's handle on the decode's board")
    parser.add_argument("--max-body-bytes", type=byte_size, default=4 << 20,
                        help="largest request body (413 beyond); default 4M")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request body may take to arrive in full (408 beyond)")
    parser.add_argument("--client-write-timeout", type=float, default=30.0,
                        help="seconds one write to a client may take; a client not reading is cut")
    parser.add_argument("--client-idle-timeout", type=float, default=75.0,
                        help="seconds a kept-alive client connection may sit idle")
    parser.add_argument("--tenant-max-requests", type=int, default=64, metavar="N",
                        help="requests of one tenant inside the router at once (reading, waiting, served); 429 beyond")
    parser.add_argument("--tenant-max-in-flight", type=int, default=32, metavar="N",
                        help="turns of one tenant served at once; more wait (other tenants' turns pass them)")
    parser.add_argument("--tenant-max-bytes", type=byte_size, default=64 << 20,
                        help="request bodies one tenant may have the router hold, at their parsed size; default 64M")
    parser.add_argument("--max-held-bytes", type=byte_size, default=512 << 20,
                        help="request bodies the router holds over every tenant (503 beyond); default 512M")
    parser.add_argument("--max-parsed-bytes", type=byte_size, default=32 << 20,
                        help="one body's estimated parsed size (413 body_too_complex beyond, never parsed); 32M")
    parser.add_argument("--tenant-max-conversations", type=int, default=None, metavar="N",
                        help="stored conversations per tenant (default: a quarter of --max-conversations with "
                             "tenants); a tenant over it loses its own least recently used")
    parser.add_argument("--tenant-max-store-bytes", type=byte_size, default=None,
                        help="memory store bytes per tenant (default: a quarter of --max-store-bytes with tenants)")
    parser.add_argument("--cache-salt", choices=CACHE_SALTS, default="auto",
                        help="vLLM cache_salt the router sets on every backend request: tenant (a keyed hash of the "
                             "tenant), conversation, off; auto: tenant when tenants are configured, else off")
    parser.add_argument("--shutdown-grace", type=float, default=5.0,
                        help="seconds SIGTERM leaves turns being served (waiting ones are refused at once)")
    parser.add_argument("--admin-port", type=int, default=None,
                        help="serve /health and /metrics on this port too, open (bind it where only the operator "
                             "reaches: --admin-host)")
    parser.add_argument("--admin-host", default="127.0.0.1", help="the admin listener's address")
    parser.add_argument("--admin-key-file", metavar="PATH",
                        help=f"a file holding the key /health and /metrics need on the main listener when API keys "
                             f"are configured (or {ADMIN_KEY_ENV})")
    parser.add_argument("--backend-api-key", help=f"bearer token for the backends (default: forward the client's; "
                                                  f"prefer {BACKEND_API_KEY_ENV} or --backend-api-key-file)")
    parser.add_argument("--backend-api-key-file", metavar="PATH", help="a file holding the backends' bearer token")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="event loop: auto uses uvloop when installed (measured: no less CPU per turn)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--log-level", default="INFO")


def session_keys(text: str | None) -> SessionKeySources:
    try:
        return SessionKeySources.parse(text)
    except SessionKeyError as exc:
        raise RouterConfigError(f"--session-key: {exc}") from None


def store_from(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """``memory`` or the Redis URL, from ``--store``, ``--redis-url``, ``--redis-url-file`` or the environment."""
    store = args.store
    flags: dict[str, str | None] = {
        "--store": store if store not in (None, "memory", "redis") else None, "--redis-url": args.redis_url,
        "--redis-url-file": read_secret_file(args.redis_url_file, "the Redis URL") if args.redis_url_file else None}
    for flag in ("--store", "--redis-url"):
        if flags[flag] and has_password(flags[flag] or ""):
            print(f"kvshuttle router: warning: the Redis password is on the command line ({flag}), where other "
                  f"users can read it (ps); prefer {REDIS_URL_ENV} or --redis-url-file", file=sys.stderr)
    if store == "memory":
        if any(flags.values()):
            raise RouterConfigError("--store memory and a Redis URL: choose one")
        return "memory"
    url = one_source("the Redis URL", flags, REDIS_URL_ENV, environ)
    if url is None and store == "redis":
        raise RouterConfigError(f"--store redis needs the URL: --redis-url-file PATH, {REDIS_URL_ENV} or --redis-url")
    register(url_secrets(url) if url else [])
    return url or "memory"


def config_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RouterConfig:
    env = os.environ if environ is None else environ
    backend_key = one_source("the backends' API key", {
        "--backend-api-key": args.backend_api_key,
        "--backend-api-key-file": (read_secret_file(args.backend_api_key_file, "the backends' API key")
                                   if args.backend_api_key_file else None)}, BACKEND_API_KEY_ENV, env)
    register([backend_key])
    admin_key = one_source("the admin key", {
        "--admin-key-file": read_secret_file(args.admin_key_file, "the admin key") if args.admin_key_file else None},
        ADMIN_KEY_ENV, env)
    register([admin_key])
    api_keys = load_api_keys(args.api_keys) if args.api_keys else {}
    register(api_keys)
    config = RouterConfig(
        prefill=[parse_backend(u) for u in args.prefill], decode=[parse_backend(u) for u in args.decode],
        connector=args.connector, store=store_from(args, env), ttl_s=args.ttl, decode_ttl_s=args.decode_ttl,
        max_conversations=args.max_conversations, tenant_header=args.tenant_header, api_keys=api_keys,
        session_keys=session_keys(args.session_key),
        reads=args.reads, balance=args.balance, affinity=args.affinity,
        decode_local_max_tokens=args.decode_local_max_tokens, retries=args.retries, prewarm=args.prewarm,
        reverse_reads=args.reverse_reads, prewarm_max_in_flight=args.prewarm_max_in_flight,
        demote_on_stop=args.demote_on_stop,
        publish_timeout_s=args.publish_timeout,
        backend_api_key=backend_key, store_timeout_s=args.store_timeout, max_in_flight=args.max_in_flight,
        max_store_bytes=args.max_store_bytes, max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
        client_write_timeout_s=args.client_write_timeout, client_idle_timeout_s=args.client_idle_timeout,
        tenant_max_requests=args.tenant_max_requests, tenant_max_in_flight=args.tenant_max_in_flight,
        tenant_max_bytes=args.tenant_max_bytes, max_held_bytes=args.max_held_bytes,
        max_parsed_bytes=args.max_parsed_bytes, tenant_max_conversations=args.tenant_max_conversations,
        tenant_max_store_bytes=args.tenant_max_store_bytes, cache_salt=args.cache_salt,
        shutdown_grace_s=args.shutdown_grace, admin_key=admin_key, token_exact=args.token_exact,
        token_exact_max_tokens=args.token_exact_max_tokens, token_exact_strict=args.token_exact_strict,
    ).check()
    check_exposure(args.host, config, args.allow_shared_tenant)
    return config


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's ``kv`` fields (secrets masked)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                                "msg": record.getMessage()}
        line.update(getattr(record, "kv", {}))
        if record.exc_info or record.exc_text:
            line["exc"] = record.exc_text or self.formatException(record.exc_info)  # type: ignore[arg-type]
        return scrub(json.dumps(line, default=str))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "kv", {})
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        return scrub(super().format(record) + (" " + extra if extra else ""))


def _logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter("%(asctime)s %(levelname)s %(message)s"))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger("kvshuttle.router")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    for name in ("aiohttp", "redis"):  # their warnings and tracebacks go through the same masking handler
        other = logging.getLogger(name)
        other.handlers[:] = [handler]
        other.setLevel(logging.WARNING)
        other.propagate = False


async def serve(config: RouterConfig, host: str, port: int, admin: tuple[str, int] | None = None) -> None:
    from aiohttp import web

    from .proxy import Router

    router = Router(config)
    runner = router.runner()
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    admin_runner = None
    if admin is not None:  # /health and /metrics where only the operator reaches
        admin_runner = web.AppRunner(router.admin_app(), access_log=None, shutdown_timeout=1.0)
        await admin_runner.setup()
        await web.TCPSite(admin_runner, admin[0], admin[1]).start()
        print(f"kvshuttle router: admin on http://{admin[0]}:{admin_runner.addresses[0][1]}", flush=True)
    if config.api_keys and not config.admin_key and admin is None:
        print("kvshuttle router: warning: with --api-keys, /health and /metrics answer 401 to everyone: give "
              "--admin-key-file or --admin-port for probes and scrapers", file=sys.stderr, flush=True)
    print(f"kvshuttle router: listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        router.shutdown()  # waiting turns and newcomers: 503 now; turns being served: shutdown_grace_s
        await runner.cleanup()
        if admin_runner is not None:
            await admin_runner.cleanup()


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except RouterConfigError as exc:
        print(f"kvshuttle router: {scrub(str(exc))}", file=sys.stderr)
        return 2
    _logging(args.log_format, args.log_level)
    try:
        admin = (args.admin_host, args.admin_port) if args.admin_port is not None else None
        _run(args.loop, serve(config, args.host, args.port, admin))
    except RouterConfigError as exc:
        print(f"kvshuttle router: {scrub(str(exc))}", file=sys.stderr)
        return 2
    return 0


def _run(choice: str, main: Any) -> None:
    """Run ``main`` on uvloop when chosen (or ``auto`` and installed), else on asyncio's own loop."""
    uvloop = None
    if choice != "asyncio":
        try:
            uvloop = importlib.import_module("uvloop")  # optional: not a dependency (and untyped where absent)
        except ImportError:
            if choice == "uvloop":
                main.close()
                raise RouterConfigError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
    if uvloop is None:
        asyncio.run(main)
    else:
        uvloop.run(main)
