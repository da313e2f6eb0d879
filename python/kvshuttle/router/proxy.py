"""The multi-turn router: an OpenAI-compatible proxy that carries each conversation's decode handle between turns.

Per turn (vLLM's disaggregated proxies' protocol, see ``docs/ARCHITECTURE.md``):

1. tenant (configured header or API key, checked in constant time) and the whole request body, bounded in
   size and time and checked (:mod:`.bodies`), all before the turn takes an admission slot; conversation key
   (the ``conversation_id`` body field, or a client's session header: :mod:`.session_keys`); client-supplied
   ``kv_transfer_params`` are dropped, untrusted;
2. the conversation's stored decode handle is taken (use-once) or read (multi-read) from the store;
3. prefill: ``stream=false``, ``max_tokens=1``, ``kv_transfer_params`` = the handle (prefill reads the
   conversation's KV back from the decode) or turn 1's ``{"do_remote_decode": true, ...}``, with a
   retention grant (kvshuttle's connector);
4. decode: the client's request with prefill's returned params and a grant, one ``X-Request-Id`` for both;
   the answer passes through to the client (streamed event by event, unbuffered, every write bounded in
   time), without ``kv_transfer_params``;
5. the decode's returned params are validated, authenticated (their MAC, under the deployment secret) and
   stored for the next turn: from the response body when not streaming; when streaming from the last chunk
   (vLLM 0.33) or else from the decode's handle board, under the ``kvshuttle_publish_key`` the router added
   (kvshuttle's connector only).

Failures degrade: a failed store lookup or prefill makes a recompute turn; a failed backend is retried on
another one without the handle (a use-once handle is never replayed); only when no decode answers does the
client get an error. No error body shows internal exception text (it may hold a secret).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from ..params import PUBLISH_KEY
from ..trust import DeploymentSecret, TrustError, is_loopback
from . import relay
from .admission import Gate, limits_of
from .answers import Answers
from .auth import ApiKeys, cache_salt
from .backends import BACKEND_FAILURES, Backend, BackendPool
from .bodies import CHAT, COMPLETIONS, BadRequest, parse_body, read_body
from .config import RouterConfig
from .demotions import STOP, Demotions
from .dispatch import Dispatch
from .endpoints import Endpoints
from .errors import RouterConfigError, StoreError
from .handles import valid_id
from .kv import Demoter, Releaser, SideChannelCalls, Taker
from .metrics import RouterMetrics
from .placement import decode_local
from .prefills import Prefills
from .prewarm import Prewarmer, answer_from_events
from .redact import install_filter, redact_url, register, url_secrets
from .relay import error_response as _error
from .releases import Releases
from .session_keys import BODY_FIELD
from .store import HandleStore, MemoryStore, RedisStore, StoredHandle
from .token_exact import TokenExact, load_codec
from .turn import Turn

log = logging.getLogger("kvshuttle.router")
# An idle backend connection is dropped before vLLM's server closes it (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): reusing
# one the server is closing fails the request (ServerDisconnectedError, a 502 and a backend marked down) whenever
# a conversation's turns are more than 5 s apart, as an agent's tool calls and a person's replies are.
BACKEND_KEEPALIVE_S = 3.0

NO_PREFILL_PARAMS = {"do_remote_decode": False, "do_remote_prefill": False}  # decode computes the prompt itself
_dumps = json.JSONEncoder(separators=(",", ":")).encode


class Router:
    """The router's state and its aiohttp application (:meth:`app`; :meth:`runner` serves it).

    A turn runs here (:meth:`_turn`) with its collaborators: :class:`.Dispatch` (tenants, backend choice,
    grants), :class:`.Prefills` (the prefill's side), :class:`.Answers` (the decode's answer, its handle
    learned) and :class:`.Releases` (retentions let go); :class:`.Endpoints` serves the small endpoints."""

    def __init__(self, config: RouterConfig, *, store: HandleStore | None = None, taker: Taker | None = None,
                 releaser: Releaser | None = None, demoter: Demoter | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        config = config.check()
        if config.secret is None:
            try:
                config = replace(config, secret=DeploymentSecret.resolve())
            except TrustError as exc:
                raise RouterConfigError(str(exc)) from None
        self.config = config
        self.secret: DeploymentSecret = config.secret  # type: ignore[assignment]  # set just above
        # Every log line from here on masks these (the formatters of `kvshuttle router` too).
        register([*config.api_keys, config.backend_api_key,
                  *(url_secrets(config.store) if config.store != "memory" else [])])
        install_filter()
        self.metrics = RouterMetrics()
        self._clock = clock
        self._keys = ApiKeys(config.api_keys)
        self.store: HandleStore = store if store is not None else self._make_store()
        salt = self.secret.key("router-affinity")  # conversations' homes: the same on every replica, unguessable
        self.prefill = BackendPool(config.prefill, "prefill", config.balance, salt)
        self.decode = BackendPool(config.decode, "decode", config.balance, salt)
        self._calls: SideChannelCalls | None = None
        if taker is None or releaser is None or (config.demote_on_stop and demoter is None):
            self._calls = SideChannelCalls(self.secret)
        self._take: Taker = taker or self._calls.take  # type: ignore[union-attr]
        self._release: Releaser = releaser or self._calls.release  # type: ignore[union-attr]
        # soft TTL classes: an answer that waits on a person demotes its retention (demotions.py)
        self._demotions = Demotions(demoter or self._calls.demote,  # type: ignore[union-attr]
                                    self.metrics) if config.demote_on_stop else None
        self._session: aiohttp.ClientSession | None = None
        # Turns beyond max_in_flight wait in the gate, before any work: an overloaded loop would otherwise lag past
        # the store's and backends' timeouts. Only turns whose whole body is in take a slot (a client trickling
        # its body holds a connection, never a slot), and each tenant's share is bounded (admission.py).
        self._gate = Gate(limits_of(config))
        self._salt_key = self.secret.key("router-cache-salt") if config.salt_mode != "off" else None
        self._keep_answers = config.prewarm or config.decode_local_max_tokens > 0
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:12]  # request ids: unique per router process, not secret
        self._tasks: list[asyncio.Task[None]] = []
        # the decode keeps a conversation only where a later turn can use it (a reverse read, a decode-local turn)
        self._decode_retains = config.reverse_reads or config.decode_local_max_tokens > 0
        self._prewarm = Prewarmer(lambda: self._session, self.metrics, config.prewarm_max_in_flight,
                                  config.prefill_timeout_s, config.max_conversations) if config.prewarm else None
        session = self._current_session
        self._dispatch = Dispatch(config, self.metrics, self.secret, self._keys)
        self._releases = Releases(self._release, self.metrics)
        self._prefills = Prefills(config, self.metrics, self.prefill, session, self._dispatch, self._releases)
        self._exact = self._token_exact()
        self._answers = Answers(config, self.metrics, self.store, self.secret, self.decode, self._take, clock,
                                self._keep_answers, self._dispatch, self._exact)
        self._endpoints = Endpoints(config, self.metrics, self.store, self.prefill, self.decode, session,
                                    self._gate, self._dispatch, self._releases)
        if config.connector == "kvshuttle" and not all(d.kv_address for d in config.decode):
            log.warning("router: decode backends without kv=HOST:PORT: streamed turns there cannot learn their "
                        "handle from a board (the next turn recomputes unless the stream carries it)")
        remote = [d.name for d in config.decode if not is_loopback(urlsplit(d.url).hostname or "")]
        if config.connector == "kvshuttle" and self.secret.scope == "local" and remote:
            log.warning("router: only this user's local secret is configured, which trusts loopback owners only: "
                        "handles from %s will be refused; set KVSHUTTLE_SECRET or KVSHUTTLE_SECRET_FILE to the "
                        "deployment's secret", ", ".join(remote))

    def _make_store(self) -> HandleStore:
        cfg, m = self.config, self.metrics
        entries, size = cfg.store_quota()
        if cfg.store == "memory":
            return MemoryStore(cfg.max_conversations, cfg.sweep_interval_s, self._clock,
                               on_expire=m.expirations.inc, on_evict=m.evictions.inc, max_bytes=cfg.max_store_bytes,
                               tenant_max_entries=entries, tenant_max_bytes=size, on_drop=self._dropped)
        return RedisStore(cfg.store, cfg.redis_key_prefix, cfg.sweep_interval_s, timeout_s=cfg.store_timeout_s,
                          clock=self._clock, on_expire=m.expirations.inc, tenant_max_entries=entries,
                          on_drop=self._dropped)

    def _token_exact(self) -> TokenExact | None:
        """The token-exact collaborator (``--token-exact``): its tokenizer and template loaded now, or None."""
        cfg, m = self.config, self.metrics
        if cfg.token_exact is None:
            return None
        return TokenExact(load_codec(cfg.token_exact), cfg.token_exact_max_tokens, cfg.token_exact_strict,
                          lambda outcome: m.token_exact[outcome].inc(),
                          lambda outcome: m.token_exact_kept[outcome].inc())

    def _dropped(self, entry: StoredHandle) -> None:
        """A conversation the store let go at a bound: its decode need not hold it to its TTL."""
        if self.config.connector == "kvshuttle" and self._session is not None:
            self._releases.later(entry)

    def _current_session(self) -> aiohttp.ClientSession | None:
        return self._session

    # -- application ----------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        # client_max_size bounds any body aiohttp itself reads; turns read theirs with read_body (same bound).
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[relay.guard])
        app.router.add_post(CHAT, self._chat)
        app.router.add_post(COMPLETIONS, self._completions)
        endpoints = self._endpoints
        app.router.add_delete("/v1/conversations/{conversation}", endpoints.delete)
        app.router.add_get("/v1/models", endpoints.models)
        app.router.add_get("/health", endpoints.admin_only(endpoints.health))
        app.router.add_get("/metrics", endpoints.admin_only(endpoints.metrics_page))
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._close)
        return app

    def admin_app(self) -> web.Application:
        """``/health`` and ``/metrics`` alone, open: for a listener only the operator reaches (``--admin-port``)."""
        return self._endpoints.admin_app()

    def runner(self) -> web.AppRunner:
        """An AppRunner for :meth:`app` with the client-facing limits (idle keep-alive, no compressed bodies)."""
        # handler_cancellation: a client that goes away cancels its turn (the backend requests are closed, no
        # prefill or decode computes for nobody); shutdown_timeout: what SIGTERM leaves turns being served.
        return web.AppRunner(self.app(), access_log=None, keepalive_timeout=self.config.client_idle_timeout_s,
                             auto_decompress=False, handler_cancellation=True,
                             shutdown_timeout=self.config.shutdown_grace_s)

    def shutdown(self) -> None:
        """Stop admitting: turns waiting for a slot and every newcomer get a 503 at once (SIGTERM)."""
        self._gate.close()

    async def _start(self, _: web.Application) -> None:
        cfg = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=BACKEND_KEEPALIVE_S),
            json_serialize=_dumps)
        await self.store.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self._health_forever(cfg.health_interval_s)))
        log.info("router: store %s, tenants %s, secret %s", "memory" if cfg.store == "memory" else
                 redact_url(cfg.store), f"from {len(self._keys)} API keys" if self._keys else
                 f"from header {cfg.tenant_header}" if cfg.tenant_header else "one shared", self.secret)

    async def _close(self, _: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._releases.close()
        if self._demotions is not None:
            await self._demotions.close()
        if self._prewarm is not None:
            await self._prewarm.close()
        await self.store.close()
        if self._session is not None:
            await self._session.close()
        if self._calls is not None:
            self._calls.close()

    async def _health_forever(self, interval: float) -> None:
        assert self._session is not None
        while True:
            await asyncio.sleep(interval)
            for pool in (self.prefill, self.decode):
                await pool.check(self._session, min(interval, self.config.connect_timeout_s))

    # -- the turn -------------------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, CHAT)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, COMPLETIONS)

    async def _admit(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """Authenticate; enter the gate (the tenant's bounds, before a byte of the body is read); read the whole
        body, each chunk charged at its parsed estimate as it arrives; parse it; and only then wait for a slot."""
        tenant = self._dispatch.tenant(request)
        if self._keys and tenant is None:
            return self._refused(endpoint, 401, "missing or unknown API key", "authentication_error", close=True)
        cfg, gate = self.config, self._gate
        try:
            ticket = gate.enter(tenant or "", request.content_length)
        except BadRequest as exc:  # the body stays unread: the connection cannot carry another request
            return self._refused(endpoint, exc.status, str(exc), exc.kind, close=True)
        try:
            try:
                raw = await read_body(request, cfg.max_body_bytes, cfg.body_timeout_s,
                                      lambda chunk: gate.take_chunk(ticket, chunk))
                body = parse_body(raw, endpoint)
            except BadRequest as exc:  # 408, 413, 415, 429 or a broken body: refused, nothing parsed or kept
                if exc.status == 408:
                    self.metrics.client_timeouts.labels("body").inc()
                return self._refused(endpoint, exc.status, str(exc), exc.kind, close=exc.status != 400)
            del raw  # only the parsed body lives on
            gate.parsed(ticket)
            try:
                await gate.serve(ticket)
            except BadRequest as exc:  # shutting down
                return self._refused(endpoint, exc.status, str(exc), exc.kind)
            return await self._turn(request, endpoint, body, tenant)
        except asyncio.CancelledError:
            self.metrics.requests.labels(endpoint, "client_gone").inc()  # its turn is cancelled with it
            raise
        finally:
            gate.leave(ticket)

    async def _turn(self, request: web.Request, endpoint: str, body: dict[str, Any],
                    tenant: str | None) -> web.StreamResponse:
        # The body field never reaches a backend, wherever the key comes from
        raw_conversation, source = self.config.session_keys.pick({BODY_FIELD: body.pop(BODY_FIELD, None)},
                                                                 request.headers)
        conversation = valid_id(raw_conversation) if raw_conversation is not None else None
        if raw_conversation is not None and conversation is None:
            return self._refused(endpoint, 400, f"the conversation key ({source}) must be a printable string of "
                                                "1..256 characters")
        if source is not None:
            self.metrics.session_keys.labels(source).inc()
        if body.pop("kv_transfer_params", None) is not None:
            self.metrics.client_params_dropped.inc()
        if self._salt_key is not None:  # the tenant's own prefix-cache entries (a client's salt folded in)
            client_salt = body.get("cache_salt")
            if client_salt is not None and (not isinstance(client_salt, str) or not client_salt):
                return self._refused(endpoint, 400, "cache_salt must be a non-empty string")
            per = conversation if self.config.salt_mode == "conversation" else None
            body["cache_salt"] = cache_salt(self._salt_key, tenant or "", per, client_salt)
        turn = Turn(endpoint, f"kvshuttle-{self._id_prefix}-{next(self._ids)}", body.get("stream") is True,
                    tenant, conversation)
        if endpoint == CHAT and turn.key is not None and self._keep_answers:
            turn.capture = [] if turn.stream else None
            turn.messages = body.get("messages") if self.config.decode_local_max_tokens > 0 else None
        warm = self._prewarm if endpoint == CHAT and turn.key is not None else None
        if warm is not None:
            warm.arrived(turn.key)
        entry = await self._lookup(turn)
        try:
            if self._exact is not None and endpoint == CHAT and turn.key is not None:
                turn.exact = await self._exact.prepare(body, entry.kept if entry is not None else None)
            headers = {"X-Request-Id": turn.request_id, **self._dispatch.auth(request)}
            local = self._decode_local(turn, endpoint, body, entry)
            if local is not None:  # computed on the decode that holds the conversation: no prefill, no transfer
                turn.placement, turn.home = "decode_local", entry.prefill if entry is not None else None
                if warm is not None:
                    warm.placed(turn.key, None)
                response = await self._decode(turn, request, body, None, headers, entry, prefer=local)
                if entry is not None and self.config.sole_user(entry.params) and self.config.connector == "kvshuttle":
                    self._releases.later(entry)  # the new turn's handle holds the history now
            else:
                p_params, failed = await self._prefills.run(turn, body, entry, headers)
                if failed is not None:
                    return failed
                if warm is not None:
                    warm.placed(turn.key, turn.prefill)
                response = await self._decode(turn, request, body, p_params, headers, entry)
        except asyncio.CancelledError:  # the client went away: the handle this turn took is of use to no one now
            if entry is not None and self.config.sole_user(entry.params) and self.config.connector == "kvshuttle":
                self._releases.later(entry)
            raise
        if warm is not None and turn.learned == "stored":
            self._start_prewarm(warm, turn, body, headers)
        if self._demotions is not None and turn.finish == STOP and turn.stored is not None:
            self._demotions.later(turn.stored)  # waits on a person: off the hot cache now, after the answer
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        self.metrics.placement[turn.placement].inc()
        log.info("turn", extra={"kv": {"request_id": turn.request_id, "endpoint": endpoint, "stream": turn.stream,
                                       "conversation": turn.conversation, "lookup": turn.lookup,
                                       "placement": turn.placement, "prefill": turn.prefill, "decode": turn.decode,
                                       "learned": turn.learned, "status": response.status,
                                       "seconds": round(time.perf_counter() - turn.started, 4)}})
        return response

    def _decode_local(self, turn: Turn, endpoint: str, body: dict[str, Any],
                      entry: StoredHandle | None) -> Backend | None:
        """The decode holding the conversation, when this turn is short enough to compute there
        (``decode_local_max_tokens``) and that decode is up; else None (the turn goes through a prefill)."""
        if entry is None or decode_local(self.config.decode_local_max_tokens, endpoint, body, entry.history) is None:
            return None
        backend = self.decode.find(entry.decode)
        return backend if backend is not None and backend.healthy else None

    def _start_prewarm(self, warm: Prewarmer, turn: Turn, body: dict[str, Any], headers: dict[str, str]) -> None:
        """Pre-warm the prefill the conversation's next turn will go to (see :mod:`.prewarm`)."""
        answer = turn.answer if turn.capture is None else answer_from_events(turn.capture)
        sticky = turn.prefill or turn.home
        backend, _ = self.prefill.choose_for(turn.key if self.config.affinity == "conversation" else None, sticky)
        if answer is None or backend is None or turn.key is None:
            warm.count("skipped")
            return
        ids = self._exact.warm_ids(turn.exact) if self._exact is not None and turn.exact is not None else None
        warm.start(turn.key, backend, body, answer, {k: v for k, v in headers.items() if k != "X-Request-Id"},
                   turn.tenant or "", ids)

    def _refused(self, endpoint: str, status: int, message: str, kind: str = "invalid_request_error",
                 close: bool = False) -> web.Response:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        response = _error(status, message, kind)
        if status in (413, 429, 503) and kind != "invalid_request_error":
            self.metrics.refusals.labels(kind).inc()
        if status in (429, 503):
            response.headers["Retry-After"] = "1"
        if close:  # the rest of the body is not read: the connection cannot carry another request
            response.force_close()
        return response

    async def _lookup(self, turn: Turn) -> StoredHandle | None:
        key = turn.key
        if key is None:
            turn.lookup = "no_conversation" if turn.conversation is None else "no_tenant"
            self.metrics.lookup[turn.lookup].inc()
            return None
        try:
            if self.config.reads == "use_once":
                found = await self.store.take(key, turn.tenant or "", turn.conversation or "")
            else:
                found = await self.store.get(key, turn.tenant or "", turn.conversation or "")
                if found.entry is not None and self.config.read_mode_of(found.entry.params) == "use_once":
                    # one reader only: this turn takes it (atomically; a concurrent turn that took it first wins)
                    found = await self.store.take(key, turn.tenant or "", turn.conversation or "")
        except StoreError as exc:
            log.info("router: store lookup failed, recomputing: %s", exc)
            self.metrics.store_errors.labels("lookup").inc()
            turn.lookup = "store_error"
            self.metrics.lookup["store_error"].inc()
            return None
        turn.lookup = found.status
        self.metrics.lookup[found.status].inc()
        return found.entry

    async def _decode(self, turn: Turn, client: web.Request, body: dict[str, Any], p_params: dict[str, Any] | None,
                      headers: dict[str, str], entry: StoredHandle | None,
                      prefer: Backend | None = None) -> web.StreamResponse:
        """The decode's answer, relayed; ``prefer``: the first backend to try (a decode-local turn's)."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                        sock_read=self.config.read_timeout_s)
        tried: set[str] = set()
        for attempt in range(1 + self.config.retries):
            # the decode that holds the conversation first: its prefix cache holds the history, so it reads
            # only the new prompt's blocks from the prefill
            backend = prefer if attempt == 0 and prefer is not None else \
                self._dispatch.choose(self.decode, turn, entry.decode if entry is not None else None, tried)
            if backend is None:
                break
            tried.add(backend.name)
            if attempt:
                self.metrics.retries.labels("decode").inc()
                turn.placement = "recompute"
            # A retry recomputes: prefill's params may name use-once blocks the failed decode already claimed.
            params = dict(p_params if p_params is not None and attempt == 0 else NO_PREFILL_PARAMS)
            publish = self._publish_key(turn, backend)
            if publish is not None:
                params[PUBLISH_KEY] = publish
            # the decode keeps the conversation only where a later turn can use it: a reverse read or a
            # decode-local turn (with neither, retention would hold memory for nobody)
            if self._decode_retains:
                params = self._dispatch.granted(params)
            exact = turn.exact
            if exact is not None and exact.send is not None:  # the prompt the prefill computed, to the id
                params["prompt_token_ids"] = list(exact.send)
            request = {**body, "kv_transfer_params": params}
            if exact is not None:  # the answer's ids, kept for the next turn (removed from what the client sees)
                request["return_token_ids"] = True
            started = time.perf_counter()
            backend.in_flight += 1
            try:
                resp = await self._session.post(backend.url + turn.endpoint, json=request,
                                                headers=backend.headers(headers), timeout=timeout)
            except BACKEND_FAILURES as exc:
                backend.in_flight -= 1
                turn.waited += time.perf_counter() - started
                self._dispatch.failed(self.decode, backend, exc)
                continue
            turn.waited += time.perf_counter() - started
            try:
                if resp.status >= 500:
                    self.metrics.backend_errors.labels("decode", backend.name).inc()
                    continue
                turn.decode = backend.name
                if turn.stream and resp.status == 200:
                    return await self._answers.relay(turn, client, resp, backend, publish)
                return await self._answers.answer(turn, client, resp, backend)
            finally:
                resp.release()
                backend.in_flight -= 1
        return _error(502, f"no decode backend answered ({len(tried)} tried)", "backend_error")

    def _publish_key(self, turn: Turn, backend: Backend) -> str | None:
        if not turn.stream or turn.key is None or self.config.connector != "kvshuttle" or not backend.spec.kv_address:
            return None
        if not self._decode_retains:  # an ungranted decode publishes nothing: waiting for it would hold [DONE]
            return None
        return secrets.token_urlsafe(18)
