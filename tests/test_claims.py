"""Claims over the side channel, answered by a real retention ledger on the owner engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from kvshuttle import PagedKVCache
from kvshuttle.policy import KVHandle, block_digests
from kvshuttle.retention import RetentionLedger
from kvshuttle.transfer import ClaimRefusedError, EngineConfig, TransferArgumentError, TransferEngine

SHAPE = (2, 64, 16, 2, 32)  # FlashAttention [2, N, B, H, D]


def cache(seed: int) -> PagedKVCache:
    rng = np.random.default_rng(seed)
    return PagedKVCache.from_arrays([rng.integers(1, 2**16, size=SHAPE, dtype=np.uint16) for _ in range(2)],
                                    "flash_attn")


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    mode = getattr(request, "param", "multi_read")
    owner = TransferEngine(cache(1), EngineConfig())
    reader = TransferEngine(cache(2), EngineConfig())
    try:
        address = owner.serve()
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        freed: list[int] = []
        ledger = RetentionLedger("owner", host, int(port), mode=mode, on_free=freed.extend)
        owner.claims = ledger
        tokens = list(range(100))
        handle = ledger.retain("r1", [5, 9, 2, 40, 7, 11, 3], block_digests(tokens, 16), 100, 16)
        peer = reader.connect(address)
        yield {"owner": owner, "reader": reader, "ledger": ledger, "handle": handle, "peer": peer, "freed": freed}
    finally:
        reader.close()
        owner.close()


def test_claim_read_and_complete(pair: dict[str, Any]) -> None:
    reader, peer, handle = pair["reader"], pair["peer"], pair["handle"]
    ticket = reader.claim(peer, handle, num_blocks=4)
    assert ticket.block_ids == handle.block_ids[:4]
    reader.read(peer, [0, 1, 2, 3], list(ticket.block_ids), claim=ticket).wait(10)
    reader.finish_claim(peer, ticket, ok=True)
    got = pair["reader"].cache.layers[0].owner[:, [0, 1, 2, 3]]
    want = pair["owner"].cache.layers[0].owner[:, list(handle.block_ids[:4])]
    assert np.array_equal(got, want)
    assert pair["ledger"].metrics()["hits"] == 1
    reader.claim(peer, handle)  # multi-read: a retried turn still reuses


@pytest.mark.parametrize("pair", ["use_once"], indirect=True)
def test_use_once_handle_is_consumed_by_the_first_read(pair: dict[str, Any]) -> None:
    reader, peer, handle = pair["reader"], pair["peer"], pair["handle"]
    ticket = reader.claim(peer, handle)
    reader.finish_claim(peer, ticket, ok=True)
    with pytest.raises(ClaimRefusedError) as refused:
        reader.claim(peer, handle)
    assert refused.value.reason in ("HandleConsumedError", "UnknownHandleError", "HandleReleasedError")
    assert sorted(pair["freed"]) == sorted(handle.block_ids)


@pytest.mark.parametrize("pair", ["use_once"], indirect=True)
def test_use_once_handle_waits_for_every_expected_reader(pair: dict[str, Any]) -> None:
    """Two reader ranks (here one engine claiming twice) expect to read the same owner rank: both claims are
    granted, a third is refused, and the handle is consumed only by the second completed read."""
    reader, peer, handle = pair["reader"], pair["peer"], pair["handle"]
    first, second = reader.claim(peer, handle, readers=2), reader.claim(peer, handle, readers=2)
    with pytest.raises(ClaimRefusedError) as refused:
        reader.claim(peer, handle, readers=2)
    assert refused.value.reason == "HandleInUseError"
    with pytest.raises(ClaimRefusedError) as tampered:
        reader.claim(peer, handle)  # a reader that expects to be alone
    assert tampered.value.reason == "TamperedHandleError" and "readers=1 presented, 2" in str(tampered.value)
    reader.read(peer, [0, 1], list(first.block_ids[:2]), claim=first).wait(10)
    reader.finish_claim(peer, first, ok=True)
    assert pair["freed"] == [] and pair["ledger"].get(handle.handle_id) is not None
    reader.finish_claim(peer, second, ok=True)
    assert sorted(pair["freed"]) == sorted(handle.block_ids)
    with pytest.raises(ClaimRefusedError) as consumed:
        reader.claim(peer, handle, readers=2)
    assert consumed.value.reason == "HandleConsumedError"


@pytest.mark.parametrize("readers", [0, 65, -1, True, "2", 2.0, None])
def test_bad_readers_are_refused_before_anything_is_sent(pair: dict[str, Any], readers: Any) -> None:
    before = pair["ledger"].metrics()
    with pytest.raises(TransferArgumentError, match=r"readers must be an integer in 1\.\.64"):
        pair["reader"].claim(pair["peer"], pair["handle"], readers=readers)
    assert pair["ledger"].metrics() == before


@pytest.mark.parametrize("change", ["generation", "block_ids", "digests", "handle_id"])
def test_tampered_or_stale_claims_are_refused(pair: dict[str, Any], change: str) -> None:
    handle: KVHandle = pair["handle"]
    params = handle.to_kv_transfer_params()
    if change == "generation":
        params["kvshuttle_generation"] += 1
    elif change == "block_ids":
        params["remote_block_ids"][1] = 60
    elif change == "digests":
        params["kvshuttle_digests"] = "00" * 16 + params["kvshuttle_digests"][32:]
    else:
        params["kvshuttle_handle_id"] = "not-a-handle"
    with pytest.raises(ClaimRefusedError):
        pair["reader"].claim(pair["peer"], KVHandle.from_kv_transfer_params(params, None))


def test_released_handle_is_refused(pair: dict[str, Any]) -> None:
    ledger, handle = pair["ledger"], pair["handle"]
    ledger.release(handle.handle_id)
    with pytest.raises(ClaimRefusedError):
        pair["reader"].claim(pair["peer"], handle)


def test_failed_read_aborts_and_unpins(pair: dict[str, Any]) -> None:
    reader, peer, handle, ledger = pair["reader"], pair["peer"], pair["handle"], pair["ledger"]
    ticket = reader.claim(peer, handle)
    reader.finish_claim(peer, ticket, ok=False)
    assert ledger.release(handle.handle_id)  # not pinned any more: released at once
    assert sorted(pair["freed"]) == sorted(handle.block_ids)


def test_owner_without_ledger_refuses(pair: dict[str, Any]) -> None:
    pair["owner"].claims = None
    with pytest.raises(ClaimRefusedError) as refused:
        pair["reader"].claim(pair["peer"], pair["handle"])
    assert refused.value.reason == "NoRetention"
