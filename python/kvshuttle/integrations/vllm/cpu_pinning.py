"""Where the worker's transfer threads run (``kvshuttle_transfer_cpus``).

A reverse read's bytes are copied by host threads unless a NIC does it: on a CPU host, UCX's progress thread and
the thread waiting on the read copy them (shared memory), on the cores the engine computes on. Layer-pipelined
loads overlap that copy with the forward pass only if it runs elsewhere. With ``kvshuttle_transfer_cpus`` the
worker keeps its transfer threads on those CPUs: the threads its transfer engine started (NIXL's progress thread,
the side channel's) and its loader threads. They are re-pinned at every load, so a later process-wide pinning
(``taskset -a``, a benchmark's) does not move them back. Linux only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable


def thread_ids() -> set[int]:
    """This process's thread ids (Linux ``/proc/self/task``; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def pin(tids: Iterable[int], cpus: frozenset[int]) -> None:
    """Set each thread's CPU mask (0: the calling thread); threads that ended meanwhile are skipped."""
    for tid in tids:  # (a thread may have ended; not Linux: the setting is refused at start-up)
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setaffinity(tid, cpus)


def check_cpus(cpus: Iterable[int]) -> str | None:
    """Why these CPUs cannot hold the transfer threads, or None."""
    if not hasattr(os, "sched_setaffinity"):
        return "this platform cannot pin threads (Linux only)"
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - allowed)
    if outside:
        return f"CPUs {outside} are not among this process's {sorted(allowed)}"
    return None
