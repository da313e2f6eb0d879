"""``kvshuttle bench tier-replay``: a shortened live Claude Code replay that checks the planner's hot-peak reduction.

Issue 35's target: turns after a pause beyond the hot TTL reuse instead of recompute, and the decode's hot tier
peaks at a quarter or less of the single-tier peak for the same hit rate. The planner predicts it on the 40
Claude Code sessions; this replays a few of them live, twice, and runs the planner on the same shortened trace:

* the trace: the first ``--sessions`` sessions of ``aiperf-sessions/kvcachetester_128k_40sessions.aiperf.jsonl``,
  ``--turns`` turns each, lengths capped for the tiny model as in ``bench clients``, the trace's own gaps times
  ``--time-scale`` (at most ``--max-gap-s``), sessions starting ``--stagger-s`` apart; the same turns written as
  the planner's JSON lines (history = the previous prompt + its answer, as aiperf threads it);
* two runs through ``kvshuttle router`` (the conversation id in every body) into a fresh prefill + decode each
  (:class:`.clients.Deployment`): ``single``, the hot tier alone with ``--long-ttl``; ``tiered``, ``--hot-ttl``
  then a host tier of ``--tier-blocks`` blocks;
* the decode's ``vllm:kvshuttle_retained_blocks`` (hot) and ``vllm:kvshuttle_tier_blocks`` (host) gauges sampled
  every ``--sample-ms`` while aiperf runs: each run's hot peak; later turns whose prefill read the history back
  (its ``read N tokens`` log lines) over later turns: the hit rate;
* the planner (``reverse_read``, the prefill's prefix cache off as here; profile ``--profile``, by default the
  ``measured`` tiny-model one) on the shortened trace with the same TTLs: predicted hot peaks, their ratio, hit
  rates, next to the measured ones.

The gauges move when the decode steps (the connector reports them with each step's stats; a TTL ends at the
next step's sweep), so an idle decode holds, and shows, what it held at its last step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .schema import envelope

TRACE = "aiperf-sessions/kvcachetester_128k_40sessions.aiperf.jsonl"
HOT_GAUGE = "vllm:kvshuttle_retained_blocks"
TIER_GAUGE = "vllm:kvshuttle_tier_blocks"
RUNS = ("single", "tiered")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", default="../shared/data/traces", help="the traces folder")
    parser.add_argument("--sessions", type=int, default=8, help="the trace's first N sessions")
    parser.add_argument("--turns", type=int, default=8, help="each session's first N turns")
    parser.add_argument("--first-tokens", type=int, default=512, help="cap on a session's first prompt")
    parser.add_argument("--turn-tokens", type=int, default=96, help="cap on a later turn's new tokens")
    parser.add_argument("--answer-tokens", type=int, default=16, help="cap on every answer")
    parser.add_argument("--time-scale", type=float, default=0.5, help="the trace's gaps times this")
    parser.add_argument("--max-gap-s", type=float, default=8.0, help="cap on a scaled gap (s)")
    parser.add_argument("--stagger-s", type=float, default=2.0, help="between the sessions' first turns (s)")
    parser.add_argument("--long-ttl", type=float, default=600.0, help="the single run's hot TTL (s)")
    parser.add_argument("--hot-ttl", type=float, default=0.5, help="the tiered run's hot TTL (s)")
    parser.add_argument("--tier-blocks", type=int, default=3072, help="the tiered run's host tier, in KV blocks")
    parser.add_argument("--tier-ttl", type=float, default=1800.0, help="the host tier's TTL (s)")
    parser.add_argument("--budget-fraction", type=float, default=0.9,
                        help="the decode's retention budget (share of its KV blocks; the default 0.25 would cap the "
                             "single run's peak)")
    parser.add_argument("--reads", choices=("multi_read", "use_once"), default="multi_read",
                        help="the decode's kvshuttle_reads: use_once ends a retention at its read (the planner's "
                             "model), multi_read (the default) keeps it for its TTL")
    parser.add_argument("--sample-ms", type=int, default=200, help="gauge sampling interval")
    parser.add_argument("--profile", default="measured", help="the planner's cost profile")
    parser.add_argument("--aiperf", default="", help="aiperf 0.13.0's executable (default: bench clients')")
    parser.add_argument("--model", default="", help="model directory (default: the tiny random Llama, built here)")
    parser.add_argument("--log-dir", default="")


def shorten(rows: list[dict[str, Any]], *, sessions: int, turns: int, first_tokens: int, turn_tokens: int,
            answer_tokens: int, time_scale: float, max_gap_s: float, stagger_s: float, prefix: str
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trace's first ``sessions`` sessions, ``turns`` turns each, lengths capped, gaps scaled and capped:
    (aiperf ``mooncake_trace`` rows keyed by ``conversation_id``, the same turns as planner trace rows)."""
    order: list[str] = []
    by_session: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        sid = str(row["session_id"])
        if sid not in by_session:
            if len(order) == sessions:
                continue
            order.append(sid)
            by_session[sid] = []
        by_session[sid].append(row)
    live: list[dict[str, Any]] = []
    plan: list[dict[str, Any]] = []
    for n, sid in enumerate(order):
        name, history = f"{prefix}-{sid}", 0
        for k, row in enumerate(by_session[sid][:turns]):
            new = max(1, min(int(row["input_length"]), first_tokens if k == 0 else turn_tokens))
            out = max(1, min(int(row.get("output_length", answer_tokens)), answer_tokens))
            gap_ms = round(n * stagger_s * 1e3) if k == 0 else round(
                min(float(row.get("delay", 0)) * time_scale, max_gap_s * 1e3))
            live.append({"session_id": name, "input_length": new, "output_length": out,
                         **({"timestamp": gap_ms} if k == 0 else {"delay": gap_ms}),
                         "extra": {"conversation_id": name}})
            plan.append({"conversation": name, "turn": k + 1, "prompt_tokens": history + new, "new_tokens": new,
                         "output_tokens": out, "gap_s": gap_ms / 1e3})
            history += new + out
    return live, plan


