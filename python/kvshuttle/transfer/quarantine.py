"""The quarantine: what a read NIXL could not cancel may still write stays out of use until NIXL says it cannot.

Releasing a NIXL request that is still in flight does not stop it: NIXL 1.5's UCX backend cancels and frees its
UCX requests and reports success, but a READ already asked of the peer lands whenever the peer answers (measured
in ``tests/test_quarantine.py``: bytes arrived in released destination blocks after the owner's data path
resumed). So a request whose read ended early (deadline, cancel, lost peer, dropped handle) is *retired* here,
not released: while NIXL reports it in progress it is *parked*, and everything it may still write (destination
blocks, a staging slot) stays out of use; once NIXL reports it done or failed it is released and what was held
back is handed back (``then``), and its :class:`Settlement` is settled. A reaper thread polls the parked requests
(one ``check_xfer_state`` each, every ``poll_s``) and picks up requests that dropped handles' finalizers queued.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ._nixl import NixlAgent, NixlCallError, NixlXfer

log = logging.getLogger(__name__)


class Settlement:
    """Whether everything one read may still write (local blocks, a staging slot) is safe to use again.

    ``done()`` is False while a NIXL request of the read is parked in the quarantine. Callbacks given to
    :meth:`on_settled` run once, when it settles (on the thread that settles it: keep them short and
    non-blocking), or at once when it is settled already. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def on_settled(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        _run(callback)

    def settle(self) -> None:
        """Mark it settled and run the callbacks (idempotent)."""
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run(callback)

    @classmethod
    def settled(cls) -> Settlement:
        """One that is settled already (a read that finished, or never started)."""
        done = cls()
        done.settle()
        return done

    @classmethod
    def of_all(cls, parts: Iterable[Settlement]) -> Settlement:
        """Settled once every part is."""
        parts = list(parts)
        combined = cls()
        left = [len(parts)]
        lock = threading.Lock()

        def one_more() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                combined.settle()

        if not parts:
            combined.settle()
        for part in parts:
            part.on_settled(one_more)
        return combined

    def __repr__(self) -> str:
        return f"<Settlement {'settled' if self.done() else 'pending'}>"


def _run(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # a hand-back that fails must not stop the others
        log.exception("kvshuttle: a quarantine hand-back failed")


@dataclass(eq=False)
class _Parked:
    xfer: NixlXfer
    label: str
    settlement: Settlement
    then: Callable[[], None] | None
    since: float = field(default_factory=time.monotonic)
    warned: bool = False


@dataclass(frozen=True)
class QuarantineStats:
    """Requests parked now, ever parked and released, and how long parked ones took to end (seconds)."""

    parked: int
    parked_total: int
    released_total: int
    oldest_s: float  # how long the oldest request parked now has been (0 when none is)
    last_release_s: float  # parked -> released, of the last one released
    max_release_s: float
    total_release_s: float


class Quarantine:
    """Retires one agent's NIXL requests: released at once when they can no longer write, else parked until then."""

    def __init__(self, agent: NixlAgent, *, poll_s: float = 0.005, idle_s: float = 0.1,
                 warn_after_s: float = 30.0) -> None:
        self._agent = agent
        self._poll_s, self._idle_s, self._warn_after_s = poll_s, idle_s, warn_after_s
        self._lock = threading.Lock()
        self._polling = threading.Lock()  # one poll at a time: a parked request is ended once
        self._parked: list[_Parked] = []
        self._orphans: list[NixlXfer] = []  # from finalizers (list.append is atomic: no lock there)
        self._wake = threading.Event()
        self._closed = False
        self._parked_total = self._released_total = 0
        self._last_s = self._max_s = self._total_s = 0.0
        # the thread holds a weak reference: an engine dropped without close() is still collected
        self._thread = threading.Thread(target=_reap_loop, args=(weakref.ref(self),),
                                        name=f"kvshuttle-quarantine-{agent.name}", daemon=True)
        self._thread.start()

    def retire(self, xfer: NixlXfer, label: str, *, then: Callable[[], None] | None = None,
               settlement: Settlement | None = None) -> Settlement:
        """End ``xfer``'s use: released now if NIXL reports it done or failed, else parked until it does.

        ``then`` runs once it is released (hand back a staging slot, say); the returned settlement (``settlement``
        when given) is settled after that."""
        entry = _Parked(xfer, label, settlement or Settlement(), then)
        if self._try_end(entry, parked=False):
            return entry.settlement
        with self._lock:
            self._parked.append(entry)
            self._parked_total += 1
        log.warning("kvshuttle: %s ended while NIXL still transfers it; its memory stays quarantined until NIXL "
                    "reports the transfer over", label)
        self._wake.set()
        return entry.settlement

    def retire_later(self, xfer: NixlXfer) -> None:
        """For finalizers (they run on any thread, at any point): queue ``xfer`` for :meth:`retire` by the reaper."""
        self._orphans.append(xfer)

    def poll(self) -> int:
        """Retire queued requests and release parked ones NIXL now reports over; returns how many stay parked."""
        with self._polling:
            return self._poll()

    def _poll(self) -> int:
        while self._orphans:
            self.retire(self._orphans.pop(), "a dropped transfer")
        with self._lock:
            parked = list(self._parked)
        ended = [entry for entry in parked if self._try_end(entry, parked=True)]
        with self._lock:
            for entry in ended:
                self._parked.remove(entry)
            left = list(self._parked)
        now = time.monotonic()
        for entry in left:
            if not entry.warned and now - entry.since > self._warn_after_s:
                entry.warned = True
                log.error("kvshuttle: %s is still in flight %.0f s after it was abandoned; its memory stays "
                          "quarantined", entry.label, now - entry.since)
        return len(left)

    def stats(self) -> QuarantineStats:
        with self._lock:
            oldest = min((e.since for e in self._parked), default=None)
            return QuarantineStats(len(self._parked), self._parked_total, self._released_total,
                                   0.0 if oldest is None else time.monotonic() - oldest, self._last_s,
                                   self._max_s, self._total_s)

    def close(self) -> int:
        """Stop the reaper. Requests still in flight are released anyway (the engine is going away; NIXL
        cancels what it can) and their settlements settled; returns how many were (logged)."""
        self._closed = True
        self._wake.set()
        self._thread.join(5.0)
        self.poll()
        with self._lock:
            left, self._parked = self._parked, []
        if left:
            log.error("kvshuttle: %d NIXL transfers still in flight at close; released anyway", len(left))
        for entry in left:
            self._agent.release(entry.xfer)
            if entry.then is not None:
                _run(entry.then)
            entry.settlement.settle()
        return len(left)

    # -- internals ------------------------------------------------------------------------------------------
    def _try_end(self, entry: _Parked, *, parked: bool) -> bool:
        if not entry.xfer.released:
            try:
                state = self._agent.state(entry.xfer)
            except NixlCallError:
                state = "ERR"  # NIXL failed the request (the peer disconnected): it moves nothing more
            if state == "PROC" or not self._agent.release(entry.xfer):
                return False
        if parked:
            took = time.monotonic() - entry.since
            with self._lock:
                self._released_total += 1
                self._last_s, self._max_s, self._total_s = took, max(self._max_s, took), self._total_s + took
            log.info("kvshuttle: %s is over after %.3f s in quarantine; its memory is handed back", entry.label, took)
        if entry.then is not None:
            _run(entry.then)
        entry.settlement.settle()
        return True

    def _pause(self) -> tuple[threading.Event, float]:
        """What the reaper waits on, and for how long: briefly while anything is parked."""
        with self._lock:
            return self._wake, self._poll_s if self._parked else self._idle_s


def _reap_loop(ref: weakref.ReferenceType[Quarantine]) -> None:
    while True:
        quarantine = ref()
        if quarantine is None or quarantine._closed:
            return
        wake, pause = quarantine._pause()
        del quarantine
        wake.wait(pause)
        wake.clear()
        quarantine = ref()
        if quarantine is None or quarantine._closed:
            return
        try:
            quarantine.poll()
        except Exception:  # the reaper must outlive a bug in one hand-back
            log.exception("kvshuttle: the quarantine reaper failed")
        del quarantine
