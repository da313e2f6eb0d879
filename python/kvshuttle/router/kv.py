"""The router's calls to a decode's kvshuttle side channel: take a streamed turn's handle, release or demote one.

Takes run on the router's event loop, without a thread: one authenticated DEALER socket per decode
(:class:`Channel`, ``zmq.asyncio``), shared by every take in flight on that loop, each request matched to its
reply by request id. The exchange is :func:`kvshuttle.transfer.control.ask_published`'s (the ``take_published``
op, polled every :data:`POLL_S` until found or ``timeout_s``), on the side channel's one client socket and its
liveness rules (:func:`~kvshuttle.transfer.side_channel.client_socket`, ``LinkWatch``, as the engine's
``Connection``): the socket's monitor and ZMTP heartbeats fail every take in flight at once when the decode's
process dies, freezes or refuses the connection, and a failed handshake (a decode of another deployment: the
CURVE handshake under the deployment secret) is a
:class:`~kvshuttle.transfer.errors.PeerAuthError`. A take that finds its kept channel lost (a decode that
restarted meanwhile) is tried once more on a fresh one. (An earlier version ran blocking takes in a thread
pool: the thread hop, the pool's polling and the GIL hand-offs cost more CPU than the exchange itself.)

Releases are rare and use :func:`~kvshuttle.transfer.control.release_retention` as is, in a small thread pool
of their own so a slow or dead decode never holds the event loop or the default executor; demotions
(``--demote-on-stop``, :func:`~kvshuttle.transfer.control.demote_retention`) share that pool. Imported lazily:
the router runs without pyzmq in front of vLLM's NixlConnector.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..trust import DeploymentSecret

#: (decode side-channel address, publish key, timeout_s) -> the published params, or None
Taker = Callable[[str, str, float], Awaitable["dict[str, Any] | None"]]
#: (the decode's params) -> whether the decode freed something
Releaser = Callable[[dict[str, Any]], Awaitable[bool]]
#: (the decode's params) -> whether the decode started moving them into its host tier (raises on a refusal)
Demoter = Callable[[dict[str, Any]], Awaitable[bool]]
POLL_S = 0.02  # between two asks while the decode has not published yet
MIN_ASK_S = 0.5  # the least one ask waits for its answer (as ask_published)


class SideChannelCalls:
    """The default taker, releaser and demoter; see the module docstring. ``close()`` drops everything.

    Takes belong to one event loop at a time: called from another loop (a new ``asyncio.run``), the channels
    of the previous one are dropped and new ones made."""

    def __init__(self, secret: DeploymentSecret, threads: int = 4) -> None:
        self._secret = secret
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # releases, demotions; made on first use
        self._channels: dict[str, Channel] = {}  # address -> the channel of self._loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: Any = None

    async def take(self, address: str, key: str, timeout_s: float) -> dict[str, Any] | None:
        from ..transfer.board import check_publish_key
        from ..transfer.errors import PeerLostError

        check_publish_key(key)
        channel, reused = self._channel(address)
        try:
            return await channel.ask_published(key, timeout_s)
        except PeerLostError:
            self._drop(address, channel)
            if not reused:
                raise
        # a kept channel to a decode that restarted meanwhile: once more on a fresh one
        channel, _ = self._channel(address)
        try:
            return await channel.ask_published(key, timeout_s)
        except PeerLostError:
            self._drop(address, channel)
            raise

    async def release(self, params: dict[str, Any]) -> bool:
        from ..transfer.control import release_retention

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads_pool(), lambda: release_retention(params, secret=self._secret))

    async def demote(self, params: dict[str, Any]) -> bool:
        from ..transfer.control import demote_retention

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads_pool(), lambda: demote_retention(params, secret=self._secret))

    def _threads_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._threads,
                                                               thread_name_prefix="kvshuttle-router-kv")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._close_channels()

    def _close_channels(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            channel.close()

    def _channel(self, address: str) -> tuple[Channel, bool]:
        """The live channel to ``address`` on the running loop (and whether it was kept), made when needed."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # the previous loop's sockets and tasks cannot serve this one (the thread
            self._close_channels()  # pool can: a release or demotion already under way keeps it)
            self._loop = loop
        channel = self._channels.get(address)
        if channel is not None and channel.lost is None:
            return channel, True
        if channel is not None:
            channel.close()
        if self._context is None:
            import zmq.asyncio

            self._context = zmq.asyncio.Context.instance()
        channel = self._channels[address] = Channel(self._context, address, self._secret)
        return channel, False

    def _drop(self, address: str, channel: Channel) -> None:
        if self._channels.get(address) is channel:
            del self._channels[address]
        channel.close()


