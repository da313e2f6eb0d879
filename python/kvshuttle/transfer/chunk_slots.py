"""The packed pipeline's bookkeeping, one side of one read: which staging slot may be used, which chunk is ready.

A slot is in exactly one state:

* *idle*: :meth:`ChunkSlots.take` may hand it out;
* *copying*: a pack (owner) or unpack (reader) of one chunk was submitted into or out of it and its
  :class:`~.executors.Completion` is not done; the slot is never handed out in this state;
* *held* (owner only): the chunk was packed and offered to the reader, whose READ of it may be running; the slot
  becomes idle when the reader releases the chunk (``release``), never earlier.

``reap`` moves finished copies on (to *held* when ``hold`` was asked, else to *idle*) and says which chunks
finished, in chunk order; ``settle`` waits for every copy still running, so an error mid-pipeline gives every
slot back only once nothing writes or reads it any more. The owner's PackJob and the reader's pipeline both use
this class, with the host executor or the CUDA one: the ordering rules are one piece of code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .executors import Completion


@dataclass
class _Copy:
    slot: int
    completion: Completion
    hold: bool


@dataclass(frozen=True)
class CopyDone:
    """A chunk whose copy completed: its slot, the copy's seconds, or the copy's error."""

    chunk: int
    slot: int
    seconds: float
    error: BaseException | None


class ChunkSlots:
    """The slots one side of one packed read reserved, and the chunks copying into or out of them."""

    def __init__(self, slots: list[int]) -> None:
        self.slots = tuple(slots)
        self._idle = list(reversed(slots))
        self._copying: dict[int, _Copy] = {}
        self._held: dict[int, tuple[int, float]] = {}  # chunk -> (slot, when it was offered)

    @property
    def copying(self) -> int:
        return len(self._copying)

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def take(self) -> int | None:
        """An idle slot, or None when every slot is copying or held."""
        return self._idle.pop() if self._idle else None

    def start(self, chunk: int, slot: int, completion: Completion, *, hold: bool) -> None:
        """Chunk ``chunk`` is being copied in slot ``slot`` (from :meth:`take`); ``hold``: keep the slot after
        the copy until :meth:`release` (an owner's packed chunk, until the reader read it)."""
        if slot not in self.slots or slot in self._idle or any(c.slot == slot for c in self._copying.values()) \
                or any(s == slot for s, _ in self._held.values()):
            raise AssertionError(f"slot {slot} is not free for chunk {chunk}")  # a pipeline bug, never input
        if chunk in self._copying or chunk in self._held:
            raise AssertionError(f"chunk {chunk} is already in flight")
        self._copying[chunk] = _Copy(slot, completion, hold)

    def give_back(self, slot: int) -> None:
        """A slot from :meth:`take` that was not used after all (its copy could not be submitted)."""
        self._idle.append(slot)

    def reap(self) -> list[CopyDone]:
        """The copies that completed since the last call, in chunk order; their slots move on."""
        out = []
        for chunk in sorted(self._copying):
            copy = self._copying[chunk]
            if not copy.completion.done():
                continue
            del self._copying[chunk]
            try:
                seconds, error = copy.completion.result(), None
            except Exception as exc:
                seconds, error = 0.0, exc
            if copy.hold and error is None:
                self._held[chunk] = (copy.slot, time.monotonic())
            else:
                self._idle.append(copy.slot)  # a failed pack is never offered: its slot is free again
            out.append(CopyDone(chunk, copy.slot, seconds, error))
        return out

    def wait_any(self, timeout: float) -> bool:
        """Block up to ``timeout`` for the oldest running copy (copies on one stream finish in order)."""
        if not self._copying:
            return False
        return self._copying[min(self._copying)].completion.wait(timeout)

    def release(self, chunk: int) -> bool:
        """The reader is done with held chunk ``chunk``: its slot is idle again. False when it was not held."""
        got = self._held.pop(chunk, None)
        if got is None:
            return False
        self._idle.append(got[0])
        return True

    def held_slots(self, chunks: set[int]) -> set[int]:
        """The slots of those of ``chunks`` still held (offered and not released)."""
        return {slot for chunk, (slot, _) in self._held.items() if chunk in chunks}

    def oldest_hold(self) -> float | None:
        """When the longest-held chunk was offered (monotonic), or None."""
        return min((since for _, since in self._held.values()), default=None)

    def running(self) -> list[Completion]:
        """The completions of the copies still running (to wait for without holding a caller's lock)."""
        return [copy.completion for copy in self._copying.values()]

    def settle(self, timeout: float) -> list[CopyDone]:
        """Wait (up to ``timeout`` in all) for every running copy; then every slot counts as idle again.

        Returns the copies that finished. A copy still running after ``timeout`` keeps its slot out of
        :attr:`reusable` (that staging may still be written)."""
        deadline = time.monotonic() + timeout
        for completion in self.running():
            completion.wait(max(0.0, deadline - time.monotonic()))
        finished = self.reap()
        for slot, _ in self._held.values():
            self._idle.append(slot)
        self._held.clear()
        return finished

    @property
    def reusable(self) -> list[int]:
        """The slots no copy is using: what may go back to the pool."""
        busy = {c.slot for c in self._copying.values()} | {s for s, _ in self._held.values()}
        return [s for s in self.slots if s not in busy]
