"""The handle board and the router's side-channel calls (``transfer/control.py``): a decode publishes a finished
request's params under a router's key and the router takes them once (what lets a router stream an answer and
still learn the next turn's handle); a router renews and releases a conversation's retention without NIXL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvshuttle.policy import KVHandle, block_digests
from kvshuttle.retention import RetentionLedger
from kvshuttle.transfer.board import HandleBoard, check_publish_key, serve_take
from kvshuttle.transfer.errors import PeerLostError, PeerUnreachableError, TransferArgumentError
from kvshuttle.trust import DeploymentSecret


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_is_taken_once() -> None:
    board = HandleBoard()
    board.put("k1", {"remote_block_ids": [1, 2]})
    assert board.take("k1") == (True, {"remote_block_ids": [1, 2]})
    assert board.take("k1") == (False, None)


def test_nothing_retained_is_published_as_found_none() -> None:
    board = HandleBoard()
    board.put("k1", None)
    assert board.take("k1") == (True, None)
    assert len(board) == 0


def test_entries_expire_after_ttl() -> None:
    clock = FakeClock()
    board = HandleBoard(ttl_s=5.0, clock=clock)
    board.put("old", {"a": 1})
    clock.now += 4.0
    board.put("young", {"b": 2})
    clock.now += 1.5
    assert board.take("old") == (False, None)
    assert board.take("young") == (True, {"b": 2})
    assert board.dropped == 1


def test_the_board_is_bounded_oldest_first() -> None:
    board = HandleBoard(max_entries=3)
    for i in range(5):
        board.put(f"k{i}", {"i": i})
    assert len(board) == 3 and board.dropped == 2
    assert board.take("k0") == (False, None)
    assert board.take("k4") == (True, {"i": 4})


@pytest.mark.parametrize("key", ["", "x" * 129, "tab\there", 7, None, b"bytes"])
def test_malformed_keys_are_named_errors(key: object) -> None:
    with pytest.raises(TransferArgumentError, match="publish key"):
        check_publish_key(key)


def test_serve_take_answers_malformed_requests_with_a_protocol_error() -> None:
    reply = serve_take(HandleBoard(), {"op": "take_published", "key": 12})
    assert reply["op"] == "error" and reply["kind"] == "protocol"
    assert serve_take(None, {"op": "take_published", "key": "k"}) == {
        "op": "published", "found": False, "kv_transfer_params": None}


@pytest.mark.parametrize(("ttl", "size"), [(0.0, 10), (-1.0, 10), (1.0, 0)])
def test_board_settings_are_checked(ttl: float, size: int) -> None:
    with pytest.raises(TransferArgumentError):
        HandleBoard(ttl_s=ttl, max_entries=size)


# -- over a real owner's side channel -------------------------------------------------------------------------
@pytest.fixture
def served() -> Iterator[tuple[str, HandleBoard, RetentionLedger]]:
    pytest.importorskip("nixl._api")
    from kvshuttle import PagedKVCache
    from kvshuttle.transfer import EngineConfig, TransferEngine

    rng = np.random.default_rng(3)
    cache = PagedKVCache.from_arrays([rng.integers(1, 2**16, size=(2, 8, 16, 2, 32), dtype=np.uint16)],
                                     "flash_attn")
    engine = TransferEngine(cache, EngineConfig())
    try:
        address = engine.serve()
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        board = HandleBoard()
        engine.board = board
        ledger = RetentionLedger("decode", host, int(port), ttl_s=30.0)
        engine.claims = ledger
        yield address, board, ledger
    finally:
        engine.close()


@pytest.fixture
def owner(served: tuple[str, HandleBoard, RetentionLedger]) -> tuple[str, HandleBoard]:
    return served[0], served[1]


SECRET = DeploymentSecret.resolve()  # what the served engine and the control calls use by default


def retained(ledger: RetentionLedger) -> dict[str, object]:
    return ledger.retain("r1", [3, 1, 2], block_digests(list(range(40)), 16), 40, 16).to_kv_transfer_params(SECRET)


def test_renew_extends_a_retention_without_a_nixl_agent(served: tuple[str, HandleBoard, RetentionLedger]) -> None:
    from kvshuttle.transfer import renew_retention

    _, _, ledger = served
    params = retained(ledger)
    renewed = renew_retention(params, ttl_s=120.0)
    assert renewed is not None and renewed["remote_block_ids"] == [3, 1, 2]
    assert float(renewed["remote_blocks_expiry_time"]) > float(params["remote_blocks_expiry_time"]) + 60


def test_release_frees_once_and_renewing_a_released_handle_gives_none(
        served: tuple[str, HandleBoard, RetentionLedger]) -> None:
    from kvshuttle.transfer import release_retention, renew_retention

    _, _, ledger = served
    params = retained(ledger)
    assert release_retention(params) is True
    assert ledger.metrics()["retained_blocks"] == 0
    assert release_retention(params) is False
    assert renew_retention(params) is None


@pytest.mark.parametrize("params", [None, {}, {"remote_host": "h"}, {"do_remote_decode": True}])
def test_renew_and_release_need_a_kvshuttle_handle(params: object) -> None:
    from kvshuttle.transfer import release_retention, renew_retention

    with pytest.raises(TransferArgumentError, match="no usable kvshuttle handle"):
        renew_retention(params)
    with pytest.raises(TransferArgumentError, match="no usable kvshuttle handle"):
        release_retention(params)


def test_forged_params_are_refused_before_any_connection(served: tuple[str, HandleBoard, RetentionLedger]) -> None:
    """An edited handle (here: pointing at a listener that counts connections) never reaches the network."""
    import socket

    from kvshuttle.transfer import release_retention, renew_retention

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    forged = {**retained(served[2]), "remote_port": listener.getsockname()[1]}
    try:
        for call in (renew_retention, release_retention):
            with pytest.raises(TransferArgumentError, match="forged or edited"):
                call(forged)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


def test_take_published_over_the_side_channel(owner: tuple[str, HandleBoard]) -> None:
    from kvshuttle.transfer import take_published

    address, board = owner
    board.put("conv-1", {"remote_num_tokens": 99, "remote_block_ids": [3, 1, 2]})
    assert take_published(address, "conv-1", timeout_s=2.0) == {"remote_num_tokens": 99,
                                                                 "remote_block_ids": [3, 1, 2]}
    assert take_published(address, "conv-1", timeout_s=0.2) is None  # taken once


def test_take_published_waits_for_a_late_publication(owner: tuple[str, HandleBoard]) -> None:
    from kvshuttle.transfer import take_published

    address, board = owner
    timer = threading.Timer(0.3, board.put, ("late", {"remote_num_tokens": 5}))
    timer.start()
    try:
        started = time.monotonic()
        params = take_published(address, "late", timeout_s=10.0)
    finally:
        timer.cancel()
    assert params == {"remote_num_tokens": 5}
    assert time.monotonic() - started < 9.0  # returned when published, not at the timeout


def test_take_published_from_nobody_is_a_named_error() -> None:
    pytest.importorskip("zmq")
    from kvshuttle.bench.e2e.engines import free_port
    from kvshuttle.transfer import take_published

    with pytest.raises(PeerUnreachableError):
        take_published(f"tcp://127.0.0.1:{free_port()}", "k", timeout_s=1.0)


def test_renew_waits_for_a_handle_the_decode_learns_a_moment_later(
        served: tuple[str, HandleBoard, RetentionLedger]) -> None:
    """The decode's ledger learns of a handle one engine step after the answer that carried it: a renewal sent
    in between is asked again, not dropped."""
    from kvshuttle.transfer import renew_retention

    address, _, ledger = served
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    digests = block_digests(list(range(40)), 16)
    issued = RetentionLedger("decode", host, int(port)).retain("r9", [4, 6, 8], digests, 40, 16, handle_id="late-1",
                                                               generation=0)
    timer = threading.Timer(0.3, ledger.retain, ("r9", [4, 6, 8], digests, 40, 16),
                            {"handle_id": "late-1", "generation": 0})
    timer.start()
    try:
        renewed = renew_retention(issued.to_kv_transfer_params(SECRET), ttl_s=60.0, unknown_grace_s=5.0)
    finally:
        timer.cancel()
    assert renewed is not None and renewed["remote_block_ids"] == [4, 6, 8]
    never = RetentionLedger("decode", host, int(port)).retain("r8", [5], digests[:1], 16, 16, handle_id="never-1")
    assert renew_retention(never.to_kv_transfer_params(SECRET), unknown_grace_s=0.2) is None


def test_a_long_conversations_handle_survives_renewal_and_publication(
        served: tuple[str, HandleBoard, RetentionLedger]) -> None:
    """128k tokens in 16-token blocks: 8,192 ids and a 256 KiB hex digest string travel in one reply."""
    from kvshuttle.transfer import renew_retention, take_published

    address, board, ledger = served
    tokens = 8192 * 16
    params = ledger.retain("long", list(range(8192)), block_digests(list(range(tokens)), 16), tokens,
                           16).to_kv_transfer_params(SECRET)
    renewed = renew_retention(params, ttl_s=60.0)
    assert renewed is not None and renewed["remote_block_ids"] == list(range(8192))
    assert renewed["kvshuttle_digests"] == params["kvshuttle_digests"]
    board.put("long-key", renewed)
    assert take_published(address, "long-key", timeout_s=2.0) == renewed


class _Rank:
    """A requester playing one owner rank: answers a release, or fails as a dead rank does."""

    def __init__(self, answer: dict[str, Any] | None) -> None:
        self.address, self.answer, self.asked = "tcp://127.0.0.1:1", answer, 0

    def request(self, message: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
        self.asked += 1
        if self.answer is None:
            raise PeerLostError("the rank's process is gone")
        return self.answer


def test_a_dead_rank_does_not_keep_the_live_ones_holding_blocks() -> None:
    from kvshuttle.transfer.control import rank_addresses, release_on_ranks

    handle = _tp2_handle()
    assert rank_addresses(handle) == [f"tcp://{r}" for r in handle.ranks]
    dead, live = _Rank(None), _Rank({"op": "released", "released": True})
    assert release_on_ranks([dead, live], handle, 1.0) is True  # the live rank after the dead one was asked too
    assert (dead.asked, live.asked) == (1, 1)
    gone = _Rank({"op": "released", "released": False})
    assert release_on_ranks([gone, gone], handle, 1.0) is False
    with pytest.raises(PeerLostError):  # nothing released and a rank failed: the failure, not a quiet False
        release_on_ranks([_Rank(None), gone], handle, 1.0)


def _tp2_handle() -> KVHandle:
    return KVHandle("owner", "req", "127.0.0.1", 5600, (1, 2), 32, 2e9, 2, "h-tp2", 0, 16,
                    (b"\x00" * 16, b"\x01" * 16), 1e9, 480.0, ("127.0.0.1:5600", "127.0.0.1:5601"))


@pytest.mark.parametrize("reply, expected", [
    ({"op": "published", "found": True, "kv_transfer_params": {"a": 1}}, (True, {"a": 1})),
    ({"op": "published", "found": True, "kv_transfer_params": None}, (True, None)),  # "nothing retained"
    ({"op": "published", "found": False}, (False, None)),  # not yet: poll again
])
def test_a_take_published_reply_is_read_once_for_both_pollers(reply: dict[str, Any],
                                                              expected: tuple[bool, Any]) -> None:
    from kvshuttle.transfer.control import published

    assert published("tcp://d:1", reply) == expected


@pytest.mark.parametrize("reply", [{"op": "error", "kind": "protocol"}, {}, {"found": True}])
def test_any_other_take_published_reply_is_a_protocol_error(reply: dict[str, Any]) -> None:
    from kvshuttle.transfer.control import published
    from kvshuttle.transfer.errors import ProtocolError

    with pytest.raises(ProtocolError, match="tcp://d:1 answered take_published with"):
        published("tcp://d:1", reply)


def test_dropped_handles_are_reported_and_taken_ones_are_not() -> None:
    """Every entry the board drops untaken (expired, pushed out, replaced by another handle under its key) reaches
    ``on_unclaimed`` once, after the lock; an explicit "nothing retained" (None) and a taken entry never do."""
    clock, heard = FakeClock(), []
    board = HandleBoard(ttl_s=5.0, max_entries=3, clock=clock, on_unclaimed=heard.append)
    board.put("a", {"h": "a"})
    board.put("none", None)
    board.put("b", {"h": "b"})
    board.put("b", {"h": "b"})  # the same handle again: nothing orphaned
    board.put("c", {"h": "c"})  # pushes out "a"
    assert heard == [{"h": "a"}]
    board.put("c", {"h": "c2"})  # another handle under a used key orphans the first
    assert heard == [{"h": "a"}, {"h": "c"}]
    assert board.take("b") == (True, {"h": "b"})
    clock.now += 6.0
    assert board.sweep() == 2 and heard[2:] == [{"h": "c2"}]  # "none" and "c2" expired; only one handle
    assert board.sweep() == 0 and len(heard) == 3 and board.dropped == 4
