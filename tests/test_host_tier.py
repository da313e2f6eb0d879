"""The host tier over real NIXL: an owner process demotes retentions into its HostTier, a reader in this process
claims and reads them back packed, byte for byte.

The owner's allocator reuses every block the ledger hands back at once (``on_free`` scribbles it), and its copier
starts each copy late: a hot block freed before its copy completed would put the scribble into the tier, and the
read-back would differ from the owner's original bytes (regenerated here from the seed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from conftest import POISON, Geo, HostCache, make_cache
from kvshuttle.policy import KVHandle
from transfer_helpers import PipedProcess, block_bytes, build_cache, token_bytes

SCRIBBLE = 0x11
COPY_DELAY_S = 0.2
HOT_TTL_S, TIER_TTL_S = 100.0, 1000.0  # on the owner's clock, which the tests move on
CAPACITY = 8
GEOS = {
    "flash_nhd": Geo("flash_attn", "NHD", "float16", num_blocks=16),
    "flashinfer_hnd": Geo("flashinfer", "HND", "bf16", num_blocks=16, num_layers=3),
    "mla": Geo("mla", "NHD", "fp8", num_blocks=16, num_heads=1, head_size=40),
    "cpu_attn": Geo("vllm_cpu_attn", dtype="bf16", num_blocks=16, layout="LBHNC"),
    "vllm_flash_hnd": Geo("vllm_flash_attn", dtype="float16", num_blocks=16, layout="LHBNC"),
}
LIMITS = "limits"  # an engine of its own for the test that moves its clock on
DIRECT_TIER = {"flash_nhd", "flashinfer_hnd", "mla"}  # geometries whose tier pieces are the cache's: read direct
# Every test reads an engine of its own: a demotion reuses (scribbles) its hot blocks for good.
ENGINES = {**GEOS, "direct": GEOS["flash_nhd"], "pinned": GEOS["flash_nhd"], "asked": GEOS["flash_nhd"],
           LIMITS: GEOS["flash_nhd"].with_(num_blocks=32)}


@dataclass
class Served:
    """One engine of the owner process: its cache, ledger and tier, and what its allocator saw."""

    cache: HostCache
    engine: Any
    ledger: Any
    offset: list[float] = field(default_factory=lambda: [0.0])
    freed: list[int] = field(default_factory=list)


def _serve(geo: Geo, seed: int) -> Served:
    from kvshuttle.retention import RetentionLedger, RetentionTerms, TierTerms
    from kvshuttle.transfer import EngineConfig, TransferEngine
    from kvshuttle.transfer.host_tier import HostTier

    cache = build_cache(geo, seed)
    tier = HostTier(cache.cache(), CAPACITY)
    engine = TransferEngine(tier.hot, EngineConfig(), tier=tier)
    host, port = engine.serve().removeprefix("tcp://").rsplit(":", 1)
    offset = [0.0]
    served = Served(cache, engine, None, offset)

    def reuse(blocks: list[int]) -> None:  # the allocator hands them to the next request at once
        served.freed += blocks
        for layer in range(geo.num_layers):
            cache.canonical(layer)[:, blocks] = SCRIBBLE

    def late(order: Any) -> None:
        threading.Timer(COPY_DELAY_S, tier.demote, (order,)).start()

    served.ledger = RetentionLedger(
        "decode", host, int(port), terms=RetentionTerms(ttl_s=HOT_TTL_S, tier=TierTerms(CAPACITY, TIER_TTL_S)),
        clock=lambda: time.monotonic() + offset[0], on_free=reuse, on_demote=late,
        bytes_per_block=tier.block_bytes)
    engine.claims = served.ledger
    return served


def _owner_main(conn: Any, names: list[str]) -> None:
    from kvshuttle.policy import block_digests

    served: dict[str, Served] = {}
    try:
        for index, name in enumerate(names):
            served[name] = _serve(ENGINES[name], index)
        conn.send(("ready", {name: s.engine.address for name, s in served.items()}))
        while True:
            if not conn.poll(0.05):
                continue
            command, args = conn.recv()
            if command == "stop":
                break
            s = served[args.pop("name")]
            if command == "retain":
                digests = block_digests(list(range(args["num_tokens"])), 16)
                conn.send(("ok", s.ledger.retain(args["request"], args["blocks"], digests, args["num_tokens"], 16)))
            elif command == "demote":
                conn.send(("ok", s.ledger.demote(args["handle_id"])))
            elif command == "release":
                conn.send(("ok", s.ledger.release(args["handle_id"])))
            elif command == "advance":
                s.offset[0] += args["seconds"]
                conn.send(("ok", s.ledger.sweep()))
            elif command == "wait_landed":  # every copy asked so far completed
                deadline = time.monotonic() + 10.0
                while s.ledger.metrics()["tiers"]["host"]["copying"] and time.monotonic() < deadline:
                    time.sleep(0.01)
                conn.send(("ok", s.ledger.metrics()))
            elif command == "state":
                conn.send(("ok", (s.ledger.metrics(), list(s.freed))))
            else:
                conn.send(("error", f"unknown command {command!r}"))
    except Exception as exc:  # report failures to the test instead of hanging it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for s in served.values():
            s.engine.close()
        conn.close()


class TierOwner(PipedProcess):
    def __init__(self, names: list[str]) -> None:
        super().__init__("tier owner", _owner_main, (names,))
        reply = self._receive(60.0)
        if reply[0] != "ready":
            self.close()
            raise RuntimeError(f"owner process failed to start: {reply}")
        self.addresses: dict[str, str] = reply[1]
        self.names = names

    def original(self, name: str) -> HostCache:
        """The owner's cache as it was built (before any block was reused)."""
        return build_cache(ENGINES[name], self.names.index(name))


