"""The library reuse read against a real decode process: every outcome is a result, never a surprise.

The decode is ``kvshuttle demo``'s worker (a paged DRAM cache whose token KV is a deterministic function of
the token ids, a retention ledger, claims on its side channel); the prefill side runs here. Every fetch is
checked byte for byte against the KV the prompt must have; every refusal or failure must leave the local
hit as the only reuse and must not report a written block as valid.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from kvshuttle.demo.workers import DemoShape, PagedWorker, WorkerProcess
from kvshuttle.policy import PolicyConfig
from kvshuttle.reuse import Failure, ReuseArgumentError, ReuseReader

SHAPE = DemoShape(layers=2, kv_heads=2, head_size=64, block_size=16, cache_blocks=256, retention_budget_blocks=200)


@pytest.fixture(scope="module")
def decode() -> Iterator[WorkerProcess]:
    worker = WorkerProcess(SHAPE, "decode")
    try:
        yield worker
    finally:
        worker.close()


@pytest.fixture
def prefill() -> Iterator[tuple[PagedWorker, ReuseReader]]:
    worker = PagedWorker(SHAPE, "prefill")
    reader = ReuseReader(worker.engine, PolicyConfig(threshold_tokens=64), timeout_s=10.0)
    try:
        yield worker, reader
    finally:
        reader.close()
        worker.engine.close()


def turn(decode: WorkerProcess, name: str, tokens: list[int], ttl_s: float | None = None) -> dict[str, Any]:
    """Decode finished a turn holding KV for all of ``tokens`` but the last; returns its kv_transfer_params."""
    done = decode.call("finish_turn", conversation=name, request_id=f"{name}-{len(tokens)}", tokens=tokens,
                       held=len(tokens) - 1, ttl_s=ttl_s)
    params: dict[str, Any] = done["kv_transfer_params"]
    return params


def words(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, 32_000, size=n)]


def unwritten(worker: PagedWorker, blocks: list[int], before: list[np.ndarray[Any, Any]]) -> bool:
    return all(np.array_equal(layer[:, blocks], old[:, blocks]) for layer, old in zip(worker.layers, before,
                                                                                      strict=True))


def test_continuation_reads_prompt_and_answer(decode: WorkerProcess, prefill: tuple[PagedWorker, ReuseReader]) -> None:
    worker, reader = prefill
    rng = np.random.default_rng(1)
    history = words(rng, 300)
    params = turn(decode, "cont", history)
    prompt = history + words(rng, 40)
    blocks = worker.allocate(len(prompt))
    result = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=blocks)
    assert result.action == "fetched" and result.reason == "fetch", result.message
    assert result.fetched_tokens == result.reused_tokens == len(history) - 1  # all decode holds
    assert result.invalid_block_ids == () and result.recompute == range(len(history) - 1, len(prompt))
    assert result.bytes == -(-result.fetched_tokens // SHAPE.block_size) * SHAPE.block_size * SHAPE.kv_bytes_per_token
    assert worker.holds(blocks, prompt, result.reused_tokens), "fetched KV differs from the prompt's"


def test_edited_history_reuses_only_the_verified_prefix(decode: WorkerProcess,
                                                         prefill: tuple[PagedWorker, ReuseReader]) -> None:
    worker, reader = prefill
    rng = np.random.default_rng(2)
    history = words(rng, 320)
    params = turn(decode, "edit", history)
    edited = list(history)
    edited[100] += 1  # block 6 (tokens 96..111) differs, and every block after it
    prompt = edited + words(rng, 30)
    blocks = worker.allocate(len(prompt))
    result = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=blocks)
    assert result.action == "fetched" and result.fetched_tokens == 96
    assert result.decision.mismatch_block == 6
    assert worker.holds(blocks, prompt, result.reused_tokens)


def test_local_hit_comes_first(decode: WorkerProcess, prefill: tuple[PagedWorker, ReuseReader]) -> None:
    worker, reader = prefill
    rng = np.random.default_rng(3)
    history = words(rng, 256)
    params = turn(decode, "local", history)
    prompt = history + words(rng, 20)
    blocks = worker.allocate(len(prompt))
    worker.write(blocks, prompt, 0, 64)  # the prefix cache held 4 blocks
    result = reader.read(params, prompt, local_hit_tokens=64, local_block_ids=blocks)
    assert result.local_tokens == 64 and result.fetched_tokens == 255 - 64
    assert result.decision.fetch_blocks.start == 4
    assert worker.holds(blocks, prompt, result.reused_tokens)


@pytest.mark.parametrize("params, reason", [
    (None, "no_handle"),
    ({"remote_block_ids": [1, 2], "remote_engine_id": "vllm"}, "unverifiable_handle"),  # vLLM's own handle
    ({"kvshuttle_version": 1, "remote_block_ids": "nope"}, "malformed_handle"),
    ("not a dict", "malformed_handle"),
])
def test_unusable_params_recompute(prefill: tuple[PagedWorker, ReuseReader], params: Any, reason: str) -> None:
    worker, reader = prefill
    prompt = list(range(200))
    blocks = worker.allocate(len(prompt))
    before = [layer.copy() for layer in worker.layers]
    result = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=blocks)
    assert (result.action, result.reason, result.reused_tokens) == ("recompute", reason, 0)
    assert result.recompute == range(200) and result.invalid_block_ids == ()
    assert unwritten(worker, blocks, before)


def test_tampered_digests_reuse_nothing(decode: WorkerProcess, prefill: tuple[PagedWorker, ReuseReader]) -> None:
    """A handle whose digests were changed to match another prompt: its MAC fails, so the prefill recomputes without
    asking the decode anything (the decode's own digest check on claims is tested in test_claims.py)."""
    worker, reader = prefill
    rng = np.random.default_rng(4)
    history = words(rng, 200)
    params = turn(decode, "tamper", history)
    other = words(rng, 200)
    from kvshuttle.policy import block_digests

    forged = {**params, "kvshuttle_digests": b"".join(block_digests(other[:199], SHAPE.block_size)).hex()}
    prompt = other + words(rng, 10)
    blocks = worker.allocate(len(prompt))
    before = [layer.copy() for layer in worker.layers]
    result = reader.read(forged, prompt, local_hit_tokens=0, local_block_ids=blocks)
    assert (result.action, result.reason, result.reused_tokens) == ("recompute", "unauthenticated_handle", 0)
    assert "forged or edited" in result.message
    assert unwritten(worker, blocks, before)


def test_expired_handle_recomputes(decode: WorkerProcess, prefill: tuple[PagedWorker, ReuseReader]) -> None:
    worker, reader = prefill
    rng = np.random.default_rng(5)
    history = words(rng, 200)
    params = turn(decode, "expire", history, ttl_s=4.0)  # inside the 5 s safety margin already
    prompt = history + words(rng, 10)
    result = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=worker.allocate(len(prompt)))
    assert (result.action, result.reason) == ("recompute", "expired")


