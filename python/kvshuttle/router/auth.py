"""The tenant of a request: from its bearer API key (constant time), a trusted gateway's header, or the one
shared tenant; and the ``cache_salt`` that keeps its prefix-cache entries its own.

A presented key is never used to look anything up: its SHA-256 is compared with :func:`hmac.compare_digest`
against the SHA-256 of every configured key, all of them every time, so neither the time to answer nor the
order of the keys tells a client how close a guess came (or how long the keys are).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from .handles import valid_id

BEARER = "bearer "


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """Configured API keys -> tenants, checked in constant time; ``repr`` never shows a key."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._keys = [(_digest(key), tenant) for key, tenant in keys.items()]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._keys)} keys)"

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant whose key the ``Authorization: Bearer KEY`` header carries, or None."""
        presented = b""
        if authorization and authorization[:len(BEARER)].lower() == BEARER:
            presented = _digest(authorization[len(BEARER):].strip())
        found: str | None = None
        for digest, tenant in self._keys:  # every key, whatever matched first
            if hmac.compare_digest(digest, presented) and found is None:
                found = tenant
        return found if presented else None


def header_tenant(value: str | None) -> str | None:
    """A tenant named by a trusted gateway's header, when it is a short printable string."""
    return valid_id(value)


def cache_salt(key: bytes, tenant: str, conversation: str | None, client_salt: str | None) -> str:
    """vLLM's ``cache_salt`` for a request: a keyed hash (``key`` derived from the deployment secret) of the tenant,
    the conversation (None: per tenant) and the client's own salt, if any, folded in, never in place of the
    tenant's. Length-prefixed: no two triples hash alike by moving characters between them."""
    parts = (tenant, conversation or "", client_salt or "")
    encoded = [p.encode("utf-8", "surrogatepass") for p in parts]
    raw = b"".join(len(p).to_bytes(4, "big") + p for p in encoded)
    return hashlib.blake2b(raw, digest_size=16, key=key).hexdigest()
