"""A decode's server-sent events on their way to the client: whole events only, without ``kv_transfer_params``.

vLLM 0.33 puts a streamed answer's ``kv_transfer_params`` on its last chunk (inside the chunk's JSON object);
0.32 sends none on streams. :class:`EventFilter` cuts the byte stream at event boundaries, passes events
through untouched unless one names ``kv_transfer_params``, in which case that field is removed from the
event's JSON object and kept (:attr:`EventFilter.params`) for the router to validate and store, exactly as a
non-streamed answer's. An event naming it that is not a JSON object is dropped whole: a client never sees a
handle or a grant. The end marker (``data: [DONE]``) can be held back until the router has stored the turn's
handle, and only when one can come: the decode was asked to publish it (``hold_done``), or the stream carried it
(``hold_after_params``, once an event did); otherwise the end passes at once. Partial events wait for the rest
(bounded by ``max_event_bytes``: past it the backend is broken).
"""

from __future__ import annotations

import json
import re
from typing import Any

PARAMS_FIELD = "kv_transfer_params"
_MARKER = PARAMS_FIELD.encode()
DONE_EVENTS = (b"data: [DONE]\n\n", b"data: [DONE]\r\n\r\n", b"data:[DONE]\n\n")
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n")
_dumps = json.JSONEncoder(separators=(",", ":")).encode


class StreamFormatError(Exception):
    """The backend's stream is not server-sent events the router can pass on (an event past the size bound)."""


class EventFilter:
    """See the module docstring; ``feed`` returns what may go to the client now."""

    __slots__ = ("_hold_done", "_hold_params", "_max", "_pending", "dropped", "found", "held", "params")

    def __init__(self, hold_done: bool, max_event_bytes: int = 16 << 20, hold_after_params: bool = False) -> None:
        self._hold_done, self._hold_params, self._max = hold_done, hold_after_params, max_event_bytes
        self._pending = b""
        self.held = b""  # the end marker, when held back
        self.found = False  # whether some event carried kv_transfer_params
        self.params: Any = None  # the last such event's value
        self.dropped = 0  # events dropped for naming kv_transfer_params without being a JSON object

    def feed(self, data: bytes) -> bytes:
        buf = self._pending + data if self._pending else data
        end = _last_boundary(buf)
        if end < 0:
            if len(buf) > self._max:
                raise StreamFormatError(f"a server-sent event of more than {self._max} bytes")
            self._pending = buf
            return b""
        complete, self._pending = buf[:end], buf[end:]
        if len(self._pending) > self._max:
            raise StreamFormatError(f"a server-sent event of more than {self._max} bytes")
        if _MARKER in complete:
            complete = b"".join(self._clean(event) for event in split_events(complete))
        out, self.held = self.held + complete, b""  # bytes after a held end marker go on, in order
        if self._hold_done or (self._hold_params and self.found):
            for done in DONE_EVENTS:
                if out.endswith(done):
                    return self._hold(out, done)
        return out

    def finish(self) -> bytes:
        """What is left once the backend's stream ended: a last unterminated event (cleaned), never the held end."""
        rest, self._pending = self._pending, b""
        if rest and _MARKER in rest:
            rest = self._clean(rest)
        return rest

    def _hold(self, out: bytes, done: bytes) -> bytes:
        self.held = done
        return out[:-len(done)]

    def _clean(self, event: bytes) -> bytes:
        if _MARKER not in event:
            return event
        body, end = split_end(event)
        lines = body.splitlines()
        data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
        try:
            chunk = json.loads(b"\n".join(data)) if data else None
        except (ValueError, RecursionError):
            chunk = None
        if not isinstance(chunk, dict):
            self.dropped += 1  # names the field but is no JSON object: nothing of it may reach the client
            return b""
        if PARAMS_FIELD not in chunk:  # the name inside a string (a model wrote it): nothing to take
            return event
        self.found, self.params = True, chunk.pop(PARAMS_FIELD)
        others = [line for line in lines if not line.startswith(b"data:")]
        return b"".join(line + b"\n" for line in others) + b"data: " + _dumps(chunk).encode() + (end or b"\n\n")


def _last_boundary(buf: bytes) -> int:
    """The offset just past the last event boundary in ``buf``, or -1."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1)


def split_events(block: bytes) -> list[bytes]:
    """Whole events (each with its boundary) of a block that ends at a boundary."""
    events, start = [], 0
    for match in _BOUNDARY.finditer(block):
        events.append(block[start:match.end()])
        start = match.end()
    if start < len(block):
        events.append(block[start:])
    return events


def split_end(event: bytes) -> tuple[bytes, bytes]:
    for end in (b"\r\n\r\n", b"\n\n"):
        if event.endswith(end):
            return event[:-len(end)], end
    return event, b""
