"""Tensor-parallel reuse reads: a reader rank reads its KV heads from an owner engine at another TP size.

The handle's ``kvshuttle_ranks`` (wire format, MAC, trust) first; then real NIXL reads between real processes:
every owner rank is its own process and peer (own TransferEngine, side channel, retention ledger, head shard of
one global random cache), every reader rank its own TransferEngine over a poisoned shard in this process. Each
read is checked byte for byte against the reader rank's slice of the global cache, and every failure must be
all or nothing: no open claim left on any owner rank, every local target block reported invalid.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvshuttle.core.ranks import rank_heads
from kvshuttle.policy import KVHandle, PolicyConfig, block_digests, parse_handle
from kvshuttle.policy.kv_handle import HandleAuthError, HandleFormatError
from kvshuttle.trust import DeploymentSecret
from rank_helpers import (
    POISON,
    SECRET_BYTES,
    Layers,
    Model,
    OwnerRank,
    close_all,
    global_layers,
    poisoned_shard,
    start_owner_groups,
)

SECRET = DeploymentSecret(SECRET_BYTES)
B = 16
TOKENS = list(range(1, 65))  # 4 full blocks


def tp_handle(tp_size: int = 2, ranks: tuple[str, ...] | None = None, host: str = "127.0.0.1") -> KVHandle:
    if ranks is None:
        ranks = tuple(f"{host}:{5600 + r}" for r in range(tp_size)) if tp_size > 1 else ()
    return KVHandle("owner", "req-1", host, 5600, (3, 1, 4, 0), 64, 2e9, tp_size, "h-ranks", 0, B,
                    tuple(block_digests(TOKENS, B)), 1e9, 480.0, ranks)


# ------------------------------------------------------------------------------------------ wire format
def test_ranks_round_trip_through_json() -> None:
    handle = tp_handle(4)
    params = json.loads(json.dumps(handle.to_kv_transfer_params(SECRET)))
    assert params["kvshuttle_ranks"] == ["127.0.0.1:5600", "127.0.0.1:5601", "127.0.0.1:5602", "127.0.0.1:5603"]
    assert parse_handle(params, secret=SECRET) == handle
    single = tp_handle(1)
    assert "kvshuttle_ranks" not in single.to_kv_transfer_params(SECRET)  # TP=1: the wire is as before
    assert parse_handle(single.to_kv_transfer_params(SECRET), secret=SECRET) == single
    listed = replace(single, ranks=("127.0.0.1:5600",))  # a TP=1 owner may list its one rank too
    assert parse_handle(listed.to_kv_transfer_params(SECRET), secret=SECRET) == listed
    assert listed.signing_bytes() != single.signing_bytes()
    v6 = tp_handle(2, host="[::1]")
    assert parse_handle(v6.to_kv_transfer_params(SECRET), secret=SECRET) == v6


def _edits(ranks: list[str]) -> list[list[str] | None]:
    out: list[list[str] | None] = [None, list(reversed(ranks))]  # dropped, reordered
    for k in range(len(ranks)):
        host, port = ranks[k].rsplit(":", 1)
        out.append([*ranks[:k], f"{host}:{int(port) + 10}", *ranks[k + 1:]])
        out.append([*ranks[:k], f"127.0.0.2:{port}", *ranks[k + 1:]])
    return out


def test_every_rank_address_edit_fails_the_mac() -> None:
    params = tp_handle(3).to_kv_transfer_params(SECRET)
    for edit in _edits(params["kvshuttle_ranks"]):
        forged = {**params}
        if edit is None:
            del forged["kvshuttle_ranks"]  # well formed (TP>1 without ranks) but not what was signed
        else:
            forged["kvshuttle_ranks"] = edit
            forged["remote_host"], forged["remote_port"] = edit[0].rsplit(":", 1)[0], int(edit[0].rsplit(":")[-1])
        with pytest.raises(HandleAuthError, match="does not match"):
            KVHandle.from_kv_transfer_params(forged, SECRET)
    grown = {**params, "tp_size": 4, "kvshuttle_ranks": [*params["kvshuttle_ranks"], "127.0.0.1:5700"]}
    with pytest.raises(HandleAuthError, match="does not match"):
        KVHandle.from_kv_transfer_params(grown, SECRET)


@pytest.mark.parametrize("ranks", [
    "127.0.0.1:5600,127.0.0.1:5601",  # not a list
    [],  # empty: omit it
    ["127.0.0.1:5600"],  # fewer than tp_size
    ["127.0.0.1:5600", "127.0.0.1:5601", "127.0.0.1:5602"],  # more
    ["127.0.0.1:5600", 5601],
    ["127.0.0.1:5600", None],
    ["127.0.0.1:5600", "127.0.0.1"],  # no port
    ["127.0.0.1:5600", ":5601"],  # no host
    ["127.0.0.1:5600", "127.0.0.1:0"],
    ["127.0.0.1:5600", "127.0.0.1:65536"],
    ["127.0.0.1:5600", "127.0.0.1:+5601"],
    ["127.0.0.1:5600", "127.0.0.1:05601"],
    ["127.0.0.1:5600", "127.0.0.1:\uff15\uff16\uff10\uff11"],  # fullwidth (non-ASCII) digits
    ["127.0.0.1:5600", "127.0.0.1 :5601"],
    ["127.0.0.1:5600", "a,b:5601"],
    ["127.0.0.1:5600", "tcp://h:5601"],
    ["127.0.0.1:5600", "::1:5601"],  # IPv6 without brackets
    ["127.0.0.1:5600", "h" * 300 + ":5601"],
    ["127.0.0.1:5600", "127.0.0.1:5600"],  # one side channel twice
    ["127.0.0.1:5601", "127.0.0.1:5600"],  # rank 0 is not host:port
])
def test_malformed_ranks_are_format_errors(ranks: Any) -> None:
    params = {**tp_handle(2).to_kv_transfer_params(SECRET), "kvshuttle_ranks": ranks}
    for secret in (None, SECRET):
        with pytest.raises(HandleFormatError) as info:
            KVHandle.from_kv_transfer_params(params, secret)
        assert not isinstance(info.value, HandleAuthError)  # refused as malformed, before the MAC


def test_hand_built_bad_ranks_are_refused_by_check() -> None:
    for ranks in (["127.0.0.1:5600", "127.0.0.1:5601"], ("127.0.0.1:5600",), ("127.0.0.1:5600", "x")):
        handle = replace(tp_handle(2), ranks=ranks)  # type: ignore[arg-type]
        assert handle.structure_problem() is not None
    assert tp_handle(2).structure_problem() is None
    assert replace(tp_handle(2), ranks=()).structure_problem() is None  # well formed; a reader recomputes it


def test_a_local_secret_refuses_a_remote_rank() -> None:
    local = DeploymentSecret(SECRET_BYTES, scope="local")
    loopback = tp_handle(2, ranks=("127.0.0.1:5600", "[::1]:5601"))
    assert parse_handle(loopback.to_kv_transfer_params(local), secret=local) == loopback
    remote = tp_handle(2, ranks=("127.0.0.1:5600", "10.0.0.7:5601"))
    with pytest.raises(HandleAuthError, match=r"10\.0\.0\.7"):
        KVHandle.from_kv_transfer_params(remote.to_kv_transfer_params(local), local)
    assert parse_handle(remote.to_kv_transfer_params(SECRET), secret=SECRET) == remote  # a deployment secret may


# --------------------------------------------------------------------------------------- real transfers
H4 = Model(num_kv_heads=4, seed=41)
H2 = Model(num_kv_heads=2, seed=42)  # GQA: fewer KV heads than the owner's 4 ranks
GROUPS = [(H4, 1), (H4, 2), (H2, 4), (H4, 2)]  # the last pair is killed by one test


class ReaderRank:
    """One reader rank: a TransferEngine over a poisoned shard and a ReuseReader at its rank."""

    def __init__(self, model: Model, tp_size: int, rank: int) -> None:
        from kvshuttle.core.layout import CacheKind, PagedKVCache
        from kvshuttle.reuse import ReuseReader
        from kvshuttle.transfer import EngineConfig, TransferEngine

        self.model, self.tp_size, self.rank = model, tp_size, rank
        self.heads = rank_heads(model.num_kv_heads, tp_size, rank)
        self.layers: Layers = poisoned_shard(model, len(self.heads))
        self.engine = TransferEngine(PagedKVCache.from_arrays(self.layers, CacheKind.FLASH_ATTN),
                                     EngineConfig(secret=SECRET))
        self.reader = ReuseReader(self.engine, PolicyConfig(threshold_tokens=16), timeout_s=10.0, tp_rank=rank,
                                  tp_size=tp_size, num_kv_heads=model.num_kv_heads)

    def poison(self) -> None:
        for layer in self.layers:
            layer[:] = POISON

    def close(self) -> None:
        self.reader.close()
        self.engine.close()


@pytest.fixture(scope="module")
def owners() -> Iterator[list[list[OwnerRank]]]:
    pytest.importorskip("nixl._api")
    groups = start_owner_groups(GROUPS)
    try:
        yield groups
    finally:
        close_all(groups)


@pytest.fixture(scope="module")
def readers() -> Iterator[dict[tuple[int, int], list[ReaderRank]]]:
    pytest.importorskip("nixl._api")
    made: dict[tuple[int, int], list[ReaderRank]] = {}
    try:
        for model, tp in ((H4, 1), (H4, 2), (H2, 1), (H2, 2)):
            made[(model.num_kv_heads, tp)] = [ReaderRank(model, tp, r) for r in range(tp)]
        yield made
    finally:
        for group in made.values():
            for rank in group:
                rank.close()


class Turn:
    """One retained turn: the same handle retained on every owner rank, signed and on the wire."""

    def __init__(self, group: list[OwnerRank], seed: int, mode: str | None = None) -> None:
        model = group[0].model
        rng = np.random.default_rng(seed)
        self.tokens = [int(t) for t in rng.integers(1, 32_000, size=4 * model.block_size)]
        self.prompt = self.tokens + [7] * 5
        self.remote_ids = tuple(int(b) for b in rng.permutation(model.num_blocks)[:4])
        digests = tuple(block_digests(self.tokens, model.block_size))
        handle_id = secrets.token_urlsafe(18)
        ranks = tuple(o.address for o in group) if len(group) > 1 else ()
        for owner in group:
            owner.call("retain", request_id=f"req-{seed}", block_ids=list(self.remote_ids), digests=list(digests),
                       num_tokens=len(self.tokens), handle_id=handle_id, mode=mode, ranks=list(ranks))
        host, port = group[0].address.rsplit(":", 1)
        now = time.time()
        self.handle = KVHandle("owner", f"req-{seed}", host, int(port), self.remote_ids, len(self.tokens), now + 300,
                               len(group), handle_id, 0, model.block_size, digests, now, 300.0, ranks)
        self.params = self.handle.to_kv_transfer_params(SECRET)
        self.model = model
        self.rng = rng

    def read(self, reader: ReaderRank) -> tuple[Any, np.ndarray[Any, Any]]:
        reader.poison()
        table = self.rng.permutation(self.model.num_blocks)[:5].astype(np.int64)  # scattered local blocks
        result = reader.reader.read(self.params, self.prompt, local_hit_tokens=0, local_block_ids=table)
        return result, table


def holds_its_slice(reader: ReaderRank, table: np.ndarray[Any, Any], remote_ids: tuple[int, ...]) -> None:
    """The read blocks hold exactly this rank's heads of the global cache; every other block is still poison."""
    want = global_layers(reader.model)
    lids, others = table[:len(remote_ids)], np.setdiff1d(np.arange(reader.model.num_blocks), table[:len(remote_ids)])
    h = reader.heads
    for got, full in zip(reader.layers, want, strict=True):
        assert np.array_equal(got[:, lids], full[:, list(remote_ids)][:, :, :, h.start:h.stop]), \
            f"reader rank {reader.rank} of TP={reader.tp_size}: read heads differ from the owner's"
        assert (got[:, others] == POISON).all(), "a block outside the read was written"


