"""What the scheduler side tells the worker side each step, and what a worker tells the scheduler at start-up.

Plain picklable dataclasses: under vLLM's multiprocess executor the metadata is pickled to the worker; under
the single-process one it is the same object, so the scheduler never touches it after handing it over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...policy import Decision, KVHandle
from .compat import KVConnectorHandshakeMetadata, KVConnectorMetadata


@dataclass(frozen=True)
class LoadJob:
    """Read ``decision``'s blocks of ``handle`` (authenticated by the scheduler) into ``local_block_ids`` for
    ``request_id``. ``failure`` (no handle): report the load failed at once, its blocks invalid.

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


@dataclass(frozen=True)
class RetainJob:
    """Keep ``block_ids`` for a finished request under the handle the scheduler already published."""

    request_id: str
    handle_id: str
    block_ids: tuple[int, ...]
    digests: tuple[bytes, ...]
    num_tokens: int
    block_size: int
    ttl_s: float
    use_once: bool


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


@dataclass
class ShuttleHandshake(KVConnectorHandshakeMetadata):
    """Where the worker serves its blocks (published in every handle the scheduler issues)."""

    host: str
    port: int
