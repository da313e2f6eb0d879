"""The retention operations a decode's side channel answers besides reads: take a published handle, renew a
conversation's retention, release it, demote it into the decode's host tier now. One implementation of each
(``ask_*``, over any requester: a router's short-lived :class:`Connection` or a reader's connected
:class:`~kvshuttle.transfer.Peer`), and the router's NIXL-free entry points (``take_published``,
``renew_retention``, ``release_retention``, ``demote_retention``), which open one authenticated connection per
call.

Handles are authenticated before anything is sent: params whose MAC does not verify under the deployment secret
never cause a connection. A dead or frozen decode fails fast with :class:`PeerUnreachableError` /
:class:`PeerLostError` instead of hanging. Blocking: call them from a thread in an async server
(``asyncio.to_thread``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import zmq

from ..errors import shown
from ..policy import KVHandle, parse_handle
from ..trust import DeploymentSecret
from .board import check_publish_key
from .claims import ClaimRefusedError
from .errors import ProtocolError, TransferArgumentError, TransferError
from .side_channel import Connection


class Requester(Protocol):
    """Sends one request and waits for its reply (``Connection``, ``Peer``)."""

    @property
    def address(self) -> str: ...

    def request(self, message: dict[str, Any], timeout: float, what: str) -> dict[str, Any]: ...


def connect(address: str, secret: DeploymentSecret | None = None) -> Connection:
    """An authenticated side-channel connection to ``address`` (the caller closes it)."""
    return Connection(zmq.Context.instance(), address, secret=secret or DeploymentSecret.resolve())


def authenticated_handle(kv_transfer_params: Any, secret: DeploymentSecret) -> KVHandle:
    """The handle in ``kv_transfer_params`` if a member of this deployment issued it; TransferArgumentError else."""
    handle = parse_handle(kv_transfer_params, secret=secret)
    if not isinstance(handle, KVHandle):
        raise TransferArgumentError(f"no usable kvshuttle handle in these kv_transfer_params: {handle.message}")
    return handle


# -- one implementation per operation ---------------------------------------------------------------------------
def published(address: str, reply: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """One ``take_published`` reply read: (found, its params: None for "nothing retained"); ProtocolError for
    anything else (the synchronous poll below and the router's asynchronous one share it)."""
    if reply.get("op") != "published":
        raise ProtocolError(f"{address} answered take_published with {shown(reply)}")
    if not reply.get("found"):
        return False, None
    params = reply.get("kv_transfer_params")
    return True, dict(params) if isinstance(params, dict) else None


def ask_published(conn: Requester, key: str, timeout_s: float, poll_s: float = 0.02) -> dict[str, Any] | None:
    """The params the owner published under ``key`` (taken: exactly one caller gets them), polling up to
    ``timeout_s``; None when nothing was published in time, or "nothing retained" was."""
    check_publish_key(key)
    deadline = time.monotonic() + timeout_s
    while True:
        reply = conn.request({"op": "take_published", "key": key}, max(0.5, deadline - time.monotonic()),
                             "take_published")
        found, params = published(conn.address, reply)
        if found:
            return params
        if time.monotonic() + poll_s > deadline:
            return None
        time.sleep(poll_s)


def ask_renewal(conn: Requester, handle: KVHandle, ttl_s: float | None, timeout_s: float,
                unknown_grace_s: float = 1.0) -> dict[str, Any] | None:
    """Renew ``handle`` for ``ttl_s`` (None: the owner's TTL; the owner clamps it to its maximum): the refreshed,
    signed params, or None when the owner no longer holds them.

    A handle the owner does not know yet is asked again for up to ``unknown_grace_s``: its ledger learns of a
    handle one engine step after the answer that carried it, so a renewal right after a turn can arrive first."""
    if ttl_s is not None and not (type(ttl_s) in (int, float) and 0 < ttl_s < 1e9):
        raise TransferArgumentError(f"ttl_s must be a positive number of seconds, got {shown(ttl_s)}")
    message = {"op": "renew_retention", "handle_id": handle.handle_id,
               "ttl_s": None if ttl_s is None else float(ttl_s)}
    grace_until = time.monotonic() + unknown_grace_s
    reply = conn.request(message, timeout_s, "a renewal")
    while reply.get("reason") == "UnknownHandleError" and time.monotonic() < grace_until:
        time.sleep(0.05)
        reply = conn.request(message, timeout_s, "a renewal")
    params = reply.get("kv_transfer_params") if reply.get("op") == "renewed" else None
    return dict(params) if isinstance(params, dict) else None


def rank_addresses(handle: KVHandle) -> list[str]:
    """Every owner rank's side channel (``tcp://host:port``; one for a single owner): each holds its own retention
    of the handle, so renewals and releases go to all of them."""
    return [f"tcp://{rank}" for rank in handle.ranks] or [f"tcp://{handle.host}:{handle.port}"]


def renew_on_ranks(ranks: Sequence[Requester], handle: KVHandle, ttl_s: float | None, timeout_s: float,
                   unknown_grace_s: float = 1.0) -> dict[str, Any] | None:
    """:func:`ask_renewal` on every owner rank (``rank_addresses`` order): rank 0's refreshed params, or None
    when any rank no longer holds the handle (a retention missing on one rank cannot be read any more)."""
    renewed = [ask_renewal(rank, handle, ttl_s, timeout_s, unknown_grace_s) for rank in ranks]
    return renewed[0] if all(params is not None for params in renewed) else None


def release_on_ranks(ranks: Sequence[Requester], handle: KVHandle, timeout_s: float) -> bool:
    """:func:`ask_release` on every owner rank, each asked whatever the others answer (a dead rank must not keep
    the live ones holding blocks); True when any freed, else the first rank's error, if one failed."""
    released, error = False, None
    for rank in ranks:
        try:
            released = ask_release(rank, handle, timeout_s) or released
        except TransferError as exc:
            error = error or exc
    if error is not None and not released:
        raise error
    return released


def ask_release(conn: Requester, handle: KVHandle, timeout_s: float) -> bool:
    """Let the owner free ``handle``'s blocks now; False when there was nothing (left) to free.

    The owner's ledger cannot tell a handle it has not learned yet (one engine step after the answer) from one
    already gone, so a release sent in that instant returns False and the blocks stay until their TTL."""
    reply = conn.request({"op": "release_retention", "handle_id": handle.handle_id}, timeout_s, "a release")
    return reply.get("op") == "released" and bool(reply.get("released"))


def demote_on_ranks(ranks: Sequence[Requester], handle: KVHandle, timeout_s: float,
                    unknown_grace_s: float = 1.0) -> bool:
    """:func:`ask_demotion` on every owner rank, each asked whatever the others answer (as releases): True when
    any rank started moving its retention into its tier; else the first rank's error (a refusal by name:
    :class:`ClaimRefusedError`), if one failed; False when every rank kept it where it was."""
    demoted, error = False, None
    for rank in ranks:
        try:
            demoted = ask_demotion(rank, handle, timeout_s, unknown_grace_s) or demoted
        except TransferError as exc:
            error = error or exc
    if error is not None and not demoted:
        raise error
    return demoted


def ask_demotion(conn: Requester, handle: KVHandle, timeout_s: float, unknown_grace_s: float = 1.0) -> bool:
    """Let the owner move ``handle``'s retention into its host tier now (its hot blocks go back once the copy
    landed; the handle stays valid, its claims are served from the tier): True when the copy started (or waits
    for reads in flight), False when it is in a tier already or the tier has no room (it stays hot).

    :class:`ClaimRefusedError` naming the owner's reason when it refuses: ``UnknownHandleError`` (after
    ``unknown_grace_s``, as renewals: the ledger learns a handle one engine step after the answer that carried
    it), ``HandleExpiredError``, ``HandleDemotingError``..., ``NoTierError`` (an owner without a host tier),
    ``NoRetention`` (an owner without a ledger). Nothing is lost on a refusal."""
    message = {"op": "demote_retention", "handle_id": handle.handle_id}
    grace_until = time.monotonic() + unknown_grace_s
    reply = conn.request(message, timeout_s, "a demotion")
    while reply.get("reason") == "UnknownHandleError" and time.monotonic() < grace_until:
        time.sleep(0.05)
        reply = conn.request(message, timeout_s, "a demotion")
    if reply.get("op") == "demoted":
        return bool(reply.get("demoted"))
    if reply.get("op") == "refused":
        raise ClaimRefusedError(f"owner at {conn.address} refused the demotion: {shown(reply.get('message'))}",
                                str(reply.get("reason", "Unknown"))[:64])
    raise ProtocolError(f"{conn.address} answered demote_retention with {shown(reply)}")


# -- a router's entry points (a connection per call) ------------------------------------------------------------
def take_published(address: str, key: str, timeout_s: float = 2.0, poll_s: float = 0.02, *,
                   secret: DeploymentSecret | None = None) -> dict[str, Any] | None:
    """:func:`ask_published` over a connection of its own to ``address``."""
    check_publish_key(key)
    conn = connect(address, secret)
    try:
        return ask_published(conn, key, timeout_s, poll_s)
    finally:
        conn.close()


def renew_retention(kv_transfer_params: Any, ttl_s: float | None = None, timeout_s: float = 2.0,
                    unknown_grace_s: float = 1.0, *, secret: DeploymentSecret | None = None) -> dict[str, Any] | None:
    """:func:`renew_on_ranks` of the handle in ``kv_transfer_params`` (authenticated first: TransferArgumentError
    for params that hold no handle of this deployment, before any connection)."""
    secret = secret or DeploymentSecret.resolve()
    handle = authenticated_handle(kv_transfer_params, secret)
    conns = [connect(address, secret) for address in rank_addresses(handle)]
    try:
        return renew_on_ranks(conns, handle, ttl_s, timeout_s, unknown_grace_s)
    finally:
        for conn in conns:
            conn.close()


def release_retention(kv_transfer_params: Any, timeout_s: float = 2.0, *,
                      secret: DeploymentSecret | None = None) -> bool:
    """:func:`release_on_ranks` of the handle in ``kv_transfer_params`` (authenticated first, as for renewals)."""
    secret = secret or DeploymentSecret.resolve()
    handle = authenticated_handle(kv_transfer_params, secret)
    conns = [connect(address, secret) for address in rank_addresses(handle)]
    try:
        return release_on_ranks(conns, handle, timeout_s)
    finally:
        for conn in conns:
            conn.close()


def demote_retention(kv_transfer_params: Any, timeout_s: float = 2.0, unknown_grace_s: float = 1.0, *,
                     secret: DeploymentSecret | None = None) -> bool:
    """:func:`demote_on_ranks` of the handle in ``kv_transfer_params`` (authenticated first, as for renewals)."""
    secret = secret or DeploymentSecret.resolve()
    handle = authenticated_handle(kv_transfer_params, secret)
    conns = [connect(address, secret) for address in rank_addresses(handle)]
    try:
        return demote_on_ranks(conns, handle, timeout_s, unknown_grace_s)
    finally:
        for conn in conns:
            conn.close()