def untouched(reader: ReaderRank) -> bool:
    return all(bool((layer == POISON).all()) for layer in reader.layers)


def no_open_claims(group: list[OwnerRank], skip: int | None = None) -> None:
    for owner in group:
        if owner.rank != skip:
            metrics = owner.call("metrics")
            assert (metrics["claims_in_flight"], metrics["pinned_blocks"]) == (0, 0), (owner.rank, metrics)


@pytest.mark.parametrize("owner_index, reader_key, slices", [
    (1, (4, 1), [2]),  # owner TP=2 -> reader TP=1: two slices of 2 heads from two ranks
    (0, (4, 2), [1, 1]),  # owner TP=1 -> reader TP=2: each reader rank reads its half from the one owner
    (1, (4, 2), [1, 1]),  # owner TP=2 -> reader TP=2: direct pairing, whole identical shards
    (2, (2, 1), [2]),  # GQA, 2 KV heads, owner TP=4 (replicated) -> reader TP=1: ranks 0 and 2
    (2, (2, 2), [1, 1]),  # GQA -> reader TP=2: reader rank 0 from owner rank 0, reader rank 1 from owner rank 3
], ids=["tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2", "gqa-tp4-to-tp1", "gqa-tp4-to-tp2"])
def test_reader_ranks_read_their_heads_byte_for_byte(owners: list[list[OwnerRank]],
                                                     readers: dict[tuple[int, int], list[ReaderRank]],
                                                     owner_index: int, reader_key: tuple[int, int],
                                                     slices: list[int]) -> None:
    group = owners[owner_index]
    turn = Turn(group, seed=100 + owner_index * 10 + reader_key[1])
    for reader, count in zip(readers[reader_key], slices, strict=True):
        result, table = turn.read(reader)
        assert result.action == "fetched" and result.fetched_tokens == len(turn.tokens), result.message
        assert result.invalid_block_ids == ()
        holds_its_slice(reader, table, turn.remote_ids)
        shard_bytes = 4 * B * 2 * len(reader.heads) * reader.model.head_size * 2 * reader.model.layers
        assert result.bytes == shard_bytes, result.telemetry  # its own heads, each once
        assert (result.telemetry is not None and result.telemetry.reason.startswith("2 head slices")) == (count == 2)
    no_open_claims(group)


