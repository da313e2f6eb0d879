"""The disk tier over real NIXL and real files: an owner process demotes retentions hot -> host -> disk (its
HostTier, then its DiskTier under a directory of this test's), a reader in this process claims and reads them back
packed into a poisoned cache, byte for byte.

The owner's allocator reuses every hot block the ledger hands back at once (scribbles it), and its disk writer
starts each write late: host slots handed back before their file was written would be overwritten by the next
demotion into them, and the read-back would differ from the owner's original bytes (regenerated from the seed).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from conftest import POISON, Geo, make_cache
from kvshuttle.policy import KVHandle
from transfer_helpers import PipedProcess, block_bytes, build_cache, token_bytes

SCRIBBLE = 0x11
WRITE_DELAY_S = 0.2
HOT_TTL_S, HOST_TTL_S, DISK_TTL_S = 100.0, 1000.0, 10_000.0  # on the owner's clock, which the tests move on
HOST_BLOCKS, DISK_BLOCKS = 8, 8
GEOS = {
    "flash_nhd": Geo("flash_attn", "NHD", "float16", num_blocks=16),
    "mla": Geo("mla", "NHD", "fp8", num_blocks=16, num_heads=1, head_size=40),
    "cpu_attn": Geo("vllm_cpu_attn", dtype="bf16", num_blocks=16, layout="LBHNC"),
}
# Every test reads an engine of its own: a demotion reuses (scribbles) its hot blocks for good.
ENGINES = {**GEOS, "evict": GEOS["flash_nhd"], "bound": GEOS["flash_nhd"], "lost": GEOS["flash_nhd"],
           "full": GEOS["flash_nhd"]}


def _serve(name: str, seed: int, root: Path) -> dict[str, Any]:
    from kvshuttle.retention import RetentionLedger, RetentionTerms, TierTerms
    from kvshuttle.transfer import EngineConfig, TransferEngine
    from kvshuttle.transfer.disk_tier import DiskTier
    from kvshuttle.transfer.host_tier import HostTier

    geo = ENGINES[name]
    cache = build_cache(geo, seed)
    tier = HostTier(cache.cache(), HOST_BLOCKS)
    (root / name).mkdir(exist_ok=True)
    disk = DiskTier(tier, root / name)
    engine = TransferEngine(tier.hot, EngineConfig(), tier=tier, disk=disk)
    host, port = engine.serve().removeprefix("tcp://").rsplit(":", 1)
    offset = [0.0]

    def reuse(blocks: list[int]) -> None:  # the allocator hands them to the next request at once
        for layer in range(geo.num_layers):
            cache.canonical(layer)[:, blocks] = SCRIBBLE

    def late(order: Any) -> None:
        threading.Timer(WRITE_DELAY_S, disk.spill, (order,)).start()

    terms = RetentionTerms(ttl_s=HOT_TTL_S, tier=TierTerms(HOST_BLOCKS, HOST_TTL_S),
                           disk=TierTerms(ttl_s=DISK_TTL_S, name="disk", capacity_bytes=DISK_BLOCKS * tier.block_bytes))
    ledger = RetentionLedger("decode", host, int(port), terms=terms, clock=lambda: time.monotonic() + offset[0],
                             on_free=reuse, on_demote=tier.demote, on_spill=late, on_discard=disk.discard,
                             bytes_per_block=tier.block_bytes, claim_timeout_s=10 * DISK_TTL_S)
    engine.claims = ledger
    return {"engine": engine, "ledger": ledger, "disk": disk, "offset": offset}


def _files(disk: Any) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path(disk.dir).iterdir() if p.name != ".lock"}


def _owner_main(conn: Any, names: list[str], root: str) -> None:
    import resource

    from kvshuttle.policy import block_digests

    served: dict[str, dict[str, Any]] = {}
    try:
        for index, name in enumerate(names):
            served[name] = _serve(name, index, Path(root))
        conn.send(("ready", {name: s["engine"].address for name, s in served.items()}))
        while True:
            if not conn.poll(0.05):
                continue
            command, args = conn.recv()
            if command == "stop":
                break
            s = served[args.pop("name")]
            ledger, disk = s["ledger"], s["disk"]
            if command == "retain":
                digests = block_digests(list(range(args["num_tokens"])), 16)
                conn.send(("ok", ledger.retain(args["request"], args["blocks"], digests, args["num_tokens"], 16)))
            elif command == "demote":
                conn.send(("ok", ledger.demote(args["handle_id"])))
            elif command == "release":
                conn.send(("ok", ledger.release(args["handle_id"])))
            elif command == "advance":
                s["offset"][0] += args["seconds"]
                conn.send(("ok", ledger.sweep()))
            elif command == "settle":  # every copy asked so far landed, every file removal ran
                deadline = time.monotonic() + 20.0
                while time.monotonic() < deadline and (
                        any(t["copying"] for t in ledger.metrics()["tiers"].values()) or disk.busy):
                    time.sleep(0.02)
                conn.send(("ok", (ledger.metrics(), _files(disk), disk.dir.name)))
            elif command == "tamper":  # behind the ledger's back
                path = disk.path(args["handle_id"])
                if args["how"] == "delete":
                    path.unlink()
                else:
                    os.truncate(path, path.stat().st_size - 1)
                conn.send(("ok", None))
            elif command == "file_limit":  # RLIMIT_FSIZE: a write past it fails as on a full disk (EFBIG)
                import signal

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (args["bytes"], hard))
                conn.send(("ok", soft))
            else:
                conn.send(("error", f"unknown command {command!r}"))
    except Exception as exc:  # report failures to the test instead of hanging it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for s in served.values():
            s["engine"].close()
        conn.close()


class DiskOwner(PipedProcess):
    def __init__(self, names: list[str], root: Path) -> None:
        super().__init__("disk tier owner", _owner_main, (names, str(root)))
        reply = self._receive(90.0)
        if reply[0] != "ready":
            self.close()
            raise RuntimeError(f"owner process failed to start: {reply}")
        self.addresses: dict[str, str] = reply[1]
        self.names, self.root = names, root

    def original(self, name: str) -> Any:
        """The owner's cache as it was built (before any block was reused)."""
        return build_cache(ENGINES[name], self.names.index(name))

    def retain(self, name: str, blocks: list[int], num_tokens: int, request: str = "req") -> KVHandle:
        handle: KVHandle = self.call("retain", name=name, request=request, blocks=blocks, num_tokens=num_tokens)
        return handle

    def to_disk(self, name: str, handle: KVHandle) -> tuple[dict[str, Any], dict[str, int]]:
        """Hot -> host (asked) -> disk (the host TTL runs out); the metrics and files once landed."""
        assert self.call("demote", name=name, handle_id=handle.handle_id) is True
        self.call("settle", name=name)
        self.call("advance", name=name, seconds=HOST_TTL_S)
        metrics, files, _ = self.call("settle", name=name)
        return metrics, files


