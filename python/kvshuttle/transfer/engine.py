"""The transfer engine: one NIXL agent per worker, playing the owner role, the reader role, or both.

Owner (decode, for reverse reads)::

    engine = TransferEngine(cache, EngineConfig(port=0))
    address = engine.serve()          # "tcp://127.0.0.1:<port>", handed to readers

Reader (prefill)::

    engine = TransferEngine(cache)
    peer = engine.connect(address)    # handshake: metadata + geometry, compatibility check
    with engine.read(peer, local_ids, remote_ids) as transfer:
        telemetry = transfer.wait(timeout=5.0)   # or poll(); failures name the invalid local blocks

A worker in a disaggregated deployment is both (prefill serves the forward read, decode the reverse one),
on one agent and one registration: :class:`TransferEngine` is :class:`~.owner.OwnerRole` plus
:class:`~.reader.ReaderRole` over one :class:`~.endpoint.Endpoint`. An engine is driven from one thread
(its internal threads share the NIXL agent through a lock).
"""

from __future__ import annotations

from typing import Any

from ..core.layout import PagedKVCache
from ._nixl import NixlCallError, mem_type_of
from .claims import ClaimAuthority
from .config import EngineConfig
from .disk_tier import DiskTier
from .errors import TransferArgumentError, TransferError
from .host_tier import HostTier
from .owner import OwnerRole
from .reader import ReaderRole


class TransferEngine(OwnerRole, ReaderRole):
    """One worker's NIXL agent, registered cache and staging, side channel, peers and transfers."""

    def __init__(self, cache: PagedKVCache, config: EngineConfig | None = None, *, staging: Any = None,
                 claims: ClaimAuthority | None = None, tier: HostTier | None = None,
                 disk: DiskTier | None = None) -> None:
        """``claims`` (an owner's retention ledger) answers readers' claims; without it claims are refused.
        ``staging``: an optional host buffer for the staging pool (see :class:`~.endpoint.Endpoint`). ``tier``:
        the host tier of ``cache`` (registered here, closed with the engine); the ledger demotes into it. ``disk``:
        the disk tier of that host tier (closed with the engine: its files go)."""
        if tier is not None and (not isinstance(tier, HostTier) or tier.hot is not cache):
            raise TransferArgumentError("tier must be a HostTier built for this engine's cache")
        if disk is not None and (not isinstance(disk, DiskTier) or disk.host is not tier):
            raise TransferArgumentError("disk must be a DiskTier built for this engine's host tier")
        super().__init__(cache, config, staging=staging)
        self._claims = claims
        self.tier, self.disk = tier, disk
        if tier is not None:
            try:
                self._registrations.append(self._agent.register(tier.regions(), *mem_type_of("cpu")))
            except NixlCallError as exc:
                self.close()
                raise TransferError(f"registering the host tier with NIXL failed: {exc}") from exc

    def close(self) -> None:
        """Close the engine (see :meth:`~.endpoint.Endpoint.close`), then its host tier and disk tier."""
        super().close()
        if self.tier is not None:
            self.tier.close()
        if self.disk is not None:
            self.disk.close()

    def __enter__(self) -> TransferEngine:
        return self
