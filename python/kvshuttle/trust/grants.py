"""Retention grants: a router's permission for an engine to keep a request's blocks for a later reader.

Keeping blocks costs the engine memory for up to its TTL, so an engine retains only for requests that carry a
grant a deployment member issued (``kvshuttle_grant`` in ``kv_transfer_params``): a client talking to vLLM
directly cannot make it hold memory for it (unless the connector is configured with
``kvshuttle_retain: "always"``). A grant is ``v1.<expiry>.<mac>``: valid until its expiry (Unix seconds) and
unforgeable without the deployment secret. Routers strip every ``kv_transfer_params`` from what clients see,
so clients never hold one to replay.
"""

from __future__ import annotations

import time

from .secret import DeploymentSecret

GRANT_FIELD = "kvshuttle_grant"
GRANT_TTL_S = 300.0  # covers a prefill, a long decode and the clock skew between hosts
_PURPOSE = "retention-grant"


def issue_grant(secret: DeploymentSecret, ttl_s: float = GRANT_TTL_S, now: float | None = None) -> str:
    """A grant valid for ``ttl_s`` seconds from ``now`` (wall clock)."""
    expiry = int((time.time() if now is None else now) + ttl_s)
    return f"v1.{expiry}.{secret.mac(_PURPOSE, str(expiry).encode()).hex()}"


def grant_valid(secret: DeploymentSecret, grant: object, now: float | None = None) -> bool:
    """True iff ``grant`` was issued under ``secret`` and has not expired. Never raises."""
    if not isinstance(grant, str) or len(grant) > 64:
        return False
    version, _, rest = grant.partition(".")
    expiry, _, tag = rest.partition(".")
    if version != "v1" or not expiry.isdigit() or len(expiry) > 12:
        return False
    try:
        raw = bytes.fromhex(tag)
    except ValueError:
        return False
    if not secret.verify(_PURPOSE, expiry.encode(), raw):
        return False
    return int(expiry) >= (time.time() if now is None else now)
