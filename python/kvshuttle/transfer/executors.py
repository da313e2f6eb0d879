"""Where a packed read's copies run: on the host (CPU caches) or on a CUDA stream (GPU caches).

The packed pipeline (``owner_service.PackJob`` packs, ``packed._Pipeline`` unpacks) submits each chunk's copy to a
:class:`CopyExecutor` and gets a :class:`Completion` back; ``chunk_slots.ChunkSlots`` then decides, from
completions only, when a chunk may be offered to the reader and when its staging slot may be used again. The
same bookkeeping drives both executors, so what the CPU tests check about it holds on the GPU path too.

* :class:`HostExecutor`: the copy runs at once on the calling thread; :class:`BackgroundExecutor`: in order on a
  native worker thread that never takes the GIL (a reader's unpacks).
* :class:`CudaExecutor`: the copy is enqueued on the executor's own CUDA stream with events before and after it;
  the completion is done when the second event completed. cupy is imported here lazily, only for CUDA caches.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from ..core import native, ops
from ..core.layout import PagedKVCache, StagingLayout
from ..errors import BackendError

if TYPE_CHECKING:
    from .._native import CopyTicket


class Completion(Protocol):
    """One submitted copy."""

    def done(self) -> bool:
        """Whether the copy finished (successfully or not). Never raises, never blocks."""
        ...

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for the copy; whether it finished."""
        ...

    def result(self) -> float:
        """Seconds the copy took; raises the copy's error. Call only once :meth:`done`."""
        ...


class CopyExecutor(Protocol):
    """Runs a packed read's pack and unpack calls and says when each finished."""

    def pack(self, cache: PagedKVCache, ids: npt.NDArray[np.int64], staging: Any, *, num_tokens: int,
             layout: StagingLayout, head_offset: int) -> Completion: ...

    def unpack(self, staging: Any, cache: PagedKVCache, ids: npt.NDArray[np.int64], *, num_tokens: int,
               layout: StagingLayout, head_offset: int) -> Completion: ...


class Finished:
    """A copy that ran on the calling thread: done at once, with its time or its error."""

    def __init__(self, seconds: float, error: BaseException | None = None) -> None:
        self._seconds, self._error = seconds, error

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True

    def result(self) -> float:
        if self._error is not None:
            raise self._error
        return self._seconds


class TicketCompletion:
    """A copy queued on a native worker thread (:class:`BackgroundExecutor`)."""

    def __init__(self, ticket: CopyTicket, plan: ops.CopyPlan) -> None:
        self._ticket = ticket
        self._plan = plan  # the worker writes through raw addresses: keep the cache and staging alive meanwhile

    def done(self) -> bool:
        return self._ticket.done()

    def wait(self, timeout: float) -> bool:
        return self._ticket.wait(timeout)

    def result(self) -> float:
        return self._ticket.result()


class HostExecutor:
    """Copies on the host, at once on the calling thread (an owner's packs, a read's last unpack)."""

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Completion:
        start = time.perf_counter()
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            return Finished(time.perf_counter() - start, exc)
        return Finished(time.perf_counter() - start)

    def pack(self, cache: PagedKVCache, ids: npt.NDArray[np.int64], staging: Any, *, num_tokens: int,
             layout: StagingLayout, head_offset: int) -> Completion:
        return self._run(ops.pack, cache, ids, staging, num_tokens=num_tokens, layout=layout,
                         head_offset=head_offset)

    def unpack(self, staging: Any, cache: PagedKVCache, ids: npt.NDArray[np.int64], *, num_tokens: int,
               layout: StagingLayout, head_offset: int) -> Completion:
        return self._run(ops.unpack, staging, cache, ids, num_tokens=num_tokens, layout=layout,
                         head_offset=head_offset)


