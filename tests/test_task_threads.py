"""The kept threads packed reads run on (python/kvshuttle/transfer/task_threads.py): a task never waits behind
another, threads are reused, closing ends them; and two real engines run their packed reads' pipelines and pack
jobs on them, one kept thread each for reads one after another."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import Geo
from kvshuttle.transfer.executors import BackgroundExecutor, HostExecutor
from kvshuttle.transfer.task_threads import TaskThreads
from transfer_helpers import block_bytes, in_process_pair


def _until(condition, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_tasks_run_at_once_even_while_others_block() -> None:
    workers = TaskThreads("test")
    barrier = threading.Barrier(4, timeout=5)  # passes only when all four tasks run at the same time
    passed: list[bool] = []

    def task() -> None:
        barrier.wait()
        passed.append(True)

    try:
        events = [workers.submit(task) for _ in range(4)]
        assert all(e.wait(10) for e in events)
        assert passed == [True] * 4 and workers.threads == 4
    finally:
        workers.close()


def test_a_thread_is_kept_for_the_next_task() -> None:
    workers = TaskThreads("test")
    seen: list[int] = []
    try:
        for _ in range(5):
            assert workers.submit(lambda: seen.append(threading.get_ident())).wait(5)
            assert _until(lambda: workers._idle == 1)  # the thread is back, waiting for a task
        assert len(set(seen)) == 1 and workers.threads == 1
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-"))
    finally:
        workers.close()


def test_a_failing_task_is_logged_and_its_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    workers = TaskThreads("test")

    def boom() -> None:
        raise ValueError("a bug in a task")

    try:
        assert workers.submit(boom).wait(5)
        assert _until(lambda: workers._idle == 1)
        ran = []
        assert workers.submit(lambda: ran.append(1)).wait(5)
        assert ran == [1] and workers.threads == 1
        assert "a bug in a task" in caplog.text
    finally:
        workers.close()


def test_close_ends_the_threads_and_refuses_new_tasks() -> None:
    workers = TaskThreads("test")
    release = threading.Event()
    busy = workers.submit(lambda: release.wait(5))
    idle = workers.submit(lambda: None)
    assert idle.wait(5) and workers.threads == 2
    workers.close()
    release.set()
    assert busy.wait(5)
    assert _until(lambda: workers.threads == 0)
    with pytest.raises(RuntimeError, match="closed"):
        workers.submit(lambda: None)
    workers.close()  # idempotent


GEO = Geo(kind="flash_attn", order="NHD", dtype="float16", num_layers=2, num_blocks=16, block_size=16,
          num_heads=4, head_size=32)
CONFIG = {"staging_chunk_bytes": 32 << 10, "staging_chunks": 4, "connect_timeout_s": 10.0}


def test_packed_reads_one_after_another_reuse_one_thread_on_each_side() -> None:
    source, target, owner, reader = in_process_pair(GEO, GEO, (3, 4), CONFIG)
    try:
        peer = reader.connect(owner.serve())
        service = owner._owner
        assert service is not None
        rng = np.random.default_rng(5)
        for _ in range(3):
            lids, rids = rng.permutation(16)[:5], rng.permutation(16)[:5]
            tel = reader.read(peer, lids, rids, path="packed").wait(30)
            assert tel.path == "packed" and tel.chunks == 3  # two blocks per chunk: the last one alone
            assert np.array_equal(block_bytes(target, lids), block_bytes(source, rids))
            assert _until(lambda: reader.pipelines._idle == 1 and service._workers._idle == 1)  # both back
        assert reader.pipelines.threads == 1
        assert service._workers.threads == 1
    finally:
        reader.close()
        owner.close()
    assert _until(lambda: reader.pipelines.threads == 0)


class _Spy:
    """An executor that notes on which Python thread each copy was submitted (and, inline, ran)."""

    def __init__(self, executor: HostExecutor) -> None:
        self.executor, self.threads = executor, []  # type: ignore[var-annotated]

    def pack(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.executor.pack(*args, **kwargs)

    def unpack(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.threads.append(threading.current_thread().name)
        return self.executor.unpack(*args, **kwargs)


def test_the_last_chunk_unpacks_on_the_pipeline_thread_the_others_on_the_native_worker() -> None:
    source, target, owner, reader = in_process_pair(GEO, GEO, (6, 7), CONFIG)
    background = BackgroundExecutor()
    reader.unpacks, reader.last_unpacks = _Spy(background), _Spy(HostExecutor())
    try:
        peer = reader.connect(owner.serve())
        lids, rids = np.arange(7), np.arange(8, 15)
        assert reader.read(peer, lids, rids, path="packed").wait(30).chunks == 4
        assert np.array_equal(block_bytes(target, lids), block_bytes(source, rids))
        assert len(reader.unpacks.threads) == 3  # queued to the worker from the pipeline thread
        assert all(name.startswith("kvshuttle-read-") for name in reader.unpacks.threads)
        assert len(reader.last_unpacks.threads) == 1
        assert reader.last_unpacks.threads[0].startswith("kvshuttle-read-")
    finally:
        reader.close()
        owner.close()
        background.close()