def gauges(prometheus_text: str) -> tuple[float, float]:
    """(hot retained blocks, host tier blocks) from the decode's ``/metrics`` text."""
    from .e2e.serve import metric_total

    return metric_total(prometheus_text, HOT_GAUGE), metric_total(prometheus_text, TIER_GAUGE)


class Sampler:
    """Polls ``read()`` (Prometheus text) every ``interval_s`` on a thread: ``samples`` of (seconds, hot, tier)."""

    def __init__(self, read: Any, interval_s: float) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.errors = 0
        self._read, self._interval = read, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gauge-sampler", daemon=True)
        self._t0 = time.monotonic()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                hot, tier = gauges(self._read())
                self.samples.append((round(time.monotonic() - self._t0, 2), hot, tier))
            except OSError:  # a slow answer under load: the next poll
                self.errors += 1
            self._stop.wait(self._interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def peaks(samples: list[tuple[float, float, float]]) -> dict[str, float]:
    """Peak hot and tier blocks, and the hot blocks' mean over the samples (block-seconds / seconds)."""
    if not samples:
        return {"hot_peak_blocks": 0.0, "tier_peak_blocks": 0.0, "hot_mean_blocks": 0.0}
    return {"hot_peak_blocks": max(s[1] for s in samples), "tier_peak_blocks": max(s[2] for s in samples),
            "hot_mean_blocks": round(sum(s[1] for s in samples) / len(samples), 2)}


def predict(plan_rows: list[dict[str, Any]], profile_name: str, *, ttl_s: float,
            tier_ttl_s: float | None) -> dict[str, Any]:
    """The planner on the shortened trace (``reverse_read``, threshold 64 as the connector's default): hit rate,
    hot peak (GiB and the profile's blocks) and the host tier's, for a hot TTL and an optional host tier (read at
    the profile's link, since only the peaks and hits are compared)."""
    from ..planner import PreparedTrace, load_profile, parse_trace, simulate, summarize
    from ..planner.tiers import Tier

    profile = load_profile(profile_name)
    trace = parse_trace([json.dumps(r) for r in plan_rows], source="shortened")
    tiers = [] if tier_ttl_s is None else [Tier("host", tier_ttl_s, profile.bandwidth_bytes_per_s,
                                                profile.transfer_overhead_s)]
    run = summarize(simulate(PreparedTrace(trace, profile.block_size), profile, mode="reverse_read", ttl_s=ttl_s,
                             threshold=64, tiers=tiers))
    block_gib = profile.held_kv_bytes_per_token * profile.block_size / 2**30
    host = run["tiers"].get("host", {})
    return {"hit_rate": round(run["hit_rate"], 4), "hot_peak_gib": round(run["retained_peak_gib"], 4),
            "hot_peak_blocks": round(run["retained_peak_gib"] / block_gib, 1),
            "tier_peak_blocks": round(host.get("retained_peak_gib", 0.0) / block_gib, 1),
            "tier_reads": host.get("reads", 0), "reasons": run["reasons"]}


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Tiered over single: measured and predicted hot-peak ratios and hit rates."""
    by = {r["row"]: r for r in results}
    if not all(name in by for name in RUNS):
        return {}
    single, tiered = by["single"], by["tiered"]

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    return {"measured_hot_peak_ratio": ratio(tiered["hot_peak_blocks"], single["hot_peak_blocks"]),
            "predicted_hot_peak_ratio": ratio(tiered["predicted"]["hot_peak_blocks"],
                                              single["predicted"]["hot_peak_blocks"]),
            "measured_hit_rate": {n: by[n]["hit_rate"] for n in RUNS},
            "predicted_hit_rate": {n: by[n]["predicted"]["hit_rate"] for n in RUNS}}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'run':<8} {'hot TTL s':>9} {'later':>5} {'reused':>6} {'hit':>6} {'plan hit':>8} {'tier reads':>10} "
             f"{'hot peak':>8} {'plan peak':>9} {'host peak':>9} {'later TTFT ms':>13}"]
    for r in result["results"]:
        p = r["predicted"]
        lines.append(f"{r['row']:<8} {r['hot_ttl_s']:>9g} {r['later_turns']:>5} {r['reused_turns']:>6} "
                     f"{r['hit_rate']:>6.2f} {p['hit_rate']:>8.2f} {r['tier']['reads']:>10} "
                     f"{r['hot_peak_blocks']:>8.0f} {p['hot_peak_blocks']:>9.0f} {r['tier_peak_blocks']:>9.0f} "
                     f"{r['later_ttft_p50_ms']!s:>13}")
    s = result["summary"]
    if s:
        lines.append(f"hot peak tiered / single: measured {s['measured_hot_peak_ratio']}, planner "
                     f"{s['predicted_hot_peak_ratio']} (peaks in KV blocks; plan: the planner on the same turns)")
    return "\n".join(lines)


# --- the live run (needs vLLM, redis-server and aiperf) -----------------------------------------------------


def _run(name: str, seed: int, args: argparse.Namespace, live: list[dict[str, Any]], plan: list[dict[str, Any]],
         model: str, logs: Path, aiperf: str) -> dict[str, Any]:
    from . import clients
    from .e2e.engines import kill_group

    single = name == "single"
    hot_ttl = args.long_ttl if single else args.hot_ttl
    folder = logs / name
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "replay.aiperf.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in live))
    deployment = clients.Deployment(model, folder, hot_ttl=hot_ttl, tier_blocks=0 if single else args.tier_blocks,
                                    tier_ttl=None if single else args.tier_ttl,
                                    decode_extra={"kvshuttle_retention_budget_fraction": args.budget_fraction,
                                                  "kvshuttle_reads": args.reads}).start()
    try:
        home = clients.hf_home(model, folder)
        router, url = deployment.router(folder / "router.log", [])
        log_path = Path(deployment.prefill.spec.log_path or "")
        offset = log_path.stat().st_size
        tier_before = clients.tier_counts(deployment.decode.metrics())
        try:
            with Sampler(deployment.decode.metrics, args.sample_ms / 1e3) as sampler:
                code = clients.aiperf_profile(aiperf, url, data, folder / "aiperf", seed, folder / "aiperf.log",
                                              home)
                time.sleep(1.0)  # the last answers' retentions land in the gauges with a later step's stats
            tier_after = clients.tier_counts(deployment.decode.metrics())
        finally:
            kill_group(router.pid)
        reads = clients.prefill_reads(log_path, offset)
    finally:
        deployment.close()
    _, turns = clients.aiperf_turns(folder / "aiperf")
    sessions = len({r["session_id"] for r in live})
    later = len(live) - sessions
    predicted = predict(plan, args.profile, ttl_s=hot_ttl, tier_ttl_s=None if single else args.tier_ttl)
    every = max(1, len(sampler.samples) // 400)  # the series, thinned to about 400 points
    return {"row": name, "hot_ttl_s": hot_ttl, "tier_blocks": 0 if single else args.tier_blocks,
            "aiperf_exit": code, "turns": len(live), "later_turns": later, "reused_turns": len(reads),
            "hit_rate": round(len(reads) / later, 4) if later else 0.0, "read_tokens": sum(reads),
            "failed_turns": sum(t["status"] != 200 for t in turns),
            "later_ttft_p50_ms": clients.later_ttft_p50_ms(turns),
            "tier": {k: int(tier_after[k] - tier_before[k]) for k in tier_after},
            **peaks(sampler.samples), "samples_taken": len(sampler.samples), "sample_errors": sampler.errors,
            "series": sampler.samples[::every], "predicted": predicted, "rounds": max(1, later),
            "seconds": {"ttft_median": round(ttft / 1e3, 4)} if (ttft := clients.later_ttft_p50_ms(turns)) else {}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from .clients import DEFAULT_AIPERF

    started = time.perf_counter()
    aiperf = args.aiperf or str(DEFAULT_AIPERF)
    if not Path(aiperf).exists():
        raise SystemExit(f"aiperf not found at {aiperf} (python3 -m venv V && V/bin/pip install aiperf==0.13.0)")
    rows = [json.loads(line) for line in (Path(args.traces) / TRACE).read_text().splitlines()
            if line.startswith("{")]
    live, plan = shorten(rows, sessions=args.sessions, turns=args.turns, first_tokens=args.first_tokens,
                         turn_tokens=args.turn_tokens, answer_tokens=args.answer_tokens, time_scale=args.time_scale,
                         max_gap_s=args.max_gap_s, stagger_s=args.stagger_s, prefix="replay")
    model = args.model
    if not model:
        from .e2e.tiny_model import assets_root, build_tiny_llama

        model = str(build_tiny_llama(assets_root() / "tiny-llama"))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvshuttle-tier-replay-"))
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "shortened.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plan))
    results = [_run(name, 2000 + i, args, live, plan, model, logs, aiperf) for i, name in enumerate(RUNS)]
    note = (f"aiperf 0.13.0 replaying the first {args.sessions} sessions x {args.turns} turns of {TRACE} (first "
            f"prompt <= {args.first_tokens}, later <= {args.turn_tokens} new, answers <= {args.answer_tokens} "
            f"tokens; gaps x {args.time_scale:g}, <= {args.max_gap_s:g} s; sessions {args.stagger_s:g} s apart) "
            "through kvshuttle router into a fresh prefill (prefix cache off, core 0) and decode (core 1) per run, "
            f"vllm serve, tiny random Llama; single: hot TTL {args.long_ttl:g} s; tiered: {args.hot_ttl:g} s then "
            f"{args.tier_blocks} host blocks; retention budget {args.budget_fraction:g} of the decode's blocks, "
            f"reads {args.reads}; "
            f"decode gauges sampled every {args.sample_ms} ms; predicted: kvshuttle "
            f"plan (reverse_read, profile {args.profile}) on the same turns; shortened trace in the log dir")
    return envelope("tier-replay", args, add_arguments, results, note=note, started=started,
                    summary={**compare(results), "planner_trace": plan})
