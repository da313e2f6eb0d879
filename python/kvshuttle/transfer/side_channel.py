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
from .errors import PeerAuthError, PeerLostError, PeerUnreachableError, ProtocolError, TransferArgumentError
from .wire import decode, encode

log = logging.getLogger(__name__)

Handler = Callable[[bytes, dict[str, Any]], "dict[str, Any] | None"]
_ids = itertools.count()
ZAP_DOMAIN = "kvshuttle"
CLIENT_MAX_MESSAGE_BYTES = 64 << 20  # what a reader accepts from an authenticated owner (handshake metadata)


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


class Connection:
    """A DEALER socket to one owner, used by one thread: requests with timeouts, and a message stream.

    The connection watches itself: a ZMQ monitor reports the TCP connection dropping (the owner's process
    died: the kernel closed its sockets) and ZMTP heartbeats (every ``heartbeat_s``, ``peer_timeout_s`` of
    silence closes the connection) catch an owner that is alive but frozen or cut off. Either makes every
    wait on this connection raise :class:`PeerLostError` at once; a refused connection before the first
    handshake raises :class:`PeerUnreachableError` at once instead of waiting for a timeout.
    """

    def __init__(self, context: zmq.Context[Any], address: str, *, secret: DeploymentSecret,
                 heartbeat_s: float = 0.5, peer_timeout_s: float = 1.0,
                 max_message_bytes: int = CLIENT_MAX_MESSAGE_BYTES) -> None:
        parse_address(address)
        self.address = address
        self.fingerprint = secret.fingerprint
        public, private = secret.curve_keys()
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IMMEDIATE, 0)
        self._socket.setsockopt(zmq.CURVE_SERVERKEY, public)  # only an owner holding the secret completes it
        self._socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
        self._socket.setsockopt(zmq.CURVE_SECRETKEY, private)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # at least three pings per timeout, so one late pong on a busy host does not drop a live peer
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(min(heartbeat_s, peer_timeout_s / 3) * 1000)))
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(peer_timeout_s * 1000)))
        self._socket.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(peer_timeout_s * 1000)))
        # heartbeats start after the ZMTP handshake; a peer frozen before it would otherwise get 30 s
        self._socket.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(peer_timeout_s * 1000)))
        self._monitor = self._socket.get_monitor_socket(_WATCHED)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        try:
            self._socket.connect(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransferArgumentError(f"cannot connect to {address!r}: {exc}") from exc
        self._rid = itertools.count(1)
        self.backlog: list[dict[str, Any]] = []  # messages received while waiting for a reply
        self.ever_connected = False
        self.refused = False  # a connection attempt was refused before any succeeded
        self.auth_failed = False  # the CURVE handshake failed: the other side is not of this deployment
        self.lost: str | None = None  # why the connection is gone, once it is

    # -- liveness -------------------------------------------------------------------------------------------
    def watch(self) -> str | None:
        """Drain the monitor without blocking; returns why the connection is lost, or None."""
        while self.lost is None:
            try:
                parsed = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
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
            elif event == zmq.EVENT_CONNECT_RETRIED and not self.ever_connected:
                self.refused = True
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and self.ever_connected:
                self.lost = (f"the connection to {self.address} dropped (owner process gone, or no heartbeat "
                             "answer within peer_timeout_s)")
        return self.lost

    def _raise_if_dead(self, what: str) -> None:
        if self.watch() is not None and self.auth_failed:
            raise PeerAuthError(f"{self.lost} (while waiting for {what})")
        if self.lost is not None:
            raise PeerLostError(f"{self.lost} while waiting for {what}; reconnect with engine.connect(address)")
        if self.refused:
            raise PeerUnreachableError(f"{self.address} refused the connection while waiting for {what}: is the "
                                       "owner running and serving (engine.serve()) on that host and port?")

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
        except zmq.ZMQError as exc:  # a full queue to a peer that stopped reading, or a closed socket
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
