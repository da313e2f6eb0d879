"""Reuse found by content on the connector's scheduler side (integrations/vllm/content_lookups.py): a decode publishes
the retentions it issues, and a request that reaches the prefill with no handle finds the longest one by its prompt's
digests, off the scheduling thread, bounded in time, scoped by its cache_salt. The index is the in-process one over a
shared table (the Redis one keeps the same contract: tests/test_content_index.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.content_lookups import PENDING, ContentLookups
from kvshuttle.integrations.vllm.metadata import ShuttleHandshake
from kvshuttle.integrations.vllm.scheduler import ShuttleScheduler
from kvshuttle.retention.index import MemoryContentIndex, MemoryTable
from test_vllm_scheduler import BS, SECRET, granted, request, words


def lookups(table: MemoryTable, **kwargs: Any) -> ContentLookups:
    return ContentLookups(MemoryContentIndex(SECRET, table=table), BS,
                          make_publisher=lambda address: MemoryContentIndex(SECRET, address, table=table), **kwargs)


def engine(table: MemoryTable, port: int, extra: dict[str, Any] | None = None, **kwargs: Any) -> ShuttleScheduler:
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **(extra or {})}, model="m")
    s = ShuttleScheduler(config, f"eng-{port}", BS, secret=SECRET, cache_dtype="bfloat16")
    s.lookups = lookups(table, **kwargs)
    s.address = ShuttleHandshake("127.0.0.1", port)
    until(lambda: s.lookups is not None and s.lookups.publisher is not None)
    return s


def until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def finish_decode(s: ShuttleScheduler, rid: str, tokens: list[int], salt: str | None = None) -> dict[str, Any]:
    """A decode request that finished holding ``tokens``; returns its params once they are indexed."""
    req = request(rid, tokens[:-8], granted({"remote_engine_id": "p"}), output=tokens[-8:])
    req.cache_salt = salt
    keep, params = s.request_finished(req, [list(range(100, 100 + -(-(len(tokens) - 1) // BS)))])
    assert keep and params is not None
    assert s.lookups is not None
    until(lambda: s.lookups is not None and s.lookups._queued == 0)
    return params


def ask(s: ShuttleScheduler, req: SimpleNamespace) -> tuple[int | None, bool]:
    """vLLM's loop: ask every step until the answer is not "not yet"."""
    for _ in range(1000):
        answer = s.get_num_new_matched_tokens(req, 0)
        if answer[0] is not None:
            return answer
        time.sleep(0.002)
    raise AssertionError("never answered")


def test_a_request_without_a_handle_reads_the_longest_retained_prefix_of_its_prompt() -> None:
    table = MemoryTable()
    short_decode, long_decode, prefill = engine(table, 5701), engine(table, 5702), engine(table, 5703)
    history = words(600)
    finish_decode(short_decode, "d-short", history[:200])
    params = finish_decode(long_decode, "d-long", history)
    prompt = history + words(40, seed=1)
    req = request("p1", prompt, None)  # no params at all: vLLM's own proxy, a load balancer, a lost key
    assert prefill.get_num_new_matched_tokens(req, 0) == (None, False)  # not yet: vLLM skips it this step
    assert ask(prefill, req) == (599, True)  # the decode holding the longest prefix, every block verified
    prefill.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(range(40)),)), 599)
    (load,) = prefill.build_connector_meta().loads
    assert load.handle.handle_id == params["kvshuttle_handle_id"] and load.handle.port == 5702
    assert prefill.get_num_new_matched_tokens(req, 0) == (0, False)  # loaded once, even after a preemption
    assert prefill.take_stats().data["decision.index.lookup_hit"] == 1


def test_an_edited_prompt_reads_only_what_verifies_and_an_unknown_one_recomputes() -> None:
    table = MemoryTable()
    decode, prefill = engine(table, 5711), engine(table, 5712)
    history = words(600)
    finish_decode(decode, "d1", history)
    edited = list(history)
    edited[100] = (edited[100] + 1) % 30000  # block 3 of 32-token blocks
    assert ask(prefill, request("p-edit", [*edited, 1], None)) == (96, True)
    assert ask(prefill, request("p-new", words(300, seed=9), None)) == (0, False)
    counts = prefill.take_stats().data
    assert counts["decision.index.lookup_miss"] == 1


def test_a_tenants_prompt_never_finds_another_tenants_retention() -> None:
    table = MemoryTable()
    decode, prefill = engine(table, 5721), engine(table, 5722)
    history = words(400)
    finish_decode(decode, "d-a", history, salt="tenant-a")
    other = request("p-b", [*history, 1], None)
    other.cache_salt = "tenant-b"
    assert ask(prefill, other) == (0, False)
    same = request("p-a", [*history, 1], None)
    same.cache_salt = "tenant-a"
    assert ask(prefill, same) == (399, True)


