"""The token-exact next prompt (``kvshuttle.router.token_ids``): the kept prompt and answer ids stay the prefix,
only what follows the answer is rendered; every way it must fall back says why.

A toy tokenizer (greedy longest match over a small vocabulary with "hello" and also "hel" + "lo") shows the
problem the path solves: a decode that emitted "hel", "lo" gets "hello" back from a re-render."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvshuttle.router import token_ids as tx
from kvshuttle.router.token_ids import KeptTurn, Message, next_prompt

SPECIALS = ("<|im_start|>", "<|im_end|>", "</s>")
WORDS = ("hello", "hel", "lo", " world", "wor", "ld", "assistant", "user", "system", "\n\n", "<think>", "</think>")


class ToyCodec:
    """Specials first, then the longest vocabulary word, else one character (id 1000 + code point)."""

    def __init__(self) -> None:
        self.vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
        self.text = {i: t for t, i in self.vocab.items()}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            match = next((t for t in SPECIALS if text.startswith(t, i)), None)
            if match is None:
                match = max((w for w in WORDS if text.startswith(w, i)), key=len, default=None)
            if match is None:
                ids.append(1000 + ord(text[i]))
                i += 1
            else:
                ids.append(self.vocab[match])
                i += len(match)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.text[i] if i in self.text else chr(i - 1000) for i in ids)

    def visible(self, ids: Sequence[int]) -> str:
        return self.decode([i for i in ids if self.text.get(i) not in SPECIALS])


def chatml(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def qwen3_like(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """Earlier answers lose their think block; the generation prompt carries an empty one (thinking off)."""
    body = "".join(f"<|im_start|>{m['role']}\n{str(m['content']).split('</think>')[-1].lstrip()}<|im_end|>\n"
                   for m in messages)
    return body + ("<|im_start|>assistant\n<think>\n\n</think>\n\n" if add_generation_prompt else "")


def plain(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """The e2e tiny model's shape: no control tokens, the stop token never rendered."""
    body = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return body + ("assistant: " if add_generation_prompt else "")


CODEC = ToyCodec()
EOS = {"chatml": CODEC.vocab["<|im_end|>"], "plain": CODEC.vocab["</s>"]}


def first_turn(render: tx.Render, answer_ids: list[int], user: str = "hello world") -> tuple[KeptTurn, list[Message]]:
    messages: list[Message] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": user}]
    prompt = CODEC.encode(render(messages, True))
    text = CODEC.visible(answer_ids)
    kept = KeptTurn(tuple(messages), tuple(prompt), tuple(answer_ids), text)
    return kept, [*messages, {"role": "assistant", "content": text}]


def non_canonical() -> list[int]:
    v = CODEC.vocab
    return [v["hel"], v["lo"], v[" world"], EOS["chatml"]]  # the canonical ids of "hello world" are hello, " world"


