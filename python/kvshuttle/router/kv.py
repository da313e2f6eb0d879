"""The router's calls to a decode's kvshuttle side channel: take a streamed turn's handle, release one.

Blocking ZMQ exchanges, run in a thread pool of their own so a slow or dead decode never holds the event loop
or the default executor. Imported lazily: the router runs without pyzmq in front of vLLM's NixlConnector.

Takes use :func:`kvshuttle.transfer.control.ask_published` (the ``take_published`` op, polled until found or
``timeout_s``) over connections kept per decode: one take per streamed turn, and a fresh connection
(socket, monitor, ZMTP handshake) costs about three times the CPU of the exchange itself. Releases are rare
and use :func:`~kvshuttle.transfer.control.release_retention` as is. Every call authenticates with the
deployment secret (the side channel's CURVE handshake; a decode of another deployment is not reached).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..trust import DeploymentSecret

#: (decode side-channel address, publish key, timeout_s) -> the published params, or None
Taker = Callable[[str, str, float], Awaitable["dict[str, Any] | None"]]
#: (the decode's params) -> whether the decode freed something
Releaser = Callable[[dict[str, Any]], Awaitable[bool]]
POLL_S = 0.02  # between two asks while the decode has not published yet


class SideChannelCalls:
    """The default taker and releaser; see the module docstring. Thread-safe; ``close()`` drops everything."""

    def __init__(self, secret: DeploymentSecret, threads: int = 32, idle_per_address: int = 32) -> None:
        self._secret = secret
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kvshuttle-router-kv")
        self._idle: dict[str, list[Any]] = {}  # address -> idle Connections (each used by one thread at a time)
        self._lock = threading.Lock()
        self._idle_max = idle_per_address

    async def take(self, address: str, key: str, timeout_s: float) -> dict[str, Any] | None:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._take, address, key, timeout_s)

    async def release(self, params: dict[str, Any]) -> bool:
        from ..transfer.control import release_retention

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: release_retention(params, secret=self._secret))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    # -- blocking side (pool threads) -----------------------------------------------------------------------
    def _take(self, address: str, key: str, timeout_s: float) -> dict[str, Any] | None:
        from ..transfer.board import check_publish_key
        from ..transfer.errors import PeerLostError

        check_publish_key(key)
        conn, reused = self._checkout(address)
        try:
            return self._ask(conn, address, key, timeout_s)
        except PeerLostError:
            conn.close()
            if not reused:
                raise
        # a kept connection to a decode that restarted meanwhile: once more on a fresh one
        conn, _ = self._checkout(address, fresh=True)
        return self._ask(conn, address, key, timeout_s)

    def _ask(self, conn: Any, address: str, key: str, timeout_s: float) -> dict[str, Any] | None:
        from ..transfer.control import ask_published

        try:
            params = ask_published(conn, key, timeout_s, POLL_S)
        except BaseException:
            conn.close()
            raise
        self._checkin(address, conn)
        return params

    def _checkout(self, address: str, fresh: bool = False) -> tuple[Any, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(address)
                if idle:
                    return idle.pop(), True
        import zmq

        from ..transfer.side_channel import Connection

        return Connection(zmq.Context.instance(), address, secret=self._secret), False

    def _checkin(self, address: str, conn: Any) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self._idle_max and conn.lost is None:
                idle.append(conn)
                return
        conn.close()