class BackgroundExecutor(HostExecutor):
    """Host copies queued in order on one native worker thread (a reader's unpacks overlap its next READ).

    The worker never takes the GIL: a chunk costs no Python thread wake-up, and ``done()`` is one atomic load.
    Validation stays on the calling thread, so a bad call fails before anything is queued. Without the native
    extension the copies run on the calling thread (the numpy reference is for checking, not for speed).
    """

    def __init__(self) -> None:
        self._copier = native.ext.AsyncCopier() if native.available() else None

    def _submit(self, pack: bool, cache: PagedKVCache, ids: npt.NDArray[np.int64], staging: Any, *,
                num_tokens: int, layout: StagingLayout, head_offset: int) -> Completion:
        assert self._copier is not None
        try:
            plan = ops.plan_copy(cache, ids, staging, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
                                 staging_written=pack)
        except Exception as exc:
            return Finished(0.0, exc)
        return TicketCompletion(ops.submit_host_copy(self._copier, plan, pack), plan)

    def pack(self, cache: PagedKVCache, ids: npt.NDArray[np.int64], staging: Any, *, num_tokens: int,
             layout: StagingLayout, head_offset: int) -> Completion:
        if self._copier is None:
            return super().pack(cache, ids, staging, num_tokens=num_tokens, layout=layout, head_offset=head_offset)
        return self._submit(True, cache, ids, staging, num_tokens=num_tokens, layout=layout, head_offset=head_offset)

    def unpack(self, staging: Any, cache: PagedKVCache, ids: npt.NDArray[np.int64], *, num_tokens: int,
               layout: StagingLayout, head_offset: int) -> Completion:
        if self._copier is None:
            return super().unpack(staging, cache, ids, num_tokens=num_tokens, layout=layout,
                                  head_offset=head_offset)
        return self._submit(False, cache, ids, staging, num_tokens=num_tokens, layout=layout,
                            head_offset=head_offset)

    def close(self) -> None:
        """Run what is queued, then stop the worker; later submissions fail with BackendError."""
        if self._copier is not None:
            self._copier.close()


def import_cupy() -> Any:
    """cupy, or BackendError saying how to get it (only CUDA caches need it)."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendError("the packed path on CUDA caches needs cupy (pip install cupy-cuda13x); without it "
                           "GPU caches read direct only") from exc
    return cupy


class EventCompletion:
    """A copy enqueued on a CUDA stream between two events; done when the second completed."""

    def __init__(self, start: Any, end: Any, cupy: Any) -> None:
        self._start, self._end, self._cupy = start, end, cupy
        self._error: BaseException | None = None

    def done(self) -> bool:
        if self._error is not None:
            return True
        try:
            return bool(self._end.done)
        except Exception as exc:  # a failed kernel surfaces here (a sticky CUDA error): done, and result raises
            self._error = exc
            return True

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.done():  # cudaEventSynchronize cannot time out: poll, sleeping briefly
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)
        return True

    def result(self) -> float:
        if self._error is not None:
            raise self._error
        return float(self._cupy.cuda.get_elapsed_time(self._start, self._end)) / 1e3


class CudaExecutor:
    """Copies on one CUDA stream of the cache's device, each between two events (its completion and its time).

    Copies on one executor run in submission order (one stream); a pack's staging is offered to the reader only
    once its completion is done, and a slot is written again only once the completion of its last use is done
    (``ChunkSlots``), so the stream never races the NIXL READ of the same bytes.
    """

    def __init__(self, device: str) -> None:
        self._cupy = cupy = import_cupy()
        self._device_index = int(device.partition(":")[2] or 0)
        with cupy.cuda.Device(self._device_index):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._lock = threading.Lock()  # one enqueue at a time: start event, kernel, end event stay together

    def _enqueue(self, fn: Any, *args: Any, **kwargs: Any) -> Completion:
        cupy = self._cupy
        with self._lock, cupy.cuda.Device(self._device_index):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(self.stream)
            fn(*args, stream=int(self.stream.ptr), **kwargs)
            end.record(self.stream)
        return EventCompletion(start, end, cupy)

    def pack(self, cache: PagedKVCache, ids: npt.NDArray[np.int64], staging: Any, *, num_tokens: int,
             layout: StagingLayout, head_offset: int) -> Completion:
        return self._enqueue(ops.pack, cache, ids, staging, num_tokens=num_tokens, layout=layout,
                             head_offset=head_offset)

    def unpack(self, staging: Any, cache: PagedKVCache, ids: npt.NDArray[np.int64], *, num_tokens: int,
               layout: StagingLayout, head_offset: int) -> Completion:
        return self._enqueue(ops.unpack, staging, cache, ids, num_tokens=num_tokens, layout=layout,
                             head_offset=head_offset)


def executor_for(cache: PagedKVCache) -> CopyExecutor:
    """The executor for ``cache``'s device: CUDA stream + events for GPU caches, else the calling thread."""
    if cache.is_cuda:
        return CudaExecutor(cache.geometry.device)
    return HostExecutor()
