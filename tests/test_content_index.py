"""The content index (issue 34): the same contract for the memory and the Redis backend (a real redis-server),
then what only one of them has (Redis down or slow, values written by someone else, the memory bounds)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from kvshuttle.policy.digests import PromptDigests, block_digests
from kvshuttle.policy.kv_handle import KVHandle
from kvshuttle.retention.index import (
    MAX_POSITIONS,
    ContentIndex,
    IndexArgumentError,
    MemoryContentIndex,
    MemoryTable,
    positions,
)
from kvshuttle.trust import DeploymentSecret

pytest_plugins = ["router_fixtures"]  # redis_server

SECRET = DeploymentSecret(b"content-index-test-secret-0123456789abcdef")
B = 16
Make = Callable[..., ContentIndex]


@pytest.fixture(params=["memory", "redis"])
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """make(publisher="", secret=SECRET, **options): index clients sharing one table (one redis-server)."""
    made: list[ContentIndex] = []
    if request.param == "memory":
        table = MemoryTable()  # one host's: every client of the test shares it

        def new(publisher: str = "", secret: DeploymentSecret = SECRET, **options: Any) -> ContentIndex:
            for bound in ("max_entries", "max_per_scope", "max_per_publisher"):
                if bound in options:
                    setattr(table, bound, options.pop(bound))
            index = MemoryContentIndex(secret, publisher, table=table, **options)
            made.append(index)
            return index
    else:
        server = request.getfixturevalue("redis_server")
        from kvshuttle.retention.index import RedisContentIndex

        def new(publisher: str = "", secret: DeploymentSecret = SECRET, **options: Any) -> ContentIndex:
            options.pop("max_entries", None)
            options.pop("max_per_scope", None)
            index = RedisContentIndex(server.url, secret, publisher, timeout_s=1.0, **options)
            made.append(index)
            return index
    yield new
    for index in made:
        index.close()


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50_000 for i in range(n)]


def chain(toks: list[int], salt: bytes = b"") -> list[bytes]:
    return block_digests(toks, B, extra_key=salt, include_partial=False)


def params(handle_id: str, reads: str = "multi_read") -> dict[str, Any]:
    return {"kvshuttle_handle_id": handle_id, "kvshuttle_reads": reads, "remote_block_ids": [1, 2, 3]}


def decode(make: Make, address: str = "127.0.0.1:5600", **options: Any) -> ContentIndex:
    index = make(address, **options)
    index.start()
    return index


def later(s: float = 60.0) -> float:
    return time.time() + s


def test_longest_prefix_among_several_retentions(make: Make) -> None:
    d, p = decode(make), make()
    base = tokens(1, 300 * B)
    for name, blocks in (("short", 40), ("long", 300), ("mid", 100)):
        assert d.publish("t", chain(base[:blocks * B]), params(name), later())
    prompt = base[:200 * B] + tokens(9, 50 * B)  # diverges after block 199: only "long" holds 192 blocks
    match = p.lookup("t", PromptDigests.from_tokens(prompt, B))
    assert match is not None and match.handle_id == "long" and match.blocks == 192
    assert match.params == params("long")
    other = p.lookup("t", chain(base[:70 * B] + tokens(8, 10 * B)))  # 64 blocks held by "mid" and "long"
    assert other is not None and other.handle_id in ("mid", "long") and other.blocks == 64
    assert p.lookup("t", chain(tokens(5, 300 * B))) is None  # nothing shared: a miss


def test_a_shared_preamble_is_found_by_many_prompts(make: Make) -> None:
    d, p = decode(make), make()
    preamble = tokens(2, 64 * B)
    assert d.publish("t", chain(preamble + tokens(3, 40 * B)), params("shared"), later())
    for seed in range(10, 30):
        match = p.lookup("t", chain(preamble + tokens(seed, (5 + seed) * B)))
        assert match is not None and (match.handle_id, match.blocks) == ("shared", 64)


def test_a_use_once_retention_does_not_take_a_shared_key_from_a_multi_read_one(make: Make) -> None:
    d, p = decode(make), make()
    preamble = tokens(2, 64 * B)
    assert d.publish("t", chain(preamble + tokens(3, 8 * B)), params("many"), later(30))
    assert d.publish("t", chain(preamble + tokens(4, 8 * B)), params("once", "use_once"), later(60))
    match = p.lookup("t", chain(preamble + tokens(5, 8 * B)))
    assert match is not None and match.handle_id == "many"
    own = p.lookup("t", chain(preamble + tokens(4, 8 * B)))  # its own last block still names it
    assert own is not None and own.handle_id == "once"


def test_scopes_never_match_each_other_and_keys_reveal_nothing(make: Make) -> None:
    d, p = decode(make), make()
    digests = chain(tokens(6, 64 * B))
    assert d.publish("tenant-a", digests, params("a"), later())
    assert p.lookup("tenant-b", digests) is None
    assert p.lookup("", digests) is None
    assert p.lookup("tenant-a", digests) is not None
    stranger = make(secret=DeploymentSecret(b"another-deployment-secret-0123456789abcdef"))
    assert stranger.lookup("tenant-a", digests) is None  # without the secret: other keys, nothing found
    names = d.names  # type: ignore[attr-defined]
    at = positions(len(digests), 32)
    mine = names.digest_keys("tenant-a", digests, at)
    assert not set(mine) & set(names.digest_keys("tenant-b", digests, at))
    assert not set(mine) & set(stranger.names.digest_keys("tenant-a", digests, at))  # type: ignore[attr-defined]
    for key in mine:  # neither the digest nor the scope appears in a key
        assert all(dg.hex() not in key for dg in digests) and "tenant" not in key


def test_withdrawn_and_expired_retentions_are_not_found(make: Make) -> None:
    d, p = decode(make), make()
    kept, gone, brief = (chain(tokens(s, 40 * B)) for s in (11, 12, 13))
    assert d.publish("t", kept, params("kept"), later())
    assert d.publish("t", gone, params("gone"), later())
    assert d.publish("t", brief, params("brief"), later(0.3))
    assert d.withdraw("gone") and not d.withdraw("gone")
    assert p.lookup("t", gone) is None
    assert p.lookup("t", brief) is not None
    time.sleep(0.4)
    assert p.lookup("t", brief) is None
    assert p.lookup("t", kept) is not None
    assert not d.publish("t", kept, params("past"), time.time() - 1)  # already ended: never indexed


def test_a_restarted_decode_is_not_found_through_its_dead_incarnation(make: Make) -> None:
    old, p = decode(make), make()
    base = tokens(20, 300 * B)
    assert old.publish("t", chain(base), params("dead-deep"), later())
    new = decode(make)  # the same address, restarted
    assert p.lookup("t", chain(base)) is None
    assert not old.publish("t", chain(base), params("zombie"), later())  # a dead incarnation publishes nothing
    assert new.publish("t", chain(base[:50 * B]), params("live"), later())
    match = p.lookup("t", chain(base))
    assert match is not None and match.handle_id == "live"
    other = decode(make, "127.0.0.1:5601")  # another decode's start leaves this one's entries alone
    assert other.publish("t", chain(tokens(21, 40 * B)), params("other"), later())
    assert p.lookup("t", chain(base)) is not None


def test_the_publisher_cap_evicts_its_own_oldest(make: Make) -> None:
    d, noisy, p = decode(make, max_per_publisher=3), decode(make, "127.0.0.1:5601", max_per_publisher=3), make()
    quiet = chain(tokens(30, 40 * B))
    assert d.publish("t", quiet, params("quiet"), later())
    for k in range(4):
        noisy.publish("t", chain(tokens(40 + k, 40 * B)), params(f"n{k}"), later(60 + k))
    assert p.lookup("t", chain(tokens(40, 40 * B))) is None  # the flooder lost its own first one
    assert all(p.lookup("t", chain(tokens(40 + k, 40 * B))) is not None for k in (1, 2, 3))
    assert p.lookup("t", quiet) is not None


def test_a_lookup_asks_a_bounded_number_of_digests(make: Make) -> None:
    assert len(positions(1_000_000, 32)) == MAX_POSITIONS and len(positions(100, 1)) == 100
    assert positions(1_000_000, 32)[-1] == 999_999
    d, p = decode(make), make()
    long = [bytes([k % 251, k // 251 % 251, 7]) * 6 for k in range(40_000)]  # a 640k-token chain of digests
    assert d.publish("t", long, params("long"), later())
    match = p.lookup("t", long)
    assert match is not None and match.blocks == 40_000


def test_a_signed_handle_comes_back_verifiable(make: Make) -> None:
    d, p = decode(make), make()
    salt = b"model\0tenant-salt"
    digests = chain(tokens(50, 64 * B), salt)
    handle = KVHandle(engine_id="decode-0", request_id="r", host="127.0.0.1", port=5600,
                      block_ids=tuple(range(64)), num_tokens=64 * B, expiry_time=later(), tp_size=1,
                      handle_id="h-signed", generation=3, block_size=B, digests=tuple(digests),
                      issued_at=time.time(), ttl_s=60.0)
    assert d.publish("t", digests, handle.to_kv_transfer_params(SECRET), handle.expiry_time)
    match = p.lookup("t", PromptDigests.from_tokens(tokens(50, 64 * B) + [1] * 40, B, extra_key=salt))
    assert match is not None and KVHandle.from_kv_transfer_params(match.params, SECRET) == handle


def test_bad_input_is_a_named_error(make: Make) -> None:
    d, p = decode(make), make()
    digests = chain(tokens(60, 8 * B))
    with pytest.raises(IndexArgumentError):
        p.lookup(7, digests)  # type: ignore[arg-type]
    with pytest.raises(IndexArgumentError):
        p.lookup("t", b"not a chain")  # type: ignore[arg-type]
    with pytest.raises(IndexArgumentError):
        p.lookup("t", ["not bytes"] * 3)  # type: ignore[list-item]
    with pytest.raises(IndexArgumentError):
        d.publish("t", digests, {"kvshuttle_reads": "multi_read"}, later())
    with pytest.raises(IndexArgumentError):
        d.publish("t", digests, params("x"), float("nan"))
    with pytest.raises(IndexArgumentError):
        make("127.0.0.1:5602").publish("t", digests, params("x"), later())  # not started
    with pytest.raises(IndexArgumentError):
        p.start()  # a reader has no incarnation
    with pytest.raises(IndexArgumentError):
        make(stride=0)


# -- memory only -------------------------------------------------------------------------------------------------
def test_memory_bounds_evict_the_least_recently_used() -> None:
    table = MemoryTable(max_entries=4, max_per_scope=2, max_per_publisher=10)
    d = MemoryContentIndex(SECRET, "127.0.0.1:5600", table=table)
    d.start()
    chains = [chain(tokens(70 + k, 40 * B)) for k in range(5)]
    assert d.publish("a", chains[0], params("a0"), later())
    assert d.publish("a", chains[1], params("a1"), later())
    assert d.lookup("a", chains[0]) is not None  # a0 is used: a1 is now the scope's least recent
    assert d.publish("a", chains[2], params("a2"), later())
    assert d.lookup("a", chains[1]) is None and d.lookup("a", chains[0]) is not None
    for k in (3, 4):
        assert d.publish(f"s{k}", chains[k], params(f"s{k}"), later())
    assert d.stats()["records"] == 4
    assert d.publish("s5", chain(tokens(80, 40 * B)), params("s5"), later())
    assert d.lookup("a", chains[2]) is None  # the least recently used overall went
    assert d.stats()["records"] == 4 and d.stats()["evicted"] == 2
    assert d.stats()["digest_keys"] <= 4 * len(positions(40, 32))  # evicted records took their keys along


def test_memory_refuses_an_oversized_record() -> None:
    d = MemoryContentIndex(SECRET, "127.0.0.1:5600", table=MemoryTable(max_record_bytes=1000))
    d.start()
    assert not d.publish("t", chain(tokens(90, 8 * B)), {**params("big"), "pad": "x" * 2000}, later())
    assert d.stats()["refused"] == 1


# -- redis only --------------------------------------------------------------------------------------------------
def test_redis_down_answers_nothing_fast() -> None:
    from kvshuttle.retention.index import RedisContentIndex

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    index = RedisContentIndex(f"redis://127.0.0.1:{port}/0", SECRET, timeout_s=0.05, backoff_s=30.0)
    digests = chain(tokens(100, 40 * B))
    started = time.perf_counter()
    assert all(index.lookup("t", digests) is None for _ in range(5))
    assert time.perf_counter() - started < 1.0
    stats = index.stats()
    assert stats["errors"] == 3 and stats["skipped_down"] == 2  # tripped after 3: then not even tried


def test_redis_that_does_not_answer_times_out() -> None:
    from kvshuttle.retention.index import RedisContentIndex

    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        index = RedisContentIndex(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", SECRET, timeout_s=0.05)
        started = time.perf_counter()
        assert index.lookup("t", chain(tokens(101, 40 * B))) is None
        assert time.perf_counter() - started < 0.5
        assert index.stats()["errors"] == 1
        index.close()


def test_redis_values_written_by_others_are_ignored(redis_server: Any) -> None:
    import redis

    from kvshuttle.retention.index import RedisContentIndex

    d = RedisContentIndex(redis_server.url, SECRET, "127.0.0.1:5600")
    d.start()
    p = RedisContentIndex(redis_server.url, SECRET, timeout_s=1.0)
    raw = redis.Redis.from_url(redis_server.url)
    digests = chain(tokens(110, 64 * B))
    assert d.publish("t", digests, params("victim"), later())
    records = raw.keys("kvshuttle:ci:r:*")
    assert len(records) == 1
    good = raw.get(records[0])
    assert isinstance(good, bytes)
    record = msgpack.unpackb(good)
    foreign = msgpack.packb({**record, "scope": "0" + record["scope"]})
    as_json = json.dumps({**record, "v": 1, "params": {**record["params"], "kvshuttle_digests": ""}}).encode()
    deep = msgpack.packb({**record, "params": {**record["params"], "remote_block_ids": [[[[1]]]] * 10_000}})
    for bad in (b"not msgpack \xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 2, "params": {}}), b"x" * (2 << 20),
                foreign, as_json, deep):
        raw.set(records[0], bad)
        assert p.lookup("t", digests) is None
    raw.set(records[0], good)
    found = p.lookup("t", digests)
    assert found is not None and found.params == params("victim")  # every field as published
    for key in raw.keys("kvshuttle:ci:p:*"):
        raw.set(key, b"garbage|pointer")
    assert p.lookup("t", digests) is None
    assert p.stats()["malformed"] == 7 and p.stats()["errors"] == 0


def test_redis_skips_a_dead_incarnation_whose_records_survived(redis_server: Any) -> None:
    import redis

    from kvshuttle.retention.index import RedisContentIndex

    raw = redis.Redis.from_url(redis_server.url)
    old = RedisContentIndex(redis_server.url, SECRET, "127.0.0.1:5600")
    old.start()
    base = tokens(120, 300 * B)
    assert old.publish("t", chain(base), params("dead"), later())
    raw.delete(*raw.keys("kvshuttle:ci:l:*"))  # its live set lost: start() cannot delete its records
    new = RedisContentIndex(redis_server.url, SECRET, "127.0.0.1:5600")
    new.start()
    assert new.publish("t", chain(base[:40 * B]), params("live"), later())
    p = RedisContentIndex(redis_server.url, SECRET)
    match = p.lookup("t", chain(base))
    assert match is not None and match.handle_id == "live"  # the deeper, dead one is skipped
    assert p.stats()["stale_skipped"] > 0


def test_the_bench_runs_small_and_prints_the_schema() -> None:
    import argparse
    import shutil

    from kvshuttle.bench import index as bench
    from kvshuttle.bench import schema

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--retentions", "300", "--lookups", "30", "--probes", "30",
                                          "--strides", "16,64"]))
    schema.check(result)
    assert bench.format_table(result)
    rows = result["results"]
    assert [r["case"] for r in rows if r["stride"] == 64] == ["publish", "next_turn_mix", "next_turn_70k",
                                                              "preamble_1k", "miss_2k", "miss_70k"]
    for row in rows:
        assert row["verified"] is True and row["rounds"] >= 1 and all(v > 0 for v in row["seconds"].values())
        assert sorted(k for k in row if "_vs_" in k) == sorted(row.get("ratio_spread", {}))
    publish = {r["stride"]: r["keys_per_retention"] for r in rows if r["case"] == "publish"}
    assert publish[16] > publish[64]  # a sparser chain publishes fewer keys
