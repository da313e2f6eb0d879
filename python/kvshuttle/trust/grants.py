"""Retention grants: a router's permission for an engine to keep one request's blocks for a later reader.

Keeping blocks costs the engine memory for up to its TTL, so an engine retains only for requests that carry a
grant a deployment member issued (``kvshuttle_grant`` in ``kv_transfer_params``): a client talking to vLLM
directly cannot make it hold memory for it (unless the connector is configured with
``kvshuttle_retain: "always"``). A grant is ``v2.<expiry>.<nonce>.<mac>``: unforgeable without the deployment
secret, valid for a request that *arrives* before its expiry (Unix seconds), however long its answer then takes,
and good for one request: an engine's :class:`GrantBook` accepts each nonce for one request id only, so a grant
replayed on other requests retains nothing more. Routers strip every ``kv_transfer_params`` from what clients
see, so clients never hold one to replay.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections.abc import Callable

from .secret import DeploymentSecret

GRANT_FIELD = "kvshuttle_grant"
GRANT_TTL_S = 300.0  # from the router to the engine's admission: queueing and the clock skew between hosts
MAX_NONCES = 1 << 20  # an engine remembers this many live nonces at most (~100 MiB at worst), then refuses
_PURPOSE = "retention-grant"
_VERSION = "v2"


def issue_grant(secret: DeploymentSecret, ttl_s: float = GRANT_TTL_S, now: float | None = None) -> str:
    """A grant for one request that arrives within ``ttl_s`` seconds from ``now`` (wall clock)."""
    expiry = int((time.time() if now is None else now) + ttl_s)
    nonce = secrets.token_hex(8)
    return f"{_VERSION}.{expiry}.{nonce}.{secret.mac(_PURPOSE, f'{expiry}.{nonce}'.encode()).hex()}"


def grant_terms(secret: DeploymentSecret, grant: object) -> tuple[int, str] | None:
    """(expiry, nonce) of a grant issued under ``secret``, or None (malformed, forged, another secret). Never
    raises."""
    if not isinstance(grant, str) or len(grant) > 96:
        return None
    parts = grant.split(".")
    if len(parts) != 4 or parts[0] != _VERSION:
        return None
    _, expiry, nonce, tag = parts
    if not (expiry.isascii() and expiry.isdigit() and len(expiry) <= 12 and len(nonce) == 16):
        return None
    try:
        raw = bytes.fromhex(tag)
        bytes.fromhex(nonce)
    except ValueError:
        return None
    if not secret.verify(_PURPOSE, f"{expiry}.{nonce}".encode(), raw):
        return None
    return int(expiry), nonce


def grant_valid(secret: DeploymentSecret, grant: object, now: float | None = None) -> bool:
    """True iff ``grant`` was issued under ``secret`` and a request arriving at ``now`` is covered. Stateless:
    an engine binds a grant to one request with :class:`GrantBook`."""
    terms = grant_terms(secret, grant)
    return terms is not None and terms[0] >= (time.time() if now is None else now)


class GrantBook:
    """An engine's record of the grants its requests were admitted with.

    :meth:`admit` when a request arrives (vLLM asks the connector about a new request; again after a preemption,
    harmlessly): the grant is checked then, against the arrival, and its nonce taken for that request id.
    :meth:`granted` when the request finishes: the answer it recorded (a request never admitted here is checked
    and recorded then). :meth:`finish` forgets the request. Memory is bounded: a nonce is remembered until its
    grant expires (no request can be admitted with it after that), at most ``max_nonces`` of them (beyond, grants
    are refused: retention is an optimisation, replay protection is not); requests only while vLLM holds them.
    """

    def __init__(self, secret: DeploymentSecret, max_nonces: int = MAX_NONCES,
                 clock: Callable[[], float] = time.time) -> None:
        self.secret, self.max_nonces, self._clock = secret, max_nonces, clock
        self._nonces: dict[str, str] = {}  # nonce -> the request id that took it
        self._expiry: list[tuple[int, str]] = []  # (expiry, nonce): when a nonce may be forgotten
        self._requests: dict[str, bool] = {}  # request id -> admitted with a valid grant
        self.refused = {"invalid": 0, "replayed": 0, "full": 0}

    def admit(self, request_id: str, grant: object) -> bool:
        """Record whether ``request_id`` arrives with a valid grant of its own (idempotent per request id)."""
        known = self._requests.get(request_id)
        if known is not None:
            return known
        ok = self._take(request_id, grant)
        self._requests[request_id] = ok
        return ok

    def granted(self, request_id: str, grant: object) -> bool:
        """Whether ``request_id`` was admitted with a valid grant (checked now if it never was admitted)."""
        known = self._requests.get(request_id)
        return known if known is not None else self.admit(request_id, grant)

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def sizes(self) -> dict[str, int]:
        return {"nonces": len(self._nonces), "requests": len(self._requests)}

    def _take(self, request_id: str, grant: object) -> bool:
        now = self._clock()
        self._forget_expired(now)
        terms = grant_terms(self.secret, grant)
        if terms is None or terms[0] < now:
            self.refused["invalid"] += 1
            return False
        expiry, nonce = terms
        holder = self._nonces.get(nonce)
        if holder is not None:
            if holder != request_id:
                self.refused["replayed"] += 1
            return holder == request_id
        if len(self._nonces) >= self.max_nonces:
            self.refused["full"] += 1
            return False
        self._nonces[nonce] = request_id
        heapq.heappush(self._expiry, (expiry, nonce))
        return True

    def _forget_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            _, nonce = heapq.heappop(self._expiry)
            self._nonces.pop(nonce, None)