def handle_state(group: list[OwnerRank]) -> list[tuple[int, int, int]]:
    """Per owner rank: (live handles, consumed, hits)."""
    return [(m["live_handles"], m["consumed"], m["hits"]) for m in (o.call("metrics") for o in group)]


def test_use_once_at_owner_tp1_waits_for_both_reader_ranks_of_tp2(
        owners: list[list[OwnerRank]], readers: dict[tuple[int, int], list[ReaderRank]]) -> None:
    """Both reader ranks of a TP=2 reader read owner rank 0 of a TP=1 owner, at the same time: each claim says 2
    readers, so the use-once handle takes both and is consumed after the second completed read, not the first."""
    group, pair = owners[0], readers[(4, 2)]
    turn = Turn(group, seed=401, mode="use_once")
    (live, consumed, hits), = handle_state(group)  # after the retain (it may supersede older turns' handles)
    tables = [turn.rng.permutation(turn.model.num_blocks)[:5].astype(np.int64) for _ in pair]
    results: list[Any] = [None, None]

    def read(k: int) -> None:
        results[k] = pair[k].reader.read(turn.params, turn.prompt, local_hit_tokens=0, local_block_ids=tables[k])

    for rank in pair:
        rank.poison()
    threads = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rank, result, table in zip(pair, results, tables, strict=True):
        assert result is not None and result.action == "fetched", getattr(result, "message", "no result")
        holds_its_slice(rank, table, turn.remote_ids)
    assert handle_state(group) == [(live - 1, consumed + 1, hits + 2)]  # consumed once, by two completed reads
    no_open_claims(group)
    again, table = turn.read(pair[0])
    assert (again.action, again.reason) == ("recompute", "claim_refused"), again.message
    assert again.owner_reason == "HandleConsumedError" and again.invalid_block_ids == tuple(table[:4].tolist())
    assert untouched(pair[0])


