"""A plan: every mode, TTL and threshold over one trace; the terminal tables, the JSON document and the plots.

JSON document (``kvshuttle plan --json``): ``planner`` (schema version), ``command``, ``profile`` (every field of
the cost profile, ``tp_size`` and ``kv_heads`` included), ``tensor_parallel`` (``tp_size``,
``rank_kv_bytes_per_token``, ``held_kv_bytes_per_token``: the KV per token on one rank and over all ranks, replicas
counted), ``trace`` (a summary), ``assumptions`` (what the model takes as given), ``baselines``
(``cache_miss``, ``local_cache``: metrics), ``settings`` (one per TTL x threshold: ``ttl_s``, ``threshold``,
``reverse_read`` and ``reverse_read+local_cache`` metrics), ``break_even_tokens``. Metrics: ``ttft_s``,
``turn_s`` (TTFT + decode) and ``later_ttft_s`` (turns 2+) as ``mean``/``p50``/``p99``; ``hit_rate`` (turns 2+
that read from decode), ``local_hit_rate``, ``tokens_recomputed``, ``tokens_fetched``, ``tokens_local``,
``bytes_moved``, ``retained_peak_gib``, ``retained_gib_s``, ``reasons`` (policy decisions by reason). Bytes and
retained memory are over all the profile's TP ranks (every replica counted: decode's memory across its ranks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from .profile import CostProfile
from .simulate import BASELINES, NO_PLACEMENT, Mode, ModeRun, Placement, PreparedTrace, Threshold, simulate, summarize
from .tiers import Tier
from .trace import Trace, uniform_trace

SCHEMA = 1
REVERSE: tuple[Mode, ...] = ("reverse_read", "reverse_read+local_cache")
ASSUMPTIONS = (
    "closed-loop conversations: a turn arrives gap_s after the previous answer ended",
    "no batching: each prefill runs alone (with --queue, requests wait for their prefill worker in arrival order)",
    "decode time is the same with and without reverse reads (decode_fixed_s + decode_s_per_token x output)",
    "decode retains a turn's prompt + answer - 1 tokens (whole blocks) until the TTL or the conversation's next "
    "request, whichever is first; one handle per conversation (decode's prefix cache shares older blocks)",
    "reads use kvshuttle's policy (digest-verified prefix, last prompt token recomputed, expiry margin, threshold)",
    "local prefix cache: per prefill worker, LRU over whole blocks of the prompts it computed or read "
    "(never the answers, which decode generated); turns routed to a random worker",
    "reads never fail (a failed read would cost the read and a recompute)",
    "tensor parallelism: prefill and decode both run tp_size ranks; each rank reads its KV-head shard over its own "
    "link at once (bandwidth per rank); bytes read and held count every rank's copy; prefill and decode times are "
    "the profile's whole-engine numbers at any tp_size",
)


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", leave=False)


def placement_for(mode: str, placement: Placement) -> Placement:
    """``placement`` as it applies to ``mode``: pre-warming fills a local cache (none in the other modes)."""
    return replace(placement, prewarm=placement.prewarm and mode.endswith("local_cache"))


def run_plan(trace: Trace, profile: CostProfile, ttls: Sequence[float], thresholds: Sequence[Threshold], *,
             prefill_workers: int = 1, queue: bool = False, expiry_margin_s: float = 5.0, progress: bool = False,
             command: str = "", placement: Placement = NO_PLACEMENT,
             tiers: Sequence[Tier] = ()) -> tuple[dict[str, Any], dict[str, ModeRun]]:
    """Simulate the baselines once and both reverse-read modes per TTL x threshold; the JSON document and the
    runs (keyed ``mode``, or ``mode@ttl@threshold``) for plotting. ``tiers``: lower retention tiers after each
    TTL (the TTL is then the hot tier's)."""
    prepared = PreparedTrace(trace, profile.block_size, progress=progress)
    options: dict[str, Any] = {"prefill_workers": prefill_workers, "queue": queue, "expiry_margin_s": expiry_margin_s,
                               "placement": asdict(placement), "tiers": [asdict(t) for t in tiers]}
    bar = _progress(len(BASELINES) + 2 * len(ttls) * len(thresholds), progress, "simulating")
    runs: dict[str, ModeRun] = {}
    baselines = {}
    for mode in BASELINES:
        runs[mode] = simulate(prepared, profile, mode=mode, prefill_workers=prefill_workers, queue=queue,
                              expiry_margin_s=expiry_margin_s, placement=placement_for(mode, placement))
        baselines[mode] = summarize(runs[mode])
        if bar is not None:
            bar.update()
    settings = []
    for ttl in ttls:
        for threshold in thresholds:
            entry: dict[str, Any] = {"ttl_s": ttl, "threshold": threshold}
            for mode in REVERSE:
                run = simulate(prepared, profile, mode=mode, ttl_s=ttl, threshold=threshold,
                               prefill_workers=prefill_workers, queue=queue, expiry_margin_s=expiry_margin_s,
                               placement=placement_for(mode, placement), tiers=tiers)
                runs[f"{mode}@{ttl}@{threshold}"] = run
                entry[mode] = summarize(run)
                if bar is not None:
                    bar.update()
            settings.append(entry)
    if bar is not None:
        bar.close()
    tp = {"tp_size": profile.tp_size, "rank_kv_bytes_per_token": profile.rank_kv_bytes_per_token,
          "held_kv_bytes_per_token": profile.held_kv_bytes_per_token}
    doc = {"planner": SCHEMA, "command": command, "profile": profile.to_dict(), "tensor_parallel": tp,
           "trace": trace.summary(),
           "assumptions": list(ASSUMPTIONS), "options": options, "baselines": baselines, "settings": settings,
           "break_even_tokens": profile.break_even_tokens()}
    return doc, runs


def _fmt(x: float) -> str:
    return f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.2f}s"