def test_released_handle_is_refused_and_recomputed(decode: WorkerProcess,
                                                   prefill: tuple[PagedWorker, ReuseReader]) -> None:
    worker, reader = prefill
    rng = np.random.default_rng(6)
    history = words(rng, 200)
    params = turn(decode, "released", history)
    assert decode.call("release", conversation="released")
    prompt = history + words(rng, 10)
    blocks = worker.allocate(len(prompt))
    before = [layer.copy() for layer in worker.layers]
    result = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=blocks)
    assert (result.action, result.reason, result.reused_tokens) == ("recompute", Failure.CLAIM_REFUSED.value, 0)
    assert "recompute, because" in result.message and result.owner_reason == "HandleReleasedError"
    assert set(result.invalid_block_ids) <= set(blocks)
    assert unwritten(worker, blocks, before)


def test_dead_decode_recomputes_then_a_new_one_is_used(prefill: tuple[PagedWorker, ReuseReader]) -> None:
    worker, reader = prefill
    rng = np.random.default_rng(7)
    history = words(rng, 200)
    prompt = history + words(rng, 10)
    doomed = WorkerProcess(SHAPE, "decode")
    try:
        params = turn(doomed, "dead", history)
        first = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=worker.allocate(len(prompt)))
        assert first.action == "fetched"
    finally:
        doomed.process.kill()
        doomed.process.join(10)
    start = time.monotonic()
    lost = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=worker.allocate(len(prompt)))
    assert lost.action == "recompute" and lost.reason in (Failure.PEER_LOST.value, Failure.PEER_UNREACHABLE.value)
    assert time.monotonic() - start < 2.0
    start = time.monotonic()
    lost_again = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=worker.allocate(len(prompt)))
    assert lost_again.reason == Failure.PEER_COOLING_DOWN.value  # the circuit breaker: refused at once, no reconnect
    assert time.monotonic() - start < 0.05
    fresh = WorkerProcess(SHAPE, "decode")
    try:
        params = turn(fresh, "dead", history)
        blocks = worker.allocate(len(prompt))
        again = reader.read(params, prompt, local_hit_tokens=0, local_block_ids=blocks)
        assert again.action == "fetched" and worker.holds(blocks, prompt, again.reused_tokens)
    finally:
        fresh.close()


