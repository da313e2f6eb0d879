"""The side channel: ZMQ ROUTER (owner) / DEALER (reader) sockets carrying msgpack maps, authenticated.

Every connection is CurveZMQ under the deployment's key pair (:mod:`kvshuttle.trust`): the owner's ZAP handler
admits only clients that prove they hold the deployment secret, and a client reaches only owners that hold it
(it pins the owner's public key), before a single message is exchanged; the channel is encrypted, so the NIXL
agent metadata of the handshake (one-sided READ access to every registered byte) never crosses in the clear.
The owner's socket drops any message over ``max_message_bytes``, and decoding bounds what a message expands to.

The owner runs one server thread. It answers requests (handshake, ping, pack, release, abort) through a
handler, and forwards messages that worker threads emit (``chunk ready``) to the reader that asked. ZMQ
sockets are not thread-safe: each socket here lives in exactly one thread; worker threads hand their
messages to the server thread over an ``inproc`` PUSH/PULL pair.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from ..errors import shown
from ..trust import DeploymentSecret
from .errors import (
    PeerAuthError,
    PeerLostError,
    PeerUnreachableError,
    ProtocolError,
    TransferArgumentError,
    TransferError,
)
from .wire import decode, encode

log = logging.getLogger(__name__)

Handler = Callable[[bytes, dict[str, Any]], "dict[str, Any] | None"]
_ids = itertools.count()
ZAP_DOMAIN = "kvshuttle"
CLIENT_MAX_MESSAGE_BYTES = 64 << 20  # what a reader accepts from an authenticated owner (handshake metadata)
SEND_EXPLAIN_S = 0.2  # how long a failed send waits for the monitor to say why (see Connection.send)


class _DeploymentKeys:
    """The ZAP handler's check: a client is admitted iff it proved it holds the deployment's CURVE key."""

    def __init__(self, public_key: bytes) -> None:
        self._public = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key == self._public


class SideChannelServer:
    """A ROUTER socket on ``tcp://host:port`` served by one daemon thread (port 0: a free port)."""

    def __init__(self, context: zmq.Context[Any], host: str, port: int, handler: Handler, *,
                 secret: DeploymentSecret, advertise_host: str | None = None,
                 max_message_bytes: int = 4 << 20) -> None:
        self._context = context
        self._handler = handler
        self._stop = threading.Event()
        self._events_address = f"inproc://kvshuttle-events-{id(self)}-{next(_ids)}"
        public, private = secret.curve_keys()
        # One ZAP handler per context (libzmq asks inproc://zeromq.zap.01 of the socket's own context).
        self._auth = ThreadAuthenticator(context, log=logging.getLogger(__name__ + ".zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_DeploymentKeys(public))
        self._router = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._router.setsockopt(zmq.CURVE_SERVER, 1)
        self._router.setsockopt(zmq.CURVE_SECRETKEY, private)
        self._router.setsockopt(zmq.CURVE_PUBLICKEY, public)
        self._router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        self._router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse, never admit
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # a larger message drops its connection
        self._router.setsockopt(zmq.HANDSHAKE_IVL, 2000)  # a client that never finishes the handshake is cut
        self._router.setsockopt(zmq.SNDHWM, 1000)  # replies to a reader that stopped reading are dropped
        try:
            if port == 0:
                port = self._router.bind_to_random_port(f"tcp://{host}")
            else:
                self._router.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._router.close()
            self._auth.stop()
            raise OSError(f"cannot bind the kvshuttle side channel on {host}:{port}: {exc} "
                          "(port in use? pass port=0 to pick a free one)") from exc
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self._events = context.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(self._events_address)
        self._thread = threading.Thread(target=self._serve, name=f"kvshuttle-side-{port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """Where readers reach this server (the advertised host, which may differ from the bind)."""
        return f"tcp://{self.advertise_host}:{self.port}"

    def emitter(self) -> Emitter:
        """A sender for one worker thread (create it in that thread; close it there)."""
        return Emitter(self._context, self._events_address)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._auth.stop()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._events, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if self._events in ready:
                    while True:
                        try:
                            identity, payload = self._events.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._router.send_multipart([identity, payload])
                if self._router in ready:
                    while True:
                        try:
                            frames = self._router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(frames)
        finally:
            self._router.close(0)
            self._events.close(0)

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        identity, payload = frames
        rid: Any = None
        try:
            message = decode(payload)
            rid = message.get("rid")
            reply = self._handler(identity, message)
        except ProtocolError as exc:
            reply = {"op": "error", "kind": "protocol", "message": str(exc)}
        except Exception as exc:  # the server must survive any handler bug; the peer gets the reason
            log.exception("kvshuttle side channel: handler failed")
            reply = {"op": "error", "kind": "internal", "message": f"{type(exc).__name__}: {exc}"}
        if reply is not None:
            if rid is not None:
                reply.setdefault("rid", rid)
            self._router.send_multipart([identity, encode(reply)])


class Emitter:
    """Sends ``(reader identity, message)`` from a worker thread through the server thread."""

    def __init__(self, context: zmq.Context[Any], address: str) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)

    def send(self, identity: bytes, message: dict[str, Any]) -> None:
        self._socket.send_multipart([identity, encode(message)])

    def close(self) -> None:
        self._socket.close()


def parse_address(address: object) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); TransferArgumentError for anything else."""
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise TransferArgumentError(f"a side-channel address is 'tcp://host:port', got {shown(address)}")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferArgumentError(f"a side-channel address is 'tcp://host:port' with a port in 1..65535, "
                                    f"got {shown(address)}")
    return host, int(port)


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_TIMED_OUT = (errno.EAGAIN, errno.ETIMEDOUT)  # a handshake that got no answer, as opposed to one refused
_WATCHED = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)


def client_socket(context: Any, address: str, secret: DeploymentSecret, *, heartbeat_s: float = 0.5,
                  peer_timeout_s: float = 1.0, max_message_bytes: int = CLIENT_MAX_MESSAGE_BYTES) -> tuple[Any, Any]:
    """``(socket, monitor)``: a DEALER socket connected to the owner at ``address`` and its monitor (the events
    :class:`LinkWatch` reads), for every client of a side channel (:class:`Connection`; the router's asyncio
    channel passes a ``zmq.asyncio`` context). TransferArgumentError for an address ZMQ cannot connect to.

    CURVE under the deployment's key pair: only an owner holding the secret completes the handshake. ZMTP
    heartbeats catch an owner that is alive but frozen or cut off.
    """
    parse_address(address)
    public, private = secret.curve_keys()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 0)
    socket.setsockopt(zmq.CURVE_SERVERKEY, public)  # only an owner holding the secret completes it
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, private)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    # at least three pings per timeout, so one late pong on a busy host does not drop a live peer
    socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(min(heartbeat_s, peer_timeout_s / 3) * 1000)))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(peer_timeout_s * 1000)))
    socket.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(peer_timeout_s * 1000)))
    # heartbeats start after the ZMTP handshake; a peer frozen before it would otherwise get 30 s
    socket.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(peer_timeout_s * 1000)))
    # Never reconnect: a connection is to one owner process, lost once it drops (LinkWatch). Reconnecting to a
    # dead owner every 100 ms queued ~14 monitor events a second that nobody reads once the link is lost; at the
    # monitor's 1,000-message limit libzmq's I/O thread blocks sending the next one, every socket of the context
    # stops, and closing the socket then blocks with the GIL held: the whole process froze (a prefill's worker,
    # ~70 s after a decode it had read from went away).
    socket.setsockopt(zmq.RECONNECT_IVL, -1)
    monitor = socket.get_monitor_socket(_WATCHED)
    try:
        socket.connect(address)
    except zmq.ZMQError as exc:
        with contextlib.suppress(zmq.ZMQError):
            socket.disable_monitor()
        monitor.close(0)
        socket.close(0)
        raise TransferArgumentError(f"cannot connect to {address!r}: {exc}") from exc
    return socket, monitor


