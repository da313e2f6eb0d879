"""``kvshuttle bench placement``: placement against the production baseline (prefix caches on, two prefills).

Two prefill ``vllm serve`` engines (their own prefix caches on) and one decode, all with ``KVShuttleConnector``,
behind a ``kvshuttle router`` process; each configuration runs the same multi-turn conversations (same seeds:
the same messages while the answers match), streamed, with ``--gap-s`` between an answer and its conversation's
next turn (an agent's tool call). Every engine's prefix cache is reset between configurations. Configurations:

* ``local_cache``: the router keeps each conversation on one prefill (affinity) and never hands it a decode
  handle (``--no-reverse-reads``): later turns get only what that prefill's own cache holds (what a deployment
  without bidirectional transfer already does);
* ``reverse_reads``: the same, with reverse reads on top (what is left beyond the local hit is read back);
* ``spread_local`` / ``spread_reverse``: no affinity (``--affinity none``: turns alternate between the prefills),
  without and with reverse reads: the misses of a router that does not place;
* ``prewarm``: affinity, reverse reads and ``--prewarm``: the router warms the next turn's prefill in the gap;
* ``decode_local``: affinity, reverse reads and ``--decode-local-max-tokens``: short follow-ups run on the decode;
* ``floor``: affinity with the bench warming the next turn's prefill itself, synchronously, before each turn
  (the history already in that prefill's cache: nothing to read, only the suffix computed).

Per turn: TTFT and turn latency (client side, through the router), where it was computed (the router's
``placement``, the prefill whose prompt counter moved), and the prompt's tokens: from that prefill's own cache,
read from the decode, computed. Per configuration: medians of later turns, their TTFT over the floor's, and the
decode's retained GiB-seconds (its ``vllm:kvshuttle_retained_blocks`` gauge sampled after every turn, times the
time to the next sample). Every answer is compared with one prefill answering the same messages alone, its
prefix cache bypassed with a ``cache_salt`` (greedy: they must be equal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..schema import envelope
from .bystander import Bystander, gap_stats
from .deployment import QUESTIONS, ask, context_document, cores, counters, delta, router_counts, start_router
from .engines import free_port, kill_group, shuttle_transfer_config
from .serve import ServedEngine, ServeSpec, metric_total

CONFIGS: dict[str, list[str]] = {
    "floor": [],
    "local_cache": ["--no-reverse-reads"],
    "reverse_reads": [],
    "spread_local": ["--affinity", "none", "--no-reverse-reads"],
    "spread_reverse": ["--affinity", "none"],
    "prewarm": ["--prewarm"],
    "decode_local": ["--decode-local-max-tokens", "{decode_local}"],
}
BLOCK = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--conversations", type=int, default=3,
                        help="interleaved turn by turn (odd: round robin then alternates each one's prefills)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context-words", type=int, default=300, help="the first message's document")
    parser.add_argument("--followup-words", type=int, default=60, help="new material with each later question")
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--gap-s", type=float, default=1.5, help="seconds from an answer to the next turn")
    parser.add_argument("--decode-local", type=int, default=256, help="decode_local's --decode-local-max-tokens")
    parser.add_argument("--bystander", action="store_true",
                        help="stream another user's long answer from the decode throughout, and report its "
                             "inter-token gaps during the measured turns and outside them (bench/e2e/bystander.py)")
    parser.add_argument("--model", default="", help="model directory (default: the tiny random Llama, built here)")
    parser.add_argument("--log-dir", default="")


def _message(config: int, conversation: int, k: int, args: argparse.Namespace) -> str:
    """Turn ``k``'s message: the same number of words in every configuration, other words in each (no
    configuration hits blocks another left in a cache that would not reset)."""
    words = args.context_words if k == 0 else args.followup_words
    text = context_document(words, seed=100_000 * config + 1000 * conversation + k) if words else ""
    question = QUESTIONS[k % len(QUESTIONS)]
    return f"{text}\n\n{question}" if text else question


def _post(url: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as reply:
        return json.loads(reply.read() or b"null")


def _reset(engines: list[ServedEngine]) -> list[str]:
    """Empty every engine's prefix cache (vLLM's dev endpoint; released retention is freed when the engine
    next steps, so a failed reset is retried after a 1-token request); the names of those that would not (a
    handle whose take failed stays retained to its TTL). Each configuration's words differ anyway."""
    stuck = []
    for engine in engines:
        for _ in range(6):
            if (_post(engine.url + "/reset_prefix_cache") or {}).get("success"):
                break
            _post(engine.url + "/v1/completions", {"model": "tiny", "prompt": "step", "max_tokens": 1})
            time.sleep(0.5)
        else:
            stuck.append(engine.spec.name)
    return stuck


