"""``kvshuttle bench retokenize``: does the decode's answer survive the chat template, and the token-exact path.

Multi-turn chat the way vLLM's OpenAI server serves it: turn k's prompt is ``encode(render(messages, True))``;
the decode generates answer ids; the client sends the answer back as text (the ids decoded without special
tokens) and turn k+1's prompt re-renders everything. The decode holds KV for ``prompt_k + answer_k`` less the
last sampled token; a block of it verifies on turn k+1 only if every token up to its end equals the new prompt's
(the digest chain), so the longest common prefix, cut to whole blocks, is what a reverse read can bring back.

Answers come three ways, per chat of :mod:`.retokenize_chats`: ``canonical`` (the tokenizer's own ids of the
answer text: what greedy decoding of a trained model mostly emits), ``split`` (the same text with a share of
tokens emitted as two smaller vocabulary tokens: the non-canonical splits sampling produces now and then) and
``random`` (uniformly drawn ids: what the README's random-weight tiny model emits). Each is measured through the
re-render and through the token-exact path (:func:`kvshuttle.router.token_ids.next_prompt`), strict (falls
back where the template rewrites earlier turns) and lenient (keeps the ids anyway).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..router.token_ids import EXACT, KeptTurn, Message, next_prompt
from .retokenize_chats import CHATS, Chat
from .retokenize_tokenizers import NAMES, Served, load
from .schema import envelope

GENERATORS = ("canonical", "split", "random")
PATHS = ("rerender", "exact_strict", "exact_lenient")
CLOSING = "Thanks. One more question."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizers", default=",".join(NAMES),
                        help=f"comma-separated: {', '.join(NAMES)}, or a directory with tokenizer.json and a "
                             "tokenizer_config.json holding chat_template (packages missing: skipped)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--split-rate", type=float, default=0.02,
                        help="share of an answer's tokens the 'split' generator emits as two tokens")
    parser.add_argument("--seeds", type=int, default=3, help="runs of the sampled generators per chat")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvshuttle" / "retokenize",
                        help="where converted tokenizers are kept")


@dataclass
class Tally:
    """Counts over turn transitions (turn k's held KV against turn k+1's prompt) for one path."""

    transitions: int = 0
    survived: int = 0  # every held answer token is in the next prompt's common prefix
    answer_blocks: int = 0  # whole blocks holding answer tokens the decode has KV for
    answer_blocks_verified: int = 0
    prompt_blocks_lost: int = 0  # blocks of turn k's own prompt the next prompt no longer matches
    fallbacks: Counter[str] = field(default_factory=Counter)

    def row(self) -> dict[str, Any]:
        return {"transitions": self.transitions, "survived": self.survived,
                "survived_pct": round(100.0 * self.survived / max(1, self.transitions), 1),
                "answer_blocks": self.answer_blocks, "answer_blocks_verified": self.answer_blocks_verified,
                "prompt_blocks_lost": self.prompt_blocks_lost, "fallbacks": dict(self.fallbacks)}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def count(tally: Tally, prompt: Sequence[int], answer: Sequence[int], next_ids: Sequence[int], block: int) -> None:
    """Adds one transition: what of ``prompt + answer`` (KV held for all but the last token) ``next_ids`` keeps."""
    held = len(prompt) + len(answer) - 1
    lcp = min(common_prefix([*prompt, *answer], next_ids), held)
    verified, prompt_blocks = lcp // block, len(prompt) // block
    tally.transitions += 1
    tally.survived += lcp >= held
    tally.answer_blocks += held // block - prompt_blocks
    tally.answer_blocks_verified += max(0, verified - prompt_blocks)
    tally.prompt_blocks_lost += max(0, prompt_blocks - verified)


class Generator:
    """Answer ids for a reference answer text, the way one kind of decode would emit them."""

    def __init__(self, served: Served, kind: str, seed: int, split_rate: float) -> None:
        self.served, self.kind, self.rng, self.split_rate = served, kind, random.Random(seed), split_rate
        vocab = served.tokenizer.get_vocab()
        self.eos_id = served.tokenizer.token_to_id(served.eos)
        special = {t.content for t in served.tokenizer.get_added_tokens_decoder().values()}
        self.plain = sorted(i for t, i in vocab.items() if t not in special)
        self._splits: dict[int, list[tuple[int, int]]] = {}

    def answer(self, text: str) -> list[int]:
        ids = self.served.encode(text)
        if self.kind == "random":
            ids = [self.rng.choice(self.plain) for _ in ids]
        elif self.kind == "split":
            ids = [part for i in ids for part in self._maybe_split(i)]
        return [*ids, self.eos_id]

    def _maybe_split(self, i: int) -> tuple[int, ...]:
        if self.rng.random() >= self.split_rate:
            return (i,)
        options = self._splits.get(i)
        if options is None:  # the token's text as two tokens that decode to it (same bytes, other ids)
            tok, text = self.served.tokenizer, self.served.decode([i])
            options = []
            for k in range(1, len(text)):
                left, right = tok.token_to_id(_spelled(tok, text[:k])), tok.token_to_id(_spelled(tok, text[k:]))
                if left is not None and right is not None:
                    options.append((left, right))
            self._splits[i] = options
        return self.rng.choice(options) if options else (i,)


def _spelled(tok: Any, text: str) -> str:
    # The vocabulary entry for ``text`` when it is one token (byte-level vocabularies spell bytes as characters).
    ids = tok.encode(text, add_special_tokens=False).ids
    return str(tok.id_to_token(ids[0])) if len(ids) == 1 else "\x00"


def simulate(served: Served, chat: Chat, gen: Generator, tallies: dict[str, Tally], block: int) -> None:
    """One chat through every path; answers are generated once per turn and shared by the paths."""
    system, turns = chat
    base: list[Message] = [{"role": "system", "content": system}] if system else []
    answers = [gen.answer(text) for _, text in turns]
    users = [user for user, _ in turns] + [CLOSING]  # the closing turn measures the last answer too
    for path in PATHS:
        messages, kept = list(base), None
        for k, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            ids: Sequence[int] = served.encode(served.render(messages, True))
            if kept is not None:
                ids = _next(path, kept, messages, served, ids, tallies[path])
                count(tallies[path], kept.prompt_ids, kept.answer_ids, ids, block)
            if k == len(turns):
                break
            answer_ids = answers[k]
            text = served.visible(answer_ids)
            kept = KeptTurn(tuple(messages), tuple(ids), tuple(answer_ids), text)
            messages.append({"role": "assistant", "content": text})


def _next(path: str, kept: KeptTurn, messages: list[Message], served: Served, rerendered: Sequence[int],
          tally: Tally) -> Sequence[int]:
    if path == "rerender":
        return rerendered
    built = next_prompt(kept, messages, served, served.render, strict=path == "exact_strict")
    if built.reason != EXACT:
        tally.fallbacks[built.reason] += 1
        return rerendered
    return built.ids


def template_notes(served: Served) -> list[str]:
    """What the template does to an answer between turns, found by rendering one (empty when nothing)."""
    notes = []
    answer = "\nfirst line\n"
    one = [{"role": "user", "content": "q"}]
    prompt = served.render(one, True)
    two = served.render([*one, {"role": "assistant", "content": answer}, {"role": "user", "content": "r"}], True)
    if not two.startswith(prompt + answer):
        shared = len(_shared(prompt + answer, two))
        notes.append("the next turn does not render the answer right after the generation prompt "
                     f"({(prompt + answer)[shared:][:24]!r} becomes {two[shared:][:24]!r})")
    if answer not in two:
        notes.append("the answer's content is changed when it is rendered as history")
    thought = served.render([*one, {"role": "assistant", "content": "<think>\nw\n</think>\n\nok"},
                             {"role": "user", "content": "r"}], True)
    if "w\n</think>" not in thought:
        notes.append("an earlier turn's thinking is dropped from the history")
    return notes


def _shared(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in [n.strip() for n in args.tokenizers.split(",") if n.strip()]:
        try:
            served = load(name, args.cache)
        except ImportError as exc:
            skipped[name] = f"not installed: {exc.name}"
            continue
        notes = template_notes(served)
        for kind in GENERATORS:
            tallies = {path: Tally() for path in PATHS}
            for seed in range(1 if kind == "canonical" else args.seeds):
                gen = Generator(served, kind, seed, args.split_rate)
                for chat in CHATS:
                    simulate(served, chat, gen, tallies, args.block_size)
            results.append({"tokenizer": name, "answers": kind, "template_notes": notes,
                            **{path: tallies[path].row() for path in PATHS}})
    note = (f"{len(CHATS)} built-in chats; turn k's held KV (prompt + answer less its last token) against turn "
            f"k+1's prompt in blocks of {args.block_size}; skipped: {skipped or 'none'}")
    return envelope("retokenize", args, add_arguments, results, note=note, started=started,
                    summary={"skipped": skipped})


def format_table(result: dict[str, Any]) -> str:
    head = (f"{'tokenizer':<12} {'answers':<9} {'turns':>5} {'survive %':>9} {'re-render':>13} "
            f"{'exact':>13} {'lenient':>13} {'prompt lost':>11}  fallbacks (exact)")
    lines = [head, "-" * len(head)]

    def share(t: dict[str, Any]) -> str:
        return f"{t['answer_blocks_verified']}/{t['answer_blocks']}"

    for r in result["results"]:
        re_, st, le = r["rerender"], r["exact_strict"], r["exact_lenient"]
        lines.append(f"{r['tokenizer']:<12} {r['answers']:<9} {re_['transitions']:>5} {re_['survived_pct']:>9} "
                     f"{share(re_):>13} {share(st):>13} {share(le):>13} "
                     f"{re_['prompt_blocks_lost']:>11}  {st['fallbacks'] or '-'}")
    seen = set()
    for r in result["results"]:
        if r["template_notes"] and r["tokenizer"] not in seen:
            seen.add(r["tokenizer"])
            lines.append(f"{r['tokenizer']}: " + "; ".join(r["template_notes"]))
    lines.append(result["note"])
    return "\n".join(lines)