def test_caller_bugs_raise(prefill: tuple[PagedWorker, ReuseReader]) -> None:
    worker, reader = prefill
    with pytest.raises(ReuseArgumentError, match="block table"):
        reader.read(None, list(range(100)), local_hit_tokens=0, local_block_ids=[1, 2])
    with pytest.raises(ReuseArgumentError, match="integers"):
        reader.read(None, list(range(10)), local_hit_tokens=0, local_block_ids=["a"])  # type: ignore[list-item]
    with pytest.raises(ReuseArgumentError, match="path"):
        ReuseReader(worker.engine, path="fast")  # type: ignore[arg-type]
    with pytest.raises(ReuseArgumentError, match="prompt"):
        reader.read(None, 5, local_hit_tokens=0, local_block_ids=[1])  # type: ignore[arg-type]


def test_misaligned_block_sizes_recompute_rather_than_guess(decode: WorkerProcess) -> None:
    """Prefill blocks of 32 tokens, decode blocks of 16 (the packed path re-chunks): a local hit of one block
    continues with the decode's block 2. A hit that ends inside a local block cannot be continued by whole
    local blocks: the local hit is kept and the rest recomputed, never guessed."""
    worker = PagedWorker(replace(SHAPE, block_size=32), "prefill")
    reader = ReuseReader(worker.engine, timeout_s=10.0)
    try:
        rng = np.random.default_rng(8)
        history = words(rng, 300)
        params = turn(decode, "sizes", history)
        prompt = history + words(rng, 20)
        blocks = worker.allocate(len(prompt))
        worker.write(blocks, prompt, 0, 32)
        aligned = reader.read(params, prompt, local_hit_tokens=32, local_block_ids=blocks)
        assert aligned.action == "fetched" and aligned.local_tokens == 32
        assert worker.holds(blocks, prompt, aligned.reused_tokens)
        misaligned = reader.read(params, prompt, local_hit_tokens=48, local_block_ids=blocks)
        assert (misaligned.action, misaligned.reason, misaligned.reused_tokens) == ("local", "misaligned", 48)
    finally:
        reader.close()
        worker.engine.close()


def test_renew_keeps_a_retention_past_its_ttl_and_release_ends_it(decode: WorkerProcess,
                                                                   prefill: tuple[PagedWorker, ReuseReader]) -> None:
    worker, reader = prefill
    rng = np.random.default_rng(9)
    history = words(rng, 200)
    params = turn(decode, "renew", history, ttl_s=6.0)  # would expire within the 5 s margin in a second
    renewed = reader.renew(params, ttl_s=120.0)
    assert renewed is not None and renewed["kvshuttle_handle_id"] == params["kvshuttle_handle_id"]
    assert renewed["remote_blocks_expiry_time"] > params["remote_blocks_expiry_time"] + 100
    prompt = history + words(rng, 10)
    kept = reader.read(renewed, prompt, local_hit_tokens=0, local_block_ids=worker.allocate(len(prompt)))
    assert kept.action == "fetched"
    assert reader.release(renewed) and not reader.release(renewed)  # the second finds nothing to free
    gone = reader.read(renewed, prompt, local_hit_tokens=0, local_block_ids=worker.allocate(len(prompt)))
    assert (gone.reason, gone.owner_reason) == ("claim_refused", "HandleReleasedError")
    assert reader.renew(renewed) is None and reader.renew({"not": "a handle"}) is None
