"""A served deployment on one machine: ``vllm serve`` engines with kvshuttle's connector behind a ``kvshuttle
router`` process, driven over HTTP with the official ``openai`` client; what ``examples/pd_chat.py`` and
``kvshuttle bench placement`` share.

Per-turn token accounting comes from the servers' own Prometheus counters (:func:`counters`): prompt tokens, the
tokens the engine's own prefix cache served, and the tokens kvshuttle read in. Turns must run one at a time for
the deltas to belong to one turn.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from .engines import free_port, kill_group
from .serve import ServedEngine, metric_total

QUESTIONS = ["tell me about the shuttle and the station", "and what about the return trip", "summarise it all"]
COUNTERS = {"prompt": "vllm:prompt_tokens_total", "local": "vllm:prefix_cache_hits_total",
            "read": "vllm:kvshuttle_tokens_read_total"}


def context_document(words: int, seed: int = 0) -> str:
    """Text of ``words`` made-up words (a long first message, an agent's tool output, a pasted file)."""
    rng = random.Random(seed)
    syllables = ["sta", "tion", "shut", "tle", "or", "bit", "dock", "ing", "port", "fuel", "crew", "log", "ma", "nu"]
    return " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(words))


def start_router(prefills: list[ServedEngine], decode: ServedEngine, decode_kv_port: int, log: Path,
                 extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``kvshuttle router`` in front of ``prefills`` and ``decode`` (its side channel on ``decode_kv_port``),
    with ``extra`` options; (process, base URL) once ``/health`` answers."""
    port = free_port()
    argv = [sys.executable, "-m", "kvshuttle.cli", "router", "--prefill", *(p.url for p in prefills),
            "--decode", f"{decode.url},kv=127.0.0.1:{decode_kv_port}", "--port", str(port), *extra]
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


def ask(client: Any, messages: list[dict[str, str]], stream: bool, max_tokens: int, conversation: str | None,
        cache_salt: str | None = None) -> tuple[str, float, float]:
    """(answer, seconds to the first token, seconds to the end). ``cache_salt``: the server computes the whole
    prompt, hitting no prefix-cache block other requests (or reverse reads) wrote (an independent reference)."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if conversation is not None:
        extra["conversation_id"] = conversation
    if cache_salt is not None:
        extra["cache_salt"] = cache_salt
    t0 = time.perf_counter()
    if not stream:
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                               temperature=0.0, extra_body=extra)
        took = time.perf_counter() - t0
        return reply.choices[0].message.content or "", took, took
    first, parts = None, []
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                                temperature=0.0, extra_body=extra, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
    took = time.perf_counter() - t0
    return "".join(parts), first or took, took


def counters(engine: ServedEngine) -> dict[str, float]:
    """An engine's prompt tokens, tokens its own prefix cache served, tokens kvshuttle read in (cumulative)."""
    text = engine.metrics()
    return {key: metric_total(text, name) for key, name in COUNTERS.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in COUNTERS}


def router_counts(url: str, name: str = "placements", label: str = "choice") -> dict[str, float]:
    """The router's ``kvshuttle_router_<name>_total`` samples by ``label``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(f"kvshuttle_router_{name}_total{{"):
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = float(line.rsplit(" ", 1)[1])
    return out


def cores() -> int:
    return os.cpu_count() or 1