def test_use_once_at_owner_tp1_stays_for_the_second_reader_rank(
        owners: list[list[OwnerRank]], readers: dict[tuple[int, int], list[ReaderRank]]) -> None:
    """One after the other: the first reader rank's read leaves the handle live for the second."""
    group, pair = owners[0], readers[(4, 2)]
    turn = Turn(group, seed=402, mode="use_once")
    (live, consumed, _), = handle_state(group)
    for k, rank in enumerate(pair):
        result, table = turn.read(rank)
        assert result.action == "fetched", result.message
        holds_its_slice(rank, table, turn.remote_ids)
        assert handle_state(group)[0][:2] == ((live, consumed) if k == 0 else (live - 1, consumed + 1))
    third, _ = turn.read(pair[1])
    assert third.reason == "claim_refused" and third.owner_reason == "HandleConsumedError", third.message
    no_open_claims(group)


def test_use_once_at_owner_tp2_is_consumed_on_each_rank_by_a_tp1_reader(
        owners: list[list[OwnerRank]], readers: dict[tuple[int, int], list[ReaderRank]]) -> None:
    group, reader = owners[1], readers[(4, 1)][0]  # one reader rank reads both owner ranks: 1 reader each
    turn = Turn(group, seed=403, mode="use_once")
    before = handle_state(group)
    result, table = turn.read(reader)
    assert result.action == "fetched", result.message
    holds_its_slice(reader, table, turn.remote_ids)
    assert handle_state(group) == [(live - 1, consumed + 1, hits + 1) for live, consumed, hits in before]
    again, table = turn.read(reader)
    assert again.reason == "claim_refused" and again.owner_reason == "HandleConsumedError", again.message
    assert again.invalid_block_ids == tuple(table[:4].tolist()) and untouched(reader)
    no_open_claims(group)


