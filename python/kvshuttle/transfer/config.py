"""Engine settings, with the reasoning behind each default. Sizes in bytes, times in seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from ..errors import shown
from .errors import TransferArgumentError

Path = Literal["auto", "direct", "packed"]
PATHS: tuple[Path, ...] = ("auto", "direct", "packed")


@dataclass(frozen=True)
class EngineConfig:
    """How one :class:`~kvshuttle.transfer.TransferEngine` runs.

    Failure detection (the serving path falls back to recompute, so it must learn of a dead peer fast):

    * ``connect_timeout_s``: the handshake and each claim wait at most this long for an answer. A refused
      connection (nothing listening) fails at once, without waiting.
    * ``heartbeat_s`` / ``peer_timeout_s``: the side channel exchanges ZMTP heartbeats every ``heartbeat_s``;
      ``peer_timeout_s`` without an answer closes the connection. A peer whose process died is noticed at
      once (the kernel closes its sockets), a frozen or cut-off one within ``peer_timeout_s``. Either fails
      every read, claim and ping to that peer with ``PeerLostError``; later calls to it fail at once.
    * ``transfer_timeout_s``: the default deadline of one read, for an owner that answers but never finishes.
    """

    name: str | None = None  # NIXL agent name (default: a fresh unique name)
    backends: tuple[str, ...] = ("UCX",)  # e.g. ("LIBFABRIC",) on EFA machines
    num_threads: int = 0  # backend worker threads (0: the backend default)
    progress_delay_us: int = 10_000  # NIXL progress thread idle wake-up (it also wakes on events); 0: none
    host: str = "127.0.0.1"  # side-channel bind address (serve)
    port: int = 0  # side-channel port; 0 picks a free one (see serve())
    # The registered staging pool: ``staging_chunks`` slots of ``staging_chunk_bytes`` each; one chunk of a
    # packed read fills one slot. 16 MiB chunks measured best (packed 2.3-2.7x direct at depth 4 / 2, against
    # 1.1-1.3x at 1 MiB: benchmarks/results/vm2_transfer_chunks.json); depths 2 and 4 are within noise there.
    staging_chunk_bytes: int = 16 << 20
    staging_chunks: int = 8  # slots in the pool (0: no packed path): 2 reads at full depth
    pipeline_depth: int = 4  # slots one packed read holds on each side
    # auto path: reads whose descriptors average below this go packed. Measured on the 2-core VM (UCX over
    # CMA, scattered ids): packed/direct 2.2x at 4 KiB, 1.5x at 8 KiB, 1.3x at 16 KiB, 0.83x at 32 KiB
    # (benchmarks/results/vm2_transfer_pieces.json), so the crossover lies between 16 and 32 KiB.
    packed_threshold_bytes: int = 32 << 10
    direct_mode: Literal["initialize", "prepped"] = "initialize"
    connect_timeout_s: float = 2.0
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 1.0
    transfer_timeout_s: float = 60.0
    staging_lease_s: float = 30.0  # owner reclaims a ready chunk not released within this (reader died)
    debug_pack_delay_s: float = 0.0  # fault injection for tests: sleep after packing each chunk

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and (value > 0 or (value == 0 and f.name == "debug_pack_delay_s"))
                want = "a positive number of seconds"
            elif f.name in ("name", "backends", "host", "direct_mode"):
                continue
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
                want = "an integer >= 0"
            if not ok:
                raise TransferArgumentError(f"EngineConfig.{f.name} must be {want}, got {shown(value)}")
        if not (isinstance(self.port, int) and self.port < 65536):
            raise TransferArgumentError(f"EngineConfig.port must be in 0..65535 (0: a free port), got "
                                        f"{shown(self.port)}")
        if self.staging_chunk_bytes <= 0:
            raise TransferArgumentError("EngineConfig.staging_chunk_bytes must be > 0")
        if self.direct_mode not in ("initialize", "prepped"):
            raise TransferArgumentError(f"EngineConfig.direct_mode must be 'initialize' or 'prepped', got "
                                        f"{shown(self.direct_mode)}")
        if not (isinstance(self.backends, tuple) and self.backends and all(isinstance(b, str) for b in self.backends)):
            raise TransferArgumentError(f"EngineConfig.backends must be a non-empty tuple of names, got "
                                        f"{shown(self.backends)}")