class LinkWatch:
    """What a client socket's monitor events say about its connection to one owner: the one set of rules for
    every client (:class:`Connection`, the router's asyncio channel), fed each event as it is read.

    ``lost`` says why an established connection is gone (the owner's process died: the kernel closed its
    sockets; no handshake or heartbeat answer: frozen or cut off; a failed CURVE handshake: ``auth_failed``);
    ``refused``: a connection attempt was refused before any succeeded.
    """

    def __init__(self, address: str, fingerprint: str) -> None:
        self.address = address
        self.fingerprint = fingerprint
        self.ever_connected = False
        self.refused = False  # a connection attempt was refused before any succeeded
        self.auth_failed = False  # the CURVE handshake failed: the other side is not of this deployment
        self.lost: str | None = None  # why the connection is gone, once it is
        self.events = 0  # monitor events fed (bounded per connection: it never reconnects)

    def feed(self, frames: list[bytes]) -> None:
        """One monitor message (its frames)."""
        self.events += 1
        if self.lost is not None:
            return
        parsed = parse_monitor_message(frames)
        event = parsed["event"]
        if event & _HANDSHAKE_FAILED and not (event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                              and int(parsed["value"]) in _TIMED_OUT):
            self.auth_failed = True
            self.lost = (f"the authenticated handshake with {self.address} failed: it does not hold this "
                         f"deployment's secret (fingerprint {self.fingerprint}), runs a kvshuttle older than "
                         "side-channel protocol 4, or hung up; set the same KVSHUTTLE_SECRET on both sides")
        elif event & _HANDSHAKE_FAILED and self.ever_connected:  # silent within HANDSHAKE_IVL: frozen
            self.lost = (f"{self.address} gave no handshake or heartbeat answer within peer_timeout_s (frozen or "
                         "cut off)")
        elif event == zmq.EVENT_CONNECTED:
            self.ever_connected = True
        elif event in (zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CLOSED) and not self.ever_connected:
            self.refused = True  # (without reconnects a refused first connect ends in CLOSED)
        elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and self.ever_connected:
            self.lost = (f"the connection to {self.address} dropped (owner process gone, or no heartbeat "
                         "answer within peer_timeout_s)")

    def error(self, what: str | None = None) -> TransferError | None:
        """The error a wait on this connection raises now (``what``: what it waits for), or None while usable:
        PeerAuthError, PeerLostError, or PeerUnreachableError for a refused connection."""
        during = f" while waiting for {what}" if what else ""
        if self.auth_failed:
            return PeerAuthError(f"{self.lost} (while waiting for {what})" if what else str(self.lost))
        if self.lost is not None:
            return PeerLostError(f"{self.lost}{during}; reconnect with engine.connect(address)" if what
                                 else self.lost)
        if self.refused:
            return PeerUnreachableError(f"{self.address} refused the connection{during}: is the owner running and "
                                        "serving (engine.serve()) on that host and port?")
        return None