def _row(label: str, ttl: str, thr: str, m: dict[str, Any]) -> str:
    t, w = m["ttft_s"], m["turn_s"]
    return (f"{label:<25}{ttl:>6}{thr:>7}{_fmt(t['mean']):>9}{_fmt(t['p50']):>9}{_fmt(t['p99']):>9}"
            f"{_fmt(w['mean']):>9}{m['hit_rate'] * 100:>6.0f}%{m['local_hit_rate'] * 100:>6.0f}%"
            f"{m['tokens_recomputed'] / 1e3:>10.1f}k{m['bytes_moved'] / 1e9:>9.1f}{m['retained_peak_gib']:>10.1f}"
            f"{m['retained_gib_s']:>10.0f}")


def format_plan(doc: dict[str, Any]) -> str:
    """The plan as terminal tables."""
    p, tr = doc["profile"], doc["trace"]
    lines = [f"trace {tr['source']}: {tr['conversations']} conversations, {tr['turns']} turns, prompts "
             f"{tr['prompt_tokens_mean']:.0f} tokens on average (max {tr['prompt_tokens_max']}), gaps p50 "
             f"{tr['gap_s_p50']} s (max {tr['gap_s_max']} s), {tr['edited_turns']} edited turns",
             f"profile {p['name']}: {p['kv_bytes_per_token'] / 1024:.0f} KiB/token, {p['block_size']}-token blocks, "
             f"{_tp(doc)}read {p['transfer_overhead_s'] * 1e3:.1f} ms + {p['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s"
             f"{' per rank' if p.get('tp_size', 1) > 1 else ''}, prefill "
             f"{p['prefill_fixed_s'] * 1e3:.1f} ms + {p['prefill_tokens_per_s']:,.0f} tokens/s, decode "
             f"{p['decode_s_per_token'] * 1e3:.0f} ms/token",
             "",
             f"{'mode':<25}{'TTL':>6}{'thr':>7}{'TTFT':>9}{'p50':>9}{'p99':>9}{'turn':>9}{'hit':>7}{'local':>7}"
             f"{'recomputed':>11}{'GB read':>9}{'peak GiB':>10}{'GiB-s':>10}"]
    for mode, m in doc["baselines"].items():
        lines.append(_row(mode, "-", "-", m))
    for s in doc["settings"]:
        for mode in REVERSE:
            lines.append(_row(mode, f"{s['ttl_s']:g}", str(s["threshold"]), s[mode]))
    be = doc["break_even_tokens"]
    best = min(doc["settings"], key=lambda s: s["reverse_read"]["ttft_s"]["mean"]) if doc["settings"] else None
    lines.append("")
    lines.append(f"break-even: a read beats recomputing the same prefix from {be} tokens on" if be is not None else
                 "break-even: recompute is always faster than a read under this profile")
    if best is not None:
        base = doc["baselines"]["cache_miss"]["ttft_s"]["mean"]
        rr = best["reverse_read"]
        lines.append(f"best TTFT with reverse reads: TTL {best['ttl_s']:g} s, threshold {best['threshold']}: mean "
                     f"{_fmt(rr['ttft_s']['mean'])} vs {_fmt(base)} recomputing ({base / rr['ttft_s']['mean']:.2f}x); "
                     f"turn {_fmt(rr['turn_s']['mean'])} vs {_fmt(doc['baselines']['cache_miss']['turn_s']['mean'])}; "
                     f"costs {rr['retained_gib_s']:.0f} GiB-s of decode memory "
                     f"(peak {rr['retained_peak_gib']:.1f} GiB)")
    lines.extend(_tier_lines(doc))
    lines.append("TTFT mean/p50/p99 over all turns; turn = TTFT + decode (mean); hit = turns 2+ that read from decode; "
                 "local = turns 2+ with a local prefix-cache hit; GiB-s = decode memory held for reuse x time"
                 + ("; GB read, peak GiB and GiB-s: summed over the TP ranks" if p.get("tp_size", 1) > 1 else ""))
    return "\n".join(lines)


