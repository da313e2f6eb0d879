"""The disk tier on the owner: retentions that left the host tier (``host_tier.py``), a file each, read back into
host memory when a reader claims them.

The retention ledger decides (``retention/demotions.py``): it counts the tier's room in blocks (``capacity_bytes``
of its terms) and hands a spill order (the host tier slots the retention leaves, ``done``) to :meth:`DiskTier.spill`;
the write runs on a kept thread and ``done(ok)`` is called once the file is whole, so only then does the ledger
give the host slots back (no fsync: the tier is a cache of what a restart loses anyway). ``discard`` removes a
retention's file once it ended and nothing reads or writes it.

A file holds a header (magic, block bytes, block count, a digest of the handle id, which also names the file) and
then the retention's blocks in the host tier's slot layout, in the order of its block ids. A claim's pack reads the
blocks it names back (:meth:`load`) into a fresh host buffer and packs from a paged-cache view of it, as from the
host tier. A file that is missing, short, longer or not this handle's is refused (:class:`TierReadError`): the reader
never gets other bytes; the owner then ends the retention (``tier_lost``).

Files live in a directory of this process's own under the directory the operator names (never a peer: nothing on
the side channel names a path), ``kvshuttle-disk-*``, with a lock file held (``flock``) while the process lives.
A start removes the directories whose lock is free (their process died), and :meth:`close` (or the interpreter's
exit, or the object's collection) removes its own: nothing is left behind after a restart. NIXL's POSIX plugin is
not used: plain ``os.write``/``os.preadv`` (issue 35).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ..core.layout import PagedKVCache
from .errors import DiskTierError, TransferArgumentError, TransferError
from .host_tier import DemotionOrder, HostTier, slot_runs, tier_cache
from .task_threads import TaskThreads

log = logging.getLogger(__name__)
PREFIX = "kvshuttle-disk-"
LOCK = ".lock"
STARTING_S = 60.0  # a directory without its lock file this old is from a process that died while starting
CLOSE_WAIT_S = 30.0  # close waits this long for writes in flight
MAGIC = b"KVSDISK1"
HEADER = struct.Struct("<8sQQ16s")  # magic, block bytes, block count, handle digest


class TierReadError(TransferError):
    """A retention's disk file could not be read back whole (missing, truncated, not its handle's, a read error)."""


def file_key(handle_id: str) -> bytes:
    """What names a handle's file and is checked in its header (the handle id itself stays off the disk)."""
    return hashlib.blake2b(handle_id.encode(), digest_size=16).digest()


def remove_dead(directory: Path) -> int:
    """Remove the tier directories under ``directory`` whose process died (their lock is free); returns how many."""
    removed = 0
    for entry in directory.iterdir():
        if not entry.name.startswith(PREFIX) or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            if dead(entry):
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
        except FileNotFoundError:  # another starting process removed it first
            continue
    return removed