def test_a_slow_index_costs_at_most_the_wait_then_the_request_recomputes() -> None:
    class Stuck(MemoryContentIndex):
        def lookup(self, scope: str, prompt: Any) -> Any:
            gate.wait(5)
            return None

    gate = threading.Event()
    prefill = engine(MemoryTable(), 5731, wait_s=0.05)
    assert prefill.lookups is not None
    prefill.lookups.index = Stuck(SECRET)
    try:
        started = time.monotonic()
        assert ask(prefill, request("p", words(300), None)) == (0, False)
        assert time.monotonic() - started < 1.0
        assert prefill.take_stats().data["decision.index.lookup_timeout"] == 1
    finally:
        gate.set()


def test_an_ended_retention_is_withdrawn_and_no_longer_found() -> None:
    table = MemoryTable()
    decode, prefill = engine(table, 5741), engine(table, 5742)
    history = words(300)
    finish_decode(decode, "d1", history)
    decode.update_connector_output({"d1"}, None)  # the worker freed its blocks: the retention ended
    until(lambda: decode.lookups is not None and decode.lookups._queued == 0)
    assert ask(prefill, request("p", [*history, 1], None)) == (0, False)


def test_a_retention_demoted_to_the_host_tier_stays_found_until_it_ends() -> None:
    """With a host tier, the worker reports a retention's blocks free when its demotion lands (``finished_sending``)
    while the tier serves it under the same handle: the index keeps it until the retention ends (``ended``)."""
    table = MemoryTable()
    decode = engine(table, 5751, {"kvshuttle_host_tier_blocks": 64})
    prefill = engine(table, 5752)
    history = words(300)
    params = finish_decode(decode, "d1", history)
    assert params["remote_blocks_expiry_time"] > time.time() + 1800  # hot TTL + the tier's: the index entry too
    decode.update_connector_output({"d1"}, None)  # the demotion landed: vLLM frees the hot blocks
    until(lambda: decode.lookups is not None and decode.lookups._queued == 0)
    assert ask(prefill, request("p1", [*history, 1], None)) == (299, True)
    decode.update_connector_output(None, None, ended={"d1"})  # the tier ended it
    until(lambda: decode.lookups is not None and decode.lookups._queued == 0)
    assert ask(prefill, request("p2", [*history, 1], None)) == (0, False)
    assert decode.state_sizes()["held"] == 0


def test_without_an_index_or_bidirectional_nothing_is_looked_up() -> None:
    config = ShuttleConfig.from_extra({}, model="m")  # bidirectional_kv_xfer off
    s = ShuttleScheduler(config, "e", BS, secret=SECRET)
    s.lookups = lookups(MemoryTable())
    assert s.get_num_new_matched_tokens(request("p", words(100), None), 0) == (0, False)
    assert s.lookups.take_counts() == {}


def test_a_flood_of_lookups_is_bounded() -> None:
    gate = threading.Event()

    class Stuck(MemoryContentIndex):
        def lookup(self, scope: str, prompt: Any) -> Any:
            gate.wait(5)
            return None

    found = ContentLookups(Stuck(SECRET), BS, wait_s=10.0)
    try:
        answers = [found.find(f"r{k}", "", words(64, seed=k), b"m") for k in range(300)]
        assert answers.count(PENDING) == 256 and answers.count(None) == 44
        assert found.take_counts()["lookup_overflow"] == 44
    finally:
        gate.set()
        found.close()


@pytest.mark.parametrize("value", ["http://x", "", 5])
def test_the_index_setting_takes_a_redis_url(value: Any) -> None:
    from kvshuttle.integrations.vllm.config import ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match="kvshuttle_content_index"):
        ShuttleConfig.from_extra({"kvshuttle_content_index": value})
    assert ShuttleConfig.from_extra({"kvshuttle_content_index": "redis://:pw@h:6379/0"}).content_index is not None
    assert "pw" not in repr(ShuttleConfig.from_extra({"kvshuttle_content_index": "redis://:pw@h:6379/0"}))


def test_publishing_starts_once_whatever_the_handshakes_repeat() -> None:
    """Every start is a new incarnation that hides the previous one's entries: one per engine."""
    table, made = MemoryTable(), []

    def make(address: str) -> MemoryContentIndex:
        made.append(address)
        return MemoryContentIndex(SECRET, address, table=table)

    found = ContentLookups(MemoryContentIndex(SECRET, table=table), BS, make_publisher=make)
    try:
        for _ in range(3):
            found.serve_as("127.0.0.1:5790")
        until(lambda: found.publisher is not None)
        assert made == ["127.0.0.1:5790"]
    finally:
        found.close()


def test_a_redis_that_answers_late_at_start_up_still_gets_the_publisher_started() -> None:
    """At an engine's start-up the host is busiest: a start() that fails is retried with backoff, not given up
    (seen in CI: a decode that gave up at once published nothing for its whole life)."""
    table, attempts = MemoryTable(), []

    class Late(MemoryContentIndex):
        def start(self) -> None:
            attempts.append(1)
            if len(attempts) < 3:
                raise RuntimeError("redis did not answer")
            super().start()

    found = ContentLookups(MemoryContentIndex(SECRET, table=table), BS,
                           make_publisher=lambda address: Late(SECRET, address, table=table))
    try:
        found.serve_as("127.0.0.1:5791")
        until(lambda: found.publisher is not None, timeout_s=10.0)
        assert len(attempts) == 3 and found.take_counts()["publisher_retry"] == 2
    finally:
        found.close()
