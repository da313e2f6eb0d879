"""What a router says to a decode over its side channel, with no NIXL agent and no KV cache of its own:
take a published handle, renew a conversation's retention, release it.

Each call opens one short-lived side-channel connection (the same ZMQ DEALER, monitor and heartbeats as a
reader's), so a dead or frozen decode fails fast with :class:`PeerUnreachableError` / :class:`PeerLostError`
instead of hanging a router's request. Blocking: call them from a thread in an async server
(``asyncio.to_thread``).
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from ..errors import shown
from ..policy import KVHandle, parse_handle
from .board import check_publish_key
from .errors import ProtocolError, TransferArgumentError
from .side_channel import Connection


def _connect(address: str) -> Connection:
    return Connection(zmq.Context.instance(), address)


def _handle(kv_transfer_params: Any) -> KVHandle:
    handle = parse_handle(kv_transfer_params)
    if not isinstance(handle, KVHandle):
        raise TransferArgumentError(f"no kvshuttle handle in these kv_transfer_params: {handle.message}")
    return handle


def take_published(address: str, key: str, timeout_s: float = 2.0, poll_s: float = 0.02) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` the owner at ``address`` published under ``key``, waiting up to ``timeout_s``.

    None when nothing was published in time, or the owner published "nothing retained". A found entry is
    removed: exactly one caller gets it.
    """
    check_publish_key(key)
    conn = _connect(address)
    try:
        return ask_published(conn, key, timeout_s, poll_s)
    finally:
        conn.close()


def ask_published(conn: Connection, key: str, timeout_s: float, poll_s: float = 0.02) -> dict[str, Any] | None:
    """:func:`take_published` over a connection the caller keeps (a router keeps one per decode)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = conn.request({"op": "take_published", "key": key}, max(0.5, deadline - time.monotonic()),
                             "take_published")
        if reply.get("op") != "published":
            raise ProtocolError(f"{conn.address} answered take_published with {shown(reply)}")
        if reply.get("found"):
            params = reply.get("kv_transfer_params")
            return dict(params) if isinstance(params, dict) else None
        if time.monotonic() + poll_s > deadline:
            return None
        time.sleep(poll_s)


def renew_retention(kv_transfer_params: Any, ttl_s: float | None = None, timeout_s: float = 2.0,
                    unknown_grace_s: float = 1.0) -> dict[str, Any] | None:
    """Keep the decode's retention of this handle for another ``ttl_s`` (default: the decode's TTL).

    The refreshed params (same blocks, later expiry), or None when the decode no longer holds them (expired,
    evicted, released, consumed). A handle the decode does not know yet is asked again for up to
    ``unknown_grace_s``: its ledger learns of a handle one engine step after the answer that carried it, so a
    renewal sent right after a turn can arrive first. TransferArgumentError for params holding no handle.
    """
    handle = _handle(kv_transfer_params)
    message = {"op": "renew_retention", "handle_id": handle.handle_id, "ttl_s": ttl_s}
    conn = _connect(f"tcp://{handle.host}:{handle.port}")
    try:
        grace_until = time.monotonic() + unknown_grace_s
        reply = conn.request(message, timeout_s, "a renewal")
        while reply.get("reason") == "UnknownHandleError" and time.monotonic() < grace_until:
            time.sleep(0.05)
            reply = conn.request(message, timeout_s, "a renewal")
    finally:
        conn.close()
    params = reply.get("kv_transfer_params") if reply.get("op") == "renewed" else None
    return dict(params) if isinstance(params, dict) else None


def release_retention(kv_transfer_params: Any, timeout_s: float = 2.0) -> bool:
    """Let the decode free this handle's blocks now; False when there was nothing (left) to free.

    The decode's ledger cannot tell a handle it has not learned yet (one engine step after the answer) from one
    already gone, so a release sent in that instant returns False and the blocks stay until their TTL."""
    handle = _handle(kv_transfer_params)
    conn = _connect(f"tcp://{handle.host}:{handle.port}")
    try:
        reply = conn.request({"op": "release_retention", "handle_id": handle.handle_id}, timeout_s, "a release")
    finally:
        conn.close()
    return reply.get("op") == "released" and bool(reply.get("released"))
