"""Cost profiles: what a prefill, a reverse read and a decode cost on one deployment.

A :class:`CostProfile` is a handful of numbers:

* **KV bytes per token** (all layers, K and V), from a model shape (:class:`ModelShape`: layers x KV heads x head
  dim x dtype bytes x 2) or given; ``block_size`` tokens per KV block (reads move whole blocks).
* **Transfer**: ``transfer_overhead_s + bytes / bandwidth_bytes_per_s`` per reverse read.
* **Prefill**: ``prefill_fixed_s + work / prefill_tokens_per_s`` where computing ``new`` tokens after ``context``
  tokens already in the cache is ``work = new + attention_ratio * new * (context + new / 2)`` token-equivalents:
  the linear part (projections, MLP) per token plus attention over every earlier token. ``attention_ratio`` is
  attention's work per (query, key) pair in units of one token's linear work: ``4 * layers * q_heads * head_dim /
  (2 * params)`` from a model shape (:meth:`ModelShape.attention_ratio`), or fitted.
* **Decode**: ``decode_fixed_s + decode_s_per_token * output_tokens`` (the same with or without reverse reads).
* ``prefill_cache_gib``: the prefill worker's prefix-cache capacity, for the local-prefix-cache baseline.

Profiles come from a name (:data:`PROFILE_NAMES`: ``measured``, fitted on this machine's end-to-end runs, see
:mod:`.validate`; ``h200-efa-qwen3-32b``, from the published numbers, see :mod:`.published`) or a JSON file with
the fields of :class:`CostProfile`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ProfileError

GIB = float(1 << 30)
PROFILE_NAMES = ("measured", "h200-efa-qwen3-32b")


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model config that set KV size and attention cost."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    q_heads: int = 0  # 0: unknown (attention_ratio 0)
    params: float = 0.0  # parameter count (for attention_ratio)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ProfileError(f"profile field 'name': must be a non-empty string, got {self.name!r}")
        if type(self.block_size) is not int or self.block_size < 1:
            raise ProfileError(f"profile {self.name!r} field 'block_size': must be an int >= 1, "
                               f"got {self.block_size!r}")
        positive = ("kv_bytes_per_token", "bandwidth_bytes_per_s", "prefill_tokens_per_s")
        for f in fields(self):
            if f.name in ("name", "block_size", "notes"):
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

    def block_bytes(self, blocks: int) -> float:
        return blocks * self.block_size * self.kv_bytes_per_token

    def transfer_s(self, blocks: int) -> float:
        """One reverse read of ``blocks`` whole blocks (0 blocks: no read, 0 s)."""
        if blocks <= 0:
            return 0.0
        return self.transfer_overhead_s + self.block_bytes(blocks) / self.bandwidth_bytes_per_s

    def decode_s(self, output_tokens: int) -> float:
        return self.decode_fixed_s + self.decode_s_per_token * output_tokens

    @property
    def prefill_cache_tokens(self) -> int:
        """Whole blocks of KV the prefill's prefix cache holds, in tokens."""
        blocks = int(self.prefill_cache_gib * GIB // (self.block_size * self.kv_bytes_per_token))
        return blocks * self.block_size

    def break_even_tokens(self, limit: int = 1 << 22) -> int | None:
        """The fewest reusable prefix tokens for which one reverse read is faster than recomputing them.

        Both sides of the comparison: read ``ceil(n / B)`` blocks (overhead + bytes / bandwidth) vs compute the
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
                                   "dtype_bytes (q_heads, params optional)")
            try:
                shape = ModelShape(**model)
            except TypeError as exc:
                raise ProfileError(f"{source}: field 'model': {exc}") from None
            values.setdefault("kv_bytes_per_token", shape.kv_bytes_per_token)
            values.setdefault("attention_ratio", shape.attention_ratio)
        values.setdefault("name", Path(source).stem if source != "<profile>" else "custom")
        missing = sorted(names - set(values) - {"notes"})
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


def load_profile(spec: str | CostProfile) -> CostProfile:
    """A named profile (:data:`PROFILE_NAMES`) or a JSON file's."""
    if isinstance(spec, CostProfile):
        return spec
    if spec == "measured":
        text = resources.files("kvshuttle.planner").joinpath("data", "measured.json").read_text("utf-8")
        return CostProfile.from_dict(json.loads(text), source="measured")
    if spec == "h200-efa-qwen3-32b":
        from .published import h200_profile

        return h200_profile()
    path = Path(spec)
    if not path.is_file():
        raise ProfileError(f"no profile {spec!r}: use one of {', '.join(PROFILE_NAMES)} or a JSON file")
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: not a readable JSON profile: {exc}") from None
    return CostProfile.from_dict(data, source=str(path))