def test_released_on_one_rank_recomputes_and_releases_the_other_claims(
        owners: list[list[OwnerRank]], readers: dict[tuple[int, int], list[ReaderRank]]) -> None:
    group = owners[1]  # owner TP=2
    turn = Turn(group, seed=201)
    assert group[1].call("release", handle_id=turn.handle.handle_id)
    reader = readers[(4, 1)][0]  # reads from both ranks: rank 0's claim is granted, rank 1's refused
    aborts = group[0].call("metrics")["aborts"]
    result, table = turn.read(reader)
    assert (result.action, result.reason, result.fetched_tokens) == ("recompute", "claim_refused", 0)
    assert "owner rank 1" in result.message and result.owner_reason == "HandleReleasedError"
    assert result.invalid_block_ids == tuple(table[:4].tolist())  # every local target block
    assert untouched(reader)
    no_open_claims(group)  # rank 0 unpinned at once: its claim was finished with ok=False
    assert group[0].call("metrics")["aborts"] == aborts + 1
    paired = readers[(4, 2)]  # direct pairing: only reader rank 1 involves owner rank 1
    assert turn.read(paired[0])[0].action == "fetched"
    failed, table = turn.read(paired[1])
    assert failed.reason == "claim_refused" and failed.invalid_block_ids == tuple(table[:4].tolist())
    no_open_claims(group)


def test_killed_rank_recomputes_everywhere_and_the_other_claims_are_released(
        owners: list[list[OwnerRank]], readers: dict[tuple[int, int], list[ReaderRank]]) -> None:
    group = owners[3]  # a TP=2 owner of its own
    turn = Turn(group, seed=301)
    reader = readers[(4, 1)][0]
    first, table = turn.read(reader)
    assert first.action == "fetched"
    holds_its_slice(reader, table, turn.remote_ids)
    group[1].kill()  # between turns
    aborts = group[0].call("metrics")["aborts"]
    start = time.monotonic()
    lost, table = turn.read(reader)
    assert lost.action == "recompute" and lost.reason in ("peer_lost", "peer_unreachable"), lost.message
    assert "owner rank 1" in lost.message
    assert lost.invalid_block_ids == tuple(table[:4].tolist())
    assert untouched(reader) and time.monotonic() - start < 3.0
    no_open_claims(group, skip=1)  # rank 0 granted a claim, then was told the read failed
    assert group[0].call("metrics")["aborts"] == aborts + 1
    again, _ = turn.read(reader)
    assert again.reason == "peer_cooling_down" and "owner rank 1" in again.message  # per-rank circuit breaker
    no_open_claims(group, skip=1)


