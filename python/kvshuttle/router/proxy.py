"""The multi-turn router: an OpenAI-compatible proxy that carries each conversation's decode handle between turns.

Per turn (vLLM's disaggregated proxies' protocol, see ``docs/ARCHITECTURE.md``):

1. tenant (configured header or API key, checked in constant time) and the whole request body, bounded in
   size and time and checked (:mod:`.bodies`), all before the turn takes an admission slot; conversation
   (``conversation_id`` body field or ``X-Conversation-Id`` header); client-supplied ``kv_transfer_params``
   are dropped, untrusted;
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
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from ..trust import GRANT_FIELD, DeploymentSecret, TrustError, is_loopback, issue_grant
from . import relay
from .auth import ApiKeys, header_tenant
from .backends import Backend, BackendPool
from .bodies import CHAT, COMPLETIONS, PRIVATE_MARKERS, BadRequest, client_error_body, parse_body, read_body
from .config import DEFAULT_TENANT, RouterConfig
from .errors import RouterConfigError, StoreError
from .handles import InvalidHandle, checked_handle, prefill_params, store_key, valid_id
from .kv import Releaser, SideChannelCalls, Taker
from .metrics import RouterMetrics
from .redact import install_filter, redact_url, register, scrub, url_secrets
from .relay import error_response as _error
from .sse import EventFilter, StreamFormatError
from .store import HandleStore, MemoryStore, RedisStore, StoredHandle

log = logging.getLogger("kvshuttle.router")

PUBLISH_KEY = "kvshuttle_publish_key"  # kvshuttle.transfer.board.PUBLISH_KEY (not imported: no pyzmq needed)
NO_PREFILL_PARAMS = {"do_remote_decode": False, "do_remote_prefill": False}  # decode computes the prompt itself
PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
BACKEND_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
_dumps = json.JSONEncoder(separators=(",", ":")).encode


@dataclass
class Turn:
    """One client request on its way through the router (for the metrics and the turn's log line)."""

    endpoint: str
    request_id: str
    stream: bool
    tenant: str | None
    conversation: str | None
    started: float = field(default_factory=time.perf_counter)
    waited: float = 0.0  # seconds spent waiting on backends and publications (not the router's own time)
    lookup: str = "no_conversation"
    prefill: str | None = None
    decode: str | None = None
    learned: str = "no"
    first_byte: bool = False

    @property
    def key(self) -> str | None:
        if self.tenant is None or self.conversation is None:
            return None
        return store_key(self.tenant, self.conversation)


class Router:
    """The router's state and its aiohttp application (:meth:`app`; :meth:`runner` serves it)."""

    def __init__(self, config: RouterConfig, *, store: HandleStore | None = None, taker: Taker | None = None,
                 releaser: Releaser | None = None, clock: Callable[[], float] = time.time) -> None:
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
        self.prefill = BackendPool(config.prefill, "prefill", config.balance)
        self.decode = BackendPool(config.decode, "decode", config.balance)
        self._calls: SideChannelCalls | None = None
        if taker is None or releaser is None:
            self._calls = SideChannelCalls(self.secret)
        self._take: Taker = taker or self._calls.take  # type: ignore[union-attr]
        self._release: Releaser = releaser or self._calls.release  # type: ignore[union-attr]
        self._session: aiohttp.ClientSession | None = None
        # Turns beyond this wait here, before any work: an overloaded loop would otherwise lag past the store's
        # and backends' timeouts and turn every overload into lost handles. Only turns whose whole body is in
        # take a slot: a client trickling its body holds a connection, never a slot.
        self._admitted = asyncio.Semaphore(config.max_in_flight)
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:12]  # request ids: unique per router process, not secret
        self._tasks: list[asyncio.Task[None]] = []
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
        if cfg.store == "memory":
            return MemoryStore(cfg.max_conversations, cfg.sweep_interval_s, self._clock,
                               on_expire=m.expirations.inc, on_evict=m.evictions.inc, max_bytes=cfg.max_store_bytes)
        return RedisStore(cfg.store, cfg.redis_key_prefix, cfg.sweep_interval_s, timeout_s=cfg.store_timeout_s,
                          clock=self._clock, on_expire=m.expirations.inc)

    # -- application ----------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        # client_max_size bounds any body aiohttp itself reads; turns read theirs with read_body (same bound).
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[relay.guard])
        app.router.add_post(CHAT, self._chat)
        app.router.add_post(COMPLETIONS, self._completions)
        app.router.add_delete("/v1/conversations/{conversation}", self._delete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._close)
        return app

    def runner(self) -> web.AppRunner:
        """An AppRunner for :meth:`app` with the client-facing limits (idle keep-alive, no compressed bodies)."""
        return web.AppRunner(self.app(), access_log=None, keepalive_timeout=self.config.client_idle_timeout_s,
                             auto_decompress=False)

    async def _start(self, _: web.Application) -> None:
        cfg = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60),
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

    # -- small endpoints ------------------------------------------------------------------------------------
    async def _health(self, _: web.Request) -> web.Response:
        def pool(p: BackendPool) -> list[dict[str, Any]]:
            return [{"name": b.name, "healthy": b.healthy, "in_flight": b.in_flight} for b in p.backends]

        up = any(b.healthy for b in self.decode.backends)  # a decode alone can answer (recompute turns)
        body = {"status": "ok" if up else "unavailable", "prefill": pool(self.prefill), "decode": pool(self.decode),
                "store": "memory" if self.config.store == "memory" else "redis"}
        return web.json_response(body, status=200 if up else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        try:
            self.metrics.live.set(await self.store.live())
        except StoreError:
            self.metrics.store_errors.labels("count").inc()
        if isinstance(self.store, MemoryStore):
            self.metrics.store_bytes.set(self.store.bytes)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        if self._keys and self._tenant(request) is None:
            return _error(401, "missing or unknown API key", "authentication_error")
        backend = self.decode.choose()
        assert backend is not None
        try:
            async with self._session.get(backend.url + "/v1/models", headers=self._auth(request)) as resp:
                return web.Response(body=client_error_body(await resp.read(), resp.status), status=resp.status,
                                    content_type="application/json")
        except BACKEND_FAILURES as exc:
            return _error(502, f"decode backend {backend.name} failed: {type(exc).__name__}", "backend_error")

    async def _delete(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        if self._keys and tenant is None:
            return _error(401, "missing or unknown API key", "authentication_error")
        conversation = valid_id(request.match_info["conversation"])
        if tenant is None or conversation is None:
            return _error(400, "a tenant and a conversation id are needed to delete a conversation")
        key = store_key(tenant, conversation)
        try:
            entry = await self.store.delete(key)
        except StoreError as exc:
            self.metrics.store_errors.labels("delete").inc()
            log.warning("router: deleting conversation %s failed: %s", conversation, exc)
            return _error(503, "the handle store is unavailable; retry later", "store_error")
        released = False
        if entry is not None and self.config.connector == "kvshuttle":
            released = await self._release_quietly(entry)
        log.info("conversation deleted", extra={"kv": {"conversation": conversation, "deleted": entry is not None,
                                                       "released": released}})
        return web.json_response({"id": conversation, "deleted": entry is not None, "released": released})

    async def _release_quietly(self, entry: StoredHandle) -> bool:
        try:
            released = await self._release(entry.params)
        except Exception as exc:  # a dead decode frees the blocks at its TTL anyway
            log.info("router: release on %s failed: %s: %s", entry.decode, type(exc).__name__, exc)
            self.metrics.releases.labels("failed").inc()
            return False
        self.metrics.releases.labels("released" if released else "gone").inc()
        return released

    # -- the turn -------------------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, CHAT)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, COMPLETIONS)

    async def _admit(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """Authenticate, read and check the whole body, and only then wait for an admission slot."""
        tenant = self._tenant(request)
        if self._keys and tenant is None:
            return self._refused(endpoint, 401, "missing or unknown API key", "authentication_error", close=True)
        cfg = self.config
        try:
            raw = await read_body(request, cfg.max_body_bytes, cfg.body_timeout_s)
        except BadRequest as exc:  # 408, 413, 415 or a broken body: the connection cannot carry another request
            if exc.status == 408:
                self.metrics.client_timeouts.labels("body").inc()
            return self._refused(endpoint, exc.status, str(exc), close=True)
        try:
            body = parse_body(raw, endpoint)
        except BadRequest as exc:
            return self._refused(endpoint, exc.status, str(exc))
        async with self._admitted:
            return await self._turn(request, endpoint, body, tenant)

    async def _turn(self, request: web.Request, endpoint: str, body: dict[str, Any],
                    tenant: str | None) -> web.StreamResponse:
        raw_conversation = body.pop("conversation_id", None)
        if raw_conversation is None:
            raw_conversation = request.headers.get("X-Conversation-Id")
        conversation = valid_id(raw_conversation) if raw_conversation is not None else None
        if raw_conversation is not None and conversation is None:
            return self._refused(endpoint, 400, "conversation_id must be a printable string of 1..256 characters")
        if body.pop("kv_transfer_params", None) is not None:
            self.metrics.client_params_dropped.inc()
        turn = Turn(endpoint, f"kvshuttle-{self._id_prefix}-{next(self._ids)}", body.get("stream") is True,
                    tenant, conversation)
        handle = await self._lookup(turn)
        headers = {"X-Request-Id": turn.request_id, **self._auth(request)}
        p_params, failed = await self._prefill(turn, body, handle, headers)
        if failed is not None:
            return failed
        response = await self._decode(turn, request, body, p_params, headers)
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        log.info("turn", extra={"kv": {"request_id": turn.request_id, "endpoint": endpoint, "stream": turn.stream,
                                       "conversation": turn.conversation, "lookup": turn.lookup,
                                       "prefill": turn.prefill, "decode": turn.decode, "learned": turn.learned,
                                       "status": response.status,
                                       "seconds": round(time.perf_counter() - turn.started, 4)}})
        return response

    def _refused(self, endpoint: str, status: int, message: str, kind: str = "invalid_request_error",
                 close: bool = False) -> web.Response:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        response = _error(status, message, kind)
        if close:  # the rest of the body is not read: the connection cannot carry another request
            response.force_close()
        return response

    def _tenant(self, request: web.Request) -> str | None:
        if self._keys:
            return self._keys.tenant(request.headers.get("Authorization"))
        if self.config.tenant_header is not None:
            return header_tenant(request.headers.get(self.config.tenant_header))
        return DEFAULT_TENANT

    def _auth(self, request: web.Request) -> dict[str, str]:
        if self.config.backend_api_key:
            return {"Authorization": f"Bearer {self.config.backend_api_key}"}
        auth = request.headers.get("Authorization")
        return {"Authorization": auth} if auth and not self._keys else {}  # tenants' keys stay here

    def _granted(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with a fresh retention grant (kvshuttle's engines keep blocks only for granted requests)."""
        if self.config.connector == "kvshuttle":
            params[GRANT_FIELD] = issue_grant(self.secret)
        return params

    async def _lookup(self, turn: Turn) -> dict[str, Any] | None:
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
        except StoreError as exc:
            log.info("router: store lookup failed, recomputing: %s", exc)
            self.metrics.store_errors.labels("lookup").inc()
            turn.lookup = "store_error"
            self.metrics.lookup["store_error"].inc()
            return None
        turn.lookup = found.status
        self.metrics.lookup[found.status].inc()
        return found.entry.params if found.entry is not None else None

    async def _prefill(self, turn: Turn, body: dict[str, Any], handle: dict[str, Any] | None,
                       headers: dict[str, str]) -> tuple[dict[str, Any] | None, web.Response | None]:
        """Prefill's returned params (None: the decode computes the prompt), or a client error to return."""
        assert self._session is not None
        request = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
        request["stream"], request["max_tokens"] = False, 1
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        tried: set[str] = set()
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s, connect=self.config.connect_timeout_s)
        for attempt in range(1 + self.config.retries):
            backend = self.prefill.choose(frozenset(tried))
            if backend is None:
                break
            tried.add(backend.name)
            if attempt:
                self.metrics.retries.labels("prefill").inc()
            # A retry goes without the handle: the failed prefill may have consumed a use-once handle.
            request["kv_transfer_params"] = self._granted(prefill_params(handle if attempt == 0 else None))
            started = time.perf_counter()
            backend.in_flight += 1
            try:
                async with self._session.post(backend.url + turn.endpoint, json=request, headers=headers,
                                              timeout=timeout) as resp:
                    status, data = resp.status, await resp.read()
            except BACKEND_FAILURES as exc:
                self._backend_failed(self.prefill, backend, exc)
                continue
            finally:
                backend.in_flight -= 1
                turn.waited += time.perf_counter() - started
            if 400 <= status < 500:  # the client's request is wrong; the decode would refuse it too
                return None, web.Response(body=client_error_body(data, status), status=status,
                                          content_type="application/json")
            if status != 200:
                self.metrics.backend_errors.labels("prefill", backend.name).inc()
                continue
            turn.prefill = backend.name
            try:
                params = json.loads(data).get("kv_transfer_params")
            except (ValueError, AttributeError, RecursionError):
                params = None
            return (params if isinstance(params, dict) and params else None), None
        return None, None  # no prefill answered: the decode computes the whole prompt (recompute)

    def _backend_failed(self, pool: BackendPool, backend: Backend, exc: BaseException) -> None:
        self.metrics.backend_errors.labels(pool.role, backend.name).inc()
        pool.mark(backend, False, f"{type(exc).__name__}: {scrub(str(exc))}")

    async def _decode(self, turn: Turn, client: web.Request, body: dict[str, Any], p_params: dict[str, Any] | None,
                      headers: dict[str, str]) -> web.StreamResponse:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                        sock_read=self.config.read_timeout_s)
        tried: set[str] = set()
        for attempt in range(1 + self.config.retries):
            backend = self.decode.choose(frozenset(tried))
            if backend is None:
                break
            tried.add(backend.name)
            if attempt:
                self.metrics.retries.labels("decode").inc()
            # A retry recomputes: prefill's params may name use-once blocks the failed decode already claimed.
            params = dict(p_params if p_params is not None and attempt == 0 else NO_PREFILL_PARAMS)
            publish = self._publish_key(turn, backend)
            if publish is not None:
                params[PUBLISH_KEY] = publish
            request = {**body, "kv_transfer_params": self._granted(params)}
            started = time.perf_counter()
            backend.in_flight += 1
            try:
                resp = await self._session.post(backend.url + turn.endpoint, json=request, headers=headers,
                                                timeout=timeout)
            except BACKEND_FAILURES as exc:
                backend.in_flight -= 1
                turn.waited += time.perf_counter() - started
                self._backend_failed(self.decode, backend, exc)
                continue
            turn.waited += time.perf_counter() - started
            try:
                if resp.status >= 500:
                    self.metrics.backend_errors.labels("decode", backend.name).inc()
                    continue
                turn.decode = backend.name
                if turn.stream and resp.status == 200:
                    return await self._relay(turn, client, resp, backend, publish)
                return await self._answer(turn, client, resp, backend)
            finally:
                resp.release()
                backend.in_flight -= 1
        return _error(502, f"no decode backend answered ({len(tried)} tried)", "backend_error")

    def _publish_key(self, turn: Turn, backend: Backend) -> str | None:
        if not turn.stream or turn.key is None or self.config.connector != "kvshuttle" or not backend.spec.kv_address:
            return None
        return secrets.token_urlsafe(18)

    async def _answer(self, turn: Turn, client: web.Request, resp: aiohttp.ClientResponse,
                      backend: Backend) -> web.StreamResponse:
        """A non-streamed answer (or any error): the body passes through, without the decode's handle. A large
        one is written here, bounded in time like a stream (a client not reading it is cut)."""
        started = time.perf_counter()
        data = await resp.read()
        turn.waited += time.perf_counter() - started
        if resp.status != 200:
            data = client_error_body(data, resp.status)
        else:
            try:
                answer = json.loads(data)
                params = answer.pop("kv_transfer_params", None) if isinstance(answer, dict) else None
                clean = _dumps(answer).encode()
            except (ValueError, RecursionError):
                answer = None
            if isinstance(answer, dict):
                # The handle is a capability on the decode's blocks: it stays between the router and backends.
                await self._learn(turn, params, backend)
                data = clean
            elif any(marker in data for marker in PRIVATE_MARKERS):
                return _error(502, f"decode backend {backend.name} answered an unreadable body", "backend_error")
        self.metrics.added_latency.observe(max(0.0, time.perf_counter() - turn.started - turn.waited))
        content_type = resp.content_type or "application/json"
        if len(data) <= relay.SMALL:  # fits the socket's buffers: aiohttp's own write cannot wait on the client
            return web.Response(body=data, status=resp.status, content_type=content_type)
        out, stopped = await relay.send(client, resp.status, data, content_type, self.config.client_write_timeout_s)
        if stopped is relay.ClientSlow:
            self.metrics.client_timeouts.labels("write").inc()
        return out

    async def _relay(self, turn: Turn, client: web.Request, resp: aiohttp.ClientResponse, backend: Backend,
                     publish: str | None) -> web.StreamResponse:
        """Stream the decode's answer event by event, without kv_transfer_params; store its handle before the end.

        The handle comes from the stream's last chunk (vLLM 0.33) or else the decode's board. The end marker
        (``data: [DONE]``) is held back until the handle is stored: a client that sends its next turn once it
        sees the end, to this replica or another, finds the handle. Every write to the client is bounded in
        time (``client_write_timeout_s``): a client that stops reading is cut and the decode's stream closed.
        """
        out = relay.StreamAnswer(status=200, headers={"Content-Type": resp.headers.get("Content-Type",
                                                                                      "text/event-stream"),
                                                      "Cache-Control": "no-cache"})
        events = EventFilter(hold_done=turn.key is not None)
        wait = self.config.client_write_timeout_s
        try:
            started = time.perf_counter()
            chunks = resp.content.iter_any()
            first = await anext(chunks, b"")
            turn.waited += time.perf_counter() - started
            await relay.prepare(client, out, wait)
            await relay.write(client, out, events.feed(first), wait)
            self.metrics.added_latency.observe(max(0.0, time.perf_counter() - turn.started - turn.waited))
            async for chunk in chunks:
                await relay.write(client, out, events.feed(chunk), wait)
            await relay.write(client, out, events.finish(), wait)
        except (relay.ClientGone, relay.ClientSlow) as exc:
            slow = isinstance(exc, relay.ClientSlow)
            turn.learned = "client_slow" if slow else "client_gone"
            if slow:
                self.metrics.client_timeouts.labels("write").inc()
                log.info("router: client of request %s stopped reading for %g s; cut, decode stream closed",
                         turn.request_id, wait)
            resp.close()  # the decode stops generating for nobody
            relay.cut(client)
            return out
        except (*BACKEND_FAILURES, StreamFormatError) as exc:
            turn.learned = "stream_failed"
            self._backend_failed(self.decode, backend, exc)
            self.metrics.unlearned.labels("stream_failed").inc()
            resp.close()
            if not out.prepared:
                return _error(502, f"decode backend {backend.name} failed: {type(exc).__name__}", "backend_error")
            await self._stream_error(client, out, f"decode backend {backend.name} failed mid-stream: "
                                                  f"{type(exc).__name__}")
            return out
        if events.dropped:
            self.metrics.events_dropped.inc(events.dropped)
        if events.found:
            await self._learn(turn, events.params, backend)
        elif publish is None:
            self.metrics.unlearned.labels("stream_without_board").inc()
        else:
            await self._take_handle(turn, backend, publish)
        try:
            await relay.finish(client, out, events.held, wait)
        except (relay.ClientGone, relay.ClientSlow):
            relay.cut(client)
        return out

    async def _take_handle(self, turn: Turn, backend: Backend, publish: str) -> None:
        address = backend.spec.kv_address
        assert address is not None
        try:
            params = await self._take(address, publish, self.config.publish_timeout_s)
        except Exception as exc:  # a dead decode: the next turn recomputes
            log.info("router: taking the handle from %s failed: %s: %s", backend.name, type(exc).__name__, exc)
            self.metrics.unlearned.labels("board_failed").inc()
            turn.learned = "board_failed"
            return
        await self._learn(turn, params, backend)

    async def _stream_error(self, client: web.Request, out: web.StreamResponse, message: str) -> None:
        wait = self.config.client_write_timeout_s
        try:  # the OpenAI clients raise on an error event: the client never takes a cut answer for a whole one
            await relay.finish(client, out, relay.error_event(message), wait)
        except (relay.ClientGone, relay.ClientSlow):
            relay.cut(client)

    async def _learn(self, turn: Turn, params: Any, backend: Backend) -> None:
        """Validate, authenticate and store the decode's returned params for the conversation's next turn."""
        key = turn.key
        if key is None or turn.tenant is None or turn.conversation is None:
            return
        if params is None:
            turn.learned = "none"
            self.metrics.unlearned.labels("none_returned").inc()
            return
        try:
            stored, life = checked_handle(params, self.config.connector, self.secret)
        except InvalidHandle as exc:
            turn.learned = "invalid"
            self.metrics.invalid.labels(exc.reason).inc()
            log.warning("router: dropping %s's params for request %s (%s): %s", backend.name, turn.request_id,
                        exc.reason, exc)
            return
        entry = StoredHandle(turn.tenant, turn.conversation, stored, backend.name, backend.spec.kv_address,
                             self._clock() + min(self.config.ttl_s, life))
        try:
            await self.store.put(key, entry)
        except StoreError as exc:
            self.metrics.store_errors.labels("put").inc()
            turn.learned = "store_error"
            log.info("router: storing the handle failed, the next turn recomputes: %s", exc)
            return
        turn.learned = "stored"
        self.metrics.stored.inc()
