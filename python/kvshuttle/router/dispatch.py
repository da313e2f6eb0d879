"""Who asks and who answers a turn: the client's tenant, the headers a backend gets, the backend chosen (the
conversation's own, or the balanced choice), a backend failure counted, a retention grant added.

The one object the turn's parts (:mod:`.proxy`, :mod:`.prefills`, :mod:`.answers`, :mod:`.endpoints`) share for
these decisions, so each rule lives in one place.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..trust import GRANT_FIELD, DeploymentSecret, issue_grant
from .auth import ApiKeys, header_tenant
from .backends import Backend, BackendPool
from .config import DEFAULT_TENANT, RouterConfig
from .metrics import RouterMetrics
from .redact import scrub
from .turn import Turn


class Dispatch:
    """The router's rules for tenants, backend headers, backend choice and grants (see the module docstring)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, secret: DeploymentSecret,
                 keys: ApiKeys) -> None:
        self.config = config
        self.metrics = metrics
        self.secret = secret
        self.keys = keys

    def tenant(self, request: web.Request) -> str | None:
        """The request's tenant: by API key (None when missing or unknown), header, or the one shared tenant."""
        if self.keys:
            return self.keys.tenant(request.headers.get("Authorization"))
        if self.config.tenant_header is not None:
            return header_tenant(request.headers.get(self.config.tenant_header))
        return DEFAULT_TENANT

    def auth(self, request: web.Request) -> dict[str, str]:
        """The Authorization header a backend gets: the backend key, or the client's when tenants have none."""
        if self.config.backend_api_key:
            return {"Authorization": f"Bearer {self.config.backend_api_key}"}
        auth = request.headers.get("Authorization")
        return {"Authorization": auth} if auth and not self.keys else {}  # tenants' keys stay here

    def choose(self, pool: BackendPool, turn: Turn, sticky: str | None, tried: set[str]) -> Backend | None:
        """The next backend of ``pool`` for the turn: its conversation's own (affinity) or the balanced choice."""
        key = turn.key if self.config.affinity == "conversation" else None
        backend, how = pool.choose_for(key, sticky, frozenset(tried))
        if backend is not None:
            self.metrics.affinity[(pool.role, how)].inc()
        return backend

    def failed(self, pool: BackendPool, backend: Backend, exc: BaseException) -> None:
        """A request to ``backend`` failed: counted, and the backend marked down until its next health check."""
        self.metrics.backend_errors.labels(pool.role, backend.name).inc()
        pool.mark(backend, False, f"{type(exc).__name__}: {scrub(str(exc))}")

    def granted(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with a fresh retention grant (kvshuttle's engines keep blocks only for granted requests)."""
        if self.config.connector == "kvshuttle":
            params[GRANT_FIELD] = issue_grant(self.secret)
        return params
