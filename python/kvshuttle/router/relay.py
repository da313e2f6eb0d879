"""Answering a client that may be slow, gone or hostile: every write bounded in time, errors without internals.

A client that stops reading a streamed answer would otherwise block the router's write forever (once the
socket buffers are full), and with it the turn's admission slot and its decode stream. :func:`write` raises
:class:`ClientSlow` when one write takes longer than the router's ``client_write_timeout_s``,
:class:`ClientGone` when the connection is closed; :func:`cut` then drops the client's connection.
:func:`guard` answers an unexpected error with a plain 500: exception text may hold a secret.

A step that cannot wait on the client (little enough buffered for it that asyncio cannot pause the writer) runs
without a timer: a streamed turn makes a dozen writes, and a timer (and, on Python 3.10, a task) per write is
CPU spent guarding against what cannot happen. :class:`StreamAnswer` sends its headers with the first bytes
of its body, and :func:`finish` the last bytes with the end of the answer: one socket write each, not two.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

log = logging.getLogger("kvshuttle.router")
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SMALL = 16 << 10  # a write that leaves this little buffered cannot block (asyncio pauses writers at 64 KiB)
_dumps = json.JSONEncoder(separators=(",", ":")).encode


class ClientGone(Exception):
    """Internal: the client closed its connection mid-answer."""


class ClientSlow(Exception):
    """Internal: the client did not take a write within the write timeout (it stopped reading)."""


class StreamAnswer(web.StreamResponse):
    """A streamed answer whose headers go out with its first body bytes (as aiohttp's own ``web.Response``)."""

    _send_headers_immediately = False


async def bounded(step: Awaitable[T], timeout_s: float) -> T:
    """``step`` within ``timeout_s``: ClientSlow past it, ClientGone when the connection is closed."""
    try:
        if _timeout is not None:  # Python >= 3.11: a deadline on this task, no task of its own
            async with _timeout(timeout_s):
                return await step
        return await asyncio.wait_for(step, timeout_s)
    except asyncio.TimeoutError:
        raise ClientSlow from None
    except (ConnectionResetError, RuntimeError) as exc:  # aiohttp's ClientConnectionResetError is both kinds
        raise ClientGone from exc


_timeout = getattr(asyncio, "timeout", None)


def _cannot_wait(client: web.Request, size: int) -> bool:
    """Whether writing ``size`` more bytes leaves so little buffered that the write cannot wait on the client."""
    transport = client.transport
    return transport is not None and transport.get_write_buffer_size() + size <= SMALL


async def _unbounded(step: Awaitable[T]) -> T:
    try:
        return await step
    except (ConnectionResetError, RuntimeError) as exc:
        raise ClientGone from exc


async def write(client: web.Request, out: web.StreamResponse, chunk: bytes, timeout_s: float) -> None:
    """Write ``chunk`` to the client; see the module docstring."""
    if not chunk:
        return
    if _cannot_wait(client, len(chunk)):  # the common case: nothing backed up (no timer needed)
        await _unbounded(out.write(chunk))
        return
    await bounded(out.write(chunk), timeout_s)


async def prepare(client: web.Request, out: web.StreamResponse, timeout_s: float) -> None:
    """Start the answer (its headers), bounded like a write."""
    if _cannot_wait(client, SMALL // 4):  # headers: well under a quarter of SMALL
        await _unbounded(out.prepare(client))
        return
    await bounded(out.prepare(client), timeout_s)


async def finish(client: web.Request, out: web.StreamResponse, last: bytes, timeout_s: float) -> None:
    """Write ``last`` (may be empty) and end the answer, in one write, bounded like a write."""
    if _cannot_wait(client, len(last) + SMALL // 4):
        await _unbounded(out.write_eof(last))
        return
    await bounded(out.write_eof(last), timeout_s)


async def send(client: web.Request, status: int, body: bytes, content_type: str, timeout_s: float
               ) -> tuple[web.StreamResponse, type[Exception] | None]:
    """A whole answer, written with :func:`write`'s bound, and what stopped it (ClientSlow, ClientGone; the
    client is cut then) or None."""
    out = web.StreamResponse(status=status, headers={"Content-Type": content_type})
    out.content_length = len(body)
    try:
        await prepare(client, out, timeout_s)
        await write(client, out, body, timeout_s)
        await finish(client, out, b"", timeout_s)
    except (ClientGone, ClientSlow) as exc:
        cut(client)
        return out, type(exc)
    return out, None


def cut(client: web.Request) -> None:
    """Drop the client's connection now (whatever is still buffered for it is discarded)."""
    transport = client.transport
    if transport is not None:
        transport.abort()


def error_event(message: str, kind: str = "backend_error", code: int = 502) -> bytes:
    """An SSE error event and the end marker: the OpenAI clients raise on it, never taking a cut answer as whole."""
    error: dict[str, Any] = {"error": {"message": message, "type": kind, "code": code}}
    return b"data: " + _dumps(error).encode() + b"\n\ndata: [DONE]\n\n"


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    """An OpenAI-style error body (what the official clients parse)."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An unexpected error is logged (secrets masked) and answered 500 without its text (it may hold one)."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception:
        log.exception("router: unexpected error handling %s %s", request.method, request.path)
        return error_response(500, "internal router error (see the router's log)", "internal_error")
