"""The native copy pool (csrc/cpu/thread_pool.cpp): equal shares over up to one thread per ``bytes_per_thread``
bytes.

Every copy must land exactly once whatever the split: the byte checks cover sizes that do not divide into the
shares, more threads than work, concurrent callers (serialized by the pool) and a pack split over every thread
while other Python threads pack at the same time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from conftest import POISON, Geo, assert_bytes_equal, make_cache, random_bytes, random_ids
from kvshuttle import _native, pack, staging_nbytes, unpack
from kvshuttle.core import reference
from kvshuttle.core.layout import StagingLayout


def memcpy_check(rng: np.random.Generator, nbytes: int, shift: int = 0) -> None:
    src = random_bytes(rng, nbytes + shift)[shift:]
    dst = np.full(nbytes + 2 * 64, POISON, np.uint8)
    _native.parallel_memcpy(dst.ctypes.data + 64, src.ctypes.data, nbytes)
    assert_bytes_equal(dst[64: 64 + nbytes], src, "copied bytes")
    assert (dst[:64] == POISON).all() and (dst[64 + nbytes:] == POISON).all(), "bytes outside the copy changed"


def run_at_once(count: int, body: Callable[[int], None], repeat: int) -> None:
    """``body(k)`` ``repeat`` times on each of ``count`` Python threads at once; any thread's error fails."""
    errors: list[BaseException] = []

    def loop(k: int) -> None:
        try:
            for _ in range(repeat):
                body(k)
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("nbytes", [1, 63, 4096, 100_003, 1 << 20])
def test_memcpy_split_every_way(rng, native_threads, threads, nbytes):
    native_threads(threads)
    memcpy_check(rng, nbytes, shift=nbytes % 7)


def test_bytes_per_thread_is_settable(rng):
    assert _native.bytes_per_thread() == 2 << 20
    try:
        _native.set_bytes_per_thread(4096)
        assert _native.bytes_per_thread() == 4096
        memcpy_check(rng, 3 * 4096 + 5)  # three threads' worth, on however many the pool has
    finally:
        _native.set_bytes_per_thread(-1)
    assert _native.bytes_per_thread() == 2 << 20


def test_concurrent_callers_each_get_their_bytes(rng, native_threads):
    """Python threads calling the pool at once: one job at a time, none loses or mixes grains."""
    native_threads(3)
    sizes = [5_000 + 997 * k for k in range(8)]
    sources = [random_bytes(rng, n) for n in sizes]
    targets = [np.full(n, POISON, np.uint8) for n in sizes]
    run_at_once(len(sizes), lambda k: _native.parallel_memcpy(targets[k].ctypes.data, sources[k].ctypes.data,
                                                              sizes[k]), repeat=40)
    for k, (src, dst) in enumerate(zip(sources, targets, strict=True)):
        assert_bytes_equal(dst, src, f"caller {k}")


def test_pack_on_all_threads_while_others_pack(rng, native_threads):
    """A pack split over 7 threads, with 3 more Python threads packing other blocks at once."""
    native_threads(7)
    geo = Geo("flash_attn", "NHD", "bf16", num_layers=4, num_blocks=24, block_size=16, num_heads=2, head_size=64)
    host = make_cache(rng, geo)
    cache = host.cache()
    layout = StagingLayout.like(cache.geometry)
    jobs = [random_ids(rng, 24, 5 + k) for k in range(4)]
    expected = []
    for ids in jobs:
        want = np.empty(staging_nbytes(cache, ids.size * 16), np.uint8)
        reference.pack(cache, ids, want, layout, ids.size * 16, 0)
        expected.append(want)
    got = [np.full(e.size, POISON, np.uint8) for e in expected]
    run_at_once(len(jobs), lambda k: pack(cache, jobs[k], got[k], backend="native"), repeat=20)
    for k in range(len(jobs)):
        assert_bytes_equal(got[k], expected[k], f"pack {k}")
    restored = make_cache(rng, geo)  # different random bytes: the unpacked blocks must become the packed ones
    unpack(got[0], restored.cache(), jobs[0], backend="native")
    again = np.full(expected[0].size, POISON, np.uint8)
    pack(restored.cache(), jobs[0], again, backend="native")
    assert_bytes_equal(again, expected[0], "unpacked then packed")
