"""The side channel: ZMQ ROUTER (owner) / DEALER (reader) sockets carrying msgpack maps.

The owner runs one server thread. It answers requests (handshake, ping, pack, release, abort) through a
handler, and forwards messages that worker threads emit (``chunk ready``) to the reader that asked. ZMQ
sockets are not thread-safe: each socket here lives in exactly one thread; worker threads hand their
messages to the server thread over an ``inproc`` PUSH/PULL pair.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from .errors import PeerUnreachableError, ProtocolError
from .wire import decode, encode

log = logging.getLogger(__name__)

Handler = Callable[[bytes, dict[str, Any]], "dict[str, Any] | None"]
_ids = itertools.count()


class SideChannelServer:
    """A ROUTER socket on ``tcp://host:port`` served by one daemon thread (port 0: a free port)."""

    def __init__(self, context: zmq.Context[Any], host: str, port: int, handler: Handler) -> None:
        self._context = context
        self._handler = handler
        self._stop = threading.Event()
        self._events_address = f"inproc://kvshuttle-events-{id(self)}-{next(_ids)}"
        self._router = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if port == 0:
                port = self._router.bind_to_random_port(f"tcp://{host}")
            else:
                self._router.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._router.close()
            raise OSError(f"cannot bind the kvshuttle side channel on {host}:{port}: {exc} "
                          "(port in use? pass port=0 to pick a free one)") from exc
        self.host, self.port = host, port
        self._events = context.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(self._events_address)
        self._thread = threading.Thread(target=self._serve, name=f"kvshuttle-side-{port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def emitter(self) -> Emitter:
        """A sender for one worker thread (create it in that thread; close it there)."""
        return Emitter(self._context, self._events_address)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

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


class Connection:
    """A DEALER socket to one owner, used by one thread: requests with timeouts, and a message stream."""

    def __init__(self, context: zmq.Context[Any], address: str) -> None:
        self.address = address
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IMMEDIATE, 0)
        self._socket.connect(address)
        self._rid = itertools.count(1)
        self.backlog: list[dict[str, Any]] = []  # messages received while waiting for a reply

    def send(self, message: dict[str, Any]) -> None:
        self._socket.send(encode(message), zmq.NOBLOCK)

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next message (backlog first), or None after ``timeout`` seconds."""
        if self.backlog:
            return self.backlog.pop(0)
        if self._socket.poll(max(0, int(timeout * 1000))) == 0:
            return None
        return decode(self._socket.recv())

    def request(self, message: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
        """Send and wait for the reply with the same request id; PeerUnreachableError after timeout."""
        rid = next(self._rid)
        self.send({**message, "rid": rid})
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._socket.poll(int(left * 1000) + 1) == 0:
                raise PeerUnreachableError(
                    f"no answer to {what} from {self.address} within {timeout:.1f} s: is the owner running "
                    "and serving (engine.serve()) on that host and port?"
                )
            reply = decode(self._socket.recv())
            if reply.get("rid") == rid:
                return reply
            self.backlog.append(reply)

    def close(self) -> None:
        self._socket.close(0)


class ConnectionLender(Protocol):
    """Lends idle connections to one owner (``engine.Peer``) so packed reads skip the TCP set-up."""

    def checkout(self, context: zmq.Context[Any]) -> Connection: ...

    def checkin(self, conn: Connection, healthy: bool) -> None: ...