@pytest.fixture(scope="module")
def owner() -> Iterator[TierOwner]:
    process = TierOwner(list(ENGINES))
    try:
        yield process
    finally:
        process.close()


class Reader:
    """A reader engine over a poisoned cache of ``geo``, connected to one engine of the owner."""

    def __init__(self, owner: TierOwner, name: str) -> None:
        from kvshuttle.transfer import EngineConfig, TransferEngine

        self.name, self.geo = name, ENGINES[name]
        self.cache = make_cache(np.random.default_rng(99), self.geo)
        self.engine = TransferEngine(self.cache.cache(), EngineConfig())
        self.peer = self.engine.connect(owner.addresses[name])
        self.source = owner.original(name)
        self.last_path = ""

    def read(self, handle: KVHandle, local: list[int], path: Literal["auto", "direct", "packed"] = "packed") -> Any:
        """Claim, read and confirm all of ``handle`` into poisoned ``local``; checks the bytes; returns the ticket."""
        self.poison()
        ticket = self.engine.claim(self.peer, handle)
        read = self.engine.read(self.peer, local, list(ticket.block_ids), num_tokens=handle.num_tokens, path=path,
                                claim=ticket)
        read.wait(20)
        self.last_path = read.path
        self.engine.finish_claim(self.peer, ticket, ok=True)
        got = token_bytes(self.cache, local, handle.num_tokens)
        assert np.array_equal(got, token_bytes(self.source, handle.block_ids, handle.num_tokens)), \
            "the bytes read back differ from the owner's"
        others = np.setdiff1d(np.arange(self.geo.num_blocks), local)
        assert (block_bytes(self.cache, others) == POISON).all(), "a block outside the read was written"
        return ticket

    def poison(self) -> None:
        for raw in self.cache.raws:
            raw[:] = POISON

    def refusal(self, handle: KVHandle) -> str:
        from kvshuttle.transfer import ClaimRefusedError

        with pytest.raises(ClaimRefusedError) as refused:
            self.engine.claim(self.peer, handle)
        return refused.value.reason

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def reader(owner: TierOwner, request: pytest.FixtureRequest) -> Iterator[Reader]:
    made = Reader(owner, getattr(request, "param", "flash_nhd"))
    try:
        yield made
    finally:
        made.close()


def retain(owner: TierOwner, name: str, blocks: list[int], num_tokens: int, request: str = "req") -> KVHandle:
    handle: KVHandle = owner.call("retain", name=name, request=request, blocks=blocks, num_tokens=num_tokens)
    return handle


