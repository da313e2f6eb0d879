"""The published H200 + EFA numbers, the ``h200-efa-qwen3-32b`` profile derived from them, and the reproduction.

Source: the vLLM blog "Improve TTFT for Multi-Turn Agentic Workloads with Bi-Directional KV Transfer in vLLM"
(2026-10-12; Qwen3-32B, TP8, 1P1D p5en.48xlarge, EFA, prefix caching off on prefill). Its sweep script
(``run_multiturn_sweep.sh``) runs, per prefix length PFX in 2k..24k: 10 conversations x 10 turns, the first
user turn PFX + 150 tokens, 150 new tokens per later turn, 300-token answers, 2 clients, the next turn sent as
soon as the answer is complete; TTFT averaged per PFX. Published: TTFT off 158 ms (2k) -> 778 ms (24k), on
122 -> 460 ms; added KV-transfer time about 30 -> 130 ms. Only the end points are given as numbers.

How the profile is derived (:func:`h200_profile`), and what is assumed:

* KV: 256 KiB per token (64 layers x 8 KV heads x 128 x bf16 x K/V), 16-token blocks; attention ratio from the
  model config (:data:`~.profile.QWEN3_32B`).
* TP8 (``tp_size`` 8, 8 KV heads: one head, 32 KiB per token, per rank; nothing replicated).
* Link: the published transfer times match the whole KV at 50 GB/s (24k tokens = 6.4 GB = 129 ms; 50 GB/s is
  one GPU's 2 x 200 Gb/s EFA), so the 8 ranks together moved 50 GB/s: the profile's per-rank bandwidth is
  50 / 8 = 6.25 GB/s (each rank's 0.8 GB shard in the same 129 ms). That is what the published times imply,
  not the per-GPU link rate; a read costs exactly what it did when this profile modelled one 50 GB/s link. The
  per-read overhead is what the published transfer times leave after one rank's bytes / 6.25 GB/s at the two
  end points (mean).
* Prefill: fixed cost and throughput fitted so that the simulated *off* leg (every turn recomputed) averages
  exactly the two published off TTFTs over the same workload. The *on* leg is then a prediction.
* Decode: 15 ms per output token (assumed, not published; it only moves whole-turn latency, equally in both
  legs); prefill prefix cache 800 GiB (8 x 141 GB HBM less weights; only the local-cache baseline uses it).
* Layer-pipelined loads (a prediction, nothing published): Qwen3-32B's 64 layers, 20 us per layer (assumed: one
  NIXL request posted and one completion waited for per layer, host side), the suffix's compute split evenly
  over the layers (:meth:`~.profile.CostProfile.layered_s`).
"""

from __future__ import annotations

import functools
from typing import Any

from ..retention.terms import DEFAULT_TTL_S
from .profile import QWEN3_32B, CostProfile, fit_prefill
from .simulate import PreparedTrace, simulate, summarize
from .trace import Trace, uniform_trace

PFX_POINTS = (2000, 4000, 8000, 12000, 16000, 20000, 24000)
PUBLISHED_TTFT_S = {2000: (0.158, 0.122), 24000: (0.778, 0.460)}  # PFX: (off, on)
PUBLISHED_TRANSFER_S = {2000: 0.030, 24000: 0.130}
TP_SIZE = 8
BANDWIDTH = 50e9  # over all 8 ranks together (what the published transfer times imply)
RANK_BANDWIDTH = BANDWIDTH / TP_SIZE  # the profile's bandwidth_bytes_per_s: per rank
WORKLOAD = {"conversations": 10, "turns": 10, "new_tokens": 150, "output_tokens": 300}
LAYERS = 64  # Qwen3-32B
LAYER_OVERHEAD_S = 20e-6  # assumed (see the module docstring)


def blog_trace(pfx: int) -> Trace:
    """One point of the published sweep (all conversations alike; the next turn right after the answer)."""
    w = WORKLOAD
    return uniform_trace(conversations=w["conversations"], turns=w["turns"], first_tokens=pfx + w["new_tokens"],
                         new_tokens=w["new_tokens"], output_tokens=w["output_tokens"], name=f"pfx{pfx}-")


def _blog_prompts(pfx: int) -> list[int]:
    first, new, out = pfx + WORKLOAD["new_tokens"], WORKLOAD["new_tokens"], WORKLOAD["output_tokens"]
    return [first + (k - 1) * (new + out) for k in range(1, WORKLOAD["turns"] + 1)]


