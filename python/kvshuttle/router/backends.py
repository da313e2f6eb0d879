"""Backend choice and health: round-robin or least-loaded over the healthy backends of one role, or a
conversation's own backend (affinity: the one that served it last, else its rendezvous-hash home).

A backend is marked down by a failed request (at once) or a failed health check, and up again by a passing
health check (``GET /health``, what vLLM's server answers). When every backend of a role is down the router
still tries them all (a health check may lag a recovery): a request is refused only when all have failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import Sequence
from typing import Literal

import aiohttp

from .config import BackendSpec, Balance

log = logging.getLogger("kvshuttle.router")

BACKEND_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, OSError)  # what a failed backend request raises
#: How a backend was chosen (the ``how`` label of ``kvshuttle_router_affinity_total``).
Chosen = Literal["sticky", "hashed", "failover", "balanced"]


def home_score(key: str, name: str, salt: bytes = b"") -> int:
    """Rendezvous (highest-random-weight) score of backend ``name`` for conversation ``key``: every router
    replica ranks a conversation's backends alike with no shared state, and removing a backend moves only the
    conversations whose home it was. Keyed with ``salt`` (derived from the deployment secret): a client cannot
    choose conversation ids that all land on one backend."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{name}".encode(), digest_size=8, key=salt).digest(), "big")


class Backend:
    """One vLLM server of a role, with its liveness and the requests in flight to it."""

    __slots__ = ("healthy", "in_flight", "role", "spec")

    def __init__(self, spec: BackendSpec, role: str) -> None:
        self.spec, self.role = spec, role
        self.healthy = True  # optimistic until a request or a health check says otherwise
        self.in_flight = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    def headers(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this backend's own credentials (its URL's user:password@), when it has some."""
        return base if self.spec.auth is None else {**base, "Authorization": self.spec.auth}

    def __repr__(self) -> str:
        return f"Backend({self.role} {self.name}, {'up' if self.healthy else 'down'}, {self.in_flight} in flight)"


class BackendPool:
    def __init__(self, specs: Sequence[BackendSpec], role: str, balance: Balance = "round_robin",
                 salt: bytes = b"") -> None:
        self.backends = [Backend(s, role) for s in specs]
        self.role, self.balance, self.salt = role, balance, salt
        self._turn = itertools.count()

    def choose(self, exclude: frozenset[str] = frozenset()) -> Backend | None:
        """The next backend to try, healthy ones first; None when every backend is excluded (tried)."""
        candidates = [b for b in self.backends if b.name not in exclude]
        if not candidates:
            return None
        healthy = [b for b in candidates if b.healthy] or candidates
        start = next(self._turn) % len(healthy)
        ordered = healthy[start:] + healthy[:start]
        if self.balance == "least_loaded":  # stable sort: ties keep round-robin order
            return min(ordered, key=lambda b: b.in_flight)
        return ordered[0]

    def choose_for(self, key: str | None, sticky: str | None = None,
                   exclude: frozenset[str] = frozenset()) -> tuple[Backend | None, Chosen]:
        """The backend for conversation ``key`` (None: :meth:`choose`): ``sticky`` (the backend that served it
        last, whose cache holds it) while it is healthy and not excluded, else the healthy backend that ranks
        first by :func:`home_score`. Hashing is stable: a failed home is left only while it is down."""
        if key is None:
            return self.choose(exclude), "balanced"
        candidates = [b for b in self.backends if b.name not in exclude]
        if not candidates:
            return None, "failover"
        healthy = [b for b in candidates if b.healthy] or candidates
        if sticky is not None:
            for b in healthy:
                if b.name == sticky:
                    return b, "sticky"
        best = max(healthy, key=lambda b: home_score(key, b.name, self.salt))
        home = best if len(healthy) == len(self.backends) else max(self.backends,
                                                                  key=lambda b: home_score(key, b.name, self.salt))
        return best, "hashed" if best is home else "failover"

    def find(self, name: str | None) -> Backend | None:
        return next((b for b in self.backends if b.name == name), None) if name is not None else None

    def mark(self, backend: Backend, healthy: bool, why: str = "") -> None:
        if backend.healthy != healthy:
            log.warning("router: %s backend %s is %s%s", backend.role, backend.name, "up" if healthy else "down",
                        f" ({why})" if why else "")
        backend.healthy = healthy

    async def check(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """One health check of every backend, concurrently."""
        async def one(backend: Backend) -> None:
            try:
                async with session.get(backend.url + "/health", headers=backend.headers({}),
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    ok, why = resp.status == 200, f"/health answered {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                ok, why = False, f"/health failed: {type(exc).__name__}"
            self.mark(backend, ok, why)

        await asyncio.gather(*(one(b) for b in self.backends))