@pytest.fixture(scope="module")
def owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DiskOwner]:
    process = DiskOwner(list(ENGINES), tmp_path_factory.mktemp("disk_tier"))
    try:
        yield process
    finally:
        process.close()


class Reader:
    """A reader engine over a poisoned cache of ``name``'s geometry, connected to that engine of the owner."""

    def __init__(self, owner: DiskOwner, name: str) -> None:
        from kvshuttle.transfer import EngineConfig, TransferEngine

        self.geo = ENGINES[name]
        self.cache = make_cache(np.random.default_rng(99), self.geo)
        self.engine = TransferEngine(self.cache.cache(), EngineConfig())
        self.peer = self.engine.connect(owner.addresses[name])
        self.source = owner.original(name)

    def poison(self) -> None:
        for raw in self.cache.raws:
            raw[:] = POISON

    def read(self, handle: KVHandle, local: list[int]) -> Any:
        """Claim, read and confirm all of ``handle`` into poisoned ``local``; checks the bytes; returns the ticket."""
        self.poison()
        ticket = self.engine.claim(self.peer, handle)
        self.engine.read(self.peer, local, list(ticket.block_ids), num_tokens=handle.num_tokens, path="packed",
                         claim=ticket).wait(20)
        self.engine.finish_claim(self.peer, ticket, ok=True)
        assert np.array_equal(token_bytes(self.cache, local, handle.num_tokens),
                              token_bytes(self.source, handle.block_ids, handle.num_tokens)), \
            "the bytes read back differ from the owner's"
        others = np.setdiff1d(np.arange(self.geo.num_blocks), local)
        assert (block_bytes(self.cache, others) == POISON).all(), "a block outside the read was written"
        return ticket

    def refusal(self, handle: KVHandle) -> str:
        from kvshuttle.transfer import ClaimRefusedError

        with pytest.raises(ClaimRefusedError) as refused:
            self.engine.claim(self.peer, handle)
        return refused.value.reason

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def reader(owner: DiskOwner, request: pytest.FixtureRequest) -> Iterator[Reader]:
    made = Reader(owner, request.param)
    try:
        yield made
    finally:
        made.close()


def settled_files(owner: DiskOwner, name: str) -> dict[str, int]:
    files: dict[str, int] = owner.call("settle", name=name)[1]
    return files


