"""Engine settings, with the reasoning behind each default. Sizes in bytes, times in seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

from ..errors import shown
from ..trust import DeploymentSecret, TrustError, is_loopback
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

    Trust (docs/SECURITY.md): ``secret`` authenticates the side channel (CURVE) and handles; None takes the
    deployment secret from the environment, else this user's local secret, which serves loopback only. ``host``
    is where the side channel listens, ``advertise_host`` the address readers are told (needed when ``host`` is
    a wildcard such as ``0.0.0.0``). Bounds on what one peer can make the owner hold: ``max_message_bytes`` per
    side-channel message, ``max_jobs_per_peer`` packed reads in progress (open claims: the ledger's
    ``max_claims_per_reader``).
    """

    name: str | None = None  # NIXL agent name (default: a fresh unique name)
    backends: tuple[str, ...] = ("UCX",)  # e.g. ("LIBFABRIC",) on EFA machines
    num_threads: int = 0  # backend worker threads (0: the backend default)
    progress_delay_us: int = 10_000  # NIXL progress thread idle wake-up (it also wakes on events); 0: none
    host: str = "127.0.0.1"  # side-channel bind address (serve)
    advertise_host: str | None = None  # the address readers reach (default: host)
    port: int = 0  # side-channel port; 0 picks a free one (see serve())
    # The registered staging pool: ``staging_chunks`` slots of ``staging_chunk_bytes`` each; one chunk of a
    # packed read fills one slot. 16 MiB chunks measured best (packed 2.3-2.7x direct at depth 4 / 2, against
    # 1.1-1.3x at 1 MiB on the earlier VM: benchmarks/results/history/vm2old_transfer_chunks.json; today's VM: 1.5x
    # against 0.7x, vm2_transfer_chunks.json); depths 2 and 4 are within noise there.
    staging_chunk_bytes: int = 16 << 20
    staging_chunks: int = 8  # slots in the pool (0: no packed path): 2 reads at full depth
    pipeline_depth: int = 4  # slots one packed read holds on each side
    # auto path: the prior of each peer's path model (transfer/path_model.py) before it has measured both paths
    # for a kind of read: runs of blocks below this go packed. Measured once on the 2-core VM (UCX over CMA,
    # scattered ids: benchmarks/results/history/vm2old_transfer_pieces.json), the crossover lay between 16 and 32 KiB;
    # on a faster VM direct won at 4 KiB already, which is why the model measures instead.
    packed_threshold_bytes: int = 32 << 10
    # auto path: once both paths are measured for a kind of read, every this-many-th decision tries the slower
    # one again, so the model follows a machine whose load changes (0: never re-explore).
    auto_explore_every: int = 16
    direct_mode: Literal["initialize", "prepped"] = "initialize"
    connect_timeout_s: float = 2.0
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 1.0
    transfer_timeout_s: float = 60.0
    staging_lease_s: float = 30.0  # owner reclaims a ready chunk not released within this (reader died)
    debug_pack_delay_s: float = 0.0  # fault injection for tests: sleep after packing each chunk
    # The largest claim (128k tokens in 16-token blocks: 8,192 ids and digests) is ~400 KiB; a handshake reply
    # carries NIXL metadata (a few KiB per region). 4 MiB bounds what a peer can make the owner decode.
    max_message_bytes: int = 4 << 20
    max_jobs_per_peer: int = 8  # packed reads one connection may have in progress (each holds staging slots)
    secret: DeploymentSecret | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and (value > 0 or (value == 0 and f.name == "debug_pack_delay_s"))
                want = "a positive number of seconds"
            elif f.name in ("name", "backends", "host", "advertise_host", "direct_mode", "secret"):
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
        for name in ("max_message_bytes", "max_jobs_per_peer"):
            if getattr(self, name) < 1:
                raise TransferArgumentError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.host, str) or not self.host:
            raise TransferArgumentError(f"EngineConfig.host must be a host name or address, got {shown(self.host)}")
        if self.advertise_host is not None and not (isinstance(self.advertise_host, str) and self.advertise_host):
            raise TransferArgumentError(f"EngineConfig.advertise_host must be a host name or address, got "
                                        f"{shown(self.advertise_host)}")
        if self.secret is not None and not isinstance(self.secret, DeploymentSecret):
            raise TransferArgumentError(f"EngineConfig.secret must be a kvshuttle.trust.DeploymentSecret, got "
                                        f"{type(self.secret).__name__}")
        if not (isinstance(self.backends, tuple) and self.backends and all(isinstance(b, str) for b in self.backends)):
            raise TransferArgumentError(f"EngineConfig.backends must be a non-empty tuple of names, got "
                                        f"{shown(self.backends)}")


WILDCARDS = ("0.0.0.0", "::", "*", "")


def check_serving_trust(config: EngineConfig, secret: DeploymentSecret) -> str:
    """The host written into addresses and handles; TrustError when the bind needs a deployment secret or a
    wildcard bind has no ``advertise_host``."""
    secret.check_bind(config.host)
    advertised = config.advertise_host or config.host
    if advertised in WILDCARDS:
        raise TrustError(f"the side channel binds {config.host!r}: set advertise_host (kvshuttle_advertise_host) to "
                         "the address readers reach it at")
    if not secret.allows_host(advertised) or (is_loopback(config.host) and not is_loopback(advertised)):
        raise TrustError(f"advertise_host {advertised!r} is not reachable through a bind on {config.host!r} with "
                         f"{secret.scope} trust; bind that address (and configure a deployment secret)")
    return advertised
