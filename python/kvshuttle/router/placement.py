"""Where a turn is computed: on a prefill (reading the conversation back from its decode, or recomputing it), or
straight on the decode that holds the conversation ("decode-local": no prefill and no transfer at all).

A decode that holds a conversation's KV (retained for its handle, and in its own prefix cache) computes a short
follow-up from that cache faster than a prefill can read the history back: NVIDIA Dynamo's "conditional
disaggregation". The router does not tokenize, so "short" is an estimate over the turn's new messages: their
text's UTF-8 bytes / 4, plus a few tokens of chat template per message. Which messages are new is decided by what
the router itself saw, never by the client's word: the stored handle carries a :func:`history_mark` (digests of
the last turn's messages and of the answer the decode gave), and only what follows that exact history counts as
new. A client that rewrote its history (a huge message before a fabricated assistant turn) matches no mark and
goes through a prefill. It errs towards the regular path: a turn with non-text content, a history the router did
not see, or a completions prompt (whose new part the router cannot tell), is never decode-local.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from .bodies import CHAT

#: What computed a turn (the ``choice`` label of ``kvshuttle_router_placements_total`` and the turn's log line).
Placement = Literal["decode_local", "reverse_read", "recompute"]
PLACEMENTS: tuple[Placement, ...] = ("decode_local", "reverse_read", "recompute")
BYTES_PER_TOKEN = 4  # a typical BPE tokenizer on English text; code and other scripts take more tokens
TEMPLATE_TOKENS = 8  # a chat template's role markers and separators per message


def _digest(items: list[str]) -> str:
    raw = b"".join(len(b).to_bytes(8, "big") + b for b in (i.encode("utf-8", "surrogatepass") for i in items))
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def _canonical(messages: list[Any]) -> str:
    return _digest([json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=False) for m in messages])


def history_mark(messages: Any, answer: str | None) -> str | None:
    """What the decode holds after a chat turn, as the router saw it: ``count:digest(messages):digest(answer)``;
    None when it cannot be told (no messages, or an answer that is not plain text)."""
    if not isinstance(messages, list) or answer is None:
        return None
    return f"{len(messages)}:{_canonical(messages)}:{_digest([answer])}"


def new_tokens_estimate(endpoint: str, body: dict[str, Any], history: str | None) -> int | None:
    """About how many tokens a chat turn adds to ``history`` (the stored :func:`history_mark`); None when it
    cannot be told (not chat, no mark, a history that is not the one the router saw, content not plain text)."""
    if endpoint != CHAT or history is None:
        return None
    messages = body.get("messages")
    count_text, _, rest = history.partition(":")
    seen, _, answer = rest.partition(":")
    if not isinstance(messages, list) or not count_text.isdigit() or len(messages) <= int(count_text) + 1:
        return None
    count = int(count_text)
    reply = messages[count]
    if not isinstance(reply, dict) or reply.get("role") != "assistant":
        return None
    text = _text(reply.get("content"))
    if text is None or _digest([text]) != answer or _canonical(messages[:count]) != seen:
        return None  # not the history the decode holds: its prefix cache would not cover it
    total = 0
    for message in messages[count + 1:]:
        text = _text(message.get("content") if isinstance(message, dict) else None)
        if text is None:
            return None
        total += len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN + TEMPLATE_TOKENS
    return total if total else None


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def decode_local(max_tokens: int, endpoint: str, body: dict[str, Any], history: str | None) -> int | None:
    """The turn's new-token estimate when it is short enough to compute on its decode (``max_tokens`` > 0),
    else None."""
    if max_tokens <= 0:
        return None
    estimate = new_tokens_estimate(endpoint, body, history)
    return estimate if estimate is not None and estimate <= max_tokens else None