def _tier_lines(doc: dict[str, Any]) -> list[str]:
    """Per setting (reverse reads), each tier's reads, peak, GiB-s and cost: the hot tier is the decode's HBM."""
    tiers = doc["options"].get("tiers") or []
    if not tiers:
        return []
    names = ["hot", *(t["name"] for t in tiers)]
    lines = ["", "retention tiers (reverse_read): " + "; ".join(
        f"{t['name']} {t['ttl_s']:g} s after hot, {t['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s per rank + "
        f"{t['overhead_s'] * 1e3:.1f} ms, ${t['price_per_gib_hour']:g}/GiB-h" for t in tiers),
             f"{'hot TTL':>8}{'thr':>7}{'hit':>7}" + "".join(f"{n + ' reads':>12}{n + ' peak':>11}{n + ' GiB-s':>12}"
                                                            f"{n + ' $':>9}" for n in names)]
    for s in doc["settings"]:
        rr = s["reverse_read"]
        cells = [f"{s['ttl_s']:>8g}{s['threshold']!s:>7}{rr['hit_rate'] * 100:>6.0f}%"]
        hot_reads = rr["reasons"].get("fetch", 0) - sum(t["reads"] for t in rr["tiers"].values())
        cells.append(f"{hot_reads:>12}{rr['retained_peak_gib']:>11.1f}{rr['retained_gib_s']:>12.0f}"
                     f"{rr['hot_cost']:>9.2f}")
        for name in names[1:]:
            t = rr["tiers"][name]
            cells.append(f"{t['reads']:>12}{t['retained_peak_gib']:>11.1f}{t['retained_gib_s']:>12.0f}{t['cost']:>9.2f}")
        lines.append("".join(cells))
    return lines


def _tp(doc: dict[str, Any]) -> str:
    """The profile line's TP part (nothing at TP1): per-rank KV and what the ranks hold together."""
    tp = doc.get("tensor_parallel") or {}
    if tp.get("tp_size", 1) <= 1:
        return ""
    return (f"TP{tp['tp_size']} ({tp['rank_kv_bytes_per_token'] / 1024:.0f} KiB/token per rank, "
            f"{tp['held_kv_bytes_per_token'] / 1024:.0f} KiB/token over the ranks), ")


# --------------------------------------------------------------------------------------------------- cases
def unfavourable_cases(first_tokens: int = 8000, turns: int = 5) -> dict[str, Trace]:
    """Small traces: a plain continuation and the cases where reverse reads cannot pay."""
    def make(name: str, *, gap_s: float = 5.0, fresh: bool = False, edit_at: int | None = None,
             n_turns: int = turns) -> Trace:
        return uniform_trace(conversations=4, turns=n_turns, first_tokens=first_tokens, new_tokens=300,
                             output_tokens=300, gap_s=gap_s, edit_at=edit_at, fresh=fresh, name=name,
                             start_spacing_s=5.0)

    return {
        "continuation": make("continuation"),
        "no_reusable_context": make("fresh", fresh=True),
        "pauses_past_ttl": make("paused", gap_s=10_000.0),
        "edited_history": make("edited", edit_at=100, n_turns=2),
    }


