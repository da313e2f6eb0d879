"""A decode whose NIXL data path stalls while its side channel keeps answering (for the quarantine tests).

No tc/netem here, and SIGSTOP stops a whole process (its side channel too). So both sides run UCX over TCP on
loopback (``UCX_TLS=tcp``), where a READ is served by the owner's UCX worker (CMA, the default on one host, reads
the owner's memory from the reader's kernel and never waits on it), and the decode process freezes only the thread
NIXL's UCX backend progresses that worker on: a signal sent to that one thread (``tgkill``) runs a handler that is
libc's ``pause()``, which returns when a second signal arrives. The process, its side channel (ZMQ's I/O thread
answers heartbeats, a Python thread answers claims) and its ledger stay alive; only the bytes stop moving.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from kvshuttle.demo.workers import Decode, DemoShape
from transfer_helpers import STARTUP_TIMEOUT_S, PipedProcess

FREEZE, THAW = signal.SIGUSR2, signal.SIGUSR1
_SYS_TGKILL = 234  # x86-64


@contextlib.contextmanager
def ucx_over_tcp() -> Iterator[None]:
    """UCX over TCP for the engines created (and the processes started) inside the block."""
    before = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"
    try:
        yield
    finally:
        if before is None:
            del os.environ["UCX_TLS"]
        else:
            os.environ["UCX_TLS"] = before


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.syscall.restype = ctypes.c_long
    return libc


def _native_threads() -> dict[int, str]:
    """This process's threads that Python did not start (NIXL's, UCX's, ZMQ's), tid -> name."""
    python = {t.native_id for t in threading.enumerate()}
    tids = (int(t) for t in os.listdir("/proc/self/task"))
    return {t: open(f"/proc/self/task/{t}/comm").read().strip() for t in tids if t not in python}


class StallableDecode(Decode):
    """``kvshuttle demo``'s decode (ledger, claims, side channel) whose data path can be frozen and thawed."""

    def __init__(self, shape: DemoShape) -> None:
        self._libc = _libc()
        # pause() and getpid() are async-signal-safe; the handler's int argument is ignored by both
        self._libc.signal(FREEZE, ctypes.cast(self._libc.pause, ctypes.c_void_p).value)
        self._libc.signal(THAW, ctypes.cast(self._libc.getpid, ctypes.c_void_p).value)
        before = _native_threads()
        super().__init__(shape)
        started = sorted((t, name) for t, name in _native_threads().items() if t not in before)
        # NIXL's UCX backend starts UCX's "async" thread, then the thread that progresses the worker
        asyncs = [t for t, name in started if name == "async"]
        self.data_threads = [t for t, name in started if asyncs and t > asyncs[0] and not name.startswith("ZMQ")]
        if not self.data_threads:
            raise RuntimeError(f"no UCX progress thread among {started}")

    def _signal(self, sig: int) -> int:
        for tid in self.data_threads:
            if self._libc.syscall(_SYS_TGKILL, os.getpid(), tid, sig) != 0:
                raise OSError(ctypes.get_errno(), f"tgkill({tid})")
        return len(self.data_threads)

    def freeze_data(self) -> int:
        return self._signal(FREEZE)

    def thaw_data(self) -> int:
        return self._signal(THAW)

    def claims_open(self) -> int:
        return int(self.ledger.metrics()["claims_in_flight"])

    def staging_free(self) -> int:
        return int(self.engine.stats()["staging_free"])


def _main(conn: Any, shape: DemoShape, stallable: bool) -> None:
    worker: Decode | None = None
    try:
        worker = StallableDecode(shape) if stallable else Decode(shape)
        conn.send(("ready", worker.address))
        while True:
            command, args = conn.recv()
            if command == "stop":
                break
            conn.send(("ok", getattr(worker, command)(**args)))
    except Exception as exc:  # report to the test instead of hanging it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if isinstance(worker, StallableDecode):
            worker.thaw_data()  # never close an engine whose progress thread is frozen
        if worker is not None:
            worker.engine.close()


class DecodeProcess(PipedProcess):
    """A decode in its own process (UCX over TCP), stallable or not; always stopped (then killed) in close()."""

    def __init__(self, shape: DemoShape, *, stallable: bool) -> None:
        with ucx_over_tcp():
            super().__init__("decode process", _main, (shape, stallable))
        reply = self._receive(STARTUP_TIMEOUT_S)
        if reply[0] != "ready":
            self.close()
            raise RuntimeError(f"decode process failed to start: {reply}")
        self.address: str = reply[1]

    def __enter__(self) -> DecodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
