"""A handle board: an owner publishes a finished request's ``kv_transfer_params`` under a key its router chose,
and the router takes them over the owner's side channel once the answer's stream has ended.

Why: vLLM's HTTP server puts ``kv_transfer_params`` only on non-streaming responses, so a router streaming the
decode's answer to its client never sees the decode's handle. The router sends a random
``kvshuttle_publish_key`` with the decode request; the decode's connector publishes the handle (or an explicit
"nothing retained") under it; the router takes them with :func:`kvshuttle.transfer.control.take_published`.

Entries are taken once, expire after ``ttl_s`` and the board holds at most ``max_entries`` (oldest dropped
first), so an unclaimed publication never grows the owner's memory. A handle nobody took (the router's take
failed or timed out, the router died) can never be named by a next turn: ``on_unclaimed`` hears of each one
dropped, and the connector ends its retention then instead of holding the blocks to the handle's TTL.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import shown
from ..params import PUBLISH_KEY
from .errors import TransferArgumentError

__all__ = ["MAX_KEY_LENGTH", "PUBLISH_KEY", "HandleBoard", "check_publish_key", "serve_take"]
MAX_KEY_LENGTH = 128


def check_publish_key(key: object) -> str:
    """The key when it is a non-empty printable string of at most 128 characters; TransferArgumentError else."""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH or not key.isprintable():
        raise TransferArgumentError(f"a publish key is a printable string of 1..{MAX_KEY_LENGTH} characters, "
                                    f"got {shown(key)}")
    return key


class HandleBoard:
    """Publications by key: ``put`` by the owner's connector, ``take`` (once) by a router. Thread-safe."""

    def __init__(self, ttl_s: float = 60.0, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic,
                 on_unclaimed: Callable[[dict[str, Any]], None] | None = None) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise TransferArgumentError(f"ttl_s and max_entries must be positive, got {ttl_s}, {max_entries}")
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self.on_unclaimed = on_unclaimed  # called (outside the lock) with each dropped entry's params
        self._entries: OrderedDict[str, tuple[float, dict[str, Any] | None]] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped = 0  # publications expired or pushed out before anyone took them

    def put(self, key: str, params: dict[str, Any] | None) -> None:
        """Publish ``params`` under ``key`` (None: the request finished and nothing was retained)."""
        check_publish_key(key)
        with self._swept() as dropped:
            replaced = self._entries.pop(key, None)
            if replaced is not None and replaced[1] != params:  # a key is used once: the first handle is orphaned
                dropped.append(replaced[1])
            self._entries[key] = (self._clock() + self.ttl_s, params)
            while len(self._entries) > self.max_entries:
                dropped.append(self._entries.popitem(last=False)[1][1])

    def take(self, key: str) -> tuple[bool, dict[str, Any] | None]:
        """(found, params); a found entry is removed."""
        with self._swept():
            entry = self._entries.pop(key, None)
        return (False, None) if entry is None else (True, entry[1])

    def sweep(self) -> int:
        """Drop the expired entries now (the connector calls it every step, so an idle board lets go too)."""
        with self._swept() as dropped:
            pass
        return len(dropped)

    def __len__(self) -> int:
        with self._swept():
            return len(self._entries)

    @contextlib.contextmanager
    def _swept(self) -> Iterator[list[dict[str, Any] | None]]:
        """Under the lock with the expired entries dropped (the body may drop more); reported after it."""
        with self._lock:
            dropped = self._sweep()
            try:
                yield dropped
            finally:
                self.dropped += len(dropped)
        if self.on_unclaimed is not None:
            for params in dropped:
                if params is not None:
                    self.on_unclaimed(params)

    def _sweep(self) -> list[dict[str, Any] | None]:
        now, dropped = self._clock(), []
        while self._entries:
            key, (deadline, params) = next(iter(self._entries.items()))
            if deadline > now:
                break
            del self._entries[key]
            dropped.append(params)
        return dropped


def serve_take(board: HandleBoard | None, message: dict[str, Any]) -> dict[str, Any]:
    """The owner's answer to ``take_published``."""
    try:
        key = check_publish_key(message.get("key"))
    except TransferArgumentError as exc:
        return {"op": "error", "kind": "protocol", "message": str(exc)}
    found, params = board.take(key) if board is not None else (False, None)
    return {"op": "published", "found": found, "kv_transfer_params": params}