@pytest.mark.parametrize("reader", list(GEOS), indirect=True)
def test_a_retention_moved_hot_host_disk_reads_back_exactly_and_release_removes_its_file(
        owner: DiskOwner, reader: Reader, request: pytest.FixtureRequest) -> None:
    name = request.node.callspec.params["reader"]
    rng = np.random.default_rng(len(name))
    blocks = [int(b) for b in rng.permutation(16)[:5]]
    handle = owner.retain(name, blocks, 5 * 16 - 3)
    metrics, files = owner.to_disk(name, handle)
    host, disk = metrics["tiers"]["host"], metrics["tiers"]["disk"]
    assert (host["blocks"], disk["blocks"], disk["demotions"], metrics["retained_blocks"]) == (0, 5, 1, 0)
    block = disk["bytes"] // 5
    assert list(files.values()) == [5 * block + 40]  # a header and the five blocks
    local = [int(b) for b in rng.permutation(16)[:5]]
    ticket = reader.read(handle, local)
    assert ticket.tier == "disk" and ticket.packed_only
    reader.read(handle, local[::-1])  # read again: the file stays until the retention ends
    assert owner.call("release", name=name, handle_id=handle.handle_id) is True
    assert settled_files(owner, name) == {}
    assert reader.refusal(handle) == "HandleReleasedError"
    metrics = owner.call("settle", name=name)[0]
    assert metrics["tiers"]["disk"]["blocks"] == 0 and metrics["tiers"]["disk"]["reads"] == 2


@pytest.mark.parametrize("reader", ["evict"], indirect=True)
def test_a_host_eviction_writes_the_victim_before_its_slots_are_reused(owner: DiskOwner, reader: Reader) -> None:
    first = owner.retain("evict", [0, 1, 2, 3, 4], 80, "first")
    assert owner.call("demote", name="evict", handle_id=first.handle_id) is True
    owner.call("settle", name="evict")
    second = owner.retain("evict", [5, 6, 7, 8, 9], 80, "second")
    # 5 + 5 blocks in 8 host slots: the first moves to disk (its write starts late), the second waits for its slots
    assert owner.call("demote", name="evict", handle_id=second.handle_id) is True
    metrics, files, _ = owner.call("settle", name="evict")
    assert (metrics["tiers"]["host"]["blocks"], metrics["tiers"]["disk"]["blocks"], len(files)) == (5, 5, 1)
    assert metrics["tiers"]["host"]["demotions"] == 2 and metrics["tiers"]["disk"]["demotions"] == 1
    assert reader.read(first, [15, 14, 13, 12, 11]).tier == "disk"  # not the second's bytes, written over it
    assert reader.read(second, [1, 3, 5, 7, 9]).tier == "host"
    from kvshuttle.transfer import release_retention
    from kvshuttle.trust import DeploymentSecret

    secret = DeploymentSecret.resolve()  # the owner process's (EngineConfig's default)
    for handle in (first, second):  # the router's call (its DELETE /v1/conversations/{id}): every tier, the file too
        assert release_retention(handle.to_kv_transfer_params(secret), secret=secret) is True
    assert settled_files(owner, "evict") == {}
    assert reader.refusal(first) == reader.refusal(second) == "HandleReleasedError"


@pytest.mark.parametrize("reader", ["bound"], indirect=True)
def test_the_byte_bound_holds_and_evicted_and_expired_files_go(owner: DiskOwner, reader: Reader) -> None:
    first = owner.retain("bound", [0, 1, 2, 3, 4], 80, "first")
    _, files = owner.to_disk("bound", first)
    (first_file,) = files
    second = owner.retain("bound", [5, 6, 7, 8, 9], 80, "second")
    metrics, files = owner.to_disk("bound", second)  # 5 + 5 blocks in 8 on disk: the first goes
    disk = metrics["tiers"]["disk"]
    assert first_file not in files and len(files) == 1
    assert disk["bytes"] <= disk["capacity_bytes"] and sum(files.values()) <= disk["capacity_bytes"] + 40
    assert reader.refusal(first) == "HandleTierEvictedError"
    reader.read(second, [10, 11, 12, 13, 14])
    owner.call("advance", name="bound", seconds=DISK_TTL_S)
    assert settled_files(owner, "bound") == {}
    assert reader.refusal(second) == "HandleTierExpiredError"
    disk = owner.call("settle", name="bound")[0]["tiers"]["disk"]
    assert (disk["evictions"], disk["expirations"], disk["misses"], disk["blocks"]) == (1, 1, 2, 0)