def _warm(engine: ServedEngine, messages: list[dict[str, str]]) -> None:
    """The floor: the history (as the next prompt starts) computed on ``engine`` before the turn, untimed."""
    _post(engine.url + "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1,
                                                "add_generation_prompt": False, "continue_final_message": False})


def _retained(decode: ServedEngine) -> float:
    return metric_total(decode.metrics(), "vllm:kvshuttle_retained_blocks")


def _kv_bytes_per_block(model: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4 * BLOCK)  # float32


def _run_config(name: str, args: argparse.Namespace, prefills: list[ServedEngine], decode: ServedEngine,
                kv_port: int, logs: Path, block_bytes: int) -> dict[str, Any]:
    import openai

    extra = [a.format(decode_local=args.decode_local) for a in CONFIGS[name]]
    router, url = start_router(prefills, decode, kv_port, logs / f"router-{name}.log", extra)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    alone = openai.OpenAI(base_url=prefills[0].url + "/v1", api_key="none", max_retries=0, timeout=600)
    histories: list[list[dict[str, str]]] = [[] for _ in range(args.conversations)]
    served: list[int | None] = [None] * args.conversations
    answered = [0.0] * args.conversations
    turns: list[dict[str, Any]] = []
    block_seconds, sampled, leftover = 0.0, time.monotonic(), _retained(decode)  # not this configuration's
    bystander = Bystander(decode.url, name=f"bystander-{name}").start() if args.bystander else None
    windows: list[tuple[float, float, float]] = []  # later turns: (request, first token, last token)
    try:
        for k in range(args.turns):
            for c in range(args.conversations):
                wait = answered[c] + args.gap_s - time.monotonic()
                if k and wait > 0:
                    time.sleep(wait)
                if name == "floor" and k and served[c] is not None:
                    _warm(prefills[served[c]], histories[c])  # type: ignore[index]
                histories[c].append({"role": "user", "content": _message(list(CONFIGS).index(name), c, k, args)})
                counted = time.monotonic()
                before = [counters(p) for p in prefills], counters(decode), router_counts(url)
                asked = time.monotonic()
                answer, ttft, took = ask(client, histories[c], True, args.answer_tokens, f"{name}-{c}")
                answered[c] = time.monotonic()
                if k:
                    windows.append((asked, asked + ttft, answered[c]))
                after = [counters(p) for p in prefills], counters(decode), router_counts(url)
                now, held = time.monotonic(), _retained(decode)
                block_seconds += max(0.0, held - leftover) * (now - sampled)
                sampled = now
                moved = [delta(a, b) for a, b in zip(after[0], before[0], strict=True)]
                busiest = max(range(len(prefills)), key=lambda i: moved[i]["prompt"])
                placement = [x for x, n in after[2].items() if n > before[2].get(x, 0.0)]
                d = delta(after[1], before[1])
                if bystander is not None:  # its prompts moved the decode's counter too (never its cache hits)
                    d["prompt"] -= bystander.prompts_between(counted, time.monotonic())
                on_prefill = moved[busiest]["prompt"] > 0
                served[c] = busiest if on_prefill else served[c]
                p = moved[busiest] if on_prefill else {**d, "read": 0.0}  # decode-local: the decode's own counts
                reference, _, _ = ask(alone, histories[c], False, args.answer_tokens, None,
                                      cache_salt=f"reference-{name}-{c}-{k}")
                turns.append({"conversation": c, "turn": k + 1, "ttft_s": round(ttft, 4), "latency_s": round(took, 4),
                              "placement": placement[0] if placement else None,
                              "prefill": busiest if on_prefill else None, "prompt_tokens": int(p["prompt"]),
                              "local_tokens": int(p["local"]), "read_tokens": int(p["read"]),
                              "computed_tokens": int(p["prompt"] - p["local"] - p["read"]),
                              "decode_local_tokens": int(d["local"]), "matches_recompute": answer == reference})
                histories[c].append({"role": "assistant", "content": answer})
        prewarms = router_counts(url, "prewarms", "result")
    finally:
        for c in range(args.conversations):  # the decode lets go of every conversation before the next config
            with contextlib.suppress(OSError):
                urllib.request.urlopen(urllib.request.Request(f"{url}/v1/conversations/{name}-{c}",
                                                              method="DELETE"), timeout=30).close()
        kill_group(router.pid)
        if bystander is not None:
            bystander.stop()
    later = [t for t in turns if t["turn"] > 1]
    extra_fields = {} if bystander is None else {
        "bystander": {**gap_stats(bystander.gaps, windows), "errors": bystander.errors[:5]}}
    return {"config": name, "router_args": extra, "turns": turns,
            "later_turns": {"ttft_s_median": _median(t["ttft_s"] for t in later),
                            "latency_s_median": _median(t["latency_s"] for t in later),
                            "local_tokens": sum(t["local_tokens"] for t in later),
                            "read_tokens": sum(t["read_tokens"] for t in later),
                            "computed_tokens": sum(t["computed_tokens"] for t in later),
                            "decode_local_turns": sum(t["placement"] == "decode_local" for t in later)},
            "seconds": _seconds(later), "rounds": len(later),
            "decode_retained_gib_s": round(block_seconds * block_bytes / (1 << 30), 4),
            "prewarms": {k: int(v) for k, v in prewarms.items() if v},
            "verified": all(t["matches_recompute"] for t in turns), **extra_fields}


