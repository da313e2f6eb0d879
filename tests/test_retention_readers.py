"""Use-once handles read by several reader ranks (tensor parallelism): a claim's ``readers`` count.

A reader at TP=2 reading an owner at TP=1 has both its ranks read owner rank 0: the owner's use-once handle must
take both claims and end only when both reads completed. The count travels in the claim (ledger argument and
side-channel field), is fixed by the handle's first claim, and is checked strictly everywhere.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest

from kvshuttle.policy import KVHandle
from kvshuttle.retention import (
    ClaimLostError,
    HandleConsumedError,
    HandleInUseError,
    HandleReleasedError,
    RetentionArgumentError,
    RetentionLedger,
    TamperedHandleError,
)
from kvshuttle.transfer.claims import claim_request, serve_claim
from kvshuttle.trust import DeploymentSecret
from test_retention import Clock

BS = 16
BAD_READERS: list[Any] = [0, 65, -1, True, False, "2", 2.0, None, [2], 2**64]


@dataclass
class Env:
    ledger: RetentionLedger
    clock: Clock
    freed: list[int]
    released: list[str]


def make(**kwargs: Any) -> Env:
    clock, freed, released = Clock(), list[int](), list[str]()
    ledger = RetentionLedger("decode-0", "10.0.0.2", 5600, clock=clock, wall_clock=lambda: 1.7e9,
                             on_free=freed.extend, on_release=released.append, **kwargs)
    return Env(ledger, clock, freed, released)


def retain(env: Env, blocks: list[int], **kwargs: Any) -> KVHandle:
    digests = [f"{i}:{b}".encode().ljust(16, b".") for i, b in enumerate(blocks)]
    return env.ledger.retain("req", blocks, digests, len(blocks) * BS, BS, **kwargs)


def claim(env: Env, handle: KVHandle, readers: int = 2, reader: str = "") -> str:
    return env.ledger.claim(handle.handle_id, handle.generation, reader=reader, readers=readers).claim_id


# ----------------------------------------------------------------------------------------------- ledger
def test_two_readers_both_claim_and_the_handle_is_consumed_after_both_complete() -> None:
    env = make(mode="use_once")
    handle = retain(env, [4, 5])
    a, b = claim(env, handle, reader="rank0"), claim(env, handle, reader="rank1")
    with pytest.raises(HandleInUseError, match=r"all 2 reader claims are taken \(2 in flight, 0 completed\)"):
        claim(env, handle, reader="rank2")
    env.ledger.complete(a)
    assert env.freed == [] and env.released == [] and env.ledger.get(handle.handle_id) is not None
    assert env.ledger.metrics()["consumed"] == 0
    with pytest.raises(HandleInUseError, match=r"1 in flight, 1 completed"):  # rank 0's slot is spent
        claim(env, handle)
    env.ledger.complete(b)
    assert sorted(env.freed) == [4, 5] and env.released == ["req"]
    metrics = env.ledger.metrics()
    assert (metrics["consumed"], metrics["hits"], metrics["live_handles"], metrics["claims_in_flight"]) == (1, 2, 0, 0)
    assert metrics["refusals"] == {"in_use": 2}
    with pytest.raises(HandleConsumedError):
        claim(env, handle)


def test_an_aborted_or_timed_out_claim_frees_its_slot() -> None:
    env = make(mode="use_once", claim_timeout_s=10.0)
    handle = retain(env, [4])
    a, b = claim(env, handle), claim(env, handle)
    assert env.ledger.abort(a)
    c = claim(env, handle)  # the aborted reader retries
    env.ledger.complete(b)
    env.clock.now += 10.0
    env.ledger.sweep()  # c timed out: its slot is free again, the handle is not consumed
    with pytest.raises(ClaimLostError):
        env.ledger.complete(c)
    assert env.freed == [] and env.ledger.get(handle.handle_id) is not None
    env.ledger.complete(claim(env, handle))
    assert env.freed == [4] and env.released == ["req"]
    assert env.ledger.metrics()["aborts"] == 1 and env.ledger.metrics()["claim_timeouts"] == 1


def test_the_first_claim_fixes_the_count_and_another_count_is_tampered() -> None:
    env = make(mode="use_once")
    two, one = retain(env, [1]), retain(env, [2])
    first = claim(env, two, readers=2)
    for other in (1, 3, 64):
        with pytest.raises(TamperedHandleError, match=f"readers={other} presented, 2 named by its first claim"):
            claim(env, two, readers=other)
    assert env.ledger.abort(first)
    with pytest.raises(TamperedHandleError, match="readers=3 presented, 2"):  # fixed even after the claim ended
        claim(env, two, readers=3)
    claim(env, one, readers=1)
    with pytest.raises(TamperedHandleError, match="readers=2 presented, 1"):  # a TP=1 reader got there first
        claim(env, one, readers=2)
    assert env.ledger.metrics()["refusals"] == {"tampered": 5}
    assert env.ledger.metrics()["claims_in_flight"] == 1  # the refused claims pinned nothing


def test_readers_one_is_the_old_use_once() -> None:
    env = make(mode="use_once")
    handle = retain(env, [7])
    first = claim(env, handle, readers=1)
    with pytest.raises(HandleInUseError, match="another reader holds the use-once claim"):
        env.ledger.claim(handle.handle_id, handle.generation)  # the default is 1
    env.ledger.complete(first)
    assert env.freed == [7]


@pytest.mark.parametrize("value", BAD_READERS)
def test_bad_readers_are_named_and_change_nothing(value: Any) -> None:
    for mode in ("use_once", "multi_read"):  # multi-read handles ignore the count, but it is still checked
        env = make(mode=mode)
        handle = retain(env, [1, 2])
        before = env.ledger.metrics()
        with pytest.raises(RetentionArgumentError, match=r"readers must be an int in 1\.\.64"):
            env.ledger.claim(handle.handle_id, handle.generation, readers=value)
        assert env.ledger.metrics() == before
        claim(env, handle, readers=2)  # a bad claim fixed nothing


def test_multi_read_handles_ignore_the_count() -> None:
    env = make(mode="multi_read")
    handle = retain(env, [1, 2])
    claims = [claim(env, handle, readers=n) for n in (2, 1, 5, 64, 2)]  # any mix, any number
    for c in claims:
        env.ledger.complete(c)
    assert env.freed == [] and env.ledger.metrics()["hits"] == 5 and env.ledger.metrics()["consumed"] == 0
    once = retain(env, [3], mode="use_once")  # a use-once handle in a multi-read ledger counts
    a, b = claim(env, once, readers=2), claim(env, once, readers=2)
    env.ledger.complete(a)
    env.ledger.complete(b)
    assert env.freed == [3]


def test_release_during_two_reads_frees_once_when_both_end() -> None:
    env = make(mode="use_once")
    handle = retain(env, [8, 9])
    a, b = claim(env, handle), claim(env, handle)
    assert env.ledger.release(handle.handle_id)
    with pytest.raises(HandleReleasedError):
        claim(env, handle)
    env.ledger.complete(a)
    assert env.freed == [] and env.released == []  # b still reads
    assert env.ledger.abort(b)
    assert sorted(env.freed) == [8, 9] and env.released == ["req"]
    assert env.ledger.metrics()["consumed"] == 0 and env.ledger.metrics()["draining_handles"] == 0


def test_threads_racing_for_a_two_reader_handle_exactly_two_win() -> None:
    env = make(mode="use_once")
    for round_ in range(30):
        handle = retain(env, [round_])
        barrier = threading.Barrier(4)
        outcomes: list[str] = []

        def reader(name: str, handle: KVHandle = handle, barrier: threading.Barrier = barrier,
                   outcomes: list[str] = outcomes) -> None:
            barrier.wait()
            try:
                claim_id = claim(env, handle, reader=name)
            except (HandleInUseError, HandleConsumedError):
                outcomes.append("refused")
                return
            env.ledger.complete(claim_id)
            outcomes.append("won")

        threads = [threading.Thread(target=reader, args=(f"rank{k}",)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(outcomes) == ["refused", "refused", "won", "won"], f"round {round_}"
    assert sorted(env.freed) == list(range(30)) and len(env.released) == 30
    assert env.ledger.metrics()["consumed"] == 30 and len(env.ledger) == 0


# ------------------------------------------------------------------------------------------------- wire
SECRET = DeploymentSecret(b"kvshuttle-readers-count-tests-secret-000001")


def test_claim_request_names_readers_only_when_not_one() -> None:
    env = make()
    handle = retain(env, [1, 2, 3])
    assert "readers" not in claim_request(handle, None)  # an owner that predates the field serves TP=1 as before
    assert "readers" not in claim_request(handle, 2, readers=1)
    message = claim_request(handle, 2, readers=3)
    assert message["readers"] == 3 and message["block_ids"] == [1, 2]


def test_serve_claim_passes_readers_to_the_ledger() -> None:
    env = make(mode="use_once")
    handle = retain(env, [1, 2])
    message = claim_request(handle, None, readers=2)
    replies = [serve_claim(env.ledger, message, reader=f"conn{k}", secret=SECRET) for k in range(3)]
    assert [r["op"] for r in replies] == ["claimed", "claimed", "refused"]
    assert replies[2]["reason"] == "HandleInUseError"
    tampered = serve_claim(env.ledger, claim_request(handle, None), reader="conn3", secret=SECRET)
    assert tampered["reason"] == "TamperedHandleError" and "readers=1 presented, 2" in tampered["message"]
    for reply in replies[:2]:
        done = serve_claim(env.ledger, {"op": "claim_done", "claim_id": reply["claim_id"], "ok": True},
                           reader="conn", secret=SECRET)
        assert done == {"op": "claim_done"}
    assert sorted(env.freed) == [1, 2]


@pytest.mark.parametrize("value", BAD_READERS)
def test_serve_claim_refuses_a_malformed_readers_field(value: Any) -> None:
    env = make(mode="use_once")
    handle = retain(env, [1, 2])
    before = env.ledger.metrics()
    reply = serve_claim(env.ledger, {**claim_request(handle, None), "readers": value}, reader="conn",
                        secret=SECRET)
    assert reply["op"] == "refused" and reply["reason"] == "MalformedClaim", reply
    assert "'readers'" in reply["message"]
    assert env.ledger.metrics() == before  # refused before the ledger was asked
