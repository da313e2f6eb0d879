"""A direct read posted as one NIXL request per group of layers, waited for layer by layer.

Groundwork for layer-pipelined reverse loads (issue 17): the caller starts every layer's read at once, then
waits for layer i just before it computes layer i (vLLM's ``wait_for_layer_load``), so the reads of later layers
overlap the forward pass of earlier ones. Each group is an ordinary :class:`~.direct.DirectTransfer` (its own
NIXL request, deadline and release); this handle only maps layers to them and ends them together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from ..errors import shown
from .direct import DirectTransfer
from .errors import TransferArgumentError, TransferError
from .quarantine import Settlement
from .transfer_handle import TransferState, TransferTelemetry


class LayeredTransfer:
    """The groups of one read: ``groups[k]`` holds the layers its request carries (``range``), in layer order.

    ``wait_layer(layer)`` returns once that layer's bytes are in the local cache, or raises the group's named
    error (every block of the read is then to be recomputed: ``invalid_block_ids``); ``wait()`` waits for all.
    ``release()`` (also on leaving a ``with`` block) cancels what is still pending and frees every request;
    ``settlement`` settles once no group's request can write any more.
    """

    def __init__(self, transfer_id: str, groups: Sequence[tuple[range, DirectTransfer]],
                 local_block_ids: tuple[int, ...], num_layers: int) -> None:
        self.transfer_id = transfer_id
        self.path = "direct"
        self.groups: tuple[range, ...] = tuple(layers for layers, _ in groups)
        self._transfers = [transfer for _, transfer in groups]
        self._group_of = {layer: k for k, (layers, _) in enumerate(groups) for layer in layers}
        self.local_block_ids = local_block_ids
        self.num_layers = num_layers
        self.started = time.perf_counter()
        self.settlement = Settlement.of_all(t.settlement for t in self._transfers)

    @property
    def state(self) -> TransferState:
        states = [t.poll() for t in self._transfers]
        for bad in (TransferState.FAILED, TransferState.CANCELLED, TransferState.PENDING):
            if bad in states:
                return bad
        return TransferState.DONE

    @property
    def invalid_block_ids(self) -> tuple[int, ...]:
        return () if self.state is TransferState.DONE else self.local_block_ids

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer``'s bytes have landed (a layer no group carries has nothing to wait for)."""
        if not (isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < self.num_layers):
            raise TransferArgumentError(f"layer must be an int in 0..{self.num_layers - 1}, got {shown(layer)}",
                                        self.local_block_ids)
        group = self._group_of.get(layer)
        if group is not None:
            self._wait(self._transfers[group], timeout)

    def wait(self, timeout: float | None = None) -> TransferTelemetry:
        """Block until every group has landed; one telemetry for the whole read."""
        deadline = None if timeout is None else time.monotonic() + timeout
        parts = [self._wait(t, None if deadline is None else max(deadline - time.monotonic(), 0.001))
                 for t in self._transfers]
        first = parts[0]
        return TransferTelemetry(
            transfer_id=self.transfer_id, path="direct", reason=f"{len(parts)} layer groups: {first.reason}",
            bytes=sum(p.bytes for p in parts), descriptors=sum(p.descriptors for p in parts),
            pieces=sum(p.pieces for p in parts), chunks=0, prep_time_s=sum(p.prep_time_s for p in parts),
            post_time_s=sum(p.post_time_s for p in parts), transfer_time_s=time.perf_counter() - self.started)

    def release(self) -> None:
        for transfer in self._transfers:
            transfer.release()

    def __enter__(self) -> LayeredTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _wait(self, transfer: DirectTransfer, timeout: float | None) -> TransferTelemetry:
        try:
            return transfer.wait(timeout)
        except TransferError:  # one group failed: the read as a whole did (its error names every block)
            self.release()
            raise

    def __repr__(self) -> str:
        return f"<LayeredTransfer {self.transfer_id} {len(self.groups)} groups {self.state.value}>"


class LayerProgress:
    """How far a layer-pipelined load has landed, shared by the thread that drives the read and the forward pass
    that waits for it: layers ``0 .. landed - 1`` are in the local cache. ``end(ok)`` closes it (``ok``: the whole
    read landed and the owner confirmed it); a wait never outlasts its timeout. Thread-safe."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._changed = threading.Condition()
        self._landed = 0
        self._ended: bool | None = None  # None while the read runs; then whether it succeeded

    @property
    def landed(self) -> int:
        return self._landed

    @property
    def ended(self) -> bool | None:
        return self._ended

    def advance(self, landed: int) -> None:
        with self._changed:
            if self._ended is None and landed > self._landed:
                self._landed = min(landed, self.num_layers)
                self._changed.notify_all()

    def end(self, ok: bool) -> None:
        """The read is over: every layer landed and was confirmed (``ok``), or it failed (nothing more lands)."""
        with self._changed:
            if self._ended is None:
                self._ended = bool(ok)
                if ok:
                    self._landed = self.num_layers
                self._changed.notify_all()

    def wait(self, layer: int, timeout: float) -> bool:
        """Block until ``layer`` has landed (True) or the read failed or ``timeout`` passed (False)."""
        with self._changed:
            self._changed.wait_for(lambda: self._landed > layer or self._ended is not None, max(timeout, 0.0))
            return self._landed > layer and self._ended is not False
