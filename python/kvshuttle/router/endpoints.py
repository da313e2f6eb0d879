"""The router's small endpoints (health, metrics, models, deleting a conversation), served by
:class:`kvshuttle.router.proxy.Router` beside its turns (whose path lives in ``proxy.py``).

With API keys configured, ``/health`` and ``/metrics`` (backend names, load, what the router holds) are not for
whoever holds a tenant's key: on the main listener they need the admin key (``Authorization: Bearer``, compared
in constant time), and :meth:`Endpoints.admin_app` serves them on a listener of their own (``--admin-port``,
meant for an address only the operator's probes and scrapers reach)."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from .admission import Gate
from .backends import BACKEND_FAILURES, BackendPool
from .bodies import client_error_body
from .config import RouterConfig
from .dispatch import Dispatch
from .errors import StoreError
from .handles import store_key, valid_id
from .metrics import RouterMetrics
from .relay import error_response as _error
from .releases import Releases
from .store import HandleStore, MemoryStore

Handler = Callable[[web.Request], Awaitable[web.Response]]

log = logging.getLogger("kvshuttle.router")


class Endpoints:
    """Everything here reads the router's state; nothing here is on a turn's path. ``session``: the router's HTTP
    client session, made when it starts."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, store: HandleStore, prefill: BackendPool,
                 decode: BackendPool, session: Callable[[], aiohttp.ClientSession | None], gate: Gate,
                 dispatch: Dispatch, releases: Releases) -> None:
        self.config = config
        self.metrics = metrics
        self.store = store
        self.prefill = prefill
        self.decode = decode
        self._session = session
        self._gate = gate
        self._dispatch = dispatch
        self._releases = releases

    def admin_app(self) -> web.Application:
        """``/health`` and ``/metrics`` alone, open: for a listener only the operator reaches (``--admin-port``)."""
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    def admin_only(self, handler: Handler) -> Handler:
        """``handler`` as the main listener serves it: open without API keys; with them, for the admin key only."""
        if not self._dispatch.keys:
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

    async def health(self, _: web.Request) -> web.Response:
        def pool(p: BackendPool) -> list[dict[str, Any]]:
            return [{"name": b.name, "healthy": b.healthy, "in_flight": b.in_flight} for b in p.backends]

        up = any(b.healthy for b in self.decode.backends)  # a decode alone can answer (recompute turns)
        body = {"status": "ok" if up else "unavailable", "prefill": pool(self.prefill), "decode": pool(self.decode),
                "store": "memory" if self.config.store == "memory" else "redis"}
        return web.json_response(body, status=200 if up else 503)

    async def metrics_page(self, _: web.Request) -> web.Response:
        try:
            self.metrics.live.set(await self.store.live())
        except StoreError:
            self.metrics.store_errors.labels("count").inc()
        if isinstance(self.store, MemoryStore):
            self.metrics.store_bytes.set(self.store.bytes)
        self.metrics.held_bytes.set(self._gate.held)
        self.metrics.waiting.set(self._gate.waiting)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        session = self._session()
        assert session is not None
        if self._dispatch.keys and self._dispatch.tenant(request) is None:
            return _error(401, "missing or unknown API key", "authentication_error")
        backend = self.decode.choose()
        assert backend is not None
        try:
            async with session.get(backend.url + "/v1/models",
                                         headers=backend.headers(self._dispatch.auth(request))) as resp:
                return web.Response(body=client_error_body(await resp.read(), resp.status), status=resp.status,
                                    content_type="application/json")
        except BACKEND_FAILURES as exc:
            return _error(502, f"decode backend {backend.name} failed: {type(exc).__name__}", "backend_error")

    async def delete(self, request: web.Request) -> web.Response:
        tenant = self._dispatch.tenant(request)
        if self._dispatch.keys and tenant is None:
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
            released = await self._releases.now(entry)
        log.info("conversation deleted", extra={"kv": {"conversation": conversation, "deleted": entry is not None,
                                                       "released": released}})
        return web.json_response({"id": conversation, "deleted": entry is not None, "released": released})