@pytest.mark.parametrize("reader", ["lost"], indirect=True)
@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_a_file_deleted_or_truncated_behind_the_ledger_is_refused_by_name(
        owner: DiskOwner, reader: Reader, how: str) -> None:
    from kvshuttle.transfer import TierLostError

    handle = owner.retain("lost", [3, 9, 1], 40, how)
    owner.to_disk("lost", handle)
    owner.call("tamper", name="lost", handle_id=handle.handle_id, how=how)
    reader.poison()
    ticket = reader.engine.claim(reader.peer, handle)
    with pytest.raises(TierLostError, match="HandleTierLostError"):
        reader.engine.read(reader.peer, [0, 1, 2], list(ticket.block_ids), num_tokens=40, path="packed",
                           claim=ticket).wait(20)
    reader.engine.finish_claim(reader.peer, ticket, ok=False)
    assert (block_bytes(reader.cache, np.arange(16)) == POISON).all()  # nothing was written
    assert reader.refusal(handle) == "HandleTierLostError"
    assert settled_files(owner, "lost") == {}  # what was left of it went too


@pytest.mark.parametrize("reader", ["full"], indirect=True)
def test_a_write_that_fails_as_on_a_full_disk_ends_the_retention_by_name(owner: DiskOwner, reader: Reader) -> None:
    handle = owner.retain("full", [4, 5, 6], 48)
    before = owner.call("file_limit", name="full", bytes=4096)  # less than one block
    try:
        metrics, files = owner.to_disk("full", handle)
    finally:
        owner.call("file_limit", name="full", bytes=before)
    assert files == {} and metrics["tiers"]["disk"]["failed_copies"] == 1
    assert metrics["tiers"]["host"]["blocks"] == 0 and metrics["tiers"]["disk"]["blocks"] == 0
    assert reader.refusal(handle) == "HandleTierExpiredError"  # the end it was leaving the host tier for


def _holder_main(conn: Any, root: str) -> None:
    """Hold a disk tier (and a file in it) until killed."""
    from kvshuttle.transfer.disk_tier import DiskTier
    from kvshuttle.transfer.host_tier import HostTier

    tier = HostTier(build_cache(GEOS["flash_nhd"], 7).cache(), 2)
    disk = DiskTier(tier, root)
    (disk.dir / "left.kv").write_bytes(b"kv" * 100)
    conn.send(("ready", disk.dir.name))
    while not conn.poll(0.1):
        pass


class Holder(PipedProcess):
    def __init__(self, root: Path) -> None:
        super().__init__("disk tier holder", _holder_main, (str(root),))
        self.dir: str = self._receive(60.0)[1]


def test_a_restart_removes_what_a_dead_process_left_and_never_a_live_ones(tmp_path: Path) -> None:
    from kvshuttle.transfer import DiskTierError
    from kvshuttle.transfer.disk_tier import DiskTier
    from kvshuttle.transfer.host_tier import HostTier

    dead, live = Holder(tmp_path), None
    try:
        dead.kill()  # SIGKILL: no close, its directory stays
        assert (tmp_path / dead.dir / "left.kv").exists()
        live = Holder(tmp_path)  # a restart: its start removes the dead one's directory
        assert {p.name for p in tmp_path.iterdir()} == {live.dir}
        (tmp_path / "operator-notes").mkdir()  # not the tier's: never touched
        starting, stale = tmp_path / "kvshuttle-disk-starting", tmp_path / "kvshuttle-disk-stale"
        starting.mkdir()  # no lock file yet: a process starting now (kept), or one that died starting (removed)
        stale.mkdir()
        os.utime(stale, (time.time() - 120, time.time() - 120))
        tier = HostTier(make_cache(np.random.default_rng(1), GEOS["flash_nhd"]).cache(), 2)
        mine = DiskTier(tier, tmp_path)
        assert mine.removed_at_start == 1  # the stale one; the live holder's lock is held
        kept = {live.dir, starting.name, "operator-notes"}
        assert {p.name for p in tmp_path.iterdir()} == {*kept, mine.dir.name}
        mine.close()
        assert {p.name for p in tmp_path.iterdir()} == kept
        live.kill()
        again = DiskTier(tier, tmp_path)
        assert again.removed_at_start == 1
        assert {p.name for p in tmp_path.iterdir()} == {again.dir.name, starting.name, "operator-notes"}
        again.close()
        with pytest.raises(DiskTierError, match="not a writable directory"):
            DiskTier(tier, tmp_path / "missing")
        (tmp_path / "file").write_text("")
        with pytest.raises(DiskTierError, match="not a writable directory"):
            DiskTier(tier, tmp_path / "file")
    finally:
        dead.close()
        if live is not None:
            live.close()
