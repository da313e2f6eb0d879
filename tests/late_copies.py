"""A fake event-based copy executor for the packed pipeline's bookkeeping tests (no GPU needed).

Like a CUDA stream with events, ``LateExecutor.pack``/``unpack`` return at once and the copy happens later: a
"device" thread applies pending copies newest first (out of order whenever two are pending) after a delay, and a
copy's completion is done only once its bytes moved. At every submission it checks that no pending copy uses the
same staging bytes: the pipeline must never hand out a slot whose last copy has not completed. ``fail_at`` makes
the n-th copy fail (a kernel error surfacing at its completion).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvshuttle.core import ops
from kvshuttle.core.arrays import describe
from kvshuttle.errors import BackendError


@dataclass
class LateCopy:
    number: int
    span: tuple[int, int]  # staging bytes [start, stop)
    apply: Any
    done_event: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    error: BaseException | None = None

    def done(self) -> bool:
        return self.done_event.is_set()

    def wait(self, timeout: float) -> bool:
        return self.done_event.wait(timeout)

    def result(self) -> float:
        assert self.done(), "result() before the copy completed"
        if self.error is not None:
            raise self.error
        return self.seconds


class LateExecutor:
    """Copies applied late and out of order by a background thread; records every ordering violation."""

    def __init__(self, delay_s: float = 0.004, fail_at: int | None = None) -> None:
        self.delay_s, self.fail_at = delay_s, fail_at
        self.violations: list[str] = []
        self.order: list[int] = []  # copy numbers in completion order
        self._pending: list[LateCopy] = []
        self._count = 0
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._device, daemon=True)
        self._thread.start()

    def _submit(self, staging: Any, apply: Any) -> LateCopy:
        view = describe(staging)
        span = (view.address, view.address + view.nbytes)
        with self._lock:
            for other in self._pending:
                if other.span[0] < span[1] and span[0] < other.span[1]:
                    self.violations.append(f"copy {self._count} reuses the staging of pending copy {other.number}")
            copy = LateCopy(self._count, span, apply)
            self._count += 1
            self._pending.append(copy)
            self._lock.notify_all()
        return copy

    def pending_spans(self) -> list[tuple[int, int]]:
        with self._lock:
            return [c.span for c in self._pending]

    def _device(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._lock.wait(0.1)
                if self._closed and not self._pending:
                    return
            time.sleep(self.delay_s)  # late: the host has moved on meanwhile
            with self._lock:
                copy = self._pending[-1]  # newest first: out of order whenever two are pending
            start = time.perf_counter()
            try:
                if copy.number == self.fail_at:
                    raise BackendError(f"injected failure of copy {copy.number}")
                copy.apply()
            except BaseException as exc:
                copy.error = exc
            copy.seconds = time.perf_counter() - start
            with self._lock:
                self._pending.remove(copy)
                self.order.append(copy.number)
            copy.done_event.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(10)

    @property
    def out_of_order(self) -> bool:
        return any(b < a for a, b in zip(self.order, self.order[1:], strict=False))

    def pack(self, cache: Any, ids: Any, staging: Any, *, num_tokens: int, layout: Any, head_offset: int) -> LateCopy:
        ops.plan_copy(cache, ids, staging, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
                      staging_written=True)  # bad input fails at submission, as the CUDA executor's does
        return self._submit(staging, lambda: ops.pack(cache, ids, staging, num_tokens=num_tokens, layout=layout,
                                                      head_offset=head_offset))

    def unpack(self, staging: Any, cache: Any, ids: Any, *, num_tokens: int, layout: Any,
               head_offset: int) -> LateCopy:
        ops.plan_copy(cache, ids, staging, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
                      staging_written=False)
        return self._submit(staging, lambda: ops.unpack(staging, cache, ids, num_tokens=num_tokens, layout=layout,
                                                        head_offset=head_offset))