def test_a_re_render_loses_a_non_canonical_answer_and_the_exact_path_keeps_it() -> None:
    kept, messages = first_turn(chatml, non_canonical())
    messages.append({"role": "user", "content": "more"})
    rerendered = CODEC.encode(chatml(messages, True))
    assert tuple(rerendered[:len(kept.ids)]) != kept.ids  # the problem: "hel" "lo" came back as "hello"
    built = next_prompt(kept, messages, CODEC, chatml)
    assert built.exact and built.matches_template and built.kept == len(kept.ids)
    assert built.ids[:built.kept] == kept.ids
    assert CODEC.decode(built.ids) == chatml(messages, True)  # the model sees the template's text
    assert built.ids[built.kept:] == tuple(CODEC.encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"))


def test_three_turns_stay_a_prefix_of_each_other() -> None:
    v = CODEC.vocab
    kept, messages = first_turn(chatml, non_canonical())
    for answer in ([v["wor"], v["ld"], EOS["chatml"]], [v["hel"], 1000 + ord("p"), EOS["chatml"]]):
        messages.append({"role": "user", "content": "again"})
        built = next_prompt(kept, messages, CODEC, chatml)
        assert built.exact and built.ids[:len(kept.ids)] == kept.ids
        text = CODEC.visible(answer)
        kept = KeptTurn(tuple(messages), built.ids, tuple(answer), text)
        messages.append({"role": "assistant", "content": text})
    assert CODEC.decode(kept.ids) == chatml(messages, False).removesuffix("\n")


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_always_verify(seed: int) -> None:
    rng = random.Random(seed)
    pool = [CODEC.vocab[w] for w in WORDS if "<" not in w] + [1000 + ord(c) for c in "abc xyz.!é😊"]
    answer = [rng.choice(pool) for _ in range(rng.randint(1, 40))] + [EOS["chatml"]]
    kept, messages = first_turn(chatml, answer)
    messages.append({"role": "user", "content": rng.choice(["hello", "", " world\n"])})
    built = next_prompt(kept, messages, CODEC, chatml)
    assert built.exact and built.ids[:len(kept.ids)] == kept.ids
    assert CODEC.decode(built.ids) == chatml(messages, True)


def test_a_template_that_rewrites_history_falls_back_when_strict_and_keeps_the_ids_when_not() -> None:
    kept, messages = first_turn(qwen3_like, non_canonical())
    messages.append({"role": "user", "content": "more"})
    strict = next_prompt(kept, messages, CODEC, qwen3_like)
    assert strict.reason == tx.TEMPLATE_REWRITES and strict.ids == ()
    lenient = next_prompt(kept, messages, CODEC, qwen3_like, strict=False)
    assert lenient.exact and not lenient.matches_template and lenient.ids[:len(kept.ids)] == kept.ids


def test_a_stop_token_the_template_never_renders_is_left_out() -> None:
    v = CODEC.vocab
    answer = [v["hel"], v["lo"], EOS["plain"]]
    kept, messages = first_turn(plain, answer)
    messages.append({"role": "user", "content": "ok"})
    built = next_prompt(kept, messages, CODEC, plain)
    assert built.exact and built.kept == len(kept.prompt_ids) + 2
    assert built.ids[:built.kept] == kept.prompt_ids + tuple(answer[:2])
    assert CODEC.decode(built.ids) == plain(messages, True)


@pytest.mark.parametrize("edit", ["user", "answer", "tool_calls", "dropped"])
def test_an_edited_history_falls_back(edit: str) -> None:
    kept, messages = first_turn(chatml, non_canonical())
    if edit == "user":
        messages[1] = {"role": "user", "content": "hello there"}
    elif edit == "answer":
        messages[-1] = {"role": "assistant", "content": "hello  world"}
    elif edit == "tool_calls":
        messages[-1] = {**messages[-1], "tool_calls": [{"id": "1", "type": "function"}]}
    else:
        messages.pop()
    messages.append({"role": "user", "content": "more"})
    assert next_prompt(kept, messages, CODEC, chatml).reason == tx.HISTORY_EDITED


def test_nothing_new_and_a_lost_answer_are_named() -> None:
    kept, messages = first_turn(chatml, non_canonical())
    assert next_prompt(kept, messages, CODEC, chatml).reason == tx.NO_NEW_MESSAGES
    messages.append({"role": "user", "content": "more"})

    def drops_answers(msgs: Sequence[Message], gen: bool) -> str:
        return chatml([m for m in msgs if m["role"] != "assistant"], gen)

    assert next_prompt(kept, messages, CODEC, drops_answers).reason == tx.SENTINEL_LOST


def test_answer_ids_that_do_not_spell_the_sent_text_fall_back() -> None:
    v = CODEC.vocab
    kept, messages = first_turn(chatml, [v["wor"], v["ld"], EOS["chatml"]])
    # the router kept ids whose text is not what the client was sent (a broken detokenization, a truncation)
    kept = KeptTurn(kept.messages, kept.prompt_ids, (v["hel"], EOS["chatml"]), kept.answer_text)
    messages.append({"role": "user", "content": "more"})
    assert next_prompt(kept, messages, CODEC, chatml).reason == tx.ANSWER_END_MISMATCH
