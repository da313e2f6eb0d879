"""Where a turn's conversation key comes from: the body field, or a header the client already sends.

Reuse needs the router to know which conversation a turn continues. Our own clients put ``conversation_id`` in the
body (or ``X-Conversation-Id``); the multi-turn clients people run send a session header of their own, and with none
of them recognised every turn recomputed. The router reads an ordered list of sources; the first present one wins.

| client | sends | source |
|---|---|---|
| kvshuttle's examples (OpenAI clients: ``extra_body``) | ``conversation_id`` in the body | ``body:conversation_id`` |
| | ``X-Conversation-Id`` | ``header:X-Conversation-Id`` |
| vLLM's multi-turn benchmark, kv-cache-tester | ``X-Session-ID`` | ``header:X-Session-ID`` |
| aiperf (its default session header) | ``X-Session-Affinity`` | ``header:X-Session-Affinity`` |
| Dynamo's clients | ``X-Dynamo-Session-ID`` | ``header:X-Dynamo-Session-ID`` |
| LMCache's multi-turn benchmark | ``x-user-id`` (one conversation per user there) | ``header:x-user-id`` |

A key from a header is as much the client's word as one in the body: it only picks which stored handle the turn
starts from, and that handle's blocks are read only where their digests match the prompt (an unrelated key costs a
refused read, never a wrong answer). Keys are per tenant, as before. Headers are matched case-insensitively (HTTP).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import KVShuttleError, shown

BODY_FIELD = "conversation_id"
# The body field first (what kvshuttle documents), then the headers of the clients in the table above.
DEFAULT_SOURCES = ("body:conversation_id", "header:X-Conversation-Id", "header:X-Session-ID",
                   "header:X-Session-Affinity", "header:X-Dynamo-Session-ID", "header:x-user-id")
MAX_SOURCES = 16
MAX_HEADER_CHARS = 64


class SessionKeyError(KVShuttleError, ValueError):
    """A session-key source that cannot be read (a router configuration error)."""


@dataclass(frozen=True)
class SessionKeySources:
    """The ordered places a conversation key is looked for: ``body:conversation_id`` or ``header:<name>``."""

    sources: tuple[str, ...] = DEFAULT_SOURCES

    def __post_init__(self) -> None:
        if not isinstance(self.sources, tuple) or not 0 < len(self.sources) <= MAX_SOURCES:
            raise SessionKeyError(f"session-key sources: 1..{MAX_SOURCES} of them, got {shown(self.sources)}")
        for source in self.sources:
            kind, _, name = source.partition(":") if isinstance(source, str) else ("", "", "")
            if kind == "body" and name == BODY_FIELD:
                continue
            if kind == "header" and 0 < len(name) <= MAX_HEADER_CHARS and _is_token(name):
                continue
            raise SessionKeyError(f"session-key source {shown(source)}: use 'body:{BODY_FIELD}' or 'header:NAME' "
                                  "(an HTTP header name)")
        if len({s.lower() for s in self.sources}) != len(self.sources):
            raise SessionKeyError(f"session-key sources name one place twice: {list(self.sources)}")

    @classmethod
    def parse(cls, text: str | Sequence[str] | None) -> SessionKeySources:
        """From the CLI (comma-separated) or a list; a bare header name means ``header:NAME``; None: the defaults."""
        if text is None:
            return cls()
        items = [s.strip() for s in text.split(",")] if isinstance(text, str) else [str(s).strip() for s in text]
        items = [s if s.startswith(("body:", "header:")) else f"header:{s}" for s in items if s]
        return cls(tuple(items))

    def pick(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[Any, str | None]:
        """``(raw key, source)`` from the first source present (the body field is taken out of ``body``'s view
        only by the caller), or ``(None, None)``. The raw key is not checked here: the caller validates it."""
        for source in self.sources:
            kind, _, name = source.partition(":")
            if kind == "body":
                if body.get(name) is not None:
                    return body[name], source
            else:
                value = headers.get(name)  # aiohttp's CIMultiDictProxy: case-insensitive
                if value is not None:
                    return value, source
        return None, None


def _is_token(name: str) -> bool:
    """An HTTP header field name (RFC 9110 token characters)."""
    return all(c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~") for c in name)
