"""The published H200 + EFA numbers, the profiles derived from them, and the reproduction.

Source: the vLLM blog "Improve TTFT for Multi-Turn Agentic Workloads with Bi-Directional KV Transfer in vLLM"
(2026-10-12; 1P1D p5en.48xlarge, EFA, prefix caching off on prefill), two models: Qwen3-32B (TP8) and GLM-5-FP8.
Its sweep script (``run_multiturn_sweep.sh``) runs, per prefix length PFX: 10 conversations x 10 turns, the first
user turn PFX + 150 tokens, 150 new tokens per later turn, 300-token answers, 2 clients, the next turn sent as
soon as the answer is complete; TTFT averaged per PFX. Only the end points are given as numbers:

* Qwen3-32B, PFX 2k..24k: TTFT off 158 -> 778 ms, on 122 -> 460 ms; added KV-transfer time about 30 -> 130 ms.
* GLM-5-FP8, PFX 2k..20k: TTFT off 500 -> 2,334 ms, on 358 -> 702 ms (3.3x at 20k); transfer about 29 -> 110 ms.

How each profile is derived (:func:`h200_profile`), and what is assumed:

* KV bytes per token from the model shape. Qwen3-32B: 256 KiB (64 layers x 8 KV heads x 128 x bf16 x K/V),
  split by TP over its 8 KV heads (one head, 32 KiB, per rank). GLM-5-FP8 (MLA + DSA, the DeepSeek-V3.2 shape):
  per layer one 656-byte ``fp8_ds_mla`` cell (512 fp8 latent values, 4 fp32 scales, 64 bf16 rope values) and
  the sparse-attention indexer's 132-byte fp8 entry, 78 layers: 61,464 B per token, *replicated* on every TP
  rank (MLA has no heads to split), so each rank reads all of it. TP8 for both (GLM-5-FP8's 744 GB of weights
  need the node's 8 GPUs; assumed, not published).
* Link. Qwen3-32B: the published transfer times match the whole KV at 50 GB/s (24k tokens = 6.4 GB = 129 ms; one
  GPU's 2 x 200 Gb/s EFA), so the 8 ranks together moved 50 GB/s: 6.25 GB/s per rank; the per-read overhead is
  what the transfer times leave after that (mean of the two end points). GLM-5-FP8: per-rank bandwidth and
  overhead both solved from its two transfer times (each rank reads every byte).
* Prefill: fixed cost and throughput fitted so that the simulated *off* leg (every turn recomputed) averages
  exactly the two published off TTFTs over the same workload. The *on* leg is then a prediction.
* Decode: 15 ms per output token (assumed, not published; it only moves whole-turn latency, equally in both
  legs); prefill prefix cache 800 GiB (8 x 141 GB HBM less weights; only the local-cache baseline uses it).
* Layer-pipelined loads (a prediction, nothing published): 20 us per layer (assumed: one NIXL request posted and
  one completion waited for per layer, host side), the suffix's compute split evenly over the layers
  (:meth:`~.profile.CostProfile.layered_s`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..retention.terms import DEFAULT_TTL_S
from .profile import QWEN3_32B, CostProfile, ModelShape, fit_prefill
from .simulate import PreparedTrace, simulate, summarize
from .trace import Trace, uniform_trace


@dataclass(frozen=True)
class PublishedCase:
    """One model's published sweep: its shape, TP size and the numbers the blog gives (PFX -> seconds)."""

    profile_name: str
    model: str
    shape: ModelShape
    pfx_points: tuple[int, ...]
    ttft_s: dict[int, tuple[float, float]]  # PFX: (off, on), the published end points
    transfer_s: dict[int, float]  # PFX: the added KV-transfer time
    tp_size: int = 8
    total_bandwidth: float = 0.0  # the link all ranks share, when the transfer times imply it; 0: solve per rank

    def rank_bytes_per_token(self) -> float:
        """What one rank holds and reads per token (its heads' share; all of an MLA latent)."""
        heads = self.shape.tp_heads
        return self.shape.kv_bytes_per_token * max(1, heads // self.tp_size) / heads


#: GLM-5-FP8 as its cache holds it: 78 layers, each an fp8_ds_mla cell (656 B) and the DSA indexer's entry (132 B)
#: per token, written as one 788-byte "latent" per layer; 64 query heads, about 40e9 active parameters of 744e9.
GLM5_FP8 = ModelShape(layers=78, kv_heads=1, head_dim=656 + 132, dtype_bytes=1, q_heads=64, params=40e9, mla=True)

QWEN_CASE = PublishedCase(
    "h200-efa-qwen3-32b", "Qwen3-32B", QWEN3_32B, (2000, 4000, 8000, 12000, 16000, 20000, 24000),
    {2000: (0.158, 0.122), 24000: (0.778, 0.460)}, {2000: 0.030, 24000: 0.130}, total_bandwidth=50e9)
GLM_CASE = PublishedCase(
    "h200-efa-glm5-fp8", "GLM-5-FP8", GLM5_FP8, (2000, 4000, 8000, 12000, 16000, 20000),
    {2000: (0.500, 0.358), 20000: (2.334, 0.702)}, {2000: 0.029, 20000: 0.110})
CASES = {case.profile_name: case for case in (QWEN_CASE, GLM_CASE)}
PUBLISHED_TTFT_S = QWEN_CASE.ttft_s  # the Qwen3-32B end points (the default profile's)
WORKLOAD = {"conversations": 10, "turns": 10, "new_tokens": 150, "output_tokens": 300}
LAYER_OVERHEAD_S = 20e-6  # assumed (see the module docstring)


def blog_trace(pfx: int) -> Trace:
    """One point of the published sweep (all conversations alike; the next turn right after the answer)."""
    w = WORKLOAD
    return uniform_trace(conversations=w["conversations"], turns=w["turns"], first_tokens=pfx + w["new_tokens"],
                         new_tokens=w["new_tokens"], output_tokens=w["output_tokens"], name=f"pfx{pfx}-")


def _blog_prompts(pfx: int) -> list[int]:
    first, new, out = pfx + WORKLOAD["new_tokens"], WORKLOAD["new_tokens"], WORKLOAD["output_tokens"]
    return [first + (k - 1) * (new + out) for k in range(1, WORKLOAD["turns"] + 1)]


def _mean_read_bytes(pfx: int, case: PublishedCase) -> float:
    """Mean bytes one rank reads at ``pfx`` (turns 2..10 read the previous prompt + answer - 1, whole blocks)."""
    prompts = _blog_prompts(pfx)
    reads = [-(-(p + WORKLOAD["output_tokens"] - 1) // 16) * 16 for p in prompts[:-1]]
    return sum(reads) / len(reads) * case.rank_bytes_per_token()


def _link(case: PublishedCase) -> tuple[float, float]:
    """(per-rank bandwidth, per-read overhead) from the published transfer times at the two end points."""
    (low, t_low), (high, t_high) = sorted(case.transfer_s.items())
    b_low, b_high = _mean_read_bytes(low, case), _mean_read_bytes(high, case)
    if case.total_bandwidth:
        bandwidth = case.total_bandwidth / case.tp_size
        overheads = [t - b / bandwidth for t, b in ((t_low, b_low), (t_high, b_high))]
        return bandwidth, max(sum(overheads) / len(overheads), 0.0)
    bandwidth = (b_high - b_low) / (t_high - t_low)
    return bandwidth, max(t_low - b_low / bandwidth, 0.0)


@functools.cache
def h200_profile(name: str = QWEN_CASE.profile_name) -> CostProfile:
    """A published profile (:data:`CASES`; see the module docstring for the derivation)."""
    case = CASES[name]
    samples = []
    for pfx, (off, _on) in sorted(case.ttft_s.items()):
        prompts = _blog_prompts(pfx)
        lin = sum(prompts) / len(prompts)
        pairs = sum(p * p / 2.0 for p in prompts) / len(prompts)
        samples.append((lin, pairs, off))
    fixed, throughput, ratio = fit_prefill(samples, attention_ratio=case.shape.attention_ratio)
    bandwidth, overhead = _link(case)
    replicated = " (MLA: replicated, every rank reads all of it)" if case.shape.mla else ""
    return CostProfile(
        name=case.profile_name, kv_bytes_per_token=float(case.shape.kv_bytes_per_token), block_size=16,
        bandwidth_bytes_per_s=bandwidth, transfer_overhead_s=overhead, prefill_fixed_s=fixed,
        prefill_tokens_per_s=throughput, attention_ratio=ratio, decode_fixed_s=0.0, decode_s_per_token=0.015,
        prefill_cache_gib=800.0, tp_size=case.tp_size, kv_heads=case.shape.tp_heads, num_layers=case.shape.layers,
        layer_overhead_s=LAYER_OVERHEAD_S,
        notes=f"{case.model} TP{case.tp_size} on p5en (H200) + EFA: {case.shape.kv_bytes_per_token:,} KV bytes per "
              f"token{replicated}; prefill fitted to the vLLM blog's recompute TTFTs over its sweep workload (the "
              f"whole engine); {bandwidth / 1e9:.2f} GB/s per rank and {overhead * 1e3:.1f} ms per read from its "
              "transfer times; decode 15 ms/token assumed")


def reproduce(profile: CostProfile | None = None) -> list[dict[str, Any]]:
    """Planner TTFT off/on per PFX of the published sweep, next to the published end points.

    ``off`` = every turn recomputed (cache_miss), ``on`` = reverse reads (the default TTL, threshold 64), each the
    mean over all 100 turns of the point, as the blog averages per prompt length; ``layered`` = the same reverse
    reads, layer-pipelined (a prediction: what kvshuttle's layered mode would gain there). The sweep and the
    published points are those of the profile's model (:data:`CASES`; Qwen3-32B's for any other profile).
    """
    profile = profile or h200_profile()
    case = CASES.get(profile.name, QWEN_CASE)
    rows = []
    for pfx in case.pfx_points:
        prepared = PreparedTrace(blog_trace(pfx), profile.block_size)
        off = summarize(simulate(prepared, profile, mode="cache_miss"))
        on_run = simulate(prepared, profile, mode="reverse_read", ttl_s=DEFAULT_TTL_S, threshold=64)
        on = summarize(on_run)
        layered = summarize(simulate(prepared, profile, mode="reverse_read", ttl_s=DEFAULT_TTL_S, threshold=64,
                                     layered=True))
        reads = [b for b in on_run.bytes_moved if b > 0]
        row: dict[str, Any] = {
            "pfx": pfx, "mean_prompt_tokens": sum(_blog_prompts(pfx)) / WORKLOAD["turns"],
            "off_s": off["ttft_s"]["mean"], "on_s": on["ttft_s"]["mean"], "layered_s": layered["ttft_s"]["mean"],
            "read_s": profile.transfer_s(round(sum(reads) / len(reads) / profile.block_bytes(1))) if reads else 0.0,
            "published_off_s": None, "published_on_s": None, "off_error": None, "on_error": None,
        }
        if pfx in case.ttft_s:
            pub_off, pub_on = case.ttft_s[pfx]
            row.update(published_off_s=pub_off, published_on_s=pub_on, off_error=row["off_s"] / pub_off - 1,
                       on_error=row["on_s"] / pub_on - 1, published_read_s=case.transfer_s[pfx])
        rows.append(row)
    return rows


def format_reproduction(rows: list[dict[str, Any]], profile: CostProfile) -> str:
    lines = [f"{'PFX':>6} {'mean prompt':>11} {'off ms':>8} {'pub off':>8} {'err':>6} {'on ms':>8} {'pub on':>8} "
             f"{'err':>6} {'read ms':>8} {'pub read':>9} {'layered':>8} {'on/lay':>7}"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:+.0f}%"

    for r in rows:
        lines.append(f"{r['pfx']:>6} {r['mean_prompt_tokens']:>11.0f} {ms(r['off_s']):>8} {ms(r['published_off_s']):>8}"
                     f" {pct(r['off_error']):>6} {ms(r['on_s']):>8} {ms(r['published_on_s']):>8} "
                     f"{pct(r['on_error']):>6} {ms(r['read_s']):>8} {ms(r.get('published_read_s')):>9} "
                     f"{ms(r['layered_s']):>8} {r['on_s'] / r['layered_s']:>6.2f}x")
    lines.append(f"profile {profile.name}: prefill {profile.prefill_fixed_s * 1e3:.1f} ms + "
                 f"{profile.prefill_tokens_per_s:,.0f} tokens/s (attention ratio {profile.attention_ratio:.2e}), "
                 f"{_link_text(profile)} + {profile.transfer_overhead_s * 1e3:.1f} ms per read;"
                 " off fitted to the published off points, on predicted; means over 10 conversations x 10 turns;"
                 f" layered = on with each layer's read overlapping earlier layers' compute ({profile.num_layers} "
                 f"layers, {profile.layer_overhead_s * 1e6:.0f} us per layer assumed), a prediction")
    return "\n".join(lines)


def _link_text(profile: CostProfile) -> str:
    """The read bandwidth: one link, or TP ranks reading their shards at once (per rank and over all of them)."""
    if profile.tp_size == 1:
        return f"{profile.bandwidth_bytes_per_s / 1e9:.0f} GB/s"
    return (f"TP{profile.tp_size}: {profile.bandwidth_bytes_per_s / 1e9:.2f} GB/s per rank "
            f"({profile.bandwidth_bytes_per_s * profile.tp_size / 1e9:.0f} GB/s over the ranks)")