@pytest.mark.parametrize("reader", list(GEOS), indirect=True)
def test_a_demoted_retention_reads_back_exactly_and_its_hot_blocks_were_freed_after_the_copy(
        owner: TierOwner, reader: Reader) -> None:
    name = reader.name
    rng = np.random.default_rng(len(name))
    blocks = [int(b) for b in rng.permutation(16)[:5]]
    handle = retain(owner, name, blocks, 5 * 16 - 3)
    assert owner.call("demote", name=name, handle_id=handle.handle_id) is True
    metrics = owner.call("wait_landed", name=name)
    tier = metrics["tiers"]["host"]
    assert (tier["blocks"], tier["demotions"], metrics["retained_blocks"]) == (5, 1, 0)
    _, freed = owner.call("state", name=name)
    assert sorted(freed) == sorted(blocks)  # vLLM's blocks went back (and were reused: scribbled)
    local = [int(b) for b in rng.permutation(16)[:5]]
    ticket = reader.read(handle, local)
    assert ticket.tier == "host" and len(ticket.slots) == 5 and reader.last_path == "packed"
    if name in DIRECT_TIER:  # the tier's pieces are the cache's: its slots read direct, byte for byte
        reader.read(handle, local[::-1], path="direct")
        assert reader.last_path == "direct"
    else:  # they are not (vLLM 0.32 layouts: K and V of a token side by side): packed only
        from kvshuttle.transfer import IncompatiblePeerError

        ticket = reader.engine.claim(reader.peer, handle)
        with pytest.raises(IncompatiblePeerError, match="host tier"):
            reader.engine.read(reader.peer, local, list(ticket.block_ids), path="direct", claim=ticket)
        reader.engine.finish_claim(reader.peer, ticket, ok=False)  # nothing moved: unpin
        reader.read(handle, local[::-1], path="auto")
        assert reader.last_path == "packed"
    assert owner.call("release", name=name, handle_id=handle.handle_id) is True
    assert reader.refusal(handle) == "HandleReleasedError"
    metrics, _ = owner.call("state", name=name)
    assert metrics["tiers"]["host"]["blocks"] == 0 and metrics["tiers"]["host"]["reads"] == 2


@pytest.mark.parametrize("reader", ["direct"], indirect=True)
def test_a_tier_claim_reads_direct_from_its_slots_and_a_read_of_the_hot_ids_is_not_confirmed(
        owner: TierOwner, reader: Reader) -> None:
    from kvshuttle.transfer import ClaimRefusedError

    handle = retain(owner, "direct", [9, 4, 12], 48, "direct")
    owner.call("demote", name="direct", handle_id=handle.handle_id)
    owner.call("wait_landed", name="direct")
    reader.read(handle, [2, 0, 1], path="direct")  # the tier's slots, read direct: exact, and confirmed
    assert reader.last_path == "direct"
    # one that does not pass the ticket (an older reader) reads the hot blocks by id: the owner refuses it
    ticket = reader.engine.claim(reader.peer, handle)
    reader.engine.read(reader.peer, [0, 1, 2], list(ticket.block_ids), path="direct").wait(20)
    with pytest.raises(ClaimRefusedError) as refused:  # it read the reused hot blocks: discard
        reader.engine.finish_claim(reader.peer, ticket, ok=True)
    assert refused.value.reason == "StaleHandleError"
    assert (block_bytes(reader.cache, [0, 1, 2]) == SCRIBBLE).all()
    reader.read(handle, [5, 3, 7])  # packed, it is served
    owner.call("release", name="direct", handle_id=handle.handle_id)


@pytest.mark.parametrize("reader", ["pinned"], indirect=True)
def test_a_demotion_waits_for_a_claim_in_flight(owner: TierOwner, reader: Reader) -> None:
    handle = retain(owner, "pinned", [2, 14, 6, 0], 60, "pinned")
    ticket = reader.engine.claim(reader.peer, handle)
    assert owner.call("demote", name="pinned", handle_id=handle.handle_id) is True
    time.sleep(2 * COPY_DELAY_S)
    metrics, freed = owner.call("state", name="pinned")
    assert metrics["tiers"]["host"]["copying"] == 0 and metrics["pinned_blocks"] == 4
    assert not set(freed) & {2, 14, 6, 0}  # the pins hold
    assert reader.refusal(handle) == "HandleDemotingError"
    reader.poison()
    reader.engine.read(reader.peer, [1, 3, 5, 7], list(ticket.block_ids), num_tokens=60, claim=ticket).wait(20)
    reader.engine.finish_claim(reader.peer, ticket, ok=True)  # the hot read is confirmed...
    assert np.array_equal(token_bytes(reader.cache, [1, 3, 5, 7], 60),
                          token_bytes(reader.source, handle.block_ids, 60))
    metrics = owner.call("wait_landed", name="pinned")  # ...then the demotion starts and lands
    assert metrics["tiers"]["host"]["demotions"] == 1
    _, freed = owner.call("state", name="pinned")
    assert sorted(freed) == [0, 2, 6, 14]
    assert reader.read(handle, [8, 10, 12, 15]).tier == "host"
    owner.call("release", name="pinned", handle_id=handle.handle_id)


