"""The packed pipeline's bookkeeping (ChunkSlots) and its executors, on CPU: the rules the GPU path relies on.

Unit tests drive ChunkSlots with completions the test finishes by hand. Pipeline tests run real packed reads
between two engines of this process (NIXL/UCX over DRAM) with ``LateExecutor`` on both sides: packs and unpacks
complete late and out of order, as on a CUDA stream seen from the host, and the executor flags any staging slot
handed out while a copy of it is pending. The bytes are compared with the owner's.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from conftest import POISON, Geo, make_cache
from kvshuttle.errors import BackendError, BlockIdError
from kvshuttle.transfer.chunk_slots import ChunkSlots
from kvshuttle.transfer.executors import CudaExecutor, Finished, HostExecutor, executor_for
from late_copies import LateExecutor
from transfer_helpers import block_bytes, in_process_pair, token_bytes


class Manual:
    """A completion the test finishes."""

    def __init__(self, seconds: float = 0.5, error: BaseException | None = None) -> None:
        self._done = threading.Event()
        self.seconds, self.error = seconds, error

    def finish(self) -> None:
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def result(self) -> float:
        assert self.done()
        if self.error is not None:
            raise self.error
        return self.seconds


# --------------------------------------------------------------------------------------------- ChunkSlots
def test_a_slot_is_never_handed_out_while_its_copy_is_pending() -> None:
    slots = ChunkSlots([0, 1])
    first, second = Manual(), Manual()
    a, b = slots.take(), slots.take()
    assert {a, b} == {0, 1} and slots.take() is None
    assert a is not None and b is not None
    slots.start(0, a, first, hold=False)
    slots.start(1, b, second, hold=False)
    assert slots.reap() == [] and slots.take() is None
    second.finish()  # out of order: the later chunk completes first
    done = slots.reap()
    assert [(d.chunk, d.slot, d.seconds, d.error) for d in done] == [(1, b, 0.5, None)]
    assert slots.take() == b and slots.take() is None  # chunk 0's slot stays out while its copy runs


def test_held_chunks_keep_their_slot_until_released() -> None:
    slots = ChunkSlots([3])
    copy = Manual()
    slot = slots.take()
    assert slot == 3
    slots.start(7, slot, copy, hold=True)
    copy.finish()
    assert [d.chunk for d in slots.reap()] == [7]
    assert slots.held == 1 and slots.take() is None  # packed and offered: the reader may be reading it
    assert slots.oldest_hold() is not None
    assert not slots.release(8) and slots.take() is None  # an unknown chunk frees nothing
    assert slots.release(7) and slots.take() == 3


def test_reap_reports_in_chunk_order_and_a_failed_copy_is_not_held() -> None:
    slots = ChunkSlots([0, 1, 2])
    copies = {chunk: Manual(error=BackendError("boom") if chunk == 1 else None) for chunk in (2, 0, 1)}
    for chunk, copy in copies.items():
        slot = slots.take()
        assert slot is not None
        slots.start(chunk, slot, copy, hold=True)
    for copy in copies.values():
        copy.finish()
    done = slots.reap()
    assert [d.chunk for d in done] == [0, 1, 2]
    assert isinstance(done[1].error, BackendError) and done[0].error is None
    assert slots.held == 2 and slots.idle == 1  # the failed pack is never offered; its slot is free


def test_starting_a_busy_slot_or_a_chunk_twice_is_a_bug() -> None:
    slots = ChunkSlots([0, 1])
    slot = slots.take()
    assert slot is not None
    slots.start(0, slot, Manual(), hold=False)
    with pytest.raises(AssertionError, match="not free"):
        slots.start(1, slot, Manual(), hold=False)
    other = slots.take()
    assert other is not None
    with pytest.raises(AssertionError, match="already in flight"):
        slots.start(0, other, Manual(), hold=False)


def test_settle_waits_for_running_copies_and_keeps_slots_still_written() -> None:
    slots = ChunkSlots([0, 1, 2])
    late, stuck, held = Manual(), Manual(), Manual()
    for chunk, copy, hold in ((0, late, False), (1, stuck, False), (2, held, True)):
        slot = slots.take()
        assert slot is not None
        slots.start(chunk, slot, copy, hold=hold)
    held.finish()
    slots.reap()
    assert {id(c) for c in slots.running()} == {id(late), id(stuck)}  # the held chunk's copy is over
    threading.Timer(0.05, late.finish).start()
    start = time.monotonic()
    done = slots.settle(0.3)
    assert time.monotonic() - start >= 0.05  # it waited for the late copy
    assert [d.chunk for d in done] == [0]
    assert sorted(slots.reusable) == [0, 2]  # the stuck copy may still write slot 1: never given back
    assert slots.held == 0


def test_wait_any_blocks_on_the_oldest_copy() -> None:
    slots = ChunkSlots([0, 1])
    assert not slots.wait_any(0.01)
    old, new = Manual(), Manual()
    for chunk, copy in ((4, old), (5, new)):
        slot = slots.take()
        assert slot is not None
        slots.start(chunk, slot, copy, hold=False)
    new.finish()
    assert not slots.wait_any(0.02)  # chunk 4 still runs
    old.finish()
    assert slots.wait_any(0.02)


def test_the_late_executor_catches_a_naive_free_list() -> None:
    """The check the pipeline tests rely on can fail: reusing a slot at once is flagged."""
    geo = Geo(kind="flash_attn", order="NHD", dtype="float16", num_layers=1, num_blocks=4, block_size=4,
              num_heads=2, head_size=8)
    cache = make_cache(np.random.default_rng(0), geo).cache()
    staging = np.zeros(1 << 12, dtype=np.uint8)
    late = LateExecutor(delay_s=0.05)
    try:
        ids = np.array([1], dtype=np.int64)
        first = late.pack(cache, ids, staging, num_tokens=4, layout=None, head_offset=0)
        late.pack(cache, ids, staging, num_tokens=4, layout=None, head_offset=0)  # same slot, first pending
        assert first.wait(2)
    finally:
        late.close()
    assert late.violations and "pending copy 0" in late.violations[0]


# ------------------------------------------------------------------------------------------ executors
def test_host_executor_reports_time_and_errors_through_the_completion() -> None:
    geo = Geo(kind="flash_attn", order="NHD", dtype="float16", num_layers=1, num_blocks=4, block_size=4,
              num_heads=2, head_size=8)
    host = make_cache(np.random.default_rng(1), geo)
    cache = host.cache()
    staging = np.zeros(2 * 4 * 2 * 8 * 2, dtype=np.uint8)
    done = HostExecutor().pack(cache, np.array([2]), staging, num_tokens=4, layout=None, head_offset=0)
    assert isinstance(done, Finished) and done.done() and done.result() >= 0
    assert np.array_equal(staging.reshape(2, 4, 2, 8 * 2), block_bytes(host, [2])[0, :, 0].reshape(2, 4, 2, 16))
    bad = HostExecutor().pack(cache, np.array([9]), staging, num_tokens=4, layout=None, head_offset=0)
    with pytest.raises(BlockIdError):
        bad.result()
    assert isinstance(executor_for(cache), HostExecutor)


def test_the_cuda_executor_without_cupy_is_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(BackendError, match="cupy"):
        CudaExecutor("cuda:0")


# ------------------------------------------------------------------------------------ real pipelines
pytest.importorskip("nixl._api")
pytest.importorskip("zmq")

from kvshuttle.transfer import TransferError  # noqa: E402

BASE = Geo(kind="flash_attn", order="NHD", dtype="float16", num_layers=2, num_blocks=32, block_size=16,
           num_heads=4, head_size=32)  # 4 KiB pieces; 32 KiB chunks hold two blocks
CONFIG = {"staging_chunk_bytes": 32 << 10, "staging_chunks": 4, "connect_timeout_s": 10.0}


@pytest.fixture
def late_pair(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    owner_geo, reader_geo, fail_at = request.param
    source, target, owner, reader = in_process_pair(owner_geo, reader_geo, (11, 12), CONFIG)
    packs, unpacks = LateExecutor(), LateExecutor(fail_at=fail_at)
    owner.packs = packs  # before serve(): the owner's service takes its executor
    reader.unpacks = reader.last_unpacks = unpacks  # the last chunk too (it unpacks on the pipeline's thread)
    released: list[list[int]] = []
    pool_release = reader.pool.release

    def checked_release(slots: list[int]) -> None:  # nothing pending may still touch a slot going back
        spans = unpacks.pending_spans()
        for slot in slots:
            start = reader.pool.address(slot)
            if any(a < start + reader.pool.slot_bytes and start < b for a, b in spans):
                unpacks.violations.append(f"slot {slot} released while an unpack of it was pending")
        released.append(list(slots))
        pool_release(slots)

    reader.pool.release = checked_release  # type: ignore[method-assign]
    try:
        peer = reader.connect(owner.serve())
        yield {"owner": owner, "reader": reader, "peer": peer, "source": source, "target": target,
               "packs": packs, "unpacks": unpacks, "released": released}
    finally:
        reader.close()
        owner.close()
        packs.close()
        unpacks.close()


TRANSFORMS = [
    (BASE, BASE, None),
    (BASE, replace(BASE, order="HND", block_size=32, num_blocks=16), None),  # token order and block size
    (replace(BASE, kind="flashinfer"), replace(BASE, num_heads=2, order="HND"), None),  # a TP head slice
]


@pytest.mark.parametrize("late_pair", TRANSFORMS, indirect=True, ids=["identity", "order_block", "head_slice"])
def test_packed_read_with_late_out_of_order_copies_is_byte_exact(late_pair: dict[str, Any]) -> None:
    reader, owner, source, target = late_pair["reader"], late_pair["owner"], late_pair["source"], late_pair["target"]
    rng = np.random.default_rng(5)
    tokens = 11 * 16 + 3  # the last block is partial
    lids = rng.permutation(target.geo.num_blocks)[: -(-tokens // target.geo.block_size)]
    rids = rng.permutation(source.geo.num_blocks)[: -(-tokens // source.geo.block_size)]
    heads = min(source.geo.heads, target.geo.heads)
    offset = 1 if heads < source.geo.heads else 0
    handle = reader.read(late_pair["peer"], lids, rids, num_tokens=tokens, path="packed", num_heads=heads,
                         remote_head_offset=offset)
    tel = handle.wait(30)
    assert tel.path == "packed" and tel.chunks >= 3
    assert np.array_equal(token_bytes(target, lids, tokens, 0, heads), token_bytes(source, rids, tokens, offset,
                                                                                   heads))
    others = np.setdiff1d(np.arange(target.geo.num_blocks), lids)
    assert (block_bytes(target, others) == POISON).all()
    packs, unpacks = late_pair["packs"], late_pair["unpacks"]
    assert packs.violations == [] and unpacks.violations == []
    assert packs.out_of_order or unpacks.out_of_order  # the test exercised completions out of order
    assert reader.stats()["staging_free"] == CONFIG["staging_chunks"]
    deadline = time.monotonic() + 5
    while owner.stats()["staging_free"] != CONFIG["staging_chunks"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.stats()["staging_free"] == CONFIG["staging_chunks"]


@pytest.mark.parametrize("late_pair", [(BASE, BASE, 3)], indirect=True, ids=["fourth_unpack_fails"])
def test_a_failed_unpack_mid_pipeline_releases_everything_after_pending_copies(late_pair: dict[str, Any]) -> None:
    reader, owner = late_pair["reader"], late_pair["owner"]
    lids, rids = np.arange(16), np.arange(16, 32)
    handle = reader.read(late_pair["peer"], lids, rids, path="packed")
    with pytest.raises(TransferError, match="injected failure") as info:
        handle.wait(30)
    invalid = set(info.value.invalid_block_ids)
    assert invalid and invalid <= set(lids.tolist())
    assert len(invalid) % 2 == 0  # whole chunks of two blocks
    valid = [i for i, b in enumerate(lids.tolist()) if b not in invalid]
    assert valid, "chunks unpacked before and around the failure count as done"
    source, target = late_pair["source"], late_pair["target"]
    assert np.array_equal(block_bytes(target, lids[valid]), block_bytes(source, rids[valid])), \
        "a block reported valid does not hold the owner's bytes"
    assert late_pair["unpacks"].violations == []  # no slot went back while an unpack of it was pending
    assert reader.stats()["staging_free"] == CONFIG["staging_chunks"]
    deadline = time.monotonic() + 5
    while owner.stats()["staging_free"] != CONFIG["staging_chunks"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.stats()["staging_free"] == CONFIG["staging_chunks"]
