"""The direct path: one batched NIXL READ from the peer's paged cache straight into the local one.

Two ways to build the request (``EngineConfig.direct_mode``):

* ``"initialize"``: :func:`kvshuttle.plan.plan_read` coalesces runs contiguous on both sides into few
  descriptors, handed to ``initialize_xfer``.
* ``"prepped"``: every (plane, block) piece of both caches is prepared once per peer with
  ``prep_xfer_dlist``; a read picks indices and ``make_prepped_xfer`` merges contiguous runs (vLLM's way).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..core.plan import ReadPlan, SideGeometry
from ._nixl import MemType, NixlAgent, NixlCallError, NixlDescList, NixlXfer
from .errors import PeerLostError, TransferError, TransferTimeoutError
from .quarantine import Quarantine
from .transfer_handle import TransferHandle, TransferState, TransferTelemetry


def all_pieces(side: SideGeometry) -> npt.NDArray[np.uint64]:
    """(addr, len, dev) of every piece, plane-major: row ``plane * num_blocks + block``."""
    blocks = np.arange(side.num_blocks, dtype=np.uint64) * np.uint64(side.block_stride)
    addrs = (side.plane_bases[:, None] + blocks[None, :]).reshape(-1)
    rows = np.empty((addrs.size, 3), dtype=np.uint64)
    rows[:, 0] = addrs
    rows[:, 1] = side.piece_bytes
    rows[:, 2] = side.device_id
    return rows


def piece_indices(side: SideGeometry, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
    """Indices into :func:`all_pieces` for blocks ``ids`` of every plane, plane-major."""
    planes = np.arange(side.num_planes, dtype=np.int64)[:, None] * side.num_blocks
    return (planes + ids[None, :]).reshape(-1).astype(np.int32)


@dataclass
class DirectRequest:
    """A READ ready to post, with what telemetry needs."""

    xfer: NixlXfer
    bytes: int
    descriptors: int
    pieces: int


def build_initialize(agent: NixlAgent, plan: ReadPlan, local_mem: MemType, remote_mem: MemType,
                     remote_agent: str, notif: bytes) -> DirectRequest:
    xfer = agent.make_xfer(plan.local, local_mem, plan.remote, remote_mem, remote_agent, notif)
    return DirectRequest(xfer, plan.total_bytes, plan.num_descriptors, plan.num_pieces)


def build_prepped(agent: NixlAgent, local_side: SideGeometry, local_dlist: NixlDescList,
                  local_ids: npt.NDArray[np.int64], remote_side: SideGeometry, remote_dlist: NixlDescList,
                  remote_ids: npt.NDArray[np.int64], notif: bytes) -> DirectRequest:
    if local_ids.size > 1 and np.any(local_ids[1:] < local_ids[:-1]):
        order = np.argsort(local_ids, kind="stable")  # ascending local ids let NIXL merge the most
        local_ids, remote_ids = local_ids[order], remote_ids[order]
    lidx = piece_indices(local_side, local_ids)
    ridx = piece_indices(remote_side, remote_ids)
    xfer = agent.make_prepped_xfer(local_dlist, lidx, remote_dlist, ridx, notif)
    return DirectRequest(xfer, int(lidx.size) * local_side.piece_bytes, int(lidx.size), int(lidx.size))


class DirectTransfer(TransferHandle):
    """A posted direct READ. Completion is checked on ``poll()``; the NIXL request is always retired through the
    quarantine: when the read ends, on ``release()``, or (queued) when the caller drops a pending handle. A read
    that ends early (deadline, cancel, lost peer) is settled (``settlement``) only once NIXL reports its request
    over: until then its destination blocks may still be written."""

    def __init__(self, transfer_id: str, reason: str, local_ids: npt.NDArray[np.int64], agent: NixlAgent,
                 quarantine: Quarantine, peer_name: str, request: DirectRequest, prep_time: float, deadline: float,
                 started: float, peer_lost: Callable[[], str | None],
                 on_done: Callable[[TransferTelemetry], None] | None = None) -> None:
        super().__init__(transfer_id, "direct", reason, local_ids, on_done)
        self.started = started
        self._agent = agent
        self._quarantine = quarantine
        self._peer_name = peer_name
        self._peer_lost = peer_lost
        self._request = request
        self._prep_time = prep_time
        self._deadline = deadline
        self._post_time = 0.0
        self._xfer: NixlXfer | None = request.xfer
        self._finalizer = weakref.finalize(self, quarantine.retire_later, request.xfer)
        self._post()

    def _post(self) -> None:
        assert self._xfer is not None
        t0 = time.perf_counter()
        try:
            state = self._agent.post(self._xfer)
        except NixlCallError as exc:
            self._post_time = time.perf_counter() - t0
            self._fail(exc)
            return
        self._post_time = time.perf_counter() - t0
        self._settle(state)

    def _progress(self) -> None:
        if self._xfer is None:
            return
        if time.monotonic() > self._deadline:
            self._release()
            self._finish(TransferState.FAILED, error=TransferTimeoutError(
                f"direct transfer {self.transfer_id} from {self._peer_name} passed its deadline and was "
                "cancelled; recompute the listed blocks", self.local_block_ids))
            return
        try:
            state = self._agent.state(self._xfer)
        except NixlCallError as exc:
            self._fail(exc)
            return
        lost = self._peer_lost() if state == "PROC" else None
        if lost is not None:  # UCX may wait long for a dead peer; the side channel knows at once
            self._fail(None, lost)
            return
        self._settle(state)

    def _wait_step(self, timeout: float) -> None:
        time.sleep(min(timeout, 0.0002))

    def _settle(self, state: str) -> None:
        if state == "PROC":
            return
        if state != "DONE":
            self._fail(None)
            return
        assert self._xfer is not None
        nixl = self._agent.telemetry(self._xfer)
        self._release()
        req = self._request
        self._finish(TransferState.DONE, telemetry=TransferTelemetry(
            transfer_id=self.transfer_id, path="direct", reason=self.reason, bytes=req.bytes,
            descriptors=req.descriptors if nixl is None else min(req.descriptors, nixl.descriptors),
            pieces=req.pieces, chunks=0, prep_time_s=self._prep_time, post_time_s=self._post_time,
            transfer_time_s=time.perf_counter() - self.started,
            nixl_descriptors=None if nixl is None else nixl.descriptors,
        ))

    def _fail(self, exc: NixlCallError | None, lost: str | None = None) -> None:
        self._release()
        if exc is None or exc.disconnected:
            detail = f" ({exc.nixl_error})" if exc else f" ({lost})" if lost else " (state ERR)"
            error: TransferError = PeerLostError(
                f"direct transfer {self.transfer_id}: the NIXL READ from {self._peer_name} failed{detail}"
                + "; the peer is gone or disconnected: recompute the listed blocks", self.local_block_ids)
        else:
            error = TransferError(f"direct transfer {self.transfer_id}: {exc}; recompute the listed blocks",
                                  self.local_block_ids)
        self._finish(TransferState.FAILED, error=error)

    def _release(self) -> None:
        if self._xfer is not None:
            self._finalizer.detach()
            self._quarantine.retire(self._xfer, f"direct transfer {self.transfer_id} from {self._peer_name}",
                                    settlement=self._settlement)
            self._xfer = None

    def _stop(self) -> None:
        self._release()
