"""A handle board: an owner publishes a finished request's ``kv_transfer_params`` under a key its router chose,
and the router takes them over the owner's side channel once the answer's stream has ended.

Why: vLLM's HTTP server puts ``kv_transfer_params`` only on non-streaming responses, so a router streaming the
decode's answer to its client never sees the decode's handle. The router sends a random
``kvshuttle_publish_key`` with the decode request; the decode's connector publishes the handle (or an explicit
"nothing retained") under it; the router takes them with :func:`kvshuttle.transfer.control.take_published`.

Entries are taken once, expire after ``ttl_s`` and the board holds at most ``max_entries`` (oldest dropped
first), so an unclaimed publication never grows the owner's memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..errors import shown
from .errors import TransferArgumentError

PUBLISH_KEY = "kvshuttle_publish_key"  # the field a router adds to a request's kv_transfer_params
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
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise TransferArgumentError(f"ttl_s and max_entries must be positive, got {ttl_s}, {max_entries}")
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[str, tuple[float, dict[str, Any] | None]] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped = 0  # publications expired or pushed out before anyone took them

    def put(self, key: str, params: dict[str, Any] | None) -> None:
        """Publish ``params`` under ``key`` (None: the request finished and nothing was retained)."""
        check_publish_key(key)
        with self._lock:
            self._sweep()
            self._entries.pop(key, None)
            self._entries[key] = (self._clock() + self.ttl_s, params)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.dropped += 1

    def take(self, key: str) -> tuple[bool, dict[str, Any] | None]:
        """(found, params); a found entry is removed."""
        with self._lock:
            self._sweep()
            entry = self._entries.pop(key, None)
        return (False, None) if entry is None else (True, entry[1])

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._entries)

    def _sweep(self) -> None:
        now = self._clock()
        while self._entries:
            key, (deadline, _) = next(iter(self._entries.items()))
            if deadline > now:
                break
            del self._entries[key]
            self.dropped += 1


def serve_take(board: HandleBoard | None, message: dict[str, Any]) -> dict[str, Any]:
    """The owner's answer to ``take_published``."""
    try:
        key = check_publish_key(message.get("key"))
    except TransferArgumentError as exc:
        return {"op": "error", "kind": "protocol", "message": str(exc)}
    found, params = board.take(key) if board is not None else (False, None)
    return {"op": "published", "found": found, "kv_transfer_params": params}