def run_cases(profile: CostProfile, ttl_s: float, threshold: Threshold) -> list[dict[str, Any]]:
    rows = []
    for name, trace in unfavourable_cases().items():
        prepared = PreparedTrace(trace, profile.block_size)
        off = summarize(simulate(prepared, profile, mode="cache_miss"))
        on = summarize(simulate(prepared, profile, mode="reverse_read", ttl_s=ttl_s, threshold=threshold))
        rows.append({"case": name, "ttft_off_s": off["later_ttft_s"]["mean"], "ttft_on_s": on["later_ttft_s"]["mean"],
                     "turn_off_s": off["turn_s"]["mean"], "turn_on_s": on["turn_s"]["mean"],
                     "hit_rate": on["hit_rate"], "tokens_fetched": on["tokens_fetched"],
                     "retained_gib_s": on["retained_gib_s"], "reasons": on["reasons"]})
    return rows


def format_cases(rows: Iterable[dict[str, Any]], ttl_s: float, threshold: Threshold) -> str:
    lines = [f"{'case':<22}{'TTFT off':>10}{'TTFT on':>10}{'turn off':>10}{'turn on':>10}{'hit':>6}{'GiB-s':>9}"
             "  reasons"]
    for r in rows:
        lines.append(f"{r['case']:<22}{_fmt(r['ttft_off_s']):>10}{_fmt(r['ttft_on_s']):>10}{_fmt(r['turn_off_s']):>10}"
                     f"{_fmt(r['turn_on_s']):>10}{r['hit_rate'] * 100:>5.0f}%{r['retained_gib_s']:>9.0f}  "
                     + ", ".join(f"{k} {v}" for k, v in r["reasons"].items()))
    lines.append(f"TTFT of turns 2+ (mean); TTL {ttl_s:g} s, threshold {threshold}; 4 conversations of 8k-token "
                 "contexts, 300 new + 300 answer tokens per turn; edited: turn 2 changes history token 100")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- plots
def write_plots(doc: dict[str, Any], runs: dict[str, ModeRun], out_dir: str | Path) -> list[Path]:
    """``ttft_vs_prompt.png`` (mean TTFT per prompt-length bin, per mode) and ``retained_vs_ttl.png`` (decode
    memory held for reuse and hit rate vs TTL, per threshold). Matplotlib's Agg backend, no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = doc["settings"]
    shown: dict[str, ModeRun] = {m: runs[m] for m in BASELINES}
    if settings:
        pick = max(settings, key=lambda s: (s["ttl_s"], -s["reverse_read"]["ttft_s"]["mean"]))
        for mode in REVERSE:
            shown[f"{mode} (TTL {pick['ttl_s']:g}, thr {pick['threshold']})"] = runs[
                f"{mode}@{pick['ttl_s']}@{pick['threshold']}"]
    prompts = np.concatenate([np.asarray(r.prompt) for r in shown.values()])
    edges = np.unique(np.quantile(prompts, np.linspace(0, 1, 13)))
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, run in shown.items():
        p, t = np.asarray(run.prompt), np.asarray(run.ttft)
        idx = np.clip(np.digitize(p, edges[1:-1]), 0, max(len(edges) - 2, 0))
        xs = [p[idx == i].mean() for i in range(len(edges) - 1) if np.any(idx == i)]
        ys = [t[idx == i].mean() for i in range(len(edges) - 1) if np.any(idx == i)]
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title(f"TTFT vs prompt length ({doc['profile']['name']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    first = _saved(fig, out / "ttft_vs_prompt.png")

    fig, (mem, hit) = plt.subplots(1, 2, figsize=(11, 4.5))
    for threshold in dict.fromkeys(s["threshold"] for s in settings):
        rows = sorted((s for s in settings if s["threshold"] == threshold), key=lambda s: s["ttl_s"])
        ttls = [s["ttl_s"] for s in rows]
        mem.plot(ttls, [s["reverse_read"]["retained_gib_s"] for s in rows], marker="o", label=f"GiB-s, thr {threshold}")
        mem.plot(ttls, [s["reverse_read"]["retained_peak_gib"] for s in rows], marker="s", linestyle="--",
                 label=f"peak GiB, thr {threshold}")
        hit.plot(ttls, [s["reverse_read"]["hit_rate"] * 100 for s in rows], marker="o", label=f"thr {threshold}")
    mem.set_xlabel("decoder_kv_blocks_ttl (s)")
    mem.set_ylabel("decode memory held for reuse")
    mem.set_yscale("symlog")
    mem.set_title("retained memory vs TTL")
    hit.set_xlabel("decoder_kv_blocks_ttl (s)")
    hit.set_ylabel("turns 2+ reading from decode (%)")
    hit.set_title("reuse hit rate vs TTL")
    for ax in (mem, hit):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return [first, _saved(fig, out / "retained_vs_ttl.png")]


def _saved(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
