"""A connected owner, as a reader sees it: handshake data, NIXL state, side-channel connections, liveness."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..trust import DeploymentSecret
from ._nixl import NixlDescList
from .errors import PeerLostError
from .path_model import PathModel
from .side_channel import Connection
from .wire import PeerInfo

_IDLE_STREAMS = 8  # idle packed-read connections kept per peer


@dataclass(eq=False)
class Peer:
    """One owner this engine reads from. ``lost`` says why it is gone, once it is (then it stays gone)."""

    address: str
    info: PeerInfo
    agent_name: str
    layout_difference: str | None  # why a direct read is impossible, or None
    conn: Connection = field(repr=False)  # claims, pings (one request at a time: ``conn_lock``)
    secret: DeploymentSecret = field(repr=False)
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 1.0
    remote_dlist: NixlDescList | None = field(default=None, repr=False)
    tier_claims: set[str] = field(default_factory=set, repr=False)  # claims read direct from the tier, unconfirmed
    path_model: PathModel = field(default_factory=lambda: PathModel(32 << 10), repr=False)  # auto's measurements
    connected: bool = True
    lost: str | None = None
    _streams: list[Connection] = field(default_factory=list, repr=False)  # idle packed-read connections
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    conn_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # ZMQ sockets are single-threaded

    def watch(self) -> str | None:
        """Why the owner is gone (a dropped connection or a silent heartbeat), or None while it is alive."""
        if self.lost is None:
            if not self.conn_lock.acquire(blocking=False):
                return self.lost  # a request on the connection is watching it (and marks the peer lost)
            try:
                why = self.conn.watch()
            finally:
                self.conn_lock.release()
            if why is not None:
                self.mark_lost(why)
        return self.lost

    def request(self, message: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
        """One request on the peer's own connection (serialized: callers may be on several threads); a lost
        connection marks the peer lost."""
        try:
            with self.conn_lock:
                return self.conn.request(message, timeout, what)
        except PeerLostError as exc:
            self.mark_lost(str(exc))
            raise

    def mark_lost(self, reason: str) -> None:
        with self._lock:
            if self.lost is None:
                self.lost = reason

    def checkout(self, context: zmq.Context[Any]) -> Connection:
        """An idle side-channel connection for one packed read (reused: a new one costs a TCP and ZMTP handshake)."""
        with self._lock:
            while self._streams:
                conn = self._streams.pop()
                if conn.watch() is None:
                    return conn
                conn.close()
        return Connection(context, self.address, secret=self.secret, heartbeat_s=self.heartbeat_s,
                          peer_timeout_s=self.peer_timeout_s)

    def checkin(self, conn: Connection, healthy: bool) -> None:
        with self._lock:
            if healthy and self.connected and self.lost is None and len(self._streams) < _IDLE_STREAMS:
                self._streams.append(conn)
                return
        conn.close()

    def close_connections(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for conn in streams:
            conn.close()
        self.conn.close()
