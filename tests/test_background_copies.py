"""The native worker that runs a reader's unpacks (``BackgroundExecutor`` over ``_native.AsyncCopier``).

Its copies must be byte-exact against the numpy oracles on every layout and dtype, run in submission order,
report errors through their completion (validation on the caller's thread, before anything is queued), and
finish what was queued when closed.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import (
    KINDS,
    Geo,
    assert_bytes_equal,
    assert_caches_equal,
    make_cache,
    oracle_pack,
    oracle_unpack,
    poisoned,
    random_bytes,
    random_ids,
    transform,
)
from kvshuttle.core import native, ops
from kvshuttle.core.layout import StagingLayout
from kvshuttle.errors import BackendError, BlockIdError, StagingError
from kvshuttle.transfer.executors import BackgroundExecutor, Finished, TicketCompletion

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native extension")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float16", "fp8", "float32"])
@pytest.mark.parametrize("name", ["identity", "flip_order", "bs24", "head_slice_bs24_flip"])
def test_background_pack_and_unpack_match_the_oracles(rng: np.random.Generator, kind: str, dtype: str,
                                                      name: str) -> None:
    geo = Geo(kind=kind, dtype=dtype, num_layers=3, num_blocks=12, block_size=16, num_heads=4, head_size=8)
    layout, offset = transform(geo, name)
    ids = random_ids(rng, geo.num_blocks, 5)
    tokens = 5 * geo.block_size - 3  # a partial last block
    source = make_cache(rng, geo)
    nbytes = ops.staging_nbytes(source.cache(), tokens, layout)
    executor = BackgroundExecutor()
    try:
        staging = poisoned(nbytes)
        done = executor.pack(source.cache(), ids, staging, num_tokens=tokens, layout=layout, head_offset=offset)
        assert isinstance(done, TicketCompletion) and done.wait(10) and done.result() >= 0
        want = poisoned(nbytes)
        oracle_pack(source, ids, want, layout, tokens, offset)
        assert_bytes_equal(staging, want, "packed staging")

        target = make_cache(rng, geo)  # random bytes stand for what the destination held before
        expected = target.clone()
        incoming = random_bytes(rng, nbytes)
        oracle_unpack(incoming, expected, ids, layout, tokens, offset)
        done = executor.unpack(incoming, target.cache(), ids, num_tokens=tokens, layout=layout, head_offset=offset)
        assert done.wait(10) and done.result() >= 0
        assert_caches_equal(target.raws, expected.raws, "unpacked cache")
    finally:
        executor.close()


def test_copies_finish_in_submission_order_and_close_runs_what_is_queued(rng: np.random.Generator) -> None:
    geo = Geo(num_layers=4, num_blocks=64, block_size=16, num_heads=8, head_size=64)
    source = make_cache(rng, geo)
    cache = source.cache()
    executor = BackgroundExecutor()
    per_block = ops.staging_nbytes(cache, geo.block_size)
    stagings = [poisoned(per_block) for _ in range(geo.num_blocks)]
    completions = [executor.pack(cache, np.array([b]), stagings[b], num_tokens=geo.block_size, layout=None,
                                 head_offset=0) for b in range(geo.num_blocks)]
    order: list[int] = []
    while len(order) < len(completions):  # a later copy is never done before an earlier one
        done = [i for i, c in enumerate(completions) if c.done()]
        assert done == list(range(len(done)))
        order = done
    executor.close()
    for b, staging in enumerate(stagings):
        want = poisoned(per_block)
        oracle_pack(source, [b], want, StagingLayout.like(cache.geometry), geo.block_size)
        assert_bytes_equal(staging, want, f"block {b}")


def test_bad_calls_fail_on_the_callers_thread_and_queue_nothing(rng: np.random.Generator) -> None:
    geo = Geo(num_blocks=4)
    target = make_cache(rng, geo)
    before = target.snapshot()
    executor = BackgroundExecutor()
    try:
        staging = random_bytes(rng, ops.staging_nbytes(target.cache(), geo.block_size))
        bad_ids = executor.unpack(staging, target.cache(), np.array([9]), num_tokens=geo.block_size, layout=None,
                                  head_offset=0)
        assert isinstance(bad_ids, Finished) and bad_ids.done()
        with pytest.raises(BlockIdError):
            bad_ids.result()
        short = executor.unpack(staging[:-1], target.cache(), np.array([1]), num_tokens=geo.block_size,
                                layout=None, head_offset=0)
        with pytest.raises(StagingError):
            short.result()
        assert_caches_equal(target.raws, before, "cache after refused unpacks")
    finally:
        executor.close()


def test_a_closed_copier_refuses_new_copies_with_a_named_error(rng: np.random.Generator) -> None:
    geo = Geo(num_blocks=4)
    cache = make_cache(rng, geo).cache()
    executor = BackgroundExecutor()
    executor.close()
    executor.close()  # idempotent
    with pytest.raises(BackendError, match="closed"):
        executor.pack(cache, np.array([1]), poisoned(ops.staging_nbytes(cache, geo.block_size)),
                      num_tokens=geo.block_size, layout=None, head_offset=0)


def test_waiting_releases_the_gil(rng: np.random.Generator) -> None:
    """While one thread waits on a long copy, another Python thread keeps running."""
    geo = Geo(num_layers=8, num_blocks=256, block_size=16, num_heads=8, head_size=128)
    cache = make_cache(rng, geo).cache()
    ids = rng.permutation(geo.num_blocks).astype(np.int64)
    executor = BackgroundExecutor()
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    staging = poisoned(ops.staging_nbytes(cache, ids.size * geo.block_size))
    counter = threading.Thread(target=count)
    counter.start()
    try:
        for _ in range(3):
            before = ticks
            assert executor.pack(cache, ids, staging, num_tokens=ids.size * geo.block_size, layout=None,
                                 head_offset=0).wait(30)
            assert ticks > before
    finally:
        stop.set()
        counter.join()
        executor.close()


def test_an_error_in_the_worker_reaches_the_caller_as_the_named_error() -> None:
    """A copy the native check refuses on the worker thread: its ticket is done and result() raises it."""
    from kvshuttle.errors import LayoutError

    copier = native.ext.AsyncCopier()
    try:
        bad = native.ext.PagedCopySpec()  # every field 0: no geometry to copy
        ticket = copier.submit(bad, np.zeros(0, dtype=np.uint64), np.zeros(1, dtype=np.int64),
                               native.ext.Direction.PACK)
        assert ticket.wait(10) and ticket.done()
        with pytest.raises(LayoutError):
            ticket.result()
        assert copier.pending() == 0
    finally:
        copier.close()
