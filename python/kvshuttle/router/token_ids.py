"""The token-exact next prompt: the conversation's kept token ids plus only the new messages, rendered.

Why: the decode's answer blocks verify only when the next prompt carries the very ids the decode generated. The
OpenAI chat path re-renders the answer as text and re-tokenizes it, and a model that emitted a non-canonical split
(or a template that rewrites earlier turns) then changes every block from the answer on
(``kvshuttle bench retokenize`` measures how often). Keeping ``prompt ids + answer ids`` and appending the
template's rendering of what follows the answer makes those blocks verify by construction.

What follows the answer is found with a sentinel: the conversation is rendered with the answer's content replaced
by a string no template changes, and the text after the sentinel is the template's closing of the answer turn,
the new messages and the generation prompt. Nothing here tokenizes with a particular library: the caller passes
an ``encode``/``decode`` pair and a ``render`` (the chat template) so the router can wrap whatever it loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

#: One OpenAI chat message (``role``, ``content``, maybe ``tool_calls`` ...), as the client sent it.
Message = Mapping[str, Any]
#: The chat template: (messages, add_generation_prompt) -> the prompt text vLLM would tokenize.
Render = Callable[[Sequence[Message], bool], str]
#: Stands for the answer's content while the template renders: no whitespace, no markup a template strips.
SENTINEL = "KVSHUTTLE\u2063ANSWER\u2063SENTINEL"

# Why a conversation falls back to a full re-render (the answer's blocks then verify only if it re-tokenizes the
# same): named so the router can count them.
HISTORY_EDITED = "history_edited"  # the client's messages are not the kept history + the kept answer
NO_NEW_MESSAGES = "no_new_messages"  # nothing after the answer: there is no next prompt to build
SENTINEL_LOST = "sentinel_lost"  # the template dropped or repeated the answer's content
ANSWER_END_MISMATCH = "answer_end_mismatch"  # the answer's ids end in text the template does not close it with
TEMPLATE_REWRITES = "template_rewrites"  # strict: the template renders the kept turns differently now
EXACT = "exact"


class TokenCodec(Protocol):
    """The served model's tokenizer as the chat path uses it: no BOS added, special tokens as text both ways."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class KeptTurn:
    """What the router keeps after a turn: the messages the prompt was rendered from, its ids, the answer."""

    messages: tuple[Message, ...]
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # as the decode generated them, the stop token included when it was sampled
    answer_text: str  # the content the client was sent (vLLM: the ids decoded without special tokens)

    @property
    def ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.answer_ids


@dataclass(frozen=True)
class NextPrompt:
    """The next turn's prompt ids, or why the router should render the whole conversation instead."""

    reason: str  # EXACT, or one of the fallback reasons above
    ids: tuple[int, ...] = ()  # empty on a fallback
    kept: int = 0  # how many leading ids are the kept turn's prompt and answer (less a stop token left out)
    # The ids decode to exactly the text the template renders for the whole conversation (only token boundaries
    # may differ); False where the template rewrites kept turns (Qwen3 drops earlier turns' thinking).
    matches_template: bool = False

    @property
    def exact(self) -> bool:
        return self.reason == EXACT


def next_prompt(kept: KeptTurn, messages: Sequence[Message], codec: TokenCodec, render: Render, *,
                strict: bool = True) -> NextPrompt:
    """The prompt ids for ``messages`` (the client's whole conversation) that keep ``kept.ids`` as their prefix.

    ``strict`` falls back (``TEMPLATE_REWRITES``) when the kept ids' text is not what the template renders for
    those turns now: the model would otherwise see a history the template would not show it (the cost: every
    such turn re-renders). Without it the kept ids stay, and ``matches_template`` says the text differs.
    """
    n = len(kept.messages)
    answer = messages[n] if len(messages) > n else None
    if (tuple(messages[:n]) != kept.messages or answer is None or answer.get("role") != "assistant"
            or answer.get("content") != kept.answer_text or _extra_keys(answer)):
        return NextPrompt(HISTORY_EDITED)
    new = list(messages[n + 1:])
    if not new:
        return NextPrompt(NO_NEW_MESSAGES)
    with_sentinel = render([*kept.messages, {"role": "assistant", "content": SENTINEL}, *new], True)
    if with_sentinel.count(SENTINEL) != 1:
        return NextPrompt(SENTINEL_LOST)
    head, tail = with_sentinel.split(SENTINEL)
    # What the answer's ids add after its content (the stop token's text, e.g. "<|im_end|>") must be how the
    # template closes the turn; the rest of the tail is appended as new ids.
    answer_ids = kept.answer_ids
    spoken = codec.decode(answer_ids)
    if not spoken.startswith(kept.answer_text):
        return NextPrompt(ANSWER_END_MISMATCH)
    extra = spoken[len(kept.answer_text):]
    if not tail.startswith(extra):
        # A stop token the template does not close the turn with (a plain "role: content" template): it was
        # sampled last, never fed to the model, so it has no KV either; the template's closing replaces it.
        if not answer_ids or codec.decode(answer_ids[:-1]) != kept.answer_text:
            return NextPrompt(ANSWER_END_MISMATCH)
        answer_ids, extra = answer_ids[:-1], ""
    glue = tail[len(extra):]
    full = render(messages, True)
    same_text = codec.decode(kept.prompt_ids) == head and full == head + kept.answer_text + tail
    if strict and not same_text:
        return NextPrompt(TEMPLATE_REWRITES)
    prefix = kept.prompt_ids + answer_ids
    return NextPrompt(EXACT, prefix + tuple(codec.encode(glue)), len(prefix), same_text)


def _extra_keys(answer: Message) -> bool:
    # An assistant message with tool calls or reasoning is rendered from more than its content: the sentinel
    # stands only for the content, so such a turn re-renders (tool calls travel as the template formats them).
    return any(answer.get(key) for key in answer if key not in ("role", "content"))
