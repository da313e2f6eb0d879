"""The owners a reader reads from: one connection per owner address, an allow-list, a circuit breaker and a hold.

:class:`OwnerPool` is what :class:`~kvshuttle.reuse.ReuseReader` and the ranked fetch (:mod:`.ranks`) share:
``peer_at`` hands out a connected owner or raises why not (not allowed, cooling down, stalled, unreachable,
lost), ``mark_failed`` opens the breaker for an owner found gone, ``hold_off`` refuses an owner until its
stuck reads are over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection

from ..transfer import IncompatiblePeerError, Peer, PeerLostError, PeerUnreachableError, Settlement, TransferEngine
from .results import OwnerCoolingDown, OwnerNotAllowed, OwnerStalled

_BOUND = 1024  # entries per table before the stale ones are dropped (decodes restarting on new ports)


class OwnerPool:
    """Connected owners of one engine, per ``tcp://host:port``; thread-safe, one connect per address at a time.

    ``allowed_owners`` (hosts, or ``host:port``; None: any) limits where reads may come from. An owner that
    failed (unreachable, lost) is refused for ``cooldown_s`` (no reconnect per request), then reconnected by the
    next caller that names it.
    """

    def __init__(self, engine: TransferEngine, *, cooldown_s: float,
                 allowed_owners: Collection[str] | None = None) -> None:
        self.engine = engine
        self.cooldown_s = float(cooldown_s)
        self.allowed_owners = None if allowed_owners is None else frozenset(allowed_owners)
        self._peers: dict[str, Peer] = {}
        self._broken: dict[str, tuple[float, str]] = {}  # address -> (refused until, why): the circuit breaker
        self._stalled: dict[str, Settlement] = {}  # address -> its timed-out reads still in flight
        self._lock = threading.Lock()  # guards the tables
        self._connecting: dict[str, threading.Lock] = {}  # one connect at a time per address

    def peer_at(self, host: str, port: int | str) -> Peer:
        """The connected owner (rank) at ``host:port``; the allow-list and the circuit breaker apply per address."""
        address = f"tcp://{host}:{port}"
        if self.allowed_owners is not None and not {host, f"{host}:{port}"} & self.allowed_owners:
            raise OwnerNotAllowed(f"owner {host}:{port} is not in allowed_owners")
        with self._lock:
            lock = self._connecting.setdefault(address, threading.Lock())
        with lock:  # one connect per address at a time; other addresses never wait on it
            self._check_cooldown(address)
            self._check_stalled(address)
            with self._lock:
                peer = self._peers.get(address)
            if peer is not None and peer.connected and peer.watch() is None:
                return peer
            if peer is not None:  # found lost: this request fails as lost, the next ones are cooled down
                why = peer.lost or "the connection was closed"
                self.mark_failed(address, why)
                raise PeerLostError(f"{why}; not reconnected for {self.cooldown_s:.0f} s")
            try:
                peer = self.engine.connect(address)
            except (PeerUnreachableError, PeerLostError, IncompatiblePeerError) as exc:
                self.mark_failed(address, str(exc))
                raise
            with self._lock:
                self._peers[address] = peer
                self._broken.pop(address, None)
            return peer

    def mark_failed(self, address: str, why: str) -> None:
        """Open the circuit breaker for ``address``: requests naming it recompute at once for ``cooldown_s``."""
        with self._lock:
            self._broken[address] = (time.monotonic() + self.cooldown_s, why[:300])
            peer = self._peers.pop(address, None)
            if len(self._broken) > _BOUND:  # forget the longest-expired first
                for stale in sorted(self._broken, key=lambda a: self._broken[a][0])[:_BOUND // 2]:
                    del self._broken[stale]
            if len(self._connecting) > _BOUND:  # decodes restarting on new ports: drop idle addresses' locks
                for idle in [a for a, lock in self._connecting.items()
                             if a not in self._peers and a not in self._broken and not lock.locked()]:
                    del self._connecting[idle]
        if peer is not None:
            self.engine.disconnect(peer)

    def hold_off(self, address: str, settled: Settlement) -> None:
        """Refuse owner ``address`` at once (``peer_stalled``) until ``settled``: a read from it passed its
        deadline and NIXL still reports it in flight."""
        with self._lock:
            previous = self._stalled.get(address)
            self._stalled[address] = settled if previous is None else Settlement.of_all((previous, settled))
            if len(self._stalled) > _BOUND:  # settled entries go first
                for over in [a for a, s in self._stalled.items() if s.done()]:
                    del self._stalled[over]

    def close(self) -> None:
        """Disconnect every owner and forget every failure (the engine itself stays open)."""
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            self._broken.clear()
            self._stalled.clear()
        for peer in peers:
            self.engine.disconnect(peer)

    def _check_cooldown(self, address: str) -> None:
        with self._lock:
            failed = self._broken.get(address)
            if failed is not None and time.monotonic() < failed[0]:
                raise OwnerCoolingDown(f"{address} failed {self.cooldown_s - (failed[0] - time.monotonic()):.1f} s "
                                       f"ago ({failed[1]}); refused for {self.cooldown_s:.0f} s before reconnecting")

    def _check_stalled(self, address: str) -> None:
        with self._lock:
            stalled = self._stalled.get(address)
            if stalled is not None and stalled.done():
                del self._stalled[address]
                stalled = None
        if stalled is not None:
            raise OwnerStalled(f"an earlier read from {address} passed its deadline and is still in flight; not "
                               "adding reads to a data path that does not move")
