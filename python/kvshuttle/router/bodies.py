"""Client request bodies in, backend error bodies out: everything the router reads from a client is bounded
and checked before a turn takes an admission slot.

* :func:`read_body` reads the whole body with a size cap (413) and a deadline for the whole read (408): a
  client trickling its body costs a connection, never a slot (a body already all there is read without a
  timer);
* :func:`parse_body` turns it into a JSON object or a :class:`BadRequest` (400) for any malformed shape:
  invalid UTF-8, not JSON, NaN / Infinity or numbers no JSON peer can read back, nesting deeper than
  :data:`MAX_DEPTH`, a top level that is not an object, ``stream`` not a bool, ``messages`` not a list of
  objects, ``prompt`` neither a string nor a list, a ``conversation_id`` that is not a short printable string
  (the fields the router reads; the rest is the backends' to check);
* :func:`client_error_body` keeps a backend's error body from showing a client anything of the KV plumbing
  (vLLM's validation errors may echo the request, ``kv_transfer_params``, handle and grant included).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .handles import valid_id

MAX_DEPTH = 64  # nesting of arrays and objects; OpenAI bodies (tools' JSON schemas included) need far less
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# What only the router and its backends may see; a backend body naming any of it is not shown to a client.
PRIVATE_MARKERS = (b"kv_transfer_params", b"kvshuttle_", b"remote_block_ids", b"remote_engine_id", b"remote_host",
                   b"do_remote_decode", b"do_remote_prefill")


class BadRequest(Exception):
    """A client request the router refuses: ``status`` (400, 408, 413, 415, 429, 503), a message safe to show and
    the error body's ``type`` (``kind``)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


async def read_body(request: web.Request, max_bytes: int, timeout_s: float,
                    take: Callable[[bytes], None] | None = None) -> bytes:
    """The whole request body; BadRequest 413 past ``max_bytes``, 408 when not all there within ``timeout_s``.
    ``take(chunk)`` sees every chunk as it arrives (and may refuse the body by raising BadRequest)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BadRequest(415, f"Content-Encoding {encoding[:32]!r} is not accepted; send the body uncompressed")
    length = request.content_length
    if length is not None and length > max_bytes:
        raise BadRequest(413, f"the request body is {length} bytes; the limit is {max_bytes}")

    async def read() -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = await request.content.readany()
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > max_bytes:
                raise BadRequest(413, f"the request body is over the limit of {max_bytes} bytes")
            if take is not None:
                take(chunk)
            chunks.append(chunk)

    try:
        if request.content.is_eof():  # all of it is here already (the common case): no read can wait
            return await read()
        return await asyncio.wait_for(read(), timeout_s)
    except BadRequest:
        raise
    except asyncio.TimeoutError:
        raise BadRequest(408, f"the request body did not arrive within {timeout_s:g} s") from None
    except Exception:  # aiohttp's payload errors (a bad chunked encoding, a cut-off body), a reset connection
        raise BadRequest(400, "the request body could not be read (malformed or cut off)") from None


class _Unusable(ValueError):
    """Raised by the decoder's hooks: a number no JSON peer can read back."""


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Unusable(f"the number {text[:24]} does not fit a double")
    return value


def _parse_constant(name: str) -> Any:
    raise _Unusable(f"{name} is not JSON")


# Integers stay on the C path (a prompt may be 100k token ids); Python refuses ints of over 4300 digits itself.
_decoder = json.JSONDecoder(parse_float=_parse_float, parse_constant=_parse_constant)


def _too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether arrays and objects nest deeper than ``limit`` (iterative: no recursion limit to hit)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_json(raw: bytes) -> Any:
    """Strict JSON (RFC 8259: UTF-8, no NaN or Infinity) of bounded depth; BadRequest 400 otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(400, f"the request body is not UTF-8 (invalid byte at offset {exc.start})") from None
    try:
        value = _decoder.decode(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(400, f"the request body is not JSON: {exc.msg} at offset {exc.pos}") from None
    except RecursionError:
        raise BadRequest(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except _Unusable as exc:
        raise BadRequest(400, f"the request body is not usable JSON: {exc}") from None
    except ValueError:  # Python's own bound on int literals (4300 digits)
        raise BadRequest(400, "the request body is not usable JSON: an integer of too many digits") from None
    if isinstance(value, (dict, list)) and (raw.count(b"[") + raw.count(b"{") > MAX_DEPTH) and _too_deep(value):
        raise BadRequest(400, f"the request body nests deeper than {MAX_DEPTH} levels")
    return value


def parse_body(raw: bytes, endpoint: str) -> dict[str, Any]:
    """The client's request as a JSON object whose fields the router touches have the right types."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest(400, f"the request body must be a JSON object, not {_kind(body)}")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise BadRequest(400, f"stream must be true or false, not {_kind(body['stream'])}")
    conversation = body.get("conversation_id")
    if conversation is not None and valid_id(conversation) is None:
        raise BadRequest(400, "conversation_id must be a printable string of 1..256 characters")
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest(400, "messages must be a list of message objects")
    elif endpoint == COMPLETIONS and "prompt" in body and not isinstance(body["prompt"], (str, list)):
        raise BadRequest(400, f"prompt must be a string or a list, not {_kind(body['prompt'])}")
    return body


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> bytes:
    """An OpenAI-style error object (what the official clients parse)."""
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def client_error_body(data: bytes, status: int) -> bytes:
    """A backend's error body as a client may see it: as is, unless it names the router's KV plumbing."""
    if any(marker in data for marker in PRIVATE_MARKERS):
        return error_body(status, f"the backend refused the request (HTTP {status}); its message is not shown "
                                  "because it echoed routing parameters", "backend_error")
    return data