def test_full_evicted_and_expired_tier_retentions_are_refused_by_name(owner: TierOwner) -> None:
    reader = Reader(owner, LIMITS)
    try:
        first = retain(owner, LIMITS, [0, 1, 2, 3, 4], 80, "first")
        second = retain(owner, LIMITS, [5, 6, 7, 8, 9], 80, "second")
        for handle in (first, second):  # 5 + 5 blocks in 8 slots: the second evicts the first from the tier
            owner.call("demote", name=LIMITS, handle_id=handle.handle_id)
            owner.call("wait_landed", name=LIMITS)
        assert reader.refusal(first) == "HandleTierEvictedError"
        reader.read(second, [15, 14, 13, 12, 11])
        big = retain(owner, LIMITS, list(range(16, 25)), 9 * 16, "big")
        assert owner.call("demote", name=LIMITS, handle_id=big.handle_id) is False  # asked: stays hot
        assert reader.read(big, [3, 4, 5, 6, 7, 8, 9, 10, 0], path="direct").tier == "hot"
        assert owner.call("advance", name=LIMITS, seconds=HOT_TTL_S) == 1  # forced: no room in 8 slots
        assert reader.refusal(big) == "HandleTierFullError"
        owner.call("advance", name=LIMITS, seconds=TIER_TTL_S)
        assert reader.refusal(second) == "HandleTierExpiredError"
        metrics, _ = owner.call("state", name=LIMITS)
        tier = metrics["tiers"]["host"]
        assert (tier["evictions"], tier["full"], tier["expirations"], tier["blocks"]) == (1, 1, 1, 0)
        assert tier["misses"] == 3
    finally:
        reader.close()


@pytest.mark.parametrize("reader", ["asked"], indirect=True)
def test_a_demotion_asked_on_the_side_channel_frees_the_hot_blocks_and_the_tier_serves_reads(
        owner: TierOwner, reader: Reader) -> None:
    """``demote_retention``: a router's call (params authenticated, a connection per rank) and a reader's connected
    peer ask the owner's ledger over the side channel; the same demotion as a TTL's: hot blocks back once copied."""
    from kvshuttle.transfer import demote_retention
    from kvshuttle.transfer.control import demote_on_ranks
    from kvshuttle.trust import DeploymentSecret

    secret = DeploymentSecret.resolve()  # the owner process's (EngineConfig's default)
    handle = retain(owner, "asked", [3, 11, 6], 40, "asked")
    assert demote_retention(handle.to_kv_transfer_params(secret), secret=secret) is True
    metrics = owner.call("wait_landed", name="asked")
    assert (metrics["tiers"]["host"]["demotions"], metrics["retained_blocks"]) == (1, 0)
    _, freed = owner.call("state", name="asked")
    assert sorted(freed) == [3, 6, 11]  # the hot blocks went back (and were reused: scribbled)
    assert reader.read(handle, [0, 5, 9]).tier == "host"  # byte for byte the owner's original
    assert demote_on_ranks([reader.peer], handle, 5.0) is False  # in the tier already: nothing to do
    second = retain(owner, "asked", [1, 2], 20, "second")
    assert demote_on_ranks([reader.peer], second, 5.0) is True
    owner.call("wait_landed", name="asked")
    assert reader.read(second, [14, 15]).tier == "host"
    for done in (handle, second):
        owner.call("release", name="asked", handle_id=done.handle_id)