def _seconds(turns: list[dict[str, Any]]) -> dict[str, float]:
    """The schema's per-row times: medians over the later turns (a first turn has nothing to place)."""
    out = {"ttft_median": _median(t["ttft_s"] for t in turns), "turn_median": _median(t["latency_s"] for t in turns)}
    return {k: v for k, v in out.items() if v}


def _median(values: Any) -> float | None:
    values = list(values)
    return round(statistics.median(values), 4) if values else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    model = args.model
    if not model:
        from .tiny_model import assets_root, build_tiny_llama

        model = str(build_tiny_llama(assets_root() / "tiny-llama"))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvshuttle-placement-"))
    logs.mkdir(parents=True, exist_ok=True)
    kv_port = free_port()
    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache between configurations
    prefills = [ServedEngine(ServeSpec(model=model, name=f"prefill{i}", kv_transfer_config=shuttle_transfer_config(),
                                       cpu_cores=(0,), env=dev, log_path=str(logs / f"prefill{i}.log")))
                for i in range(2)]
    decode = ServedEngine(ServeSpec(model=model, name="decode", cpu_cores=(1 % cores(),), env=dev,
                                    kv_transfer_config=shuttle_transfer_config(kvshuttle_port=kv_port),
                                    log_path=str(logs / "decode.log")))
    results = []
    try:
        for engine in (*prefills, decode):
            engine.launch()
        for engine in (*prefills, decode):
            engine.wait_ready()
        block_bytes = _kv_bytes_per_block(model)
        for name in names:
            stuck = _reset([*prefills, decode])
            results.append({**_run_config(name, args, prefills, decode, kv_port, logs, block_bytes),
                            "caches_not_reset": stuck})
    finally:
        for engine in (*prefills, decode):
            engine.close()
    floor = next((r["later_turns"]["ttft_s_median"] for r in results if r["config"] == "floor"), None)
    for r in results:
        ttft = r["later_turns"]["ttft_s_median"]
        r["ttft_over_floor"] = round(ttft / floor, 3) if floor and ttft else None
    note = ("two prefill vllm serve engines (prefix caches on, both on core 0) and one decode (core 1) behind "
            "kvshuttle router on a 2-vCPU VM; streamed turns, one at a time; tiny random Llama (float32)")
    return envelope("placement", args, add_arguments, results, note=note, started=started)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'config':<15} {'TTFT p50':>9} {'/floor':>7} {'turn p50':>9} {'local':>7} {'read':>6} "
             f"{'computed':>9} {'dec-local':>9} {'GiB-s':>7} {'prewarm used/sent':>17} {'ok':>3}"]
    for r in result["results"]:
        later, pw = r["later_turns"], r["prewarms"]
        warm = f"{pw.get('used', 0)}/{pw.get('sent', 0)}" if pw else "-"
        over = r["ttft_over_floor"] if r["ttft_over_floor"] is not None else "-"
        lines.append(f"{r['config']:<15} {later['ttft_s_median']!s:>9} {over!s:>7} {later['latency_s_median']!s:>9} "
                     f"{later['local_tokens']:>7} {later['read_tokens']:>6} {later['computed_tokens']:>9} "
                     f"{later['decode_local_turns']:>9} {r['decode_retained_gib_s']:>7} {warm:>17} "
                     f"{'yes' if r['verified'] else 'NO':>3}")
    lines.append("(later turns only: seconds, medians; tokens summed: from the prefill's own cache, read from the "
                 "decode, computed; GiB-s: the decode's retained KV over the run)")
    watched = [r for r in result["results"] if "bystander" in r]
    if watched:
        lines.append(f"{'bystander on the decode':<24} {'tokens':>7} {'ITL p50':>8} {'p90':>7} {'max':>7}  (ms)")
        for r in watched:
            for where in ("during_prefill", "during_answer", "outside_turns"):
                s = r["bystander"][where]
                cells = [s.get(k, "-") for k in ("itl_ms_p50", "itl_ms_p90", "itl_ms_max")]
                lines.append(f"{r['config'] + ' ' + where.replace('_turns', ''):<24} {s['tokens']:>7} "
                             f"{cells[0]!s:>8} {cells[1]!s:>7} {cells[2]!s:>7}")
    return "\n".join(lines)
