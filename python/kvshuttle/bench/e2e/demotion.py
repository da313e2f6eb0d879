"""``kvshuttle bench demotion``: what demoting retentions into a decode's host tier costs the decode's other requests.

One prefill (prefix cache off, core 0) and one decode (core 1) ``vllm serve`` engine with ``KVShuttleConnector``;
the decode has a host tier (``kvshuttle_host_tier_blocks``) and a hot TTL longer than the run, so nothing moves
into the tier unless asked. Bystanders (``bench/e2e/bystander.py``: long streamed completions sent straight to the
decode) stream throughout. Each round first retains ``--windows x --per-window`` conversations on the decode (a
``--history-tokens`` prompt prefilled, read by the decode, answered: the decode keeps prompt + answer under a
handle), untimed; then ``--windows`` pairs of windows of ``--window-s`` seconds, the pair's order alternating:

* ``demote``: ``demote_retention`` (the side-channel op the router's ``--demote-on-stop`` sends) of the next
  ``--per-window`` conversations at the window's start; the decode copies their blocks into the host tier on a kept
  thread of its own process and gives the hot blocks back;
* ``quiet``: nothing.

At the end of a round the demoted conversations are released (the tier is empty again). The bystanders' inter-token
gaps are split by the window their gap ended in: their p50/p99 in demote windows over quiet ones is what demotion
costs the decode's other requests at that rate of demotions, both kinds measured interleaved on the same engines.
``touched``: the gaps that overlapped a copy in flight (from the demotion's request to the copy's end, the copy
time from the decode's log line), against the gaps that overlapped the same span from the start of a quiet window:
the cost to the tokens that met a copy, whatever the rate. The copy rate is the decode's own (bytes over the copy
thread's time per demotion).
``--per-window 0`` demotes nothing: an A/A run, whose "demote" over quiet ratios are the noise of the others.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..schema import envelope
from .bystander import Bystander, summary
from .engines import free_port, shuttle_transfer_config
from .serve import ServedEngine, ServeSpec, metric_total

BLOCK = 32
KINDS = ("demote", "quiet")
COPY_LINE = re.compile(r"kvshuttle: host tier: demoted (\S+) \(([0-9.]+) MiB\) in ([0-9.]+) ms")
Window = tuple[str, float, float]  # (kind, start, end), monotonic seconds
Gap = tuple[float, float]  # (previous token's arrival, this one's)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=4, help="rounds of (retain, windows, release)")
    parser.add_argument("--windows", type=int, default=5, help="demote windows per round, each paired with a quiet one")
    parser.add_argument("--per-window", type=int, default=2,
                        help="conversations demoted at once in a demote window (0: an A/A run, nothing demoted: "
                             "the ratios' own noise)")
    parser.add_argument("--window-s", type=float, default=4.0,
                        help="seconds of each window (long enough for a copy at nice 19 to land within it)")
    parser.add_argument("--history-tokens", type=int, default=2048, help="each conversation's prompt")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--bystanders", type=int, default=2, help="streams of other users' answers on the decode")
    parser.add_argument("--model", default="", help="model directory (default: the tiny random Llama, built here)")
    parser.add_argument("--log-dir", default="")


# --- the arithmetic (tests/test_bench_demotion.py) ------------------------------------------------------------------


def window_order(rounds: int, windows: int) -> list[list[str]]:
    """Per round, the kinds of its windows in order: pairs, the demote window first in every other pair (counted
    across rounds), so a drift of the machine within a pair falls on both kinds alike."""
    out, pair = [], 0
    for _ in range(rounds):
        kinds: list[str] = []
        for _ in range(windows):
            kinds += list(KINDS) if pair % 2 == 0 else list(reversed(KINDS))
            pair += 1
        out.append(kinds)
    return out


def split_gaps(gaps: Sequence[Gap], windows: Sequence[Window]) -> dict[str, list[float]]:
    """Gaps (ms) by the kind of window they ended in; gaps ending outside every window are left out."""
    out: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for begin, end in gaps:
        kind = next((k for k, start, stop in windows if start <= end <= stop), None)
        if kind is not None:
            out[kind].append((end - begin) * 1e3)
    return out


def touched(gaps: Sequence[Gap], spans: Sequence[tuple[float, float]]) -> list[float]:
    """Gaps (ms) that overlapped any of ``spans`` (start, end)."""
    return [(end - begin) * 1e3 for begin, end in gaps if any(begin < stop and end > start for start, stop in spans)]


def copies(log_text: str) -> dict[str, tuple[float, float]]:
    """The decode's demotion copies by handle id prefix: (MiB, ms)."""
    return {m.group(1): (float(m.group(2)), float(m.group(3))) for m in COPY_LINE.finditer(log_text)}


