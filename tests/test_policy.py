"""Reuse-or-recompute decisions: verification, partial blocks, the last token, local hits, expiry, thresholds,
the cost model, malformed handles (the property test against an oracle: test_policy_property.py)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvshuttle.policy import (
    CostEstimate,
    Decision,
    KVHandle,
    PolicyConfig,
    PolicyError,
    PromptDigests,
    Reason,
    block_digests,
    decide,
    decide_from_params,
    estimate_clock_offset,
    parse_handle,
)

NOW = 1_700_000_000.0
B = 16
ANY = PolicyConfig(threshold_tokens=1)  # fetch whatever verifies: isolates verification from the threshold


def toks(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 150_000, size=n)]


def make_handle(remote: list[int], *, block_size: int = B, expiry_in: float = 300.0, extra_key: bytes = b"",
                digest_size: int = 16, digests: tuple[bytes, ...] | None = None) -> KVHandle:
    """A decode's handle for ``remote`` tokens, sent through the wire format and parsed as prefill would."""
    n_blocks = -(-len(remote) // block_size)
    handle = KVHandle(
        engine_id="decode-0", request_id="req-1", host="10.0.0.2", port=5600,
        block_ids=tuple(range(1000, 1000 + 3 * n_blocks, 3)), num_tokens=len(remote), expiry_time=NOW + expiry_in,
        tp_size=1, handle_id="h" * 32, generation=7, block_size=block_size,
        digests=digests if digests is not None else tuple(
            block_digests(remote, block_size, extra_key=extra_key, digest_size=digest_size)),
        issued_at=NOW, ttl_s=480.0)
    parsed = parse_handle(handle.to_kv_transfer_params(), secret=None)
    assert isinstance(parsed, KVHandle), parsed
    return parsed


def run(prompt: Any, handle: KVHandle | None, *, local: int = 0, config: PolicyConfig = ANY, now: float = NOW,
        offset: float = 0.0) -> Decision:
    return decide(prompt, local_hit_tokens=local, handle=handle, now_wall=now, config=config, clock_offset_s=offset)


def assert_fetch(d: Decision, first: int, last: int, tokens: int) -> None:
    assert d.action == "fetch" and d.reason is Reason.FETCH, d
    assert d.fetch_blocks == range(first, last)
    assert d.fetch_tokens == tokens
    assert d.reused_tokens == d.local_tokens + tokens


# --------------------------------------------------------------------------------------------- verifying
def test_continuation_fetches_all_remote_tokens() -> None:
    remote = toks(100)  # 6 full blocks + 4 tokens
    handle = make_handle(remote)
    d = run(remote + toks(50, seed=1), handle)
    assert_fetch(d, 0, 7, 100)
    assert d.verified_tokens == 100 and d.mismatch_block is None
    assert d.remote_block_ids == handle.block_ids
    assert d.fetch_token_range == range(0, 100)
    assert d.remaining_s == pytest.approx(300.0)


def test_prompt_digests_and_token_ids_decide_alike() -> None:
    remote = toks(100)
    prompt = remote + toks(50, seed=1)
    handle = make_handle(remote)
    assert run(PromptDigests.from_tokens(prompt, B), handle) == run(prompt, handle)
    assert run(np.array(prompt, dtype=np.int32), handle) == run(prompt, handle)


@pytest.mark.parametrize(("edit_block", "fetched_blocks"), [(0, 0), (3, 3), (5, 5), (6, 6)])
def test_mismatch_cuts_at_the_first_differing_block(edit_block: int, fetched_blocks: int) -> None:
    remote = toks(100)  # blocks 0-5 full, block 6 partial
    prompt = remote + toks(40, seed=1)
    prompt[edit_block * B + 2] += 1  # an edited history (block 6: inside the partial block)
    d = run(prompt, make_handle(remote))
    assert d.mismatch_block == edit_block
    assert d.verified_tokens == fetched_blocks * B
    if fetched_blocks == 0:
        assert d.action == "recompute" and d.reason is Reason.NOTHING_VERIFIED and d.fetch_tokens == 0
    else:
        assert_fetch(d, 0, fetched_blocks, fetched_blocks * B)


def test_stripped_reasoning_reuses_only_the_prefix_before_it() -> None:
    """D generated <think>...</think> + answer; the next turn's prompt drops the thinking tokens."""
    system, think, answer = toks(40, seed=1), toks(37, seed=2), toks(30, seed=3)
    remote = system + think + answer
    prompt = system + answer + toks(20, seed=4)
    d = run(prompt, make_handle(remote))
    assert_fetch(d, 0, 2, 32)  # block 2 (tokens 32..47) mixes system and thinking: not reused
    assert d.mismatch_block == 2


def test_vllm_style_end_trim_would_misalign_but_we_do_not() -> None:
    """Tokens deleted in the middle shift everything after: no later block may be reused."""
    remote = toks(8 * B)
    prompt = remote[:2 * B] + remote[2 * B + 3:] + toks(30, seed=9)
    d = run(prompt, make_handle(remote))
    assert d.fetch_blocks == range(0, 2) and d.mismatch_block == 2


def test_extra_key_mismatch_verifies_nothing() -> None:
    remote = toks(64)
    handle = make_handle(remote, extra_key=b"model-a")
    assert run([*remote, 1], handle, config=replace(ANY, extra_key=b"model-b")).reason is Reason.NOTHING_VERIFIED
    assert run([*remote, 1], handle, config=replace(ANY, extra_key=b"model-a")).action == "fetch"


# ------------------------------------------------------------------------------ partial block, last token
@pytest.mark.parametrize("remote_len", [64, 70])
def test_last_prompt_token_is_always_recomputed(remote_len: int) -> None:
    remote = toks(remote_len)
    handle = make_handle(remote)
    same = run(remote, handle)  # the prompt is exactly what D holds (e.g. a retried turn)
    assert_fetch(same, 0, -(-remote_len // B), remote_len - 1)
    assert same.reused_tokens == remote_len - 1
    longer = run([*remote, 5], handle)
    assert_fetch(longer, 0, -(-remote_len // B), remote_len)


def test_one_token_prompt_reuses_nothing() -> None:
    d = run([7], make_handle([7] * 20))
    assert d.action == "recompute" and d.fetch_tokens == 0 and d.reused_tokens == 0


def test_partial_block_needs_its_own_digest_to_match() -> None:
    remote = toks(3 * B + 5)
    prompt = remote + toks(10, seed=1)
    ok = run(prompt, make_handle(remote))
    assert_fetch(ok, 0, 4, 3 * B + 5)
    prompt[3 * B + 4] += 1  # the partial block's last token differs
    cut = run(prompt, make_handle(remote))
    assert_fetch(cut, 0, 3, 3 * B)
    assert cut.mismatch_block == 3


def test_partial_block_digest_over_full_block_tokens_never_verifies() -> None:
    """A lying handle: a partial block published with the digest of the full block (more tokens than it holds)."""
    prompt = toks(4 * B)
    digests = tuple(block_digests(prompt, B))
    handle = make_handle(prompt[:3 * B + 5], digests=digests)
    assert run(prompt, handle).fetch_blocks == range(0, 3)


@pytest.mark.parametrize(("prompt_len", "expected"), [
    (100, 96),  # 6 full blocks covered; block 6 (96..111) only partly: a block digest cannot vouch for part
    (96, 95),  # 6 full blocks, but the last token is recomputed
    (97, 96),
    (20, 16),
    (15, 0),  # not even one full block
])
def test_prompt_shorter_than_remote_reuses_only_what_it_covers(prompt_len: int, expected: int) -> None:
    remote = toks(160)
    d = run(remote[:prompt_len], make_handle(remote))
    assert d.fetch_tokens == expected
    assert d.fetch_blocks == range(0, -(-expected // B))
    if expected == 0:
        assert d.reason is Reason.NOTHING_VERIFIED


def test_prompt_ending_inside_the_remote_partial_block() -> None:
    remote = toks(100)  # partial block 6 holds tokens 96..99
    d = run(remote[:98], make_handle(remote))
    assert_fetch(d, 0, 6, 96)


# ----------------------------------------------------------------------------------------------- local hit
@pytest.mark.parametrize(("local", "expected"), [
    (64, ("fetch", 4, 8, 64)),  # local smaller than the verified prefix: fetch only the rest
    (128, ("local", 0, 0, 0)),  # local equal: nothing to fetch
    (160, ("local", 0, 0, 0)),  # local larger
    (0, ("fetch", 0, 8, 128)),
])
def test_local_hit_against_verified_prefix(local: int, expected: tuple[str, int, int, int]) -> None:
    remote = toks(128)
    prompt = remote + toks(100, seed=1)
    prompt_edited = list(prompt)
    prompt_edited[140] += 1  # irrelevant to D (past its tokens), keeps the local hit meaningful
    d = run(prompt_edited, make_handle(remote), local=local)
    action, first, last, tokens = expected
    assert d.action == action
    assert d.local_tokens == local
    assert d.fetch_blocks == range(first, last) and d.fetch_tokens == tokens
    assert d.reused_tokens == local + tokens
    if action == "local":
        assert d.reason is Reason.LOCAL_COVERS


def test_unaligned_local_hit_fetches_from_the_next_block_boundary() -> None:
    remote = toks(128)
    d = run([*remote, 1], make_handle(remote), local=20)
    assert_fetch(d, 2, 8, 128 - 32)  # tokens 20..31 are recomputed; fetched blocks never overlap the hit
    assert d.fetch_token_range == range(32, 128)
    assert d.reused_tokens == 20 + 96


def test_local_hit_is_capped_below_the_last_token() -> None:
    d = run(toks(50), None, local=500)
    assert d.local_tokens == 49 and d.action == "local" and d.reason is Reason.NO_HANDLE


def test_negative_local_hit_is_a_caller_bug() -> None:
    with pytest.raises(PolicyError):
        run(toks(50), None, local=-1)


# ------------------------------------------------------------------------------------------- threshold
@pytest.mark.parametrize(("fetch_tokens", "fetches"), [(63, False), (64, True), (65, True)])
def test_threshold_boundary_on_the_count(fetch_tokens: int, fetches: bool) -> None:
    remote = toks(fetch_tokens)
    d = run(remote + toks(10, seed=1), make_handle(remote), config=PolicyConfig())  # default: 64
    assert d.fetch == fetches
    assert d.fetch_tokens == (fetch_tokens if fetches else 0)
    if not fetches:
        assert d.reason is Reason.BELOW_THRESHOLD and d.action == "recompute"
        assert d.verified_tokens == 63


@pytest.mark.parametrize(("threshold", "fetches"), [(63, True), (64, True), (65, False)])
def test_threshold_boundary_on_the_setting(threshold: int, fetches: bool) -> None:
    remote = toks(64)
    d = run([*remote, 1], make_handle(remote), config=PolicyConfig(threshold_tokens=threshold))
    assert d.fetch == fetches


def test_threshold_counts_only_tokens_past_the_local_hit() -> None:
    remote = toks(96)
    handle = make_handle(remote)
    assert run([*remote, 1], handle, local=32, config=PolicyConfig(threshold_tokens=64)).fetch_tokens == 64
    d = run([*remote, 1], handle, local=48, config=PolicyConfig(threshold_tokens=64))
    assert d.reason is Reason.BELOW_THRESHOLD and d.action == "local" and d.reused_tokens == 48


@pytest.mark.parametrize("threshold", [0, -1])
def test_threshold_zero_or_less_disables_fetching(threshold: int) -> None:
    remote = toks(500)
    d = run([*remote, 1], make_handle(remote), config=PolicyConfig(threshold_tokens=threshold))
    assert d.action == "recompute" and d.reason is Reason.FETCH_DISABLED and d.fetch_tokens == 0


def test_vllm_threshold_zero_means_always_pull() -> None:
    config = PolicyConfig.from_vllm_threshold(0)
    assert config.threshold_tokens == 1
    remote = toks(5)
    assert run(remote * 4, make_handle(remote * 4), config=config).fetch_tokens == 19
    assert PolicyConfig.from_vllm_threshold(128).threshold_tokens == 128


# ---------------------------------------------------------------------------------------------- expiry
@pytest.mark.parametrize(("expiry_in", "fetches"), [
    (5.0, False),  # exactly at the margin: expired
    (5.0 + 2**-20, True),
    (5.0 - 2**-20, False),
    (0.0, False),
    (-100.0, False),
    (300.0, True),
])
def test_expiry_margin_edge(expiry_in: float, fetches: bool) -> None:
    remote = toks(100)
    d = run([*remote, 1], make_handle(remote, expiry_in=expiry_in))
    assert d.fetch == fetches
    if not fetches:
        assert d.reason is Reason.EXPIRED and d.remaining_s == pytest.approx(expiry_in)


def test_expiry_margin_is_configurable() -> None:
    remote = toks(100)
    handle = make_handle(remote, expiry_in=8.0)
    assert not run([*remote, 1], handle, config=replace(ANY, expiry_margin_s=10.0)).fetch
    assert run([*remote, 1], handle, config=replace(ANY, expiry_margin_s=0.0)).fetch


@pytest.mark.parametrize(("handle_dtype", "cache_dtype", "fetches"), [
    ("fp8_e4m3", "fp8_e4m3", True),
    ("bfloat16", "bfloat16", True),
    ("bfloat16", "fp8_e4m3", False),  # bf16 bytes read into an fp8 cache
    ("fp8_e5m2", "fp8_e4m3", False),  # same size, other meaning
    ("", "bfloat16", False),  # a handle that does not say what its bytes are
    ("fp8_e4m3", "", True),  # no check asked for (the planner, a bench)
])
def test_a_handle_of_another_cache_dtype_recomputes(handle_dtype: str, cache_dtype: str, fetches: bool) -> None:
    remote = toks(100)
    handle = replace(make_handle(remote), cache_dtype=handle_dtype)
    decision = run([*remote, 1], handle, config=replace(ANY, cache_dtype=cache_dtype))
    assert decision.fetch is fetches
    if not fetches:
        assert decision.reason is Reason.CACHE_DTYPE_MISMATCH and decision.fetch_tokens == 0


def test_nan_clock_refuses() -> None:
    remote = toks(100)
    assert run([*remote, 1], make_handle(remote), now=math.nan).reason is Reason.EXPIRED
    assert run([*remote, 1], make_handle(remote), offset=math.nan).reason is Reason.EXPIRED


def test_clock_offset_decode_ahead() -> None:
    """D's wall clock runs 100 s ahead of ours: offset = D - P = +100. Its expiry stamps look 100 s later."""
    remote = toks(100)
    d_now = NOW + 100.0
    soon = make_handle(remote)
    soon = replace(soon, expiry_time=d_now + 3.0)  # 3 s left on D: must refuse
    assert run([*remote, 1], soon, offset=100.0).reason is Reason.EXPIRED
    assert run([*remote, 1], soon, offset=0.0).fetch  # ignoring the skew would read blocks about to be freed
    later = replace(soon, expiry_time=d_now + 30.0)
    d = run([*remote, 1], later, offset=100.0)
    assert d.fetch and d.remaining_s == pytest.approx(30.0)


def test_clock_offset_decode_behind() -> None:
    """D's wall clock runs 100 s behind: offset = -100. Without it a live handle looks long expired."""
    remote = toks(100)
    d_now = NOW - 100.0
    handle = replace(make_handle(remote), expiry_time=d_now + 30.0)
    assert run([*remote, 1], handle, offset=-100.0).fetch
    assert run([*remote, 1], handle, offset=0.0).reason is Reason.EXPIRED
    assert run([*remote, 1], replace(handle, expiry_time=d_now + 4.0), offset=-100.0).reason is Reason.EXPIRED


def test_estimate_clock_offset_sign() -> None:
    # we send at 10.0 and receive at 11.0 (our clock); D read its clock as 110.5 in between: D = P + 100
    assert estimate_clock_offset(10.0, 110.5, 11.0) == 100.0
    assert estimate_clock_offset(10.0, -89.5, 11.0) == -100.0


# ------------------------------------------------------------------------------------------ handle faults
def _params(**changes: Any) -> dict[str, Any]:
    params = make_handle(toks(100)).to_kv_transfer_params()
    params.update(changes)
    return params


@pytest.mark.parametrize("params", [
    _params(kvshuttle_version=99),
    _params(kvshuttle_digests="zz" * 7),
    _params(kvshuttle_digests=["00" * 16] * 7),  # a list, not one string
    _params(kvshuttle_digests="00" * 16 * 6),  # one digest short
    _params(kvshuttle_digests="00" * 16 * 7 + "00"),  # not a whole number of digests
    _params(kvshuttle_digest_size=0),
    _params(remote_block_ids=[1, 1, 2, 3, 4, 5, 6]),
    _params(remote_block_ids=[-1, 1, 2, 3, 4, 5, 6]),
    _params(remote_num_tokens=200),
    _params(remote_num_tokens="100"),
    _params(remote_port=True),
    _params(remote_blocks_expiry_time=math.inf),
    _params(kvshuttle_block_size=0),
    {k: v for k, v in _params().items() if k != "remote_engine_id"},
    {"kvshuttle_version": 1},
    {"kvshuttle_version": 1, 3: 4},
    "not a dict",
    ["kvshuttle_version"],
    42,
], ids=lambda p: str(p)[:40])
def test_malformed_handle_is_a_recompute_decision(params: Any) -> None:
    parsed = parse_handle(params, secret=None)
    assert isinstance(parsed, Decision)
    assert parsed.action == "recompute" and parsed.reason is Reason.MALFORMED_HANDLE and parsed.message
    with_local = parse_handle(params, secret=None, local_hit_tokens=32)
    assert isinstance(with_local, Decision) and with_local.action == "local" and with_local.reused_tokens == 32
    d = decide_from_params(toks(200), params, local_hit_tokens=0, now_wall=NOW, config=ANY, secret=None)
    assert d.action == "recompute" and d.reason is Reason.MALFORMED_HANDLE


@pytest.mark.parametrize(("params", "reason"), [
    (None, Reason.NO_HANDLE),
    ({}, Reason.NO_HANDLE),
    ({"do_remote_decode": True}, Reason.NO_HANDLE),
    ({"remote_block_ids": [1, 2], "remote_num_tokens": 32, "remote_engine_id": "d"}, Reason.UNVERIFIABLE_HANDLE),
])
def test_missing_or_unverifiable_handle(params: Any, reason: Reason) -> None:
    d = decide_from_params(toks(200), params, local_hit_tokens=16, now_wall=NOW, config=ANY, secret=None)
    assert d.reason is reason and d.action == "local" and d.reused_tokens == 16


def test_decide_from_params_fetches_a_good_handle() -> None:
    remote = toks(100)
    d = decide_from_params([*remote, 1], make_handle(remote).to_kv_transfer_params(), local_hit_tokens=0,
                           now_wall=NOW, config=ANY, secret=None)
    assert_fetch(d, 0, 7, 100)


@pytest.mark.parametrize("change", [
    {"digests": ()},  # built by hand, never checked: digest count differs from block count
    {"num_tokens": 500},
    {"block_size": 0},
    {"digests": ("ab",) * 7},
])
def test_inconsistent_handle_objects_are_refused(change: dict[str, Any]) -> None:
    remote = toks(100)
    d = run([*remote, 1], replace(make_handle(remote), **change))
    assert d.reason is Reason.MALFORMED_HANDLE and d.action == "recompute"


def test_digests_of_uneven_length_are_refused() -> None:
    remote = toks(100)
    handle = make_handle(remote)
    uneven = (handle.digests[0] + b"x", *handle.digests[1:])
    assert run([*remote, 1], replace(handle, digests=uneven)).reason is Reason.MALFORMED_HANDLE


def test_no_handle_and_empty_handle() -> None:
    assert run(toks(10), None).reason is Reason.NO_HANDLE
    assert run(toks(10), make_handle([])).reason is Reason.NOTHING_VERIFIED


# ------------------------------------------------------------------------------- block size, vLLM hashes
def test_prompt_digests_in_another_block_size_are_redigested() -> None:
    remote = toks(100)
    prompt = [*remote, 1]
    d = run(PromptDigests.from_tokens(prompt, 32), make_handle(remote))
    assert_fetch(d, 0, 7, 100)


def test_handle_with_32_byte_digests() -> None:
    remote = toks(100)
    handle = make_handle(remote, digest_size=32)
    assert_fetch(run([*remote, 1], handle), 0, 7, 100)
    assert_fetch(run(PromptDigests.from_tokens([*remote, 1], B), handle), 0, 7, 100)


def _vllm_like_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    out, parent = [], b"seed" * 8
    for k in range(len(tokens) // block_size):
        parent = __import__("hashlib").sha256(parent + repr(tokens[k * block_size:(k + 1) * block_size]).encode()
                                              ).digest()
        out.append(parent)
    return out


def test_vllm_block_hashes_verify_full_blocks_only() -> None:
    remote = toks(100)
    prompt = remote + toks(30, seed=1)
    hashes = _vllm_like_hashes(remote, B)
    handle = make_handle(remote, digests=(*hashes, b"\x00" * 32))  # D has no hash for its partial block
    prompt_digests = PromptDigests.from_vllm_block_hashes(_vllm_like_hashes(prompt, B), B, len(prompt))
    assert_fetch(run(prompt_digests, handle), 0, 6, 96)
    other_size = PromptDigests.from_vllm_block_hashes(_vllm_like_hashes(prompt, 8), 8, len(prompt))
    assert run(other_size, handle).reason is Reason.BLOCK_SIZE_MISMATCH
    ours = make_handle(remote)  # 16-byte kvshuttle digests against 32-byte vLLM hashes
    assert run(prompt_digests, ours).reason is Reason.DIGEST_SCHEME_MISMATCH


# ---------------------------------------------------------------------------------------------- cost model
COST = PolicyConfig(kind="cost", kv_bytes_per_token=1000.0, bandwidth_bytes_per_s=1e9, transfer_overhead_s=1e-3,
                    prefill_tokens_per_s=1e5, cost_margin=1.0)


@pytest.mark.parametrize(("tokens", "fetches"), [(96, False), (112, True), (2000, True), (16, False)])
def test_cost_model_both_sides_of_break_even(tokens: int, fetches: bool) -> None:
    # transfer = 1 ms + tokens * 1 us; recompute = tokens * 10 us: break-even at 111.1 tokens
    remote = toks(tokens)
    d = run([*remote, 1], make_handle(remote), config=COST)
    assert d.fetch == fetches
    assert d.cost is not None
    assert d.cost.transfer_s == pytest.approx(1e-3 + tokens * 1e-6)
    assert d.cost.recompute_s == pytest.approx(tokens * 1e-5)
    if not fetches:
        assert d.reason is Reason.RECOMPUTE_CHEAPER


def test_cost_margin_demands_a_clear_win() -> None:
    remote = toks(112)
    assert run([*remote, 1], make_handle(remote), config=COST).fetch
    assert not run([*remote, 1], make_handle(remote), config=replace(COST, cost_margin=2.0)).fetch


def test_cost_model_exact_break_even_recomputes() -> None:
    # every quantity a power of two: transfer = 64 blocks' bytes / 1 B/s = recompute = 64 tokens / 1 tok/s
    config = PolicyConfig(kind="cost", kv_bytes_per_token=1.0, bandwidth_bytes_per_s=1.0, transfer_overhead_s=0.0,
                          prefill_tokens_per_s=1.0, cost_margin=1.0)
    remote = toks(64)
    d = run([*remote, 1], make_handle(remote), config=config)
    assert d.cost == CostEstimate(64.0, 64.0, 64) and not d.fetch
    assert run([*remote, 1], make_handle(remote), config=replace(config, cost_margin=0.5)).fetch


def test_cost_model_charges_whole_blocks() -> None:
    remote = toks(113)  # 8 blocks, the last holding one token
    d = run([*remote, 1], make_handle(remote), config=COST)
    assert d.cost is not None and d.cost.nbytes == 8 * B * 1000


@pytest.mark.parametrize("bad", [
    {"kind": "other"},
    {"kind": "cost"},
    {"kind": "cost", "kv_bytes_per_token": 1.0, "bandwidth_bytes_per_s": 1.0, "prefill_tokens_per_s": 0.0},
    {"kind": "cost", "kv_bytes_per_token": 1.0, "bandwidth_bytes_per_s": 1.0, "prefill_tokens_per_s": 1.0,
     "transfer_overhead_s": -1.0},
    {"kind": "cost", "kv_bytes_per_token": 1.0, "bandwidth_bytes_per_s": math.inf, "prefill_tokens_per_s": 1.0},
    {"expiry_margin_s": -1.0},
    {"expiry_margin_s": math.nan},
    {"threshold_tokens": 1.5},
])
def test_bad_config_raises(bad: dict[str, Any]) -> None:
    with pytest.raises(PolicyError):
        PolicyConfig(**bad)


# ------------------------------------------------------------------------------------------------- import
def test_policy_imports_without_torch_cuda_or_native() -> None:
    code = """
import importlib.abc, sys
BLOCKED = ("torch", "cupy", "nixl", "zmq")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED or name == "kvshuttle._native":
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
import kvshuttle.policy
loaded = [m for m in sys.modules if m.split(".")[0] in BLOCKED or m == "kvshuttle._native"]
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
