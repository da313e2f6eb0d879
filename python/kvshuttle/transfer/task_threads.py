"""Daemon threads kept for the next task: the packed path's pack jobs (owner) and read pipelines (reader).

Starting a thread cost 0.35 ms on the 2-vCPU VM (an instrumented one-off run, not a bench row), paid on both
sides of every packed read; a kept thread takes the next task from a queue. A task never waits behind another:
when no kept thread is idle a new one starts (the tasks are bounded anyway: each holds staging slots). Daemon threads,
unlike ``ThreadPoolExecutor``'s, never hold up the interpreter's exit behind a task waiting on a dead peer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_Task = tuple[Callable[[], None], threading.Event] | None  # None: a kept thread's signal to end


class TaskThreads:
    """Runs each submitted task at once on an idle kept thread or a new one."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a task and not yet promised one
        self._threads = 0
        self._closed = False

    @property
    def threads(self) -> int:
        """Threads started and not yet ended."""
        with self._lock:
            return self._threads

    def submit(self, task: Callable[[], None]) -> threading.Event:
        """Start ``task``; the event is set when it returned (or raised: logged, the task's own bug)."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} task threads are closed")
            self._tasks.put((task, done))
            if self._idle:
                self._idle -= 1  # that thread takes this task: no other submit counts on it
                return done
            self._threads += 1
            number = self._threads
        threading.Thread(target=self._loop, name=f"{self._name}-{number}", daemon=True).start()
        return done

    def close(self) -> None:
        """End the idle threads and those that finish their task; later submits raise. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._tasks.put(None)

    def _loop(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                break
            task, done = item
            try:
                task()
            except Exception:  # pragma: no cover - the packed tasks catch everything themselves
                log.exception("kvshuttle: a %s task failed", self._name)
            finally:
                done.set()
            with self._lock:
                if self._closed:
                    break
                self._idle += 1
        with self._lock:
            self._threads -= 1