def test_rank_mapping_failures_recompute_with_a_reason(readers: dict[tuple[int, int], list[ReaderRank]]) -> None:
    reader = readers[(4, 2)][0]
    reader.poison()
    prompt, table = [*TOKENS, 9], np.arange(5)
    uneven = tp_handle(3)  # 4 KV heads cannot be split over 3 owner ranks: nothing is connected or written
    unlisted = tp_handle(2, ranks=())  # TP=2 without kvshuttle_ranks: no rank to read from
    for handle in (uneven, unlisted):
        result = reader.reader.read(handle.to_kv_transfer_params(SECRET), prompt, local_hit_tokens=0,
                                    local_block_ids=table)
        assert (result.action, result.reason, result.invalid_block_ids) == ("recompute", "rank_mapping", ()), \
            result.message
    assert untouched(reader)


def test_rank_arguments_are_checked(readers: dict[tuple[int, int], list[ReaderRank]]) -> None:
    from kvshuttle.reuse import ReuseArgumentError, ReuseReader

    two_heads = readers[(4, 2)][0].engine  # a shard of 2 of 4 heads
    ok = ReuseReader(two_heads, tp_rank=1, tp_size=2, num_kv_heads=4)
    assert (ok.tp_rank, ok.tp_size, ok.num_kv_heads) == (1, 2, 4)
    assert ReuseReader(readers[(4, 1)][0].engine).num_kv_heads == 4  # TP=1: every head of its shard
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tp_size": 2}, "num_kv_heads"),
        ({"tp_size": 2, "tp_rank": 2, "num_kv_heads": 4}, "tp_rank"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": True, "num_kv_heads": 4}, "tp_size"),
        ({"tp_size": 2, "tp_rank": -1, "num_kv_heads": 4}, "tp_rank"),
        ({"tp_size": 3, "num_kv_heads": 4}, "evenly"),
        ({"tp_size": 2, "num_kv_heads": 0}, "KV heads"),
        ({"tp_size": 1, "num_kv_heads": 4}, "shard has 2"),  # TP=1 holds all 4
        ({"tp_size": 2, "num_kv_heads": 2}, "shard has 2"),  # rank 0 of TP=2 holds 1 of 2
    ]
    for kwargs, match in cases:
        with pytest.raises(ReuseArgumentError, match=match):
            ReuseReader(two_heads, **kwargs)


def test_renewal_and_release_reach_every_owner_rank(owners: list[list[OwnerRank]],
                                                    readers: dict[tuple[int, int], list[ReaderRank]]) -> None:
    """Each owner rank holds its own retention: a renewal that reached rank 0 alone would let rank 1 expire (and
    with it the handle), a release on rank 0 alone would leave rank 1 holding the blocks."""
    from kvshuttle.transfer import release_retention, renew_retention
    from kvshuttle.transfer.control import ask_release, connect

    group = owners[1]  # TP=2
    reader = readers[(4, 1)][0].reader

    def expiries(turn: Turn) -> list[Any]:
        return [owner.call("expiry", handle_id=turn.handle.handle_id) for owner in group]

    for seed, (renew, release) in enumerate((
            (reader.renew, reader.release),  # a reader's calls, over its connected peers
            (lambda p, ttl_s: renew_retention(p, ttl_s=ttl_s, secret=SECRET),  # a router's
             lambda p: release_retention(p, secret=SECRET)))):
        turn = Turn(group, seed=900 + seed)
        before = expiries(turn)
        renewed = renew(turn.params, ttl_s=1000.0)
        assert renewed is not None
        handle = KVHandle.from_kv_transfer_params(renewed, SECRET)  # still signed, still naming every rank
        assert handle.ranks == turn.handle.ranks and handle.tp_size == 2 and handle.handle_id == turn.handle.handle_id
        after = expiries(turn)
        assert all(a > b + 500 for a, b in zip(after, before, strict=True)), (before, after)
        assert release(renewed) is True
        assert expiries(turn) == [None, None]
        assert release(renewed) is False
    # a rank that lost the handle: the renewal says so (None) instead of renewing a handle no reader can use
    turn = Turn(group, seed=990)
    conn = connect(f"tcp://{group[1].address}", SECRET)
    try:
        assert ask_release(conn, turn.handle, 5.0) is True
    finally:
        conn.close()
    assert renew_retention(turn.params, ttl_s=1000.0, secret=SECRET) is None
    assert release_retention(turn.params, secret=SECRET) is True  # rank 0 still held it
    assert expiries(turn) == [None, None]