def dead(entry: Path) -> bool:
    """Whether the process that made tier directory ``entry`` is gone (its lock free, or never taken)."""
    try:
        fd = os.open(entry / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # still starting, or died before it locked
        return time.time() - entry.stat().st_mtime > STARTING_S
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a live process holds it
    finally:
        os.close(fd)  # (a lock taken goes with the descriptor)
    return True


def remove_own(directory: Path, lock_fd: int) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    os.close(lock_fd)


def write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


class DiskTier:
    """The disk tier of ``host`` (its slots are what it writes) under ``directory``; pass it to
    ``TransferEngine(..., disk=)`` and its :meth:`spill`, :meth:`discard` to the ledger (``on_spill``,
    ``on_discard``), whose terms' disk tier bounds the bytes. :class:`DiskTierError` when ``directory`` is unusable."""

    def __init__(self, host: HostTier, directory: str | os.PathLike[str]) -> None:
        if not isinstance(host, HostTier):
            raise TransferArgumentError("a disk tier takes what leaves a HostTier: pass it")
        root = Path(directory)
        if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
            raise DiskTierError(f"disk tier directory {str(root)[:200]!r} is not a writable directory")
        self.host, self.block_bytes = host, host.block_bytes
        try:
            self.removed_at_start = remove_dead(root)
            self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))  # mode 0700: this process's only
            self._lock_fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise DiskTierError(f"disk tier directory {str(root)[:200]!r}: {exc}") from exc
        self._remove = weakref.finalize(self, remove_own, self.dir, self._lock_fd)  # at exit too, if not closed
        self._threads = TaskThreads("kvshuttle-spill")
        self._lock = threading.Lock()
        self._pending: set[threading.Event] = set()
        self.writes = 0  # completed spills
        self.failed = 0  # failed spills (a full disk...)
        self._closed = False

    @property
    def busy(self) -> int:
        """Writes and removals not finished yet."""
        with self._lock:
            return sum(1 for event in self._pending if not event.is_set())

    def path(self, handle_id: str) -> Path:
        return self.dir / f"{file_key(handle_id).hex()}.kv"

    def spill(self, order: DemotionOrder) -> None:
        """Write host tier slots ``order.block_ids`` into the handle's file, then ``order.done(ok)``; returns at
        once (a kept thread writes). Never raises: a bad order, a closed tier, a full disk fail the copy."""
        handle_id = order.handle_id
        try:
            slots = order.block_ids
            if not slots or min(slots) < 0 or max(slots) >= self.host.capacity_blocks or not handle_id:
                raise TransferArgumentError(f"a spill names {len(slots)} host slots outside [0, "
                                            f"{self.host.capacity_blocks}) or no handle")
            self._submit(lambda: self._write(handle_id, slots, order))
        except (RuntimeError, TransferArgumentError) as exc:  # RuntimeError: closing
            log.warning("kvshuttle: disk tier write refused: %s", exc)
            order.done(False)

    def discard(self, handle_id: str) -> None:
        """Remove the handle's file (off the caller's thread; nothing when there is none)."""
        with contextlib.suppress(RuntimeError):  # closed: the directory goes anyway
            self._submit(lambda: self.path(handle_id).unlink(missing_ok=True))

    def load(self, handle_id: str, count: int) -> npt.NDArray[np.uint8]:
        """The first ``count`` blocks of the handle's file (host tier slot layout), or TierReadError."""
        buffer = np.empty(count * self.block_bytes, dtype=np.uint8)
        try:
            fd = os.open(self.path(handle_id), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise TierReadError(f"the disk tier file of {handle_id[:12]}... cannot be opened: {exc}") from None
        try:
            header = os.pread(fd, HEADER.size, 0)
            size = os.fstat(fd).st_size
            if len(header) < HEADER.size:
                raise TierReadError(f"the disk tier file of {handle_id[:12]}... is {size} bytes: no header")
            magic, block_bytes, blocks, key = HEADER.unpack(header)
            expected = HEADER.size + blocks * block_bytes
            if (magic, block_bytes, key) != (MAGIC, self.block_bytes, file_key(handle_id)) or blocks < count:
                raise TierReadError(f"the disk tier file of {handle_id[:12]}... is not this handle's blocks")
            if size != expected:
                raise TierReadError(f"the disk tier file of {handle_id[:12]}... is {size} bytes, not {expected}")
            done = 0
            while done < buffer.nbytes:
                got = os.preadv(fd, [buffer.data[done:]], HEADER.size + done)
                if got <= 0:
                    raise TierReadError(f"the disk tier file of {handle_id[:12]}... ended after {done} bytes")
                done += got
        except OSError as exc:
            raise TierReadError(f"reading the disk tier file of {handle_id[:12]}... failed: {exc}") from None
        finally:
            os.close(fd)
        return buffer

    def cache_of(self, buffer: npt.NDArray[np.uint8]) -> PagedKVCache:
        """Blocks :meth:`load` read, viewed as a paged cache the owner packs from (block i: the file's i-th)."""
        return tier_cache(buffer, self.host.hot, buffer.nbytes // self.block_bytes)

    def close(self) -> None:
        """Let writes in flight finish (each reports), then remove this process's directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for event in pending:
            event.wait(max(0.0, deadline - time.monotonic()))
        self._threads.close()
        self._remove()

    def _submit(self, task: Callable[[], object]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the disk tier is closed")
            done = self._threads.submit(lambda: self._run(task))
            self._pending.add(done)

    def _run(self, task: Callable[[], object]) -> None:
        try:
            task()
        except Exception:
            log.exception("kvshuttle: a disk tier task failed")
        with self._lock:
            self._pending = {event for event in self._pending if not event.is_set()}

    def _write(self, handle_id: str, slots: Sequence[int], order: DemotionOrder) -> None:
        path, ok = self.path(handle_id), False
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                write_all(fd, memoryview(HEADER.pack(MAGIC, self.block_bytes, len(slots), file_key(handle_id))))
                for index, count in slot_runs(slots):
                    write_all(fd, self.host.slot_bytes(slots[index], count).data)
            finally:
                os.close(fd)
            ok = True
        except OSError as exc:  # a full disk, a removed directory: the retention ends (logged, counted)
            log.warning("kvshuttle: writing a disk tier file failed: %s", exc)
            path.unlink(missing_ok=True)
        with self._lock:
            if ok:
                self.writes += 1
            else:
                self.failed += 1
        order.done(ok)
