"""The host tier's demotion copy on its own (no NIXL): it lands the blocks' bytes in the slots, tells ``on_copied``
its size and time, and runs at the lowest CPU priority, so on the engine's cores the forward passes go first."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from conftest import Geo, make_cache

GEO = Geo("vllm_cpu_attn", dtype="bf16", num_blocks=16, layout="LBHNC")


def test_a_demotion_copy_lands_the_bytes_reports_itself_and_yields_the_cpu() -> None:
    import kvshuttle
    from kvshuttle.retention import Demotion
    from kvshuttle.transfer.host_tier import COPY_NICENESS, HostTier

    cache = make_cache(np.random.default_rng(35), GEO).cache()
    mine = os.getpriority(os.PRIO_PROCESS, 0)  # (Linux: this thread's)
    copied: list[tuple[str, int, float, int | None]] = []

    def on_copied(handle_id: str, nbytes: int, seconds: float) -> None:  # runs on the copy thread
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform == "linux" else None
        copied.append((handle_id, nbytes, seconds, nice))

    tier = HostTier(cache, 4, on_copied=on_copied)
    done = threading.Event()
    reports: list[bool] = []
    ids = (5, 2, 9)
    tier.demote(Demotion("handle-35", ids, (1, 2, 3), lambda ok: (reports.append(ok), done.set())))
    assert done.wait(30) and reports == [True]
    expected = np.zeros(3 * tier.block_bytes, dtype=np.uint8)
    kvshuttle.pack(cache, np.asarray(ids, dtype=np.int64), expected, num_tokens=3 * cache.geometry.block_size,
             layout=tier.layout)
    assert np.array_equal(tier.slot_bytes(1, 3), expected) and not tier.slot_bytes(0).any()
    [(handle_id, nbytes, seconds, nice)] = copied
    assert (handle_id, nbytes) == ("handle-35", 3 * tier.block_bytes) and seconds > 0
    if sys.platform == "linux":
        assert nice == COPY_NICENESS
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the thread that asked (the engine's, in a worker) kept its own
    tier.close()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_lower_priority_moves_only_the_calling_thread() -> None:
    from kvshuttle.transfer.host_tier import lower_priority

    seen: list[int] = []

    def worker() -> None:
        lower_priority(7)
        lower_priority(3)  # never raises it back (an unprivileged thread could not)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(30)
    assert seen == [max(7, before)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
