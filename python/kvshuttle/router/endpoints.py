"""The router's small endpoints (health, metrics, models, deleting a conversation) and the release of a decode's
retention, as a mixin of :class:`kvshuttle.router.proxy.Router` (whose turn path lives in ``proxy.py``).

With API keys configured, ``/health`` and ``/metrics`` (backend names, load, what the router holds) are not for
whoever holds a tenant's key: on the main listener they need the admin key (``Authorization: Bearer``, compared
in constant time), and :meth:`Endpoints.admin_app` serves them on a listener of their own (``--admin-port``,
meant for an address only the operator's probes and scrapers reach)."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from .backends import BACKEND_FAILURES, BackendPool
from .bodies import client_error_body
from .errors import StoreError
from .handles import store_key, valid_id
from .relay import error_response as _error
from .store import MemoryStore, StoredHandle

if TYPE_CHECKING:
    from .admission import Gate

Handler = Callable[[web.Request], Awaitable[web.Response]]

if TYPE_CHECKING:
    from .auth import ApiKeys
    from .config import RouterConfig
    from .kv import Releaser
    from .metrics import RouterMetrics
    from .store import HandleStore

log = logging.getLogger("kvshuttle.router")


class Endpoints:
    """Everything here reads the router's state; nothing here is on a turn's path."""

    config: RouterConfig
    metrics: RouterMetrics
    store: HandleStore
    prefill: BackendPool
    decode: BackendPool
    _keys: ApiKeys
    _session: aiohttp.ClientSession | None
    _release: Releaser
    _gate: Gate

    def _tenant(self, request: web.Request) -> str | None:
        raise NotImplementedError

    def _auth(self, request: web.Request) -> dict[str, str]:
        raise NotImplementedError

    def admin_app(self) -> web.Application:
        """``/health`` and ``/metrics`` alone, open: for a listener only the operator reaches (``--admin-port``)."""
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    def _admin_only(self, handler: Handler) -> Handler:
        """``handler`` as the main listener serves it: open without API keys; with them, for the admin key only."""
        if not self._keys:
            return handler
        expected = hashlib.sha256((self.config.admin_key or "").encode()).digest()

        async def guarded(request: web.Request) -> web.Response:
            auth = request.headers.get("Authorization", "")
            presented = hashlib.sha256(auth[7:].strip().encode("utf-8", "surrogatepass")).digest()
            if self.config.admin_key and auth[:7].lower() == "bearer " and hmac.compare_digest(presented, expected):
                return await handler(request)
            return _error(401, f"{request.path} needs the router's admin key (--admin-key-file) when API keys are "
                               "configured, or use the admin listener (--admin-port)", "authentication_error")

        return guarded

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
        self.metrics.held_bytes.set(self._gate.held)
        self.metrics.waiting.set(self._gate.waiting)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        if self._keys and self._tenant(request) is None:
            return _error(401, "missing or unknown API key", "authentication_error")
        backend = self.decode.choose()
        assert backend is not None
        try:
            async with self._session.get(backend.url + "/v1/models",
                                         headers=backend.headers(self._auth(request))) as resp:
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
