"""The host tier's memory on the owner: ``capacity_blocks`` slots of host memory, one KV block each, registered
with the owner's NIXL agent, and the copier that demotes a retention's hot blocks into them.

The retention ledger decides (``retention/demotions.py``): it picks the slots and hands a demotion order (hot
block ids, tier slots, ``done``) to :meth:`HostTier.demote`. The copy runs off the caller's thread (the caller may
be the engine's step), and ``done(ok)`` is called once the bytes are in the slots, so only then does the ledger
give the hot blocks back. On a CPU host the copy is a native pack on a kept thread at the lowest CPU priority (the
engine's own threads go first on the cores they share). On a GPU host it is enqueued on
the tier's own CUDA stream, after an event recorded on the engine's current stream (the engine's writes of those
blocks come first): a pack into a device bounce buffer, then device-to-host copies into the slots (pinned host
memory), then an event whose completion is the copy's; nothing blocks the engine's stream.

On a GPU host the slots are pinned and mapped host memory, which the GPU addresses in place (unified virtual
addressing): :attr:`HostTier.cache` is then a cupy view of them, so the owner packs a tier claim's reads on its
CUDA stream straight from host memory into its VRAM staging, as it packs hot claims.

Layout: slot ``s`` holds one block in the cache's identity staging layout (``StagingLayout.like``: ``[layer]
[plane][piece]``, each piece ``[B][H][D]`` or ``[H][B][D]``), the bytes a packed read of that block would stage,
so one pack moves a run of blocks into a run of slots. :attr:`HostTier.cache` views the slots as a paged cache
(``flash_attn`` or ``mla`` kind, layers interleaved per slot) with the hot cache's block size, heads, head size
and order: the owner packs a tier claim's reads from it exactly as from the hot cache (``owner_service.py``),
and every pack of it yields the bytes the same pack of the hot blocks yielded. Where the hot cache's direct-read
pieces are contiguous ``[B][H][D]`` (or ``[H][B][D]``) runs, a slot's pieces are the same bytes in the same
format: the owner publishes them (``PeerInfo.tier``) and readers read tier claims direct from the slots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ..core.layout import PagedKVCache, StagingLayout
from ..core.ops import current_stream
from .errors import TransferArgumentError
from .executors import Completion, CudaExecutor, EventCompletion, HostExecutor, import_cupy
from .task_threads import TaskThreads

log = logging.getLogger(__name__)
# The copy thread's niceness: on cores the engine computes on, its forward passes go first and the copy takes the
# time they leave (`kvshuttle bench demotion`: at the default priority a copy stretched the bystanders' gaps it met)
COPY_NICENESS = 19
COPY_TIMEOUT_S = 60.0  # a copy that has not completed by then failed (the retention then ends; logged)
D2H = 2  # cudaMemcpyDeviceToHost


class DemotionOrder(Protocol):
    """What the ledger asks (``kvshuttle.retention.Demotion``): hot ``block_ids`` into tier ``slots`` (or, of the
    disk tier, host tier slots ``block_ids`` into the handle's file)."""

    @property
    def handle_id(self) -> str: ...

    @property
    def block_ids(self) -> tuple[int, ...]: ...

    @property
    def slots(self) -> tuple[int, ...]: ...

    @property
    def done(self) -> Callable[[bool], Any]: ...


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """``(index, length)`` of each run of consecutive slots in ``slots`` (in order)."""
    runs: list[tuple[int, int]] = []
    for index, slot in enumerate(slots):
        if runs and slots[runs[-1][0]] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def tier_cache(buffer: Any, hot: PagedKVCache, capacity_blocks: int) -> PagedKVCache:
    """``buffer`` (``capacity_blocks`` slots in the identity staging layout of ``hot``; a numpy array, or a
    cupy array over mapped host memory) as a paged cache."""
    g = hot.geometry
    item = g.itemsize
    typed = buffer.view(np.dtype(f"u{item}"))  # the bytes only matter: an unsigned type of the element's size
    if isinstance(buffer, np.ndarray):
        def strided(x: Any, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
            return np.lib.stride_tricks.as_strided(x, shape, strides, writeable=True)
    else:
        strided = import_cupy().lib.stride_tricks.as_strided
    piece = g.piece_bytes
    block = g.num_planes * piece
    token, head = ((g.num_heads * g.row_bytes, g.row_bytes) if g.order.value == "NHD"
                   else (g.row_bytes, g.block_size * g.row_bytes))
    layers = []
    for layer in range(g.num_layers):
        start = layer * g.planes_per_layer * piece // item
        if g.planes_per_layer == 1:  # mla: [N, B, D], one head
            shape: tuple[int, ...] = (capacity_blocks, g.block_size, g.head_size)
            strides: tuple[int, ...] = (block, token, item)
        else:  # flash_attn: [2, N, B, H, D]
            shape = (2, capacity_blocks, g.block_size, g.num_heads, g.head_size)
            strides = (piece, block, token, head, item)
        layers.append(strided(typed[start:], shape, strides))
    return PagedKVCache.from_arrays(layers, "mla" if g.planes_per_layer == 1 else "flash_attn", g.order)


PORTABLE_MAPPED = 1 | 2  # cudaHostAllocPortable | cudaHostAllocMapped: every context may address it in place


def host_buffer(nbytes: int, pinned: bool) -> npt.NDArray[np.uint8]:
    """``nbytes`` of zeroed host memory (pinned and mapped with cupy for GPU hosts: device-to-host copies need
    it pinned, and the owner's pack kernels read it in place)."""
    if pinned:
        cupy = import_cupy()
        memory = cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(nbytes, PORTABLE_MAPPED), 0)
        buffer = np.frombuffer(memory, dtype=np.uint8, count=nbytes)  # keeps ``memory`` alive (its base)
    else:
        buffer = np.empty(nbytes, dtype=np.uint8)
    buffer.fill(0)  # fault the pages in now, not during the first demotion
    return buffer


def mapped_view(buffer: npt.NDArray[np.uint8], device: str) -> Any:
    """Pinned, mapped ``buffer`` as a cupy array on ``device``: under unified virtual addressing the GPU reads
    and writes it at its host address (over the bus). ``buffer`` stays alive as the view's owner."""
    cupy = import_cupy()
    index = int(device.partition(":")[2] or 0)
    memory = cupy.cuda.UnownedMemory(buffer.ctypes.data, buffer.nbytes, buffer, index)
    return cupy.ndarray((buffer.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))


def lower_priority(niceness: int = COPY_NICENESS) -> None:
    """Give the calling thread (Linux: ``setpriority`` of a thread id moves that thread only) ``niceness``; a
    thread can always lower its own priority. Elsewhere, or when refused, nothing changes."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)


class HostTier:
    """``capacity_blocks`` host slots for ``cache``'s blocks; pass it to ``TransferEngine(..., tier=)`` (which
    registers it) and its :meth:`demote` to the ledger (``RetentionLedger(on_demote=tier.demote)``), whose terms'
    tier must name the same capacity. ``on_copied(handle_id, nbytes, seconds)``: told of each completed copy (its
    time on the copy thread, until the bytes are in the slots), e.g. to log it."""

    def __init__(self, cache: PagedKVCache, capacity_blocks: int,
                 on_copied: Callable[[str, int, float], object] | None = None) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TransferArgumentError("pass the owner's PagedKVCache")
        if type(capacity_blocks) is not int or capacity_blocks <= 0:
            raise TransferArgumentError(f"capacity_blocks must be an int > 0, got {capacity_blocks!r}")
        g = cache.geometry
        self.hot = cache
        self.capacity_blocks = capacity_blocks
        self.layout = StagingLayout.like(g)
        self.block_bytes = self.layout.nbytes(g, g.block_size)
        self.buffer = host_buffer(capacity_blocks * self.block_bytes, pinned=cache.is_cuda)
        self.cache = tier_cache(mapped_view(self.buffer, g.device) if cache.is_cuda else self.buffer, cache,
                                capacity_blocks)
        self._cuda: CudaExecutor | None = None
        self._host = HostExecutor()
        self._threads = TaskThreads("kvshuttle-demote")
        self._lock = threading.Lock()
        self.copies = 0  # completed demotion copies
        self._on_copied = on_copied
        self._closed = False

    @property
    def nbytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of the slots, host memory (NIXL's DRAM) on every host."""
        return [(int(self.buffer.ctypes.data), self.nbytes)]

    def slot_bytes(self, slot: int, count: int = 1) -> npt.NDArray[np.uint8]:
        """The bytes of ``count`` slots from ``slot`` (a view)."""
        return self.buffer[slot * self.block_bytes:(slot + count) * self.block_bytes]

    def demote(self, order: DemotionOrder) -> None:
        """Copy ``order.block_ids`` of the hot cache into ``order.slots``, then call ``order.done(ok)``; returns
        at once (the copy runs on a kept thread, or a CUDA stream). Never raises: a bad order fails the copy."""
        try:
            self._check(order)
            written = self._engine_event()
            self._threads.submit(lambda: self._run(order, written))
        except Exception as exc:  # a bad order, closing, or the device refusing the event: the copy failed
            log.warning("kvshuttle: host tier copy refused: %s", exc)
            order.done(False)

    def close(self) -> None:
        """Let copies in flight finish (each reports), then stop; later demotions fail at once."""
        with self._lock:
            self._closed = True
        self._threads.close()

    def _check(self, order: DemotionOrder) -> None:
        with self._lock:
            if self._closed:
                raise TransferArgumentError("the host tier is closed")
        ids, slots = order.block_ids, order.slots
        if len(ids) != len(slots) or not ids:
            raise TransferArgumentError(f"a demotion names {len(ids)} blocks and {len(slots)} slots")
        if min(slots) < 0 or max(slots) >= self.capacity_blocks:
            raise TransferArgumentError(f"tier slots outside [0, {self.capacity_blocks}): the ledger's tier "
                                        "capacity must be the HostTier's")

    def _engine_event(self) -> Any:
        """On a GPU host: an event recorded now on the caller's current stream (the engine's, when the engine's
        thread demotes), which the copy waits for, so the engine's writes of the blocks come first. A retained
        block was written by a step whose output the engine already read: this orders it on the device too."""
        if not self.hot.is_cuda:
            return None
        cupy = import_cupy()
        with cupy.cuda.Device(self._device_index):
            written = cupy.cuda.Event(disable_timing=True)
            cupy.cuda.runtime.eventRecord(written.ptr, current_stream(self.hot))
        return written

    @property
    def _device_index(self) -> int:
        return int(self.hot.geometry.device.partition(":")[2] or 0)

    def _run(self, order: DemotionOrder, written: Any) -> None:
        ok = False
        lower_priority()
        started = time.perf_counter()
        try:
            completion, keep = self._copy(np.asarray(order.block_ids, dtype=np.int64), order.slots, written)
            if completion.wait(COPY_TIMEOUT_S):
                completion.result()  # raises the copy's error
                ok = True
            else:  # its slots go back to the ledger while the stream may still write them: logged loudly
                log.error("kvshuttle: a host tier copy did not complete within %.0f s", COPY_TIMEOUT_S)
            del keep  # the bounce buffer lives until the stream is done with it
        except Exception:
            log.exception("kvshuttle: a host tier copy failed")
        if ok:
            with self._lock:
                self.copies += 1
            if self._on_copied is not None:
                try:
                    self._on_copied(order.handle_id, len(order.block_ids) * self.block_bytes,
                                    time.perf_counter() - started)
                except Exception:
                    log.exception("kvshuttle: the host tier's on_copied failed")
        order.done(ok)

    def _copy(self, ids: npt.NDArray[np.int64], slots: Sequence[int], written: Any) -> tuple[Completion, Any]:
        """Start the copy; (its completion, what must stay alive until it completed)."""
        block = self.hot.geometry.block_size
        if not self.hot.is_cuda:
            last: Completion | None = None
            for index, count in slot_runs(slots):  # one pack per run of consecutive slots
                last = self._host.pack(self.hot, ids[index:index + count], self.slot_bytes(slots[index], count),
                                       num_tokens=count * block, layout=self.layout, head_offset=0)
                last.result()  # host packs ran already: raise the first error
            assert last is not None
            return last, None
        return self._copy_cuda(ids, slots, written)

    def _copy_cuda(self, ids: npt.NDArray[np.int64], slots: Sequence[int], written: Any) -> tuple[Completion, Any]:
        """After ``written``: pack on the tier's stream into a device bounce buffer, then copy each run of slots
        to the host."""
        cupy = import_cupy()
        if self._cuda is None:
            self._cuda = CudaExecutor(self.hot.geometry.device)
        stream = self._cuda.stream
        with cupy.cuda.Device(self._device_index):
            stream.wait_event(written)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            bounce = cupy.empty(len(ids) * self.block_bytes, dtype=cupy.uint8)
            start.record(stream)
            self._cuda.pack(self.hot, ids, bounce, num_tokens=len(ids) * self.hot.geometry.block_size,
                            layout=self.layout, head_offset=0)
            for index, count in slot_runs(slots):
                cupy.cuda.runtime.memcpyAsync(self.slot_bytes(slots[index], count).ctypes.data,
                                              bounce.data.ptr + index * self.block_bytes, count * self.block_bytes,
                                              D2H, stream.ptr)
            end.record(stream)
        return EventCompletion(start, end, cupy), bounce