def _mean_read_bytes(pfx: int) -> float:
    """Mean bytes one rank reads at ``pfx`` (turns 2..10 read the previous prompt + answer - 1, whole blocks)."""
    prompts = _blog_prompts(pfx)
    reads = [-(-(p + WORKLOAD["output_tokens"] - 1) // 16) * 16 for p in prompts[:-1]]
    return sum(reads) / len(reads) * QWEN3_32B.kv_bytes_per_token / TP_SIZE  # 8 heads over 8 ranks: 1 each


@functools.lru_cache(maxsize=1)
def h200_profile() -> CostProfile:
    """The ``h200-efa-qwen3-32b`` profile (see the module docstring for the derivation)."""
    ratio = QWEN3_32B.attention_ratio
    samples = []
    for pfx in (2000, 24000):
        prompts = _blog_prompts(pfx)
        lin = sum(prompts) / len(prompts)
        pairs = sum(p * p / 2.0 for p in prompts) / len(prompts)
        samples.append((lin, pairs, PUBLISHED_TTFT_S[pfx][0]))
    fixed, throughput, ratio = fit_prefill(samples, attention_ratio=ratio)
    overheads = [PUBLISHED_TRANSFER_S[p] - _mean_read_bytes(p) / RANK_BANDWIDTH for p in (2000, 24000)]
    overhead = max(sum(overheads) / len(overheads), 0.0)
    return CostProfile(
        name="h200-efa-qwen3-32b", kv_bytes_per_token=float(QWEN3_32B.kv_bytes_per_token), block_size=16,
        bandwidth_bytes_per_s=RANK_BANDWIDTH, transfer_overhead_s=overhead, prefill_fixed_s=fixed,
        prefill_tokens_per_s=throughput, attention_ratio=ratio, decode_fixed_s=0.0, decode_s_per_token=0.015,
        prefill_cache_gib=800.0, tp_size=TP_SIZE, kv_heads=QWEN3_32B.kv_heads, num_layers=LAYERS,
        layer_overhead_s=LAYER_OVERHEAD_S,
        notes="Qwen3-32B TP8 on p5en (H200) + EFA: prefill fitted to the vLLM blog's recompute TTFTs over its "
              "sweep workload (the whole TP8 engine); 6.25 GB/s per rank (50 GB/s over the 8 ranks, as its "
              "transfer times imply); overhead from its transfer times; decode 15 ms/token assumed")


def reproduce(profile: CostProfile | None = None) -> list[dict[str, Any]]:
    """Planner TTFT off/on per PFX of the published sweep, next to the published end points.

    ``off`` = every turn recomputed (cache_miss), ``on`` = reverse reads (the default TTL, threshold 64), each the
    mean over all 100 turns of the point, as the blog averages per prompt length; ``layered`` = the same reverse
    reads, layer-pipelined (a prediction: what kvshuttle's layered mode would gain there).
    """
    profile = profile or h200_profile()
    rows = []
    for pfx in PFX_POINTS:
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
        if pfx in PUBLISHED_TTFT_S:
            pub_off, pub_on = PUBLISHED_TTFT_S[pfx]
            row.update(published_off_s=pub_off, published_on_s=pub_on, off_error=row["off_s"] / pub_off - 1,
                       on_error=row["on_s"] / pub_on - 1, published_read_s=PUBLISHED_TRANSFER_S[pfx])
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
                 f"{_link(profile)} + {profile.transfer_overhead_s * 1e3:.1f} ms per read;"
                 " off fitted to the published off points, on predicted; means over 10 conversations x 10 turns;"
                 f" layered = on with each layer's read overlapping earlier layers' compute ({profile.num_layers} "
                 f"layers, {profile.layer_overhead_s * 1e6:.0f} us per layer assumed), a prediction")
    return "\n".join(lines)


def _link(profile: CostProfile) -> str:
    """The read bandwidth: one link, or TP ranks reading their shards at once (per rank and over all of them)."""
    if profile.tp_size == 1:
        return f"{profile.bandwidth_bytes_per_s / 1e9:.0f} GB/s"
    return (f"TP{profile.tp_size}: {profile.bandwidth_bytes_per_s / 1e9:.2f} GB/s per rank "
            f"({profile.bandwidth_bytes_per_s * profile.tp_size / 1e9:.0f} GB/s over the ranks)")
