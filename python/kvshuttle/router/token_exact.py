"""The token-exact path (``--token-exact TOKENIZER_DIR``): a chat turn's prompt built from the ids the decode
generated, so the decode's answer blocks verify on the next turn's prefill.

Through ``/v1/chat/completions`` a client re-sends the answer as text; vLLM re-renders the template and
re-tokenizes it, and a different split (or a template that renders the kept turns differently) changes every block
from the answer on: the prefill's digest check refuses them and recomputes. With this option the router asks the
decode for ``return_token_ids``, keeps a bounded :class:`~.token_ids.KeptTurn` (the messages, the prompt ids, the
answer's ids and text, all from the decode's response, never from a client) next to the conversation's handle, and
on the next turn sends :func:`~.token_ids.next_prompt`'s ids as ``kv_transfer_params.prompt_token_ids`` to the
prefill and the decode (vLLM uses them instead of rendering the messages). Anything else (no kept turn, an edited
history, a request the router cannot render as vLLM does, a tokenizer or template error, a turn too long to keep)
falls back to the plain path, counted in ``kvshuttle_router_token_exact_total{outcome}``; never an error.

``tokenizers`` and ``jinja2`` (the ``token-exact`` extra) are imported only when the option is on.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import logging
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import token_ids
from .errors import RouterConfigError
from .sse import split_end, split_events
from .token_ids import KeptTurn, Message

log = logging.getLogger("kvshuttle.router")
_dumps = json.JSONEncoder(separators=(",", ":")).encode

# Router-side outcomes beside token_ids' reasons (EXACT and the fallbacks), for the counter's label.
NO_KEPT_TURN = "no_kept_turn"  # the conversation has no kept turn (its first turn, or the last one was not kept)
UNSUPPORTED = "unsupported_request"  # tools, a client template, non-text content...: vLLM renders it otherwise
ERROR = "error"  # the tokenizer or the template failed on this conversation
OUTCOMES = (token_ids.EXACT, token_ids.HISTORY_EDITED, token_ids.NO_NEW_MESSAGES, token_ids.SENTINEL_LOST,
            token_ids.ANSWER_END_MISMATCH, token_ids.TEMPLATE_REWRITES, NO_KEPT_TURN, UNSUPPORTED, ERROR)
# What became of a turn's answer: kept for the next turn, or why not.
KEPT = "kept"
KEEPS = (KEPT, "oversized", "no_ids", "unusable", "mismatch")
# Body fields that make vLLM render the prompt differently from the template alone (or several prompts).
RENDER_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "documents", "continue_final_message", "echo",
                 "mm_processor_kwargs", "prompt_embeds")
MESSAGE_KEYS = frozenset(("role", "content"))
ROLES = frozenset(("system", "user", "assistant", "developer"))
BYTES_PER_TOKEN = 16  # a kept turn's bound in bytes per token of its bound (ids ~5.3 B base64, text ~4 B)


class ChatCodec:
    """The served model's tokenizer and chat template as vLLM's chat path uses them: the template rendered with
    Hugging Face's settings, its text encoded without BOS (``add_special_tokens`` is False for chat), ids decoded
    with special tokens as text."""

    def __init__(self, tokenizer: Any, template: str, specials: dict[str, str]) -> None:
        from jinja2.ext import loopcontrols  # type: ignore[import-not-found, unused-ignore]
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # type: ignore[import-not-found, unused-ignore]

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        def tojson(x: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

        # what transformers gives a template (vLLM renders with it): these two filters/globals and loopcontrols
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(template)
        self._tokenizer = tokenizer
        self._specials = specials

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return str(self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._specials))


def load_codec(path: str | Path) -> ChatCodec:
    """A Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json`` with ``chat_template``, or
    a ``chat_template.jinja``) as a :class:`ChatCodec`; RouterConfigError says what is missing."""
    where = Path(path)
    try:
        import jinja2  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
        import tokenizers  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        raise RouterConfigError("--token-exact needs the tokenizers and jinja2 packages: "
                                "pip install 'kvshuttle[token-exact]'") from None
    try:
        config = json.loads((where / "tokenizer_config.json").read_text(encoding="utf-8"))
        tokenizer = tokenizers.Tokenizer.from_file(str(where / "tokenizer.json"))
    except (OSError, ValueError, Exception) as exc:  # tokenizers raises its own Exception subclass
        raise RouterConfigError(f"--token-exact {where}: cannot load tokenizer.json and tokenizer_config.json "
                                f"({type(exc).__name__})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # several named templates: vLLM's default is the one named "default"
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if (not isinstance(template, str) or not template) and (where / "chat_template.jinja").is_file():
        template = (where / "chat_template.jinja").read_text(encoding="utf-8")  # transformers' newer layout
    if not isinstance(template, str) or not template:
        raise RouterConfigError(f"--token-exact {where}: no chat_template in tokenizer_config.json or "
                                "chat_template.jinja")

    def special(key: str) -> str:
        value = config.get(key) or ""
        return str(value.get("content", "") if isinstance(value, dict) else value)

    try:
        return ChatCodec(tokenizer, template, {k: special(k) for k in ("bos_token", "eos_token", "unk_token",
                                                                       "pad_token")})
    except Exception as exc:  # a template jinja2 cannot compile
        raise RouterConfigError(f"--token-exact {where}: the chat template does not compile: {exc}") from None


@dataclass
class ExactTurn:
    """One chat turn on the token-exact path: what was sent, and the ids collected from the decode's answer."""

    messages: list[Any]  # the client's messages (what the prompt was rendered from, or built for)
    client_ids: bool  # the client asked for return_token_ids itself: its answer keeps them
    send: tuple[int, ...] | None = None  # the prompt ids sent to prefill and decode (an exact next prompt)
    prompt_ids: list[int] | None = None
    answer_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    usable: bool = True  # one choice, text only, within bounds: what can be kept
    overflow: bool = False
    kept: bool = False  # stored with the handle (TokenExact.keep)

    def take(self, chunk: dict[str, Any], streamed: bool, limit: int) -> None:
        """Collect (and unless the client asked, remove) the ids of one answer or stream chunk."""
        prompt = chunk.get("prompt_token_ids") if self.client_ids else chunk.pop("prompt_token_ids", None)
        if prompt is not None:
            self.prompt_ids = prompt if _ids(prompt) else None
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                self.usable = False
                continue
            ids = choice.get("token_ids") if self.client_ids else choice.pop("token_ids", None)
            if choice.get("index", 0) != 0:
                self.usable = False
                continue
            message = choice.get("delta" if streamed else "message")
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(message, dict) and any(message.get(k) for k in message if k not in ("role", "content")):
                self.usable = False  # tool calls or reasoning: the next turn renders more than the content
            if self.overflow or not self.usable:
                continue  # nothing of this turn will be kept: collect no more
            if ids is None:
                if content:
                    self.usable = False  # text without its ids: the kept ids would not spell it
            elif not _ids(ids):
                self.usable = False
            elif len(self.answer_ids) + len(ids) > limit:
                self.overflow = True
            else:
                self.answer_ids.extend(ids)
            if isinstance(content, str):
                self.text.append(content)


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(x) is int and 0 <= x < 1 << 31 for x in value)


