"""A decode's retention let go by the router: a deleted conversation's, a handle a turn left unused or
superseded, one the store dropped at a bound. Quietly (a dead decode frees the blocks at its TTL anyway), and
off the turn's path where the turn need not wait for it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .kv import Releaser
from .metrics import RouterMetrics
from .store import StoredHandle

log = logging.getLogger("kvshuttle.router")


class Releases:
    """``now`` (awaited) and ``later`` (a task of its own, kept referenced until done); ``close`` cancels those
    still running."""

    def __init__(self, release: Releaser, metrics: RouterMetrics) -> None:
        self._release = release
        self._metrics = metrics
        self._later: set[asyncio.Task[Any]] = set()

    async def now(self, entry: StoredHandle) -> bool:
        """Release ``entry``'s retention on its decode; whether the decode freed something (False on failure)."""
        try:
            released = await self._release(entry.params)
        except Exception as exc:  # a dead decode frees the blocks at its TTL anyway
            log.info("router: release on %s failed: %s: %s", entry.decode, type(exc).__name__, exc)
            self._metrics.releases.labels("failed").inc()
            return False
        self._metrics.releases.labels("released" if released else "gone").inc()
        return released

    def later(self, entry: StoredHandle) -> None:
        """:meth:`now`, after the turn and off its path (needs the running event loop)."""
        task = asyncio.get_running_loop().create_task(self.now(entry))
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def close(self) -> None:
        """Cancel the releases still running and wait for them to end."""
        tasks = list(self._later)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
