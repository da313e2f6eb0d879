"""A bystander on the decode: another user's answer streaming while the measured turns run, and what they cost it.

A decode-local turn computes its new tokens on the decode, in the same engine steps as every answer the decode is
generating; a reverse-read turn only adds its answer (its prompt's KV arrives from the prefill). The bystander is
one long streamed completion after another, sent straight to the decode (its own ``cache_salt`` per request, so
its prompt never hits a cached block), every token's arrival time kept. Its inter-token gaps are then split by
whether they ended inside a measured turn (the turn's request to its last token) or outside every turn: the
difference is what the turns cost the decode's other requests.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

PROMPT = "station log, continued: " + " ".join(f"entry {i} docked and refuelled" for i in range(40))


class Bystander:
    """Streams completions from ``url`` (an OpenAI-compatible server) on a thread until :meth:`stop`."""

    def __init__(self, url: str, max_tokens: int = 1500, name: str = "bystander") -> None:
        self.url, self.max_tokens, self.name = url, max_tokens, name
        self.gaps: list[tuple[float, float]] = []  # (previous token's arrival, this one's), monotonic seconds
        self.submitted: list[float] = []  # each request's start (its prompt moves the decode's prompt counter)
        self.prompt_tokens = 0  # one request's prompt (the server's count, from the first one's usage)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Bystander:
        self._thread.start()
        deadline = time.monotonic() + 120
        while len(self.gaps) < 3 and time.monotonic() < deadline and not self.errors:
            time.sleep(0.05)  # streaming before the first measured turn
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600)
        n = 0
        while not self._stop.is_set():
            n += 1
            self.submitted.append(time.monotonic())
            try:
                stream = client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=self.max_tokens, temperature=0.0, stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "cache_salt": f"{self.name}-{n}"})
                last = None
                for chunk in stream:
                    now = time.monotonic()
                    if chunk.usage is not None and not self.prompt_tokens:
                        self.prompt_tokens = int(chunk.usage.prompt_tokens)
                    if not chunk.choices:
                        continue
                    if last is not None:
                        self.gaps.append((last, now))
                    last = now
                    if self._stop.is_set():
                        stream.close()
                        break
            except Exception as exc:  # the bench reports it and goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.5)

    def prompts_between(self, start: float, stop: float) -> int:
        """Prompt tokens the bystander added to the decode's counters between two monotonic times."""
        return self.prompt_tokens * sum(start <= t <= stop for t in self.submitted)


def gap_stats(gaps: list[tuple[float, float]], turns: list[tuple[float, float, float]]) -> dict[str, Any]:
    """The bystander's inter-token gaps (ms) by where they ended: inside a measured turn's prefill (its request to
    its first token), inside the rest of a turn (its answer streaming), outside every turn. ``turns``: (request,
    first token, last token) monotonic times."""
    prefill: list[float] = []
    answer: list[float] = []
    outside: list[float] = []
    for begin, end in gaps:
        ms = (end - begin) * 1e3
        if any(a <= end <= f for a, f, _ in turns):
            prefill.append(ms)
        elif any(f < end <= z for _, f, z in turns):
            answer.append(ms)
        else:
            outside.append(ms)
    return {"during_prefill": summary(prefill), "during_answer": summary(answer), "outside_turns": summary(outside)}


def summary(ms: list[float]) -> dict[str, Any]:
    """Count, p50, p90, p99, max and mean of inter-token gaps (ms); ``{"tokens": 0}`` for none."""
    if not ms:
        return {"tokens": 0}
    ordered = sorted(ms)

    def at(q: float) -> float:  # the value below which a fraction q of the gaps fall (nearest rank)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"tokens": len(ms), "itl_ms_p50": round(statistics.median(ordered), 2), "itl_ms_p90": at(0.9),
            "itl_ms_p99": at(0.99), "itl_ms_max": round(ordered[-1], 2),
            "itl_ms_mean": round(statistics.fmean(ordered), 2)}
