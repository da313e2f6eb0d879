"""The owner role (decode, for reverse reads): serve the paged cache to readers, answer claims, hear completions."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.plan import SideGeometry
from ._nixl import NixlCallError
from .board import HandleBoard
from .claims import ClaimAuthority
from .config import check_serving_trust
from .disk_tier import DiskTier
from .endpoint import Endpoint
from .errors import SideChannelError, TransferError
from .host_tier import HostTier
from .owner_service import OwnerService
from .side_channel import SideChannelServer
from .wire import NOTIF_PREFIX, PeerInfo, StagingInfo


@dataclass(frozen=True)
class ReadNotice:
    """A completion notification received by an owner: ``peer_agent`` finished reading."""

    peer_agent: str
    transfer_id: str | None  # None for notifications not sent by kvshuttle
    tag: bytes  # the reader's ``notify`` payload (or the raw message)


class OwnerRole(Endpoint):
    """Serves this endpoint's cache on a side channel (``serve``); ``claims`` is the retention authority."""

    _claims: ClaimAuthority | None = None
    _board: HandleBoard | None = None
    tier: HostTier | None = None  # the host tier the ledger demotes into; tier claims are packed from it
    disk: DiskTier | None = None  # the disk tier what leaves the host tier goes to; its claims are read back

    def serve(self) -> str:
        """Start answering readers on the side channel; returns its address (``tcp://host:port``, the advertised
        host). TrustError when the bind address needs a deployment secret that is not configured."""
        self._check_open()
        if self._server is None:
            advertised = check_serving_trust(self.config, self.secret)
            try:
                metadata = self._agent.metadata()
            except NixlCallError as exc:
                raise SideChannelError(f"reading this agent's NIXL metadata failed: {exc}") from exc
            staging = StagingInfo(self.pool.slot_bytes, self.pool.slots, self.pool_mem, self.pool_device)
            tier = SideGeometry.from_cache(self.tier.cache) if self.tier is not None else None  # host memory: dev 0
            info = PeerInfo(self.name, metadata, self.side, self.cache.geometry, self.mem_type, staging, tier)
            self._owner = OwnerService(self.cache, self.pool, lambda: info, self.config.staging_lease_s,
                                       self.config.debug_pack_delay_s, self.config.pipeline_depth, self._claims,
                                       secret=self.secret, max_jobs=self.config.max_jobs_per_peer,
                                       executor=self.packs, tier=self.tier, disk=self.disk)
            try:
                self._server = SideChannelServer(self._zmq, self.config.host, self.config.port, self._owner.answer,
                                                 secret=self.secret, advertise_host=advertised,
                                                 max_message_bytes=self.config.max_message_bytes)
            except OSError as exc:
                raise SideChannelError(str(exc)) from exc
            self._owner.server = self._server
            self._owner.board = self._board
        return self._server.address

    @property
    def address(self) -> str | None:
        return self._server.address if self._server else None

    @property
    def claims(self) -> ClaimAuthority | None:
        """The authority answering readers' claims (settable after serve(): a ledger needs the address)."""
        return self._claims

    @claims.setter
    def claims(self, authority: ClaimAuthority | None) -> None:
        self._claims = authority
        if self._owner is not None:
            self._owner.claims = authority

    @property
    def board(self) -> HandleBoard | None:
        """Handles published for routers to take (``take_published``); None: nothing is ever published."""
        return self._board

    @board.setter
    def board(self, board: HandleBoard | None) -> None:
        self._board = board
        if self._owner is not None:
            self._owner.board = board

    def notifications(self) -> list[ReadNotice]:
        """Completion notifications from readers since the last call (owner side)."""
        self._check_open()
        try:
            received = self._agent.notifs()
        except NixlCallError as exc:
            raise TransferError(f"reading NIXL notifications failed: {exc}") from exc
        notices = []
        for agent, messages in received.items():
            for message in messages:
                if message.startswith(NOTIF_PREFIX):
                    tid, _, tag = message[len(NOTIF_PREFIX):].partition(b":")
                    notices.append(ReadNotice(agent, tid.decode(errors="replace"), tag))
                else:
                    notices.append(ReadNotice(agent, None, message))
        return notices
