"""A multi-turn conversation over a prefill and a decode engine, routed as vLLM's multi-turn proxy routes it.

Per turn (vLLM ``examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py``, see the reference
notes' bidirectional spec, section 5):

1. prefill gets the whole prompt with ``max_tokens=1`` and ``kv_transfer_params``:
   turn 1 ``{"do_remote_decode": True, "do_remote_prefill": False, "remote_*": None}``; later turns the
   decode's params of the previous turn with ``do_remote_decode=True, do_remote_prefill=False`` (prefill then
   reads the conversation's KV back from decode and computes only the rest);
2. decode gets the same prompt, ``max_tokens`` and prefill's returned ``kv_transfer_params`` unchanged (it
   reads the prompt's KV from prefill and generates the answer);
3. decode's returned ``kv_transfer_params`` are kept for the next turn (use-once, like the proxy's cache).

The next prompt is the previous prompt + the decode's answer + new "user" tokens, an exact continuation of
decode's sequence (the bidirectional mode's requirement). ``run_local_conversation`` replays the same prompts
on one engine without transfers: the reference the disaggregated answers must equal.

This driver is a trusted member of the deployment (it holds the deployment secret, as a kvshuttle router does):
it adds a retention grant (``kvshuttle_grant``) to what it sends each engine, without which kvshuttle's engines
keep nothing for the next reader (``kvshuttle_retain: "granted"``, their default; vLLM's own connector ignores
the field). ``grant=False`` sends exactly what vLLM's proxy sends (engines then need ``kvshuttle_retain:
"always"`` to keep anything).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...trust import GRANT_FIELD, DeploymentSecret, issue_grant
from .tiny_model import SPECIAL_TOKENS, random_prompt

#: What the proxy sends prefill when it holds nothing for the conversation (vLLM's toy and multi-turn proxies).
FIRST_TURN_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
    "remote_host": None, "remote_port": None,
}


class Engine(Protocol):
    """What the driver needs from an engine (``VllmEngine`` has it)."""

    def generate(self, prompt_token_ids: list[int], max_tokens: int,
                 kv_transfer_params: dict[str, Any] | None = None, *,
                 cache_salt: str | None = None) -> dict[str, Any]: ...


@dataclass
class ConversationPlan:
    """The token-level shape of a synthetic conversation (ids drawn from the model's non-special vocabulary)."""

    turns: int = 3
    first_tokens: int = 512
    next_tokens: int = 64
    answer_tokens: int = 16
    vocab: int = 4096
    seed: int = 0

    def user_tokens(self, turn: int) -> list[int]:
        """The new tokens the client adds at ``turn`` (1-based)."""
        n = self.first_tokens if turn == 1 else self.next_tokens
        return random_prompt(n, vocab=self.vocab, seed=self.seed * 1000 + turn)


@dataclass
class Turn:
    """One turn: the prompt, and what each engine returned (see ``VllmEngine.generate``)."""

    turn: int
    prompt: list[int]
    prefill_params: dict[str, Any]
    prefill: dict[str, Any]
    decode: dict[str, Any]
    reference: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def answer(self) -> list[int]:
        return list(self.decode["token_ids"])

    def summary(self) -> dict[str, Any]:
        """A flat row for printing: lengths, times, the tokens decode reported it had (prompt + answer - 1)."""
        dparams = self.decode.get("kv_transfer_params") or {}
        return {
            "turn": self.turn, "prompt_tokens": len(self.prompt),
            "prefill_ttft_s": _r(self.prefill.get("ttft_s")),
            "prefill_engine_ttft_s": _r(self.prefill.get("engine_ttft_s")),
            "prefill_latency_s": _r(self.prefill.get("latency_s")),
            "prefill_cached_tokens": self.prefill.get("num_cached_tokens"),
            "decode_ttft_s": _r(self.decode.get("ttft_s")), "decode_latency_s": _r(self.decode.get("latency_s")),
            "decode_cached_tokens": self.decode.get("num_cached_tokens"),
            "decode_remote_num_tokens": dparams.get("remote_num_tokens"),
            "matches_reference": None if self.reference is None else self.reference["token_ids"] == self.answer,
        }


def granted(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` plus a fresh retention grant under this process's deployment secret (a copy)."""
    return {**params, GRANT_FIELD: issue_grant(DeploymentSecret.resolve())}


def prefill_params_for(previous_decode_params: dict[str, Any] | None, *, grant: bool = True) -> dict[str, Any]:
    """The ``kv_transfer_params`` the multi-turn proxy sends prefill, given decode's last returned params (plus a
    retention grant, unless ``grant=False``: prefill keeps the prompt's blocks for its decode only with one)."""
    if not previous_decode_params:
        params = copy.deepcopy(FIRST_TURN_PARAMS)
    else:
        params = copy.deepcopy(previous_decode_params)
        params["do_remote_decode"] = True
        params["do_remote_prefill"] = False
    return granted(params) if grant else params


def decode_params_for(prefill_params: dict[str, Any], *, grant: bool = True) -> dict[str, Any]:
    """What the driver sends decode: prefill's returned params unchanged (as vLLM's proxy does), plus a retention
    grant unless ``grant=False`` (decode keeps prompt + answer for the next turn only with one)."""
    params = copy.deepcopy(prefill_params)
    return granted(params) if grant else params


def edited_token(token: int, vocab: int) -> int:
    """Another non-special token id (an edit of the history)."""
    first = len(SPECIAL_TOKENS)
    return first + (token - first + 1) % (vocab - first)


def run_pd_conversation(prefill: Engine, decode: Engine, plan: ConversationPlan, *,
                        reuse_decode_params: bool = True, edit_at: int | None = None,
                        before_turn: Callable[[int, list[Turn]], None] | None = None, grant: bool = True) -> list[Turn]:
    """Run ``plan.turns`` turns through prefill then decode; returns every turn's results.

    ``reuse_decode_params=False`` sends every turn as a first turn (prefill recomputes the whole prompt):
    the same traffic without the reverse read, for a side-by-side TTFT. ``edit_at`` changes that token of the
    history in turn 2's prompt (an edited conversation); ``before_turn(k, turns so far)`` runs just before each
    turn k >= 2 (a pause, or warming a prefix cache).
    ``grant``: add a retention grant to every request (see the module docstring).
    """
    turns: list[Turn] = []
    prompt: list[int] = []
    handle: dict[str, Any] | None = None
    for k in range(1, plan.turns + 1):
        if turns:
            prompt = prompt + turns[-1].answer
        prompt = prompt + plan.user_tokens(k)
        if k == 2 and edit_at is not None:
            prompt[edit_at] = edited_token(prompt[edit_at], plan.vocab)
        if k >= 2 and before_turn is not None:
            before_turn(k, turns)
        p_params = prefill_params_for(handle if reuse_decode_params else None, grant=grant)
        p_out = prefill.generate(prompt, 1, copy.deepcopy(p_params))
        d_params = p_out.get("kv_transfer_params")
        if not d_params:
            raise RuntimeError(f"turn {k}: prefill returned no kv_transfer_params "
                               f"(finish_reason {p_out.get('finish_reason')})")
        d_out = decode.generate(prompt, plan.answer_tokens, decode_params_for(d_params, grant=grant))
        turn = Turn(k, list(prompt), p_params, p_out, d_out)
        if p_out["token_ids"][:1] != d_out["token_ids"][:1]:
            turn.notes.append(f"prefill's token {p_out['token_ids'][:1]} != decode's first {d_out['token_ids'][:1]}")
        turns.append(turn)
        handle = d_out.get("kv_transfer_params")
    return turns


def run_local_conversation(engine: Engine, turns: list[Turn], *, cache_salt: str | None = None,
                           ) -> list[dict[str, Any]]:
    """Replay each turn's prompt on one engine with no transfer parameters; attach and return the results.
    ``cache_salt``: each replay computes its whole prompt even where the engine's prefix cache holds blocks that
    reverse reads wrote (an independent reference)."""
    results = []
    for turn in turns:
        out = engine.generate(turn.prompt, len(turn.answer), None,
                              **({"cache_salt": f"{cache_salt}-{turn.turn}"} if cache_salt else {}))
        turn.reference = out
        results.append(out)
    return results


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)