class IdsTap:
    """A streamed answer's whole events (an :class:`~.sse.EventFilter`'s output) on their way to the client: each
    chunk's ids collected into ``turn`` and, unless the client asked for them, removed."""

    def __init__(self, turn: ExactTurn, limit: int) -> None:
        self._turn, self._limit = turn, limit

    def feed(self, data: bytes) -> bytes:
        if not data:
            return data
        return b"".join(self._event(event) for event in split_events(data))

    def _event(self, event: bytes) -> bytes:
        body, end = split_end(event)
        lines = body.splitlines()
        data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
        if not data or data == [b"[DONE]"]:
            return event
        try:
            chunk = json.loads(b"\n".join(data))
        except (ValueError, RecursionError):
            chunk = None
        if not isinstance(chunk, dict):
            self._turn.usable = False
            return event
        self._turn.take(chunk, True, self._limit)
        if self._turn.client_ids:
            return event
        others = [line for line in lines if not line.startswith(b"data:")]
        return b"".join(line + b"\n" for line in others) + b"data: " + _dumps(chunk).encode() + (end or b"\n\n")


def kept_json(kept: KeptTurn) -> str:
    """A kept turn as stored with the handle: ids as little-endian uint32, base64 (a quarter of JSON's size)."""
    return _dumps({"m": list(kept.messages), "p": _pack(kept.prompt_ids), "a": _pack(kept.answer_ids),
                   "t": kept.answer_text})


