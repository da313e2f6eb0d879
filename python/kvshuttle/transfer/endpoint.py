"""What an owner and a reader share: one NIXL agent, the registered cache and staging pool, bookkeeping."""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import zmq

from ..core.layout import PagedKVCache
from ..core.plan import SideGeometry
from ..errors import BackendError
from ..trust import DeploymentSecret
from ._nixl import NixlAgent, NixlCallError, NixlDescList, NixlRegistration, mem_type_of
from .config import EngineConfig
from .errors import TransferArgumentError, TransferError
from .executors import BackgroundExecutor, CopyExecutor, HostExecutor, executor_for, import_cupy
from .quarantine import Quarantine
from .staging import StagingPool
from .task_threads import TaskThreads
from .transfer_handle import TransferHandle, TransferState

if TYPE_CHECKING:
    from .owner_service import OwnerService
    from .peer import Peer
    from .side_channel import SideChannelServer

log = logging.getLogger(__name__)


def device_staging(device: str, nbytes: int) -> Any:
    """A zeroed VRAM buffer of ``nbytes`` on ``device`` (cupy), or None (logged) when cupy is missing."""
    try:
        cupy = import_cupy()
    except BackendError as exc:
        log.info("kvshuttle: %s", exc)
        return None
    with cupy.cuda.Device(int(device.partition(":")[2] or 0)):
        buffer = cupy.zeros(max(1, nbytes), dtype=cupy.uint8)
        cupy.cuda.get_current_stream().synchronize()  # zeroed before any other stream packs into it
    return buffer