class Channel:
    """One authenticated DEALER socket to one decode's side channel, on the running event loop.

    Requests in flight are futures by request id: a reader task completes them, a watcher task reads the
    socket's monitor and fails them all, with the reason, once the connection is lost (see the module
    docstring). Once lost, a channel stays lost: the caller makes a new one."""

    def __init__(self, context: Any, address: str, secret: DeploymentSecret, heartbeat_s: float = 0.5,
                 peer_timeout_s: float = 1.0) -> None:
        from ..transfer.side_channel import LinkWatch, client_socket

        self.address = address
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._rid = itertools.count(1)
        self.lost: BaseException | None = None  # why the channel is unusable, once it is
        self._closed = False
        # the side channel's one client socket and liveness rules, on this loop's asyncio context
        self._socket, self._monitor = client_socket(context, address, secret, heartbeat_s=heartbeat_s,
                                                    peer_timeout_s=peer_timeout_s)
        self.link = LinkWatch(address, secret.fingerprint)
        loop = asyncio.get_running_loop()
        self._tasks = (loop.create_task(self._read()), loop.create_task(self._watch()))

    async def ask_published(self, key: str, timeout_s: float) -> dict[str, Any] | None:
        """As :func:`kvshuttle.transfer.control.ask_published` (the key is checked by the caller)."""
        from ..transfer.control import published

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            reply = await self.request({"op": "take_published", "key": key},
                                       max(MIN_ASK_S, deadline - loop.time()), "take_published")
            found, params = published(self.address, reply)
            if found:
                return params
            if loop.time() + POLL_S > deadline:
                return None
            await asyncio.sleep(POLL_S)

    async def request(self, message: dict[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
        """Send ``message`` and wait up to ``timeout_s`` for the reply with its request id; the side channel's
        errors (PeerUnreachableError on no answer, PeerLostError, PeerAuthError) otherwise."""
        from ..transfer.wire import encode

        if self.lost is not None:
            raise self.lost
        rid = next(self._rid)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[rid] = reply
        timer = loop.call_later(timeout_s, self._expire, reply, what, timeout_s)
        try:
            await self._socket.send(encode({**message, "rid": rid}))
            return await reply
        finally:
            timer.cancel()
            self._pending.pop(rid, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.lost is None:
            from ..transfer.errors import PeerLostError

            self._fail(PeerLostError(f"the channel to {self.address} was closed"))
        for task in getattr(self, "_tasks", ()):
            task.cancel()
        with contextlib.suppress(Exception):  # a socket of a loop that is gone: nothing left to unregister
            self._socket.disable_monitor()
        for socket in (self._monitor, self._socket):
            with contextlib.suppress(Exception):
                socket.close(0)

    # -- internals ------------------------------------------------------------------------------------------
    def _expire(self, reply: asyncio.Future[dict[str, Any]], what: str, timeout_s: float) -> None:
        from ..transfer.errors import PeerUnreachableError

        if not reply.done():
            reply.set_exception(PeerUnreachableError(
                f"no answer to {what} from {self.address} within {timeout_s:.1f} s: is the owner running and "
                "serving (engine.serve()) on that host and port?"))

    def _fail(self, error: BaseException) -> None:
        """The channel is lost: every request in flight fails with ``error`` now, later ones at once."""
        if self.lost is None:
            self.lost = error
        pending, self._pending = self._pending, {}
        for reply in pending.values():
            if not reply.done():
                reply.set_exception(error)

    async def _read(self) -> None:
        from ..transfer.errors import PeerLostError, ProtocolError
        from ..transfer.wire import decode

        try:
            while self.lost is None:
                message = decode(await self._socket.recv())
                rid = message.get("rid")
                reply = self._pending.pop(rid, None) if type(rid) is int else None
                if reply is not None and not reply.done():
                    reply.set_result(message)
        except asyncio.CancelledError:
            self._fail(PeerLostError(f"the channel to {self.address} was closed"))
            raise
        except ProtocolError as exc:  # an undecodable reply: no telling whose it was
            self._fail(exc)
        except Exception as exc:  # the socket was closed under the reader (close(), a loop shutting down)
            self._fail(PeerLostError(f"the channel to {self.address} failed: {type(exc).__name__}"))

    async def _watch(self) -> None:
        """The side channel's liveness rules (:class:`~kvshuttle.transfer.side_channel.LinkWatch`), applied as
        the monitor's events arrive: the first error fails every request in flight."""
        from ..transfer.errors import PeerLostError

        try:
            while self.lost is None:
                self.link.feed(await self._monitor.recv_multipart())
                error = self.link.error()
                if error is not None:
                    self._fail(error)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the monitor was closed under the watcher
            self._fail(PeerLostError(f"the channel to {self.address} failed: {type(exc).__name__}"))