class Connection:
    """A DEALER socket to one owner, used by one thread: requests with timeouts, and a message stream.

    The connection watches itself (:class:`LinkWatch`): a ZMQ monitor reports the TCP connection dropping and
    ZMTP heartbeats (every ``heartbeat_s``, ``peer_timeout_s`` of silence closes the connection) catch an owner
    that is alive but frozen or cut off. Either makes every wait on this connection raise
    :class:`PeerLostError` at once; a refused connection before the first handshake raises
    :class:`PeerUnreachableError` at once instead of waiting for a timeout.
    """

    def __init__(self, context: zmq.Context[Any], address: str, *, secret: DeploymentSecret,
                 heartbeat_s: float = 0.5, peer_timeout_s: float = 1.0,
                 max_message_bytes: int = CLIENT_MAX_MESSAGE_BYTES) -> None:
        self.address = address
        self._socket, self._monitor = client_socket(context, address, secret, heartbeat_s=heartbeat_s,
                                                    peer_timeout_s=peer_timeout_s,
                                                    max_message_bytes=max_message_bytes)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.link = LinkWatch(address, secret.fingerprint)
        self._rid = itertools.count(1)
        self.backlog: list[dict[str, Any]] = []  # messages received while waiting for a reply

    @property
    def lost(self) -> str | None:
        """Why the connection is gone, once it is."""
        return self.link.lost

    # -- liveness -------------------------------------------------------------------------------------------
    def watch(self) -> str | None:
        """Drain the monitor without blocking (all of it, lost or not); returns why the connection is lost, or
        None."""
        while True:
            try:
                self.link.feed(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        return self.link.lost

    def _raise_if_dead(self, what: str) -> None:
        self.watch()
        error = self.link.error(what)
        if error is not None:
            raise error

    def _wait(self, timeout: float, what: str) -> bool:
        """Wait up to ``timeout`` for a message; False on timeout; raises as soon as the peer is gone."""
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_dead(what)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = dict(self._poller.poll(max(1, int(min(left, 1.0) * 1000) + 1)))  # monitor wakes it too
            if self._socket in ready:
                return True

    # -- messages -------------------------------------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        try:
            self._socket.send(encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full queue to a peer that stopped reading, a dropped pipe, a closed socket
            # A failed handshake or a refusal drops the pipe before its monitor event is read: give the link a
            # moment to say why (PeerAuthError says which secret to set), else the peer is lost.
            deadline = time.monotonic() + SEND_EXPLAIN_S
            while True:
                self._raise_if_dead("a send")
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._monitor.poll(max(1, int(left * 1000)))
            raise PeerLostError(f"cannot send to {self.address}: {exc}") from exc

    def receive(self, timeout: float, what: str = "a message") -> dict[str, Any] | None:
        """The next message (backlog first), or None after ``timeout`` seconds; PeerLostError when gone."""
        if self.backlog:
            return self.backlog.pop(0)
        if not self._wait(timeout, what):
            return None
        return decode(self._socket.recv())

    def request(self, message: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
        """Send and wait for the reply with the same request id.

        PeerUnreachableError when nothing answered within ``timeout`` (or the connection was refused),
        PeerLostError when an established connection dropped meanwhile.
        """
        rid = next(self._rid)
        self.send({**message, "rid": rid})
        deadline = time.monotonic() + timeout
        while True:
            if not self._wait(deadline - time.monotonic(), what):
                raise PeerUnreachableError(
                    f"no answer to {what} from {self.address} within {timeout:.1f} s: is the owner running "
                    "and serving (engine.serve()) on that host and port?"
                )
            reply = decode(self._socket.recv())
            if reply.get("rid") == rid:
                return reply
            self.backlog.append(reply)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self._monitor.close(0)
        self._socket.close(0)


class ConnectionLender(Protocol):
    """Lends idle connections to one owner (``transfer.Peer``) so packed reads skip the TCP set-up."""

    def checkout(self, context: zmq.Context[Any]) -> Connection: ...

    def checkin(self, conn: Connection, healthy: bool) -> None: ...

    def mark_lost(self, reason: str) -> None: ...