def past_windows(spans: Sequence[tuple[float, float]], windows: Sequence[Window]) -> int:
    """Spans (copies in flight) that ended after the window they started in: their tail fell in the next window."""
    return sum(1 for start, stop in spans if any(a <= start <= b < stop for _, a, b in windows))


def over(subject: dict[str, Any], peer: dict[str, Any], key: str) -> float | None:
    """``subject[key] / peer[key]`` (a time ratio: > 1 is slower), None without both."""
    a, b = subject.get(key), peer.get(key)
    return round(a / b, 3) if a and b else None


def compare(gaps: Sequence[Gap], windows: Sequence[Window], spans: Sequence[tuple[float, float]],
            phantoms: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """The bystanders' gaps in demote and quiet windows, those that met a copy and those that met the same span of
    a quiet window, and the ratios demote / quiet of p50 and p99 (the target: p99 at most 1.2x)."""
    split = split_gaps(gaps, windows)
    out: dict[str, Any] = {kind: summary(split[kind]) for kind in KINDS}
    out["touched"] = {"demote": summary(touched(gaps, spans)), "quiet": summary(touched(gaps, phantoms))}
    for q in ("p50", "p99"):
        out[f"{q}_demote_over_quiet"] = over(out["demote"], out["quiet"], f"itl_ms_{q}")
    out["touched_p50_over_quiet"] = over(out["touched"]["demote"], out["touched"]["quiet"], "itl_ms_p50")
    out["touched_max_over_quiet"] = over(out["touched"]["demote"], out["touched"]["quiet"], "itl_ms_max")
    return out


# --- the live run (needs vLLM) --------------------------------------------------------------------------------------


def _completion(url: str, prompt: list[int], max_tokens: int, params: dict[str, Any]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "kv_transfer_params": params}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as reply:
        out: dict[str, Any] = json.loads(reply.read())
    return out


def _retain(prefill: ServedEngine, decode: ServedEngine, prompt: list[int], answer_tokens: int) -> dict[str, Any]:
    """One conversation's turn through prefill then decode (granted, as a router sends it): the decode's handle."""
    from .conversation import decode_params_for, prefill_params_for

    first = _completion(prefill.url, prompt, 1, prefill_params_for(None))
    answer = _completion(decode.url, prompt, answer_tokens, decode_params_for(first["kv_transfer_params"]))
    params: dict[str, Any] | None = answer.get("kv_transfer_params")
    if not params or not params.get("kvshuttle_handle_id"):
        raise RuntimeError(f"the decode retained nothing: {params}")
    return params


def _round(r: int, kinds: list[str], args: argparse.Namespace, engines: tuple[ServedEngine, ServedEngine],
           ) -> tuple[list[Window], list[tuple[float, float, str]], int]:
    """One round: retain, the windows, release. (windows, demotions as (request, reply, handle id), demoted)."""
    from ...transfer.control import demote_retention, release_retention
    from .tiny_model import random_prompt

    prefill, decode = engines
    handles = [_retain(prefill, decode, random_prompt(args.history_tokens, seed=1000 * r + c), args.answer_tokens)
               for c in range(args.windows * args.per_window)]
    print(f"round {r + 1}: retained {[h['kvshuttle_handle_id'][:12] for h in handles]}", file=sys.stderr)
    before = metric_total(decode.metrics(), "vllm:kvshuttle_tier_demotions_total")
    windows: list[Window] = []
    asked: list[tuple[float, float, str]] = []
    queue = list(handles)
    for kind in kinds:
        start = time.monotonic()
        if kind == "demote":
            for params in queue[:args.per_window]:
                sent = time.monotonic()
                if not demote_retention(params, timeout_s=30.0):
                    raise RuntimeError(f"the decode kept {params['kvshuttle_handle_id'][:12]} hot (tier full?)")
                asked.append((sent, time.monotonic(), str(params["kvshuttle_handle_id"])))
            del queue[:args.per_window]
        time.sleep(max(0.0, start + args.window_s - time.monotonic()))
        windows.append((kind, start, time.monotonic()))
    deadline = time.monotonic() + 60  # copies at nice 19 on a busy core may still be landing
    while True:
        demoted = int(metric_total(decode.metrics(), "vllm:kvshuttle_tier_demotions_total") - before)
        if demoted >= len(asked) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for params in handles:
        release_retention(params, timeout_s=30.0)
    return windows, asked, demoted


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    model = args.model
    if not model:
        from .tiny_model import assets_root, build_tiny_llama

        model = str(build_tiny_llama(assets_root() / "tiny-llama"))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvshuttle-demotion-"))
    logs.mkdir(parents=True, exist_ok=True)
    held = -(-(args.history_tokens + args.answer_tokens - 1) // BLOCK)  # blocks a conversation keeps
    tier_blocks = max(1, (held + 1) * args.windows * args.per_window)  # a block of slack each: never "tier full"
    # nothing leaves the hot cache unasked: a hot TTL past the run, a budget that holds every conversation (the
    # default fraction of the cache would demote the oldest while later ones are retained)
    tier = {"decoder_kv_blocks_ttl": 3000.0, "kvshuttle_host_tier_blocks": tier_blocks,
            "kvshuttle_retention_budget_blocks": tier_blocks}
    prefill = ServedEngine(ServeSpec(model=model, name="prefill", enable_prefix_caching=False, cpu_cores=(0,),
                                     kv_transfer_config=shuttle_transfer_config(), log_path=str(logs / "prefill.log")))
    decode = ServedEngine(ServeSpec(model=model, name="decode", cpu_cores=(1,), kv_cache_space_gib=2,
                                    kv_transfer_config=shuttle_transfer_config(kvshuttle_port=free_port(), **tier),
                                    log_path=str(logs / "decode.log")))
    rounds: list[tuple[list[Window], list[tuple[float, float, str]], dict[str, Any]]] = []
    bystanders: list[Bystander] = []
    try:
        for engine in (prefill, decode):
            engine.launch()
        for engine in (prefill, decode):
            engine.wait_ready()
        # a request's whole context fits the model's 4,096 tokens: few restarts (a restart's prefill is a long gap)
        bystanders = [Bystander(decode.url, max_tokens=3500, name=f"bystander{i}").start()
                      for i in range(args.bystanders)]
        for r, kinds in enumerate(window_order(args.rounds, args.windows)):
            w, a, demoted = _round(r, kinds, args, (prefill, decode))
            rounds.append((w, a, {"round": r + 1, "demoted": demoted, "asked": len(a), "load_avg": _load()}))
    finally:
        for b in bystanders:
            b.stop()
        for engine in (prefill, decode):
            engine.close()
    gaps = [g for b in bystanders for g in b.gaps]
    logged = copies((logs / "decode.log").read_text())
    sizes = [logged.get(handle_id[:12], (0.0, 0.0)) for _, a, _ in rounds for _, _, handle_id in a]
    # a copy in flight: from the demotion's request to its reply plus the copy thread's time (the copy starts
    # before the reply); a quiet window's phantom: the median such span from its start
    spans = [[(sent, replied + logged.get(h[:12], (0.0, 0.0))[1] / 1e3) for sent, replied, h in a]
             for _, a, _ in rounds]
    length = statistics.median(e - s for each in spans for s, e in each) if any(spans) else 0.0
    phantoms = [[(s, s + length) for k, s, _ in w if k == "quiet"] for w, _, _ in rounds]
    per_round = [{**row, **_ratios(compare(gaps, w, spans[i], phantoms[i]))} for i, (w, _, row) in enumerate(rounds)]
    windows = [x for w, _, _ in rounds for x in w]
    demote_s = sum(e - s for k, s, e in windows if k == "demote")
    result = {"case": f"{args.per_window} x {held} blocks per {2 * args.window_s:g} s",
              **compare(gaps, windows, [x for each in spans for x in each], [x for each in phantoms for x in each]),
              "demotions": len(sizes), "demoted": sum(row["demoted"] for row in per_round),
              "copies_logged": sum(1 for m, _ in sizes if m), "blocks_per_demotion": held,
              "copy_mib_median": _median(m for m, _ in sizes if m), "copy_ms_median": _median(t for m, t in sizes if m),
              "copy_gbps_median": _median(m * 2**20 / t / 1e6 for m, t in sizes if m and t),
              "offered_mib_per_s": round(sum(m for m, _ in sizes) / max(1e-9, demote_s), 1),
              "copies_past_window": past_windows([x for each in spans for x in each], windows),
              "rounds": len(per_round), "per_round": per_round,
              "bystander_errors": [e for b in bystanders for e in b.errors][:5]}
    result["verified"] = result["demoted"] == result["demotions"] == result["copies_logged"]
    # min / median / max of the rounds' own ratios (not the schema's ratio_spread: the pooled ratio is no median)
    result["round_spread"] = {key: _spread([row[key] for row in per_round if row.get(key)])
                              for key in ("p50_demote_over_quiet", "p99_demote_over_quiet")}
    # the schema's per-method seconds: the median gap (seconds per token) in each kind of window
    result["seconds"] = {kind: round(result[kind]["itl_ms_p50"] / 1e3, 5) for kind in KINDS
                         if result[kind].get("itl_ms_p50")}
    note = (f"one prefill (prefix cache off, core 0) and one decode (core 1, a host tier of {tier_blocks} blocks) "
            f"vllm serve, tiny random Llama (float32, 1 MiB per 32-token block); {args.bystanders} bystanders "
            "streaming from the decode; demotions by demote_retention on the decode's side channel")
    return envelope("demotion", args, add_arguments, [result], note=note, started=started)


def _ratios(cmp: dict[str, Any]) -> dict[str, Any]:
    keys = ("p50_demote_over_quiet", "p99_demote_over_quiet", "touched_p50_over_quiet")
    return {k: cmp[k] for k in keys} | {f"{kind}_p99_ms": cmp[kind].get("itl_ms_p99") for kind in KINDS}


def _median(values: Any) -> float | None:
    values = list(values)
    return round(statistics.median(values), 2) if values else None


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"min": min(values), "median": round(statistics.median(values), 3), "max": max(values)} if values else None


def _load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'bystander gaps':<16} {'tokens':>7} {'ITL p50':>8} {'p90':>7} {'p99':>7} {'max':>7}  (ms)"]
    for r in result["results"]:
        for label, s in (("demote windows", r["demote"]), ("quiet windows", r["quiet"]),
                         ("met a copy", r["touched"]["demote"]), ("same, quiet", r["touched"]["quiet"])):
            cells = [s.get(f"itl_ms_{q}", "-") for q in ("p50", "p90", "p99", "max")]
            lines.append(f"{label:<16} {s['tokens']:>7} " + " ".join(f"{c!s:>7}" for c in cells))
        spread = r["round_spread"]["p99_demote_over_quiet"] or {}
        lines.append(f"p99 demote / quiet {r['p99_demote_over_quiet']} (rounds {spread.get('min')}-"
                     f"{spread.get('max')}; target <= 1.2), p50 {r['p50_demote_over_quiet']}; "
                     f"{r['demoted']}/{r['demotions']} demoted, {r['copy_mib_median']} MiB each in "
                     f"{r['copy_ms_median']} ms ({r['copy_gbps_median']} GB/s; {r.get('copies_past_window')} "
                     f"ended past their window), {r['offered_mib_per_s']} MiB/s in demote windows; load "
                     f"{result['machine']['load_avg']}")
        lines += [f"  round {row['round']}: p99 {row['quiet_p99_ms']} -> {row['demote_p99_ms']} ms "
                  f"({row['p99_demote_over_quiet']}x), load {row['load_avg']}" for row in r["per_round"]]
    return "\n".join(lines)