class Endpoint:
    """One worker's NIXL agent with its paged cache and staging pool registered; the base of both roles."""

    def __init__(self, cache: PagedKVCache, config: EngineConfig | None = None, *, staging: Any = None) -> None:
        """Create the agent and register ``cache`` and the staging pool (``staging``: an optional buffer on the
        cache's device of ``staging_chunks * staging_chunk_bytes`` bytes to use instead of a new numpy, or for
        CUDA caches cupy, allocation)."""
        if not isinstance(cache, PagedKVCache):
            raise TransferArgumentError("pass a PagedKVCache (PagedKVCache.from_arrays(layers, kind))")
        if config is not None and not isinstance(config, EngineConfig):
            raise TransferArgumentError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config = config or EngineConfig()
        if config.name is None:
            self.config = config = replace(config, name=f"kvshuttle-{uuid.uuid4().hex[:12]}")
        assert config.name is not None
        self.name = config.name
        self.secret = config.secret or DeploymentSecret.resolve()  # authenticates the side channel and handles
        self.cache = cache
        self.mem_type, self.device_id = mem_type_of(cache.geometry.device)
        self.side = SideGeometry.from_cache(cache, self.device_id)
        # CUDA caches stage in VRAM (cupy) and copy on streams with events (executors.py); without cupy they
        # read direct only.
        slots = config.staging_chunks
        if cache.is_cuda and staging is None and slots:
            staging = device_staging(cache.geometry.device, config.staging_chunk_bytes * slots)
            slots = slots if staging is not None else 0
        self.pool = StagingPool(config.staging_chunk_bytes, slots, staging if slots else None)
        if self.pool.slots and self.pool.view.device != cache.geometry.device:
            raise TransferArgumentError(f"staging is on {self.pool.view.device} but the cache is on "
                                        f"{cache.geometry.device}: pass staging on the cache's device")
        self.pool_mem, self.pool_device = mem_type_of(self.pool.view.device)
        # Packs (owner) run on the calling job thread or a CUDA stream; unpacks (reader) on a native worker thread
        # (no GIL, no Python wake-up per chunk) or another stream: the pipeline's bookkeeping is the same for both
        # (chunk_slots.py). A read's last chunk unpacks on its pipeline thread: no READ is left to overlap.
        self._background: BackgroundExecutor | None = None
        self.packs: CopyExecutor = HostExecutor()
        self.unpacks: CopyExecutor = self.packs
        self.last_unpacks: CopyExecutor = self.packs
        if cache.is_cuda and self.pool.slots:
            self.packs, self.unpacks = executor_for(cache), executor_for(cache)
            self.last_unpacks = self.unpacks
        elif self.pool.slots:  # without staging there are no packed reads, so no worker
            self._background = BackgroundExecutor()
            self.unpacks = self._background
        self.pipelines = TaskThreads("kvshuttle-read")  # the packed reads' pipelines (owners: their pack jobs)
        self._agent = NixlAgent(config.name, config.backends, num_threads=config.num_threads,
                                progress_delay_us=config.progress_delay_us)
        self.quarantine = Quarantine(self._agent)  # where reads that ended early wait until NIXL says they are over
        self._registrations: list[NixlRegistration] = []
        self._local_dlist: NixlDescList | None = None
        self._peers: dict[str, Peer] = {}
        self._peers_lock = threading.RLock()  # readers on several threads connect and forget peers
        self._active: weakref.WeakSet[TransferHandle] = weakref.WeakSet()
        self._zmq: zmq.Context[Any] = zmq.Context()
        self._server: SideChannelServer | None = None
        self._owner: OwnerService | None = None
        self._closed = False
        try:
            self._registrations.append(self._agent.register(cache.regions(), self.mem_type, self.device_id))
            if self.pool.slots:
                self._registrations.append(self._agent.register(
                    [(self.pool.base, self.pool.nbytes)], self.pool_mem, self.pool_device))
        except NixlCallError as exc:
            self.close()
            raise TransferError(f"registering the KV cache with NIXL failed: {exc}") from exc

    def stats(self) -> dict[str, int]:
        """Live NIXL objects and engine state (flat over time when nothing leaks). ``quarantined_xfers``: NIXL
        requests of reads that ended early and that NIXL still reports in flight (their memory held back)."""
        self._prune_lost()
        counts = self._agent.counts()
        held = self.quarantine.stats()
        return {
            "registrations": counts["registration"], "dlists": counts["dlist"],
            "xfer_handles": counts["xfer"], "stuck_xfer_handles": counts["stuck_xfer"],
            "quarantined_xfers": held.parked, "quarantine_released": held.released_total,
            "active_transfers": sum(1 for h in list(self._active) if h.state is TransferState.PENDING),
            "owner_jobs": self._owner.active_jobs if self._owner else 0,
            "staging_free": self.pool.free, "staging_chunks": self.pool.slots, "peers": len(self._peers),
        }

    def close(self) -> None:
        """Cancel transfers, stop serving, forget peers, release every NIXL object. Idempotent; never raises
        (a NIXL object that cannot be released is logged: the process is usually going away)."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._active):
            handle.release()
        if self._server is not None:
            self._server.close()
        if self._owner is not None:
            self._owner.close()
        for peer in list(self._peers.values()):
            self._forget(peer)
        agent = getattr(self, "_agent", None)
        if getattr(self, "quarantine", None) is not None:
            self.quarantine.close()
        if agent is not None:
            try:
                agent.retry_stuck()
                if self._local_dlist is not None:
                    agent.release_dlist(self._local_dlist)
                for registration in self._registrations:
                    agent.deregister(registration)
            except NixlCallError as exc:
                log.warning("kvshuttle: releasing NIXL objects of %s failed: %s", self.name, exc)
        self.pipelines.close()
        if self._background is not None:
            self._background.close()
        self._zmq.term()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("this TransferEngine is closed; create a new one")

    def _prune_lost(self) -> None:
        """Forget peers found lost meanwhile (a read in flight noticed it): their NIXL state goes at once."""
        with self._peers_lock:
            peers = list(self._peers.values())
        for peer in peers:
            if peer.watch() is not None:
                self._forget(peer)

    def _forget(self, peer: Peer) -> None:
        """Drop a peer: its NIXL remote state and its connections (never raises)."""
        with self._peers_lock:
            if not peer.connected:
                return
            peer.connected = False
            if self._peers.get(peer.agent_name) is peer:
                del self._peers[peer.agent_name]
            try:
                if peer.remote_dlist is not None:
                    self._agent.release_dlist(peer.remote_dlist)
                self._agent.remove_remote(peer.agent_name)
            except NixlCallError as exc:
                log.debug("kvshuttle: forgetting peer %s: %s", peer.address, exc)
        peer.close_connections()
