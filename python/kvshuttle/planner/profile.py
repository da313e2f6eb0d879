"""Cost profiles: what a prefill, a reverse read and a decode cost on one deployment.

A :class:`CostProfile` is a handful of numbers:

* **KV bytes per token** (all layers, K and V, one copy of the model's KV), from a model shape
  (:class:`ModelShape`: layers x KV heads x head dim x dtype bytes x 2) or given; ``block_size`` tokens per KV
  block (reads move whole blocks).
* **Tensor parallelism**: ``tp_size`` ranks (default 1) on both prefill and decode, the KV split over them by KV
  heads as vLLM splits it: each rank holds ``max(1, kv_heads // tp_size)`` of the ``kv_heads`` heads, so ranks
  outnumbering the heads replicate them, and MLA (one latent per token and layer, ``kv_heads`` 1) is replicated
  on every rank. Per rank: ``kv_bytes_per_token * max(1, kv_heads // tp_size) / kv_heads`` bytes per token
  (:attr:`CostProfile.rank_kv_bytes_per_token`); ``kv_heads`` 0 (unknown, e.g. a profile given bytes per token
  without a model shape) splits evenly, ``kv_bytes_per_token / tp_size``. Bytes moved and bytes retained count
  every rank's copy (per rank x ``tp_size``: :meth:`CostProfile.block_bytes`).
* **Transfer**: ``transfer_overhead_s + rank bytes / bandwidth_bytes_per_s`` per reverse read: every rank reads
  its own shard over its own link at the same time, so ``bandwidth_bytes_per_s`` is per rank (per link), not the
  sum over the ranks (at ``tp_size`` 1 the two are the same).
* **Prefill**: ``prefill_fixed_s + work / prefill_tokens_per_s`` where computing ``new`` tokens after ``context``
  tokens already in the cache is ``work = new + attention_ratio * new * (context + new / 2)`` token-equivalents:
  the linear part (projections, MLP) per token plus attention over every earlier token. ``attention_ratio`` is
  attention's work per (query, key) pair in units of one token's linear work: ``4 * layers * q_heads * head_dim /
  (2 * params)`` from a model shape (:meth:`ModelShape.attention_ratio`), or fitted.
* **Layer-pipelined loads** (``kvshuttle_load_mode="layered"``): with ``num_layers`` L > 1 the read of each layer
  overlaps the compute of the layers before it. Read R (one rank's bytes / bandwidth) and suffix compute C split
  evenly over the layers; layer i computes once its KV landed and layer i - 1 computed, so the pair costs
  ``transfer_overhead_s + max(R + C / L, R / L + C) + L * layer_overhead_s`` (:meth:`CostProfile.layered_s`)
  instead of ``transfer_s + C``: the longer of the two, plus one layer of the shorter. ``num_layers`` 0 or 1:
  nothing overlaps.
* **Decode**: ``decode_fixed_s + decode_s_per_token * output_tokens`` (the same with or without reverse reads).
* ``prefill_cache_gib``: the prefill worker's prefix-cache capacity over all its ranks (replicas counted), for
  the local-prefix-cache baseline.

Prefill and decode times are the whole engine's (all its ranks together) as measured: ``tp_size`` does not scale
them. A profile measured or fitted at one TP size describes that TP size; changing ``tp_size`` alone re-shards
the reads (and the bytes held) under the same per-rank link and the same compute.

Profiles come from a name (:func:`.profiles.load_profile`: ``measured``, fitted on this machine's end-to-end runs,
see :mod:`.validate`; ``h200-efa-qwen3-32b`` and ``h200-efa-glm5-fp8``, from the published numbers, see
:mod:`.published`) or a JSON file with the fields of :class:`CostProfile`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ProfileError

GIB = float(1 << 30)
@dataclass(frozen=True)
class ModelShape:
    """The parts of a model config that set KV size and attention cost.

    ``mla``: multi-head latent attention (DeepSeek-V2/V3): one latent vector of ``head_dim`` (``kv_lora_rank +
    qk_rope_head_dim``, 512 + 64 for DeepSeek-V3) per token and layer instead of K and V per KV head; it has no
    heads to split, so vLLM replicates it on every TP rank (:attr:`tp_heads` 1, ``kv_heads`` ignored).
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    q_heads: int = 0  # 0: unknown (attention_ratio 0)
    params: float = 0.0  # parameter count (for attention_ratio)
    mla: bool = False

    @property
    def tp_heads(self) -> int:
        """The heads tensor parallelism splits the KV by (1 for MLA: replicated on every rank)."""
        return 1 if self.mla else self.kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers (MLA: the one latent vector per layer)."""
        if self.mla:
            return self.layers * self.head_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_ratio(self) -> float:
        """Attention FLOPs per (query, key) pair (QK^T and AV: 4 * layers * q_heads * head_dim) over one token's
        linear FLOPs (2 * params)."""
        if self.q_heads <= 0 or self.params <= 0:
            return 0.0
        return 4.0 * self.layers * self.q_heads * self.head_dim / (2.0 * self.params)


#: Qwen3-32B (config.json: 64 layers, 64 attention heads, 8 KV heads, head_dim 128; 32.8e9 parameters), bf16.
QWEN3_32B = ModelShape(layers=64, kv_heads=8, head_dim=128, dtype_bytes=2, q_heads=64, params=32.8e9)


@dataclass(frozen=True)
class CostProfile:
    """One deployment's costs (see the module docstring for the model)."""

    name: str
    kv_bytes_per_token: float
    block_size: int
    bandwidth_bytes_per_s: float
    transfer_overhead_s: float
    prefill_fixed_s: float
    prefill_tokens_per_s: float
    attention_ratio: float
    decode_fixed_s: float
    decode_s_per_token: float
    prefill_cache_gib: float
    notes: str = ""
    tp_size: int = 1  # TP ranks on prefill and on decode (see the module docstring)
    kv_heads: int = 0  # the model's KV heads (1: MLA); 0: unknown, the KV splits evenly over the ranks
    num_layers: int = 0  # attention layers a layer-pipelined load overlaps (0: unknown, nothing overlaps)
    layer_overhead_s: float = 0.0  # what each layer of a layer-pipelined load adds (its NIXL request, its wait)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ProfileError(f"profile field 'name': must be a non-empty string, got {self.name!r}")
        for name, low in (("block_size", 1), ("tp_size", 1), ("kv_heads", 0), ("num_layers", 0)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ProfileError(f"profile {self.name!r} field {name!r}: must be an int >= {low}, got {value!r}")
        heads, tp = self.kv_heads, self.tp_size
        if heads and heads % tp and tp % heads:  # vLLM's QKVParallelLinear divides one by the other
            raise ProfileError(f"profile {self.name!r} field 'tp_size': {tp} ranks cannot split {heads} KV heads "
                               "(vLLM needs kv_heads % tp_size == 0 or tp_size % kv_heads == 0)")
        positive = ("kv_bytes_per_token", "bandwidth_bytes_per_s", "prefill_tokens_per_s")
        for f in fields(self):
            if f.name in ("name", "block_size", "notes", "tp_size", "kv_heads", "num_layers"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ProfileError(f"profile {self.name!r} field {f.name!r}: must be a finite number, got {value!r}")
            if value < 0 or (f.name in positive and value == 0):
                need = "> 0" if f.name in positive else ">= 0"
                raise ProfileError(f"profile {self.name!r} field {f.name!r}: must be {need}, got {value!r}")
            object.__setattr__(self, f.name, float(value))
        if not isinstance(self.notes, str):
            raise ProfileError(f"profile {self.name!r} field 'notes': must be a string")

    # ------------------------------------------------------------------------------------------ costs
    def work(self, new: float, context: float) -> float:
        """Token-equivalents of computing ``new`` tokens after ``context`` cached ones."""
        return new + self.attention_ratio * new * (context + new / 2.0)

    def compute_s(self, new: float, context: float) -> float:
        """Prefill compute time of ``new`` tokens after ``context`` (no fixed cost)."""
        return self.work(new, context) / self.prefill_tokens_per_s

    @property
    def rank_kv_bytes_per_token(self) -> float:
        """KV bytes per token one TP rank holds: its ``max(1, kv_heads // tp_size)`` of the ``kv_heads`` heads
        (``kv_heads`` 0: an even split, ``kv_bytes_per_token / tp_size``)."""
        if self.kv_heads == 0:
            return self.kv_bytes_per_token / self.tp_size
        return self.kv_bytes_per_token * max(1, self.kv_heads // self.tp_size) / self.kv_heads

    @property
    def held_kv_bytes_per_token(self) -> float:
        """KV bytes per token over all TP ranks, every replica counted (``kv_bytes_per_token`` unless ranks
        outnumber the KV heads)."""
        if self.kv_heads == 0:
            return self.kv_bytes_per_token
        return self.kv_bytes_per_token * (max(1, self.kv_heads // self.tp_size) * self.tp_size) / self.kv_heads

    def rank_block_bytes(self, blocks: int) -> float:
        """Bytes of ``blocks`` whole blocks on one TP rank (what one rank's read moves)."""
        return blocks * self.block_size * self.rank_kv_bytes_per_token

    def block_bytes(self, blocks: int) -> float:
        """Bytes of ``blocks`` whole blocks over all TP ranks (replicas counted): bytes moved, bytes retained."""
        return blocks * self.block_size * self.held_kv_bytes_per_token

    def transfer_s(self, blocks: int) -> float:
        """One reverse read of ``blocks`` whole blocks (0 blocks: no read, 0 s): every rank reads its shard over
        its own link at once, so overhead + one rank's bytes / the per-rank bandwidth."""
        if blocks <= 0:
            return 0.0
        return self.transfer_overhead_s + self.rank_block_bytes(blocks) / self.bandwidth_bytes_per_s

    def layered_s(self, blocks: int, new: float, context: float) -> float:
        """A layer-pipelined read of ``blocks`` whole blocks and the compute of ``new`` tokens after ``context``
        (see the module docstring); without layers to overlap, the read then the compute."""
        compute = self.compute_s(new, context)
        layers = self.num_layers
        if blocks <= 0 or layers <= 1:
            return self.transfer_s(blocks) + compute
        read = self.rank_block_bytes(blocks) / self.bandwidth_bytes_per_s
        return (self.transfer_overhead_s + max(read + compute / layers, read / layers + compute)
                + layers * self.layer_overhead_s)

    def decode_s(self, output_tokens: int) -> float:
        return self.decode_fixed_s + self.decode_s_per_token * output_tokens

    @property
    def prefill_cache_tokens(self) -> int:
        """Whole blocks of KV the prefill's prefix cache (``prefill_cache_gib`` over its ranks) holds, in tokens."""
        blocks = int(self.prefill_cache_gib * GIB // self.block_bytes(1))
        return blocks * self.block_size

    def break_even_tokens(self, limit: int = 1 << 22) -> int | None:
        """The fewest reusable prefix tokens for which one reverse read is faster than recomputing them.

        Both sides of the comparison: read ``ceil(n / B)`` blocks (overhead + one rank's bytes / the per-rank
        bandwidth, so a larger ``tp_size`` lowers it while the KV heads split further) vs compute the
        ``n`` prefix tokens (their linear work plus their attention among themselves); the suffix after them
        costs the same either way. None: recompute is never slower up to ``limit`` tokens.
        """
        def read_wins(n: int) -> bool:
            return self.transfer_s(-(-n // self.block_size)) < self.compute_s(n, 0)

        if not read_wins(limit):
            return None
        lo, hi = 0, limit  # read_wins(hi) holds; find the smallest n with read_wins(n) from there down
        if read_wins(1):
            return 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if read_wins(mid):
                hi = mid
            else:
                lo = mid
        return hi

    # ------------------------------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_changes(self, **changes: Any) -> CostProfile:
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<profile>") -> CostProfile:
        if not isinstance(data, Mapping):
            raise ProfileError(f"{source}: a profile is a JSON object with the fields of CostProfile")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names - {"model"})
        if unknown:
            raise ProfileError(f"{source}: unknown profile field(s) {unknown}; known: {sorted(names)}")
        values = dict(data)
        model = values.pop("model", None)
        if model is not None:  # a model shape instead of kv_bytes_per_token (and attention_ratio)
            if not isinstance(model, Mapping):
                raise ProfileError(f"{source}: field 'model': must be an object with layers, kv_heads, head_dim, "
                                   "dtype_bytes (q_heads, params, mla optional)")
            try:
                shape = ModelShape(**model)
            except TypeError as exc:
                raise ProfileError(f"{source}: field 'model': {exc}") from None
            values.setdefault("kv_bytes_per_token", shape.kv_bytes_per_token)
            values.setdefault("attention_ratio", shape.attention_ratio)
            values.setdefault("kv_heads", shape.tp_heads)
        values.setdefault("name", Path(source).stem if source != "<profile>" else "custom")
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = sorted(names - set(values) - optional)
        if missing:
            raise ProfileError(f"{source}: missing profile field(s) {missing}")
        return cls(**values)


def fit_prefill(samples: Sequence[tuple[float, float, float]], attention_ratio: float | None = None,
                ) -> tuple[float, float, float]:
    """``(prefill_fixed_s, prefill_tokens_per_s, attention_ratio)`` fitted to ``(linear, pairs, seconds)`` samples.

    ``linear`` is the tokens computed and ``pairs`` their ``new * (context + new / 2)`` (per request, or a mean
    over requests); seconds = fixed + (linear + ratio * pairs) / throughput. With ``attention_ratio`` given, two
    unknowns (least squares); else three (ratio fitted too; refitted with 0 if the fit makes it negative).
    """
    arr = np.asarray(samples, dtype=float)
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] < (2 if attention_ratio is not None else 3):
        raise ProfileError("fit_prefill needs (linear, pairs, seconds) samples: 2 with a given attention ratio, "
                           f"3 without; got {arr.shape}")
    lin, pairs, t = arr[:, 0], arr[:, 1], arr[:, 2]
    if attention_ratio is None:
        design = np.column_stack([np.ones_like(lin), lin, pairs])
        (a, b, c), *_ = np.linalg.lstsq(design, t, rcond=None)
        if c >= 0 and b > 0:
            return max(float(a), 0.0), 1.0 / float(b), float(c / b)
        attention_ratio = 0.0
    design = np.column_stack([np.ones_like(lin), lin + attention_ratio * pairs])
    (a, b), *_ = np.linalg.lstsq(design, t, rcond=None)
    if not b > 0:
        raise ProfileError("the samples do not grow with the tokens computed: no positive prefill throughput fits")
    return max(float(a), 0.0), 1.0 / float(b), float(attention_ratio)