def kept_from_json(text: str) -> KeptTurn | None:
    """The kept turn of a stored entry, or None when it is unreadable (then the turn takes the plain path)."""
    try:
        data = json.loads(text)
        messages = tuple(data["m"])
        if not all(isinstance(m, dict) for m in messages) or not isinstance(data["t"], str):
            return None
        return KeptTurn(messages, _unpack(data["p"]), _unpack(data["a"]), data["t"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


def _pack(ids: Sequence[int]) -> str:
    raw = array("I", ids)
    if sys.byteorder != "little":
        raw.byteswap()
    return base64.b64encode(raw.tobytes()).decode()


def _unpack(text: str) -> tuple[int, ...]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise ValueError("kept ids are not whole uint32s")
    ids = array("I")
    ids.frombytes(raw)
    if sys.byteorder != "little":
        ids.byteswap()
    return tuple(ids)


def renderable(body: dict[str, Any]) -> bool:
    """Whether vLLM renders this chat request from its messages and the template alone, as the router can: text
    messages of plain roles, one choice, none of the fields that change the rendering."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or any(body.get(k) is not None for k in RENDER_FIELDS):
        return False
    if body.get("add_generation_prompt", True) is not True or body.get("add_special_tokens", False) is not False:
        return False
    if body.get("n", 1) not in (1, None):
        return False
    return all(isinstance(m, dict) and m.keys() <= MESSAGE_KEYS and m.get("role") in ROLES
               and isinstance(m.get("content"), str) for m in messages)


class TokenExact:
    """The router's token-exact collaborator (see the module docstring). ``count(outcome)`` and ``kept(outcome)``:
    the metrics' children; ``max_tokens``: the longest conversation (prompt and answer ids) kept."""

    def __init__(self, codec: ChatCodec, max_tokens: int, strict: bool, count: Any, kept: Any) -> None:
        self.codec, self.max_tokens, self.strict = codec, max_tokens, strict
        self.max_bytes = max(64 << 10, BYTES_PER_TOKEN * max_tokens)
        self._count, self._kept = count, kept

    async def prepare(self, body: dict[str, Any], stored: str | None) -> ExactTurn | None:
        """This turn's state: None when the request cannot take the path (nothing asked, nothing kept); else the
        ids to send when the kept turn gives an exact next prompt. Never raises."""
        if not renderable(body):
            self._count(UNSUPPORTED)
            return None
        turn = ExactTurn(list(body["messages"]), body.get("return_token_ids") is True)
        kept = kept_from_json(stored) if stored is not None else None
        if kept is None:
            self._count(NO_KEPT_TURN)
            return turn
        try:  # off the event loop: two renders and a decode of the whole conversation
            found = await asyncio.to_thread(token_ids.next_prompt, kept, turn.messages, self.codec,
                                            self.codec.render, strict=self.strict)
        except Exception as exc:  # a template's raise_exception, a tokenizer error: the plain path
            log.info("router: token-exact prompt failed, rendering as usual: %s", type(exc).__name__)
            self._count(ERROR)
            return turn
        self._count(found.reason)
        if found.exact:
            turn.send = found.ids
        return turn

    def _renders_as_served(self, messages: list[Any], prompt_ids: list[int]) -> bool:
        return self.codec.encode(self.codec.render(messages, True)) == prompt_ids

    def warm_ids(self, turn: ExactTurn) -> list[int] | None:
        """What a pre-warm computes on the token-exact path: the turn's prompt and answer ids but the last (a stop
        token the next prompt may leave out), a prefix of the next exact prompt; None when nothing was kept."""
        if not turn.kept or turn.prompt_ids is None:
            return None
        return turn.prompt_ids + turn.answer_ids[:-1]

    async def keep(self, turn: ExactTurn) -> str | None:
        """The kept turn to store with the decode's handle (JSON), or None (counted). Kept only when the decode's
        prompt ids are what this router would have sent: its ids on an exact turn, else its own rendering (a
        tokenizer or template other than the served model's is found here, before any id of it is sent)."""
        if not turn.usable:
            self._kept("unusable")
            return None
        if turn.prompt_ids is None or not turn.answer_ids:
            self._kept("no_ids")
            return None
        if turn.overflow or len(turn.prompt_ids) + len(turn.answer_ids) > self.max_tokens:
            self._kept("oversized")
            return None
        if turn.send is not None:
            same = turn.prompt_ids == list(turn.send)
        else:
            try:  # off the event loop: a render and an encoding of the whole conversation
                same = await asyncio.to_thread(self._renders_as_served, turn.messages, turn.prompt_ids)
            except Exception:  # the template raised on it: nothing the router could build on
                same = False
        if not same:
            self._kept("mismatch")
            return None
        text = kept_json(KeptTurn(tuple(turn.messages), tuple(turn.prompt_ids), tuple(turn.answer_ids),
                                  "".join(turn.text)))
        if len(text) > self.max_bytes:
            self._kept("oversized")
            return None
        self._kept(KEPT)
        turn.kept = True
        return text
