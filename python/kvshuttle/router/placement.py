"""Where a turn is computed: on a prefill (reading the conversation back from its decode, or recomputing it), or
straight on the decode that holds the conversation ("decode-local": no prefill and no transfer at all).

A decode that holds a conversation's KV (retained for its handle, and in its own prefix cache) computes a short
follow-up from that cache faster than a prefill can read the history back: NVIDIA Dynamo's "conditional
disaggregation". The router does not tokenize, so "short" is an estimate over the turn's new messages (those after
the last assistant message): their text's UTF-8 bytes / 4, plus a few tokens of chat template per message. It
errs towards the regular path: a turn with non-text content, or a completions prompt (whose new part the router
cannot tell), is never decode-local.
"""

from __future__ import annotations

from typing import Any, Literal

from .bodies import CHAT

#: What computed a turn (the ``choice`` label of ``kvshuttle_router_placements_total`` and the turn's log line).
Placement = Literal["decode_local", "reverse_read", "recompute"]
PLACEMENTS: tuple[Placement, ...] = ("decode_local", "reverse_read", "recompute")
BYTES_PER_TOKEN = 4  # a typical BPE tokenizer on English text; code and other scripts take more tokens
TEMPLATE_TOKENS = 8  # a chat template's role markers and separators per message


def new_tokens_estimate(endpoint: str, body: dict[str, Any]) -> int | None:
    """About how many tokens a chat turn adds after its last assistant message; None when it cannot be told
    (not chat, no assistant message yet, or content that is not plain text)."""
    if endpoint != CHAT:
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
               default=None)
    if last is None:
        return None
    total = 0
    for message in messages[last + 1:]:
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


def decode_local(max_tokens: int, endpoint: str, body: dict[str, Any]) -> int | None:
    """The turn's new-token estimate when it is short enough to compute on its decode (``max_tokens`` > 0),
    else None."""
    if max_tokens <= 0:
        return None
    estimate = new_tokens_estimate(endpoint, body)
    return estimate if estimate is not None and estimate <= max_tokens else None
