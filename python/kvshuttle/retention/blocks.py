"""The ledger's retained blocks: which live handles hold each, what it holds, and each block's generation.

A block is recorded once however many handles hold it (the ledger module's "Sharing"); its generation is the
epoch of its last return to the allocator, the epoch growing by one at every return. Not thread-safe: the
ledger calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable

from .records import BlockRecord, RetainedRecord, extends_chain


class BlockTable:
    __slots__ = ("_gen", "_records", "epoch")

    def __init__(self) -> None:
        self._records: dict[int, BlockRecord] = {}
        self._gen: dict[int, int] = {}  # block -> epoch of its last return to the allocator (0: never)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, block: int) -> bool:
        return block in self._records

    def ids(self) -> frozenset[int]:
        return frozenset(self._records)

    def generation(self, block: int) -> int:
        return self._gen.get(block, 0)

    def attach(self, handle: RetainedRecord) -> tuple[list[RetainedRecord], int]:
        """Make ``handle`` a holder of each of its blocks. A recorded block it does not extend was reused behind
        the ledger's back: taken back first. Returns the holders that took back made stale (the caller ends them)
        and how many blocks were superseded."""
        stale: list[RetainedRecord] = []
        superseded = 0
        for k, b in enumerate(handle.block_ids):
            digest, valid = handle.digests[k], handle.valid(k)
            record = self._records.get(b)
            if record is not None and not extends_chain(record, k, digest, valid):
                superseded += 1
                stale += self.take_back(b)
                record = None
            if record is None:
                self._records[b] = BlockRecord(k, digest, valid, handle)
            else:
                record.holders.append(handle)
                if valid > record.valid:
                    record.valid, record.digest = valid, digest
        return stale, superseded

    def release(self, handle: RetainedRecord) -> list[int]:
        """``handle`` lets go of its blocks; returns those it held last (now back with the allocator)."""
        freed = []
        for b in handle.block_ids:
            record = self._records.get(b)
            if record is None:
                continue  # taken back by the owner already
            try:
                record.holders.remove(handle)  # identity: RetainedRecord has no __eq__
            except ValueError:
                continue  # the block was taken back and retained anew by someone else
            if not record.holders:
                del self._records[b]
                self._bump(b)
                freed.append(b)
        return freed

    def take_back(self, block: int) -> list[RetainedRecord]:
        """The owner has ``block`` back (or reused it): forget it, returning its holders, now stale."""
        self._bump(block)
        record = self._records.pop(block, None)
        if record is None:
            return []
        for holder in record.holders:
            holder.reused.add(block)
        return record.holders

    def detach(self, handle: RetainedRecord) -> list[int]:
        """Undo a refused retain's attach; returns the blocks no one else holds (the caller's to free)."""
        frees = []
        for b in handle.block_ids:
            record = self._records[b]
            record.holders.remove(handle)
            if not record.holders:  # no read in flight: its only holder was never claimed
                del self._records[b]
                self._bump(b)
                frees.append(b)
        return frees

    def pinned(self, reading: Iterable[RetainedRecord]) -> set[int]:
        """Recorded blocks that a handle of ``reading`` (reads in flight) still holds."""
        pinned: set[int] = set()
        for handle in reading:
            for b in handle.block_ids:
                record = self._records.get(b)
                if record is not None and any(h is handle for h in record.holders):
                    pinned.add(b)
        return pinned

    def held_only_by(self, handles: Iterable[RetainedRecord]) -> set[int]:
        """Recorded blocks whose every holder is one of ``handles`` (what their ends would free)."""
        among = set(handles)
        only: set[int] = set()
        for handle in among:
            for b in handle.block_ids:
                record = self._records.get(b)
                if record is not None and all(h in among for h in record.holders):
                    only.add(b)
        return only

    def _bump(self, block: int) -> None:
        self.epoch += 1
        self._gen[block] = self.epoch