@pytest.mark.parametrize("reader", ["asked"], indirect=True)
def test_a_demotion_of_a_forged_or_unknown_handle_is_refused_and_changes_nothing(
        owner: TierOwner, reader: Reader) -> None:
    import dataclasses

    from kvshuttle.transfer import ClaimRefusedError, TransferArgumentError, demote_retention
    from kvshuttle.transfer.control import demote_on_ranks
    from kvshuttle.trust import DeploymentSecret

    secret = DeploymentSecret.resolve()
    handle = retain(owner, "asked", [7, 8], 30, "kept")
    params = handle.to_kv_transfer_params(secret)
    forged = {**params, "kvshuttle_handle_id": "f" * len(handle.handle_id)}
    with pytest.raises(TransferArgumentError, match="no usable kvshuttle handle"):  # before any connection
        demote_retention(forged, secret=secret)
    other = DeploymentSecret(b"another-deployment-entirely-secret-0003")
    with pytest.raises(TransferArgumentError):  # another deployment's member cannot even name it
        demote_retention(params, secret=other)
    unknown = dataclasses.replace(handle, handle_id="0" * len(handle.handle_id))
    with pytest.raises(ClaimRefusedError) as refused:
        demote_on_ranks([reader.peer], unknown, 5.0, unknown_grace_s=0.1)
    assert refused.value.reason == "UnknownHandleError"
    metrics, freed = owner.call("state", name="asked")
    assert metrics["tiers"]["host"]["copying"] == 0 and not {7, 8} & set(freed)
    assert reader.read(handle, [4, 12], path="direct").tier == "hot"  # still hot, read as before
    owner.call("release", name="asked", handle_id=handle.handle_id)
    with pytest.raises(ClaimRefusedError) as refused:
        demote_on_ranks([reader.peer], handle, 5.0)
    assert refused.value.reason == "HandleReleasedError"


def test_an_owner_without_a_tier_refuses_a_demotion_by_name() -> None:
    import zmq

    from kvshuttle.policy import block_digests
    from kvshuttle.retention import RetentionLedger
    from kvshuttle.transfer import ClaimRefusedError, EngineConfig, PeerAuthError, TransferEngine, demote_retention
    from kvshuttle.transfer.control import ask_demotion
    from kvshuttle.transfer.side_channel import Connection
    from kvshuttle.trust import DeploymentSecret

    secret = DeploymentSecret(b"no-tier-owner-suite-deployment-secret-0004")
    engine = TransferEngine(build_cache(GEOS["flash_nhd"], 5).cache(), EngineConfig(secret=secret))
    try:
        host, port = engine.serve().removeprefix("tcp://").rsplit(":", 1)
        engine.claims = ledger = RetentionLedger("decode", host, int(port))
        handle = ledger.retain("r", [4, 2], block_digests(list(range(30)), 16), 30, 16)
        with pytest.raises(ClaimRefusedError) as refused:
            demote_retention(handle.to_kv_transfer_params(secret), secret=secret)
        assert refused.value.reason == "NoTierError"
        kept = ledger.get(handle.handle_id)
        assert kept is not None and kept.block_ids == handle.block_ids  # nothing lost
        assert ledger.metrics()["retained_blocks"] == 2
        outsider = Connection(zmq.Context.instance(), engine.address or "", secret=DeploymentSecret(b"o" * 40))
        try:
            time.sleep(0.5)  # its handshake failed and its pipe is gone (unread by the monitor) before it sends
            with pytest.raises(PeerAuthError):  # without the deployment secret: no handshake, no op
                ask_demotion(outsider, handle, 3.0)
        finally:
            outsider.close()
        assert ledger.get(handle.handle_id) is not None
    finally:
        engine.close()


def test_host_tier_arguments_are_checked() -> None:
    from kvshuttle.retention import Demotion
    from kvshuttle.transfer import TransferArgumentError, TransferEngine
    from kvshuttle.transfer.host_tier import HostTier, slot_runs

    cache = make_cache(np.random.default_rng(3), GEOS["flash_nhd"]).cache()
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(TransferArgumentError):
            HostTier(cache, bad)  # type: ignore[arg-type]
    with pytest.raises(TransferArgumentError):
        HostTier("cache", 4)  # type: ignore[arg-type]
    tier = HostTier(cache, 4)
    other = make_cache(np.random.default_rng(4), GEOS["flash_nhd"]).cache()
    with pytest.raises(TransferArgumentError, match="built for this engine's cache"):
        TransferEngine(other, tier=tier)
    reports: list[bool] = []
    for ids, slots in (((1, 2), (0, 4)), ((1,), (0, 1)), ((), ())):  # a slot past the capacity; counts differ
        tier.demote(Demotion("h", ids, slots, reports.append))
    assert reports == [False, False, False] and not tier.buffer.any()
    assert slot_runs([3, 4, 5, 0, 1, 7]) == [(0, 3), (3, 2), (5, 1)]
    tier.close()
