"""What the scheduler side tells the worker side each step, and what a worker tells the scheduler at start-up.

Plain picklable dataclasses: under vLLM's multiprocess executor the metadata is pickled to the worker; under
the single-process one it is the same object, so the scheduler never touches it after handing it over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...policy import Decision, KVHandle
from .compat import KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadJob:
    """Read ``decision``'s blocks of ``handle`` (authenticated by the scheduler) into ``local_block_ids`` for
    ``request_id``. ``failure`` (no handle): report the load failed at once, its blocks invalid. ``layered``: vLLM
    computes the request in this very step (a synchronous load): the worker reads layer by layer, the forward
    pass waits for each layer (``wait_for_layer_load``), and a failure is reported as invalid blocks in this step
    (never in ``finished_recving``, which vLLM keeps for asynchronous loads).

    ``decided_at`` is ``time.monotonic()`` in the EngineCore process when the load was scheduled; the load's
    deadline counts from it (``+ kvshuttle_load_timeout_s``), not from when the worker gets to it. The worker
    runs on the same host, and CLOCK_MONOTONIC is one clock for every process of a host.
    """

    request_id: str
    handle: KVHandle | None
    decision: Decision
    local_block_ids: tuple[int, ...]
    num_tokens: int  # prompt length
    decided_at: float
    failure: str = ""
    layered: bool = False


@dataclass(frozen=True)
class RetainJob:
    """Keep ``block_ids`` for a finished request under the handle the scheduler already published (every
    tensor-parallel rank retains the same handle: same id, blocks and digests)."""

    request_id: str
    handle_id: str
    block_ids: tuple[int, ...]
    digests: tuple[bytes, ...]
    num_tokens: int
    block_size: int
    ttl_s: float
    use_once: bool
    ranks: tuple[str, ...] = ()  # every rank's side channel (TP > 1): a renewed handle names them too
    cache_dtype: str = ""  # what the blocks' bytes mean: a renewed handle names it too


@dataclass(frozen=True)
class Publication:
    """What a finished request returned as ``kv_transfer_params`` (None: nothing retained), published under the
    router's key once the worker has retained (or refused) its blocks."""

    request_id: str
    key: str
    params: dict[str, Any] | None


@dataclass
class ShuttleMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    retains: list[RetainJob] = field(default_factory=list)
    publications: list[Publication] = field(default_factory=list)
    # requests whose retention ended on some tensor-parallel rank: every rank ends it too (vLLM frees the
    # blocks only when every rank reported the request finished sending)
    releases: list[str] = field(default_factory=list)


@dataclass
class ShuttleWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler each step (vLLM aggregates every rank's): the requests whose retention
    ended on this rank (expired, released, evicted, consumed), so that the scheduler ends them on every rank; and
    the layered loads this rank settled whole in the step (summed over ranks: a load landed when every rank says
    so), so that the scheduler lets their blocks into vLLM's prefix cache (``sync_loads.py``)."""

    ended: set[str] = field(default_factory=set)
    landed: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: Any) -> ShuttleWorkerMeta:
        landed = dict(self.landed)
        for request_id, ranks in (getattr(other, "landed", None) or {}).items():
            landed[request_id] = landed.get(request_id, 0) + ranks
        return ShuttleWorkerMeta(self.ended | set(getattr(other, "ended", ()) or ()), landed)


@dataclass
class ShuttleHandshake(KVConnectorHandshakeMetadata):
    """Where a worker (tensor-parallel rank ``tp_rank``) serves its head shard (every handle lists each rank's)."""

    host: str
    port: int
    tp_rank: int = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
