"""Answering a client that may be slow, gone or hostile: every write bounded in time, errors without internals.

A client that stops reading a streamed answer would otherwise block the router's write forever (once the
socket buffers are full), and with it the turn's admission slot and its decode stream. :func:`write` raises
:class:`ClientSlow` when one write takes longer than the router's ``client_write_timeout_s``,
:class:`ClientGone` when the connection is closed; :func:`cut` then drops the client's connection.
:func:`guard` answers an unexpected error with a plain 500: exception text may hold a secret.
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


async def bounded(step: Awaitable[T], timeout_s: float) -> T:
    """``step`` within ``timeout_s``: ClientSlow past it, ClientGone when the connection is closed."""
    try:
        return await asyncio.wait_for(step, timeout_s)
    except asyncio.TimeoutError:
        raise ClientSlow from None
    except (ConnectionResetError, RuntimeError) as exc:  # aiohttp's ClientConnectionResetError is both kinds
        raise ClientGone from exc


async def write(client: web.Request, out: web.StreamResponse, chunk: bytes, timeout_s: float) -> None:
    """Write ``chunk`` to the client; see the module docstring."""
    if not chunk:
        return
    transport = client.transport
    if transport is not None and transport.get_write_buffer_size() + len(chunk) <= SMALL:
        try:  # the common case: nothing backed up, so the write cannot wait (no timer needed)
            await out.write(chunk)
        except (ConnectionResetError, RuntimeError) as exc:
            raise ClientGone from exc
        return
    await bounded(out.write(chunk), timeout_s)


async def send(client: web.Request, status: int, body: bytes, content_type: str, timeout_s: float
               ) -> tuple[web.StreamResponse, type[Exception] | None]:
    """A whole answer, written with :func:`write`'s bound, and what stopped it (ClientSlow, ClientGone; the
    client is cut then) or None."""
    out = web.StreamResponse(status=status, headers={"Content-Type": content_type})
    out.content_length = len(body)
    try:
        await bounded(out.prepare(client), timeout_s)
        await write(client, out, body, timeout_s)
        await bounded(out.write_eof(), timeout_s)
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
