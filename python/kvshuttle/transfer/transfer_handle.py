"""Transfer handles (poll / wait / cancel) and the per-transfer telemetry record."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import TransferCancelledError, TransferError, TransferTimeoutError
from .quarantine import Settlement


class TransferState(str, enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TransferTelemetry:
    """What one read cost. Times are seconds of wall clock on the reader.

    ``prep_time_s``: validation, planning and descriptor creation; ``post_time_s``: inside NIXL's
    ``transfer()`` calls (with UCX over CMA the copy itself happens there); ``transfer_time_s``: from the
    call to ``read()`` until the data is in the local cache (unpack included for the packed path).
    """

    transfer_id: str
    path: str  # "direct" or "packed"
    reason: str  # why that path was chosen
    bytes: int  # bytes moved over NIXL
    descriptors: int  # NIXL descriptors posted (after coalescing)
    pieces: int  # (layer, plane, block) pieces the read covers
    chunks: int  # staging chunks (packed), 0 for direct
    prep_time_s: float
    post_time_s: float
    transfer_time_s: float
    unpack_time_s: float = 0.0  # packed: time spent unpacking chunks (overlaps with reads)
    owner_pack_time_s: float = 0.0  # packed: time the owner spent packing chunks (overlaps too)
    nixl_descriptors: int | None = None  # NIXL's own count after its merging, when it reports one

    @property
    def bytes_per_descriptor(self) -> float:
        return self.bytes / self.descriptors if self.descriptors else 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.transfer_time_s / 1e9 if self.transfer_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_descriptor": self.bytes_per_descriptor, "gbps": self.gbps}


class Outcome:
    """How a transfer ended, set once by whoever finishes it (the caller's thread or a pipeline thread).

    Kept apart from :class:`TransferHandle` so a pipeline thread never holds the handle: a handle the
    caller drops can be collected, and its finalizer stops the pipeline.
    """

    def __init__(self, on_done: Callable[[TransferTelemetry], None] | None = None) -> None:
        self.on_done = on_done  # told the telemetry of a read that finished DONE (the auto path's model)
        self.state = TransferState.PENDING
        self.error: TransferError | None = None
        self.telemetry: TransferTelemetry | None = None
        self.finished = threading.Event()
        self._lock = threading.Lock()

    def finish(self, state: TransferState, telemetry: TransferTelemetry | None = None,
               error: TransferError | None = None) -> bool:
        """Record the end; False (and no change) when it already ended."""
        with self._lock:
            if self.state is not TransferState.PENDING:
                return False
            self.telemetry, self.error, self.state = telemetry, error, state
        try:
            if state is TransferState.DONE and telemetry is not None and self.on_done is not None:
                self.on_done(telemetry)
        finally:  # waiters wake whatever the observer does
            self.finished.set()
        return True


class TransferHandle:
    """An asynchronous read into the local cache (a *transfer handle*; not a NIXL handle, not a KV handle).

    ``poll()`` never blocks; ``wait(timeout)`` blocks and returns the telemetry or raises the transfer's
    named error (on its own timeout it cancels the transfer and raises TransferTimeoutError);
    ``cancel()`` stops it; ``release()`` (also on leaving a ``with`` block, and best effort when the handle
    is garbage-collected) cancels it if still pending and frees everything it holds. After a failure,
    ``invalid_block_ids`` lists the local blocks to recompute, and they may be written again only once
    ``settlement`` is settled: a read NIXL could not cancel keeps them (and its staging) quarantined until NIXL
    reports it over (:mod:`.quarantine`).
    """

    def __init__(self, transfer_id: str, path: str, reason: str, local_ids: npt.NDArray[np.int64],
                 on_done: Callable[[TransferTelemetry], None] | None = None) -> None:
        self.transfer_id = transfer_id
        self.path = path
        self.reason = reason
        self.local_block_ids: tuple[int, ...] = tuple(np.asarray(local_ids, dtype=np.int64).tolist())
        self.started = time.perf_counter()
        self._outcome = Outcome(on_done)
        self._settlement = Settlement()  # settled by the path once nothing of this read can still write

    # -- for subclasses -------------------------------------------------------------------------------------
    def _progress(self) -> None:
        """Advance without blocking (direct path: check NIXL state). Packed transfers advance on a thread."""

    def _wait_step(self, timeout: float) -> None:
        """Block for at most ``timeout`` seconds waiting for progress."""
        self._outcome.finished.wait(timeout)

    def _stop(self) -> None:
        """Stop the transfer and free its resources (idempotent)."""

    def _invalid_ids(self) -> tuple[int, ...]:
        """Local blocks without valid data right now (all of them unless the path tracks chunks)."""
        return () if self.state is TransferState.DONE else self.local_block_ids

    def _finish(self, state: TransferState, telemetry: TransferTelemetry | None = None,
                error: TransferError | None = None) -> None:
        self._outcome.finish(state, telemetry, error)

    # -- public ---------------------------------------------------------------------------------------------
    @property
    def state(self) -> TransferState:
        return self._outcome.state

    @property
    def telemetry(self) -> TransferTelemetry | None:
        return self._outcome.telemetry

    @property
    def error(self) -> TransferError | None:
        return self._outcome.error

    @property
    def invalid_block_ids(self) -> tuple[int, ...]:
        return self._invalid_ids()

    @property
    def settlement(self) -> Settlement:
        """Settled once nothing of this read can write any more (its NIXL requests are over and released)."""
        return self._settlement

    def poll(self) -> TransferState:
        if self.state is TransferState.PENDING:
            self._progress()
        return self.state

    def done(self) -> bool:
        return self.poll() is not TransferState.PENDING

    def wait(self, timeout: float | None = None) -> TransferTelemetry:
        """Block until the read finishes; return its telemetry or raise its named error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is TransferState.PENDING:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                self._stop_with(TransferTimeoutError(
                    f"transfer {self.transfer_id} ({self.path}) did not finish within {timeout:.3g} s and was "
                    "cancelled; recompute the listed blocks or retry with a longer timeout",
                    self._invalid_after_stop()))
                break
            self._wait_step(left)
        if self.error is not None:
            raise self.error
        assert self.telemetry is not None
        return self.telemetry

    def cancel(self) -> None:
        """Cancel the read (no-op when it already finished). ``wait()`` then raises TransferCancelledError."""
        if self.state is TransferState.PENDING:
            self._stop_with(TransferCancelledError(
                f"transfer {self.transfer_id} was cancelled", self._invalid_after_stop()))

    def release(self) -> None:
        """Cancel the read if it is still pending and free what it holds (NIXL request, staging). Idempotent."""
        self.cancel()
        self._stop()

    def __enter__(self) -> TransferHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _invalid_after_stop(self) -> tuple[int, ...]:
        self._stop()
        return self._invalid_ids()

    def _stop_with(self, error: TransferError) -> None:
        state = TransferState.CANCELLED if isinstance(error, TransferCancelledError) else TransferState.FAILED
        self._finish(state, error=error)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.transfer_id} {self.path} {self.state.value} "
                f"{len(self.local_block_ids)} blocks>")
