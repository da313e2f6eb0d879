"""Property: for random prompts, edits, handles, local hits, clocks and thresholds, a fetch is always a prefix
of verified blocks, never the last prompt token, and exactly what a block-by-block oracle allows."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvshuttle.policy import KVHandle, PolicyConfig, PromptDigests, block_digests
from test_policy import NOW, make_handle, run


def _oracle(prompt: list[int], handle: KVHandle, local: int, now: float, offset: float,
            config: PolicyConfig) -> tuple[range, int] | None:
    """Block by block, the slow obvious way: what may be fetched, or None."""
    bs, n = handle.block_size, len(prompt)
    verified = 0
    for k in range(len(handle.block_ids)):
        end = min((k + 1) * bs, handle.num_tokens)
        if end > n or block_digests(prompt[:end], bs)[-1] != handle.digests[k]:
            break
        verified = end
    local = min(local, max(n - 1, 0))
    end, first = min(verified, n - 1), -(-local // bs)
    count = end - first * bs
    if count <= 0 or not handle.expiry_time - (now + offset) > config.expiry_margin_s:
        return None
    if config.threshold_tokens <= 0 or count < config.threshold_tokens:
        return None
    return range(first, -(-end // bs)), count


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    bs = draw(st.sampled_from([1, 2, 3, 4, 16]))
    vocab = draw(st.sampled_from([2, 1000]))  # a tiny vocabulary makes equal blocks and accidental re-matches
    token = st.integers(0, vocab - 1)
    remote = draw(st.lists(token, max_size=100))
    op = draw(st.sampled_from(["continue", "same", "truncate", "edit", "delete", "insert"]))
    i = draw(st.integers(0, len(remote)))
    if op == "continue":
        prompt = remote + draw(st.lists(token, min_size=1, max_size=20))
    elif op == "same":
        prompt = list(remote)
    elif op == "truncate":
        prompt = remote[:i]
    elif op == "edit":
        prompt = list(remote) + draw(st.lists(token, max_size=5))
        if i < len(prompt):
            prompt[i] = draw(token)
    elif op == "delete":
        prompt = remote[:i] + remote[i + draw(st.integers(1, 10)):] + draw(st.lists(token, max_size=5))
    else:
        prompt = remote[:i] + draw(st.lists(token, min_size=1, max_size=5)) + remote[i:]
    # mostly live handles and low thresholds, so most examples reach the fetch path that matters
    handle = make_handle(remote, block_size=bs, expiry_in=draw(st.just(300.0) | st.floats(-10.0, 30.0)))
    tamper = draw(st.none() | st.just(-1) | st.integers(0, 100))  # -1: the last (often partial) block
    if tamper is not None and handle.digests:  # D's content differs from what the prompt says at one block
        k = tamper % len(handle.digests)
        digests = list(handle.digests)
        digests[k] = bytes(b ^ 0x5A for b in digests[k])
        handle = replace(handle, digests=tuple(digests))
    local = draw(st.just(0) | st.integers(0, len(prompt) // bs).map(lambda k: k * bs) | st.integers(0, len(prompt) + 3))
    return {"prompt": prompt, "handle": handle, "local": local,
            "offset": draw(st.just(0.0) | st.floats(-20.0, 20.0)), "threshold": draw(st.just(1) | st.integers(-1, 40)),
            "digested": draw(st.booleans())}


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_fetch_is_always_a_verified_prefix_and_never_the_last_token(s: dict[str, Any]) -> None:
    prompt, handle, local = s["prompt"], s["handle"], s["local"]
    config = PolicyConfig(threshold_tokens=s["threshold"])
    given_prompt = PromptDigests.from_tokens(prompt, handle.block_size) if s["digested"] else prompt
    d = run(given_prompt, handle, local=local, config=config, offset=s["offset"])
    bs, n = handle.block_size, len(prompt)
    assert d.reused_tokens == d.local_tokens + d.fetch_tokens <= max(n - 1, 0)
    if d.fetch:
        for k in d.fetch_blocks:  # every fetched block re-digested from the prompt equals the handle's digest
            end = min((k + 1) * bs, handle.num_tokens)
            assert end <= n and block_digests(prompt[:end], bs)[-1] == handle.digests[k]
        assert d.fetch_token_range.stop <= n - 1  # never the last prompt token
        assert d.fetch_token_range.start >= d.local_tokens  # never what is local already
        assert d.fetch_blocks.stop == -(-d.fetch_token_range.stop // bs)
        assert d.remote_block_ids == handle.block_ids[d.fetch_blocks.start:d.fetch_blocks.stop]
    else:
        assert d.fetch_tokens == 0 and not d.fetch_blocks and d.action in ("local", "recompute")
    expected = _oracle(prompt, handle, local, NOW, s["offset"], config)
    assert (None if not d.fetch else (d.fetch_blocks, d.fetch_tokens)) == expected
    event(f"{d.action}: {d.reason.value}")
