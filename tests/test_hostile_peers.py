"""The owner's side channel under attack: raw sockets and hostile messages, each refused, nothing readable, the
owner still serving and a legitimate reader's bytes intact afterwards.

The owner is a real TransferEngine with a retention ledger; attackers are plain ZMQ sockets (no keys, wrong keys)
and raw TCP, or authenticated peers that send hand-made messages (a member that misbehaves, or is broken).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

pytest.importorskip("nixl._api")

from kvshuttle import PagedKVCache
from kvshuttle.policy import block_digests
from kvshuttle.retention import RetentionLedger
from kvshuttle.transfer import ClaimRefusedError, EngineConfig, PeerAuthError, PeerLostError, TransferEngine
from kvshuttle.transfer.side_channel import Connection
from kvshuttle.trust import DeploymentSecret, TrustError

SHAPE = (2, 32, 16, 2, 32)  # FlashAttention [2, N, B, H, D]
SECRET = DeploymentSecret(b"hostile-peer-suite-deployment-secret-0001")
OTHER = DeploymentSecret(b"some-other-deployment-entirely-secret-0002")
TOKENS = list(range(100))
BLOCKS = [5, 9, 2, 20, 7, 11, 3]  # 100 tokens in 16-token blocks


def cache(seed: int) -> PagedKVCache:
    rng = np.random.default_rng(seed)
    return PagedKVCache.from_arrays([rng.integers(1, 2**16, size=SHAPE, dtype=np.uint16) for _ in range(2)],
                                    "flash_attn")


@pytest.fixture
def owner() -> Iterator[dict[str, Any]]:
    # 16 KiB slots: two 8 KiB blocks (2 layers x K, V x 16 tokens x 2 heads x 32 x 2 bytes) per chunk
    engine = TransferEngine(cache(1), EngineConfig(secret=SECRET, max_message_bytes=256 << 10, max_jobs_per_peer=2,
                                                   staging_chunk_bytes=16 << 10))
    reader = TransferEngine(cache(2), EngineConfig(secret=SECRET))
    try:
        address = engine.serve()
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        ledger = RetentionLedger("owner", host, int(port), max_ttl_s=600.0, max_claims_per_reader=4)
        engine.claims = ledger
        handle = ledger.retain("r1", BLOCKS, block_digests(TOKENS, 16), 100, 16)
        yield {"engine": engine, "reader": reader, "address": address, "ledger": ledger, "handle": handle}
    finally:
        reader.close()
        engine.close()


def legit_read_intact(o: dict[str, Any]) -> None:
    """A member reader claims, reads packed and direct, and gets the owner's exact bytes."""
    reader: TransferEngine = o["reader"]
    peer = reader.connect(o["address"])
    for path, local in (("packed", [0, 1, 2]), ("direct", [3, 4, 5])):
        reader.cache.layers[0].owner[:, local] = 0xA5A5  # poisoned destination
        ticket = reader.claim(peer, o["handle"], num_blocks=3)
        reader.read(peer, local, list(ticket.block_ids), path=path, claim=ticket).wait(10)
        reader.finish_claim(peer, ticket, ok=True)
        for layer in range(2):
            got = reader.cache.layers[layer].owner[:, local]
            assert np.array_equal(got, o["engine"].cache.layers[layer].owner[:, BLOCKS[:3]]), path
    assert o["engine"].stats()["staging_free"] == o["engine"].stats()["staging_chunks"]


def plain_dealer(address: str, **curve: bytes) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in curve.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


def no_reply(sock: zmq.Socket[Any], message: dict[str, Any], wait_ms: int = 1500) -> bool:
    try:
        sock.send(msgpack.packb(message), zmq.NOBLOCK)
    except zmq.Again:  # the owner already dropped the connection at the handshake: nothing reached it
        sock.close(0)
        return True
    got = sock.poll(wait_ms)
    sock.close(0)
    return got == 0


def member(o: dict[str, Any]) -> Connection:
    return Connection(zmq.Context.instance(), o["address"], secret=SECRET)


def ask(conn: Connection, message: dict[str, Any]) -> dict[str, Any]:
    try:
        return conn.request(message, 3.0, message.get("op", "?"))
    finally:
        conn.close()


# ------------------------------------------------------------------------------------ not authenticated at all
def test_plain_zmq_client_gets_no_handshake(owner: dict[str, Any]) -> None:
    """No CURVE: the owner never answers, so the NIXL metadata (READ access to the cache) never leaves it."""
    assert no_reply(plain_dealer(owner["address"]), {"op": "hello", "protocol": 4})
    legit_read_intact(owner)


def test_client_with_another_deployments_keys_is_refused(owner: dict[str, Any]) -> None:
    public, private = OTHER.curve_keys()
    server_public, _ = SECRET.curve_keys()  # even knowing the owner's public key does not help
    sock = plain_dealer(owner["address"], CURVE_SERVERKEY=server_public, CURVE_PUBLICKEY=public,
                        CURVE_SECRETKEY=private)
    assert no_reply(sock, {"op": "hello", "protocol": 4})
    with pytest.raises(PeerAuthError, match="secret"):
        TransferEngine(cache(3), EngineConfig(secret=OTHER)).connect(owner["address"])
    legit_read_intact(owner)


def test_raw_tcp_garbage_and_silence(owner: dict[str, Any]) -> None:
    """Garbage bytes, a half-open handshake that never finishes: the owner drops them and serves others."""
    port = int(owner["address"].rsplit(":", 1)[1])
    silent = socket.create_connection(("127.0.0.1", port))  # holds a connection, says nothing
    noisy = socket.create_connection(("127.0.0.1", port))
    noisy.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"GARBAGE" * 1000)
    try:
        legit_read_intact(owner)
    finally:
        silent.close()
        noisy.close()


def test_reader_never_talks_to_an_owner_outside_the_deployment() -> None:
    """The reader pins the deployment's key: an impostor owner (another secret) fails the handshake at once."""
    impostor = TransferEngine(cache(4), EngineConfig(secret=OTHER))
    reader = TransferEngine(cache(5), EngineConfig(secret=SECRET))
    try:
        address = impostor.serve()
        started = time.monotonic()
        with pytest.raises(PeerAuthError):
            reader.connect(address)
        assert time.monotonic() - started < 2.5
    finally:
        reader.close()
        impostor.close()


def test_routable_bind_needs_a_deployment_secret(tmp_path: Any) -> None:
    local = DeploymentSecret.local(tmp_path)
    with pytest.raises(TrustError, match="KVSHUTTLE_SECRET"):
        TransferEngine(cache(6), EngineConfig(secret=local, host="0.0.0.0", advertise_host="10.1.2.3")).serve()
    with pytest.raises(TrustError, match="advertise_host"):
        TransferEngine(cache(6), EngineConfig(secret=SECRET, host="0.0.0.0")).serve()


# --------------------------------------------------------------------------- authenticated, but misbehaving
def _pack(block_ids: list[int], **over: Any) -> dict[str, Any]:
    ids = block_ids
    message = {"op": "pack", "tid": "t1", "ids": ids, "num_tokens": 16 * len(ids), "chunk_tokens": 16,
               "layout": {"block_size": 16, "num_heads": 2, "order": "NHD"}, "head_offset": 0, "window": 2}
    return {**message, **over}


def test_pack_without_a_claim_is_refused(owner: dict[str, Any]) -> None:
    reply = ask(member(owner), _pack([5, 9]))
    assert reply["op"] == "error" and "claim_id" in reply["message"]
    assert owner["engine"].stats()["owner_jobs"] == 0
    legit_read_intact(owner)


def test_pack_outside_the_claim_or_with_a_dead_claim_is_refused(owner: dict[str, Any]) -> None:
    reader: TransferEngine = owner["reader"]
    peer = reader.connect(owner["address"])
    ticket = reader.claim(peer, owner["handle"], num_blocks=2)  # covers blocks 5 and 9
    outside = ask(member(owner), _pack([5, 30], claim_id=ticket.claim_id))  # 30 holds someone else's KV
    assert outside["op"] == "error" and outside["kind"] == "claim"
    reader.finish_claim(peer, ticket, ok=True)
    replayed = ask(member(owner), _pack([5, 9], claim_id=ticket.claim_id))  # a finished claim is dead
    assert replayed["op"] == "error" and replayed["kind"] == "claim"
    forged = ask(member(owner), _pack([5, 9], claim_id="x" * 24))
    assert forged["op"] == "error" and forged["kind"] == "claim"
    legit_read_intact(owner)


@pytest.mark.parametrize("over", [
    {"window": 0}, {"window": -1}, {"window": 10**6}, {"window": True}, {"window": "2"},
    {"chunk_tokens": 0}, {"chunk_tokens": 8}, {"chunk_tokens": 2.0},
    {"num_tokens": 2**62}, {"ids": [5, 5]}, {"ids": [-1]}, {"ids": [2**62]}, {"ids": "5"},
    {"head_offset": 1}, {"head_offset": -1}, {"layout": {"block_size": 0, "num_heads": 2, "order": "NHD"}},
    {"layout": []}, {"tid": ""}, {"tid": "x" * 65}, {"tid": 7},
])
def test_pack_fields_out_of_range_are_refused(owner: dict[str, Any], over: dict[str, Any]) -> None:
    """Windows, chunks larger than a staging slot, ids, heads, layouts: each refused before a slot is taken."""
    reader: TransferEngine = owner["reader"]
    peer = reader.connect(owner["address"])
    ticket = reader.claim(peer, owner["handle"], num_blocks=2)
    reply = ask(member(owner), _pack([5, 9], claim_id=ticket.claim_id, **over))
    assert reply["op"] == "error", reply
    assert owner["engine"].stats()["owner_jobs"] == 0
    assert owner["engine"].stats()["staging_free"] == owner["engine"].stats()["staging_chunks"]
    reader.finish_claim(peer, ticket, ok=False)
    legit_read_intact(owner)


def test_a_chunk_larger_than_a_staging_slot_is_refused(owner: dict[str, Any]) -> None:
    """Three blocks in one 16 KiB slot would spill into the next slots, which other readers are reading."""
    reader: TransferEngine = owner["reader"]
    peer = reader.connect(owner["address"])
    ticket = reader.claim(peer, owner["handle"], num_blocks=3)
    reply = ask(member(owner), _pack(BLOCKS[:3], claim_id=ticket.claim_id, chunk_tokens=48))
    assert reply["op"] == "error" and "more than a slot" in reply["message"]
    conn = member(owner)
    try:
        fits = conn.request(_pack(BLOCKS[:3], claim_id=ticket.claim_id, chunk_tokens=32, tid="t2"), 3.0, "pack")
        assert fits["op"] == "packing" and fits["chunks"] == 2
        conn.send({"op": "abort", "tid": "t2"})
        wait_for_jobs(owner)
    finally:
        conn.close()
    reader.finish_claim(peer, ticket, ok=False)
    legit_read_intact(owner)


def wait_for_jobs(o: dict[str, Any]) -> None:
    deadline = time.monotonic() + 5
    while o["engine"].stats()["owner_jobs"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert o["engine"].stats()["owner_jobs"] == 0


def test_a_peer_cannot_hold_more_than_its_share(owner: dict[str, Any]) -> None:
    """Packs in progress and open claims are capped per connection."""
    conn = member(owner)
    try:
        claims = [conn.request({"op": "claim", "handle_id": owner["handle"].handle_id, "generation": 0,
                                "block_ids": BLOCKS[:1], "digests": list(owner["handle"].digests[:1])}, 3.0, "claim")
                  for _ in range(5)]
        assert [c["op"] for c in claims] == ["claimed"] * 4 + ["refused"]
        assert claims[-1]["reason"] == "ClaimLimitError"
        packs = [conn.request(_pack([5], tid=f"t{i}", claim_id=claims[0]["claim_id"], window=1), 3.0, "pack")
                 for i in range(3)]
        assert [p["op"] for p in packs[:2]] == ["packing", "packing"]
        assert packs[2]["op"] == "error" and packs[2]["kind"] == "too_many_jobs"
        for i in range(2):
            conn.send({"op": "abort", "tid": f"t{i}"})
        wait_for_jobs(owner)
    finally:
        conn.close()
    legit_read_intact(owner)


@pytest.mark.parametrize("message", [
    {"op": "claim", "handle_id": 7, "generation": 0, "block_ids": [5], "digests": [b"x"]},
    {"op": "claim", "handle_id": "h", "generation": "0", "block_ids": [5], "digests": [b"x"]},
    {"op": "claim", "handle_id": "h", "generation": 0, "block_ids": [1] * 140_000, "digests": []},
    {"op": "claim", "handle_id": "h", "generation": 0, "block_ids": [5], "digests": [b"x"], "readers": True},
    {"op": "claim", "handle_id": "h", "generation": 0, "block_ids": [5], "digests": [b"x"], "readers": 65},
    {"op": "claim", "handle_id": "h", "generation": 0, "block_ids": [5], "digests": [b"x"], "readers": "2"},
    {"op": "claim_done", "claim_id": "c", "ok": "yes"},
    {"op": "renew_retention", "handle_id": "h", "ttl_s": "forever"},
    {"op": "renew_retention", "handle_id": "h", "ttl_s": float("inf")},
    {"op": "free_chunk", "tid": 3, "chunk": "0"},
    {"op": "abort", "tid": "t", "keep": "all"},
    {"op": "abort", "tid": "t", "keep": list(range(65))},
    {"op": "nonsense"},
    {"op": "hello", "protocol": 3},
])
def test_malformed_ops_get_a_named_refusal(owner: dict[str, Any], message: dict[str, Any]) -> None:
    conn = member(owner)
    try:
        conn.send({**message, "rid": 1})
        reply = conn.receive(3.0, "a reply")
    finally:
        conn.close()
    if message["op"] in ("free_chunk", "abort"):
        assert reply is not None and reply["kind"] == "protocol"
    else:
        assert reply is not None and reply["op"] in ("refused", "error"), reply
    if message["op"] == "hello":
        assert reply["kind"] == "protocol_version" and "same kvshuttle version" in reply["message"]
    if "readers" in message:  # refused for the field, before the ledger looks the handle up
        assert reply["reason"] == "MalformedClaim" and "'readers'" in reply["message"], reply
    legit_read_intact(owner)


def test_oversized_and_expanding_messages_cost_nothing_lasting(owner: dict[str, Any]) -> None:
    """Over max_message_bytes: the connection is dropped unanswered. A small message that would expand into
    millions of objects (empty maps) is refused by the decoder's budget."""
    big = member(owner)
    big.send({"op": "ping", "pad": b"\x00" * (300 << 10)})
    with pytest.raises(PeerLostError):  # the owner cut the connection without reading the message
        big.receive(5.0, "a reply")
    big.close()
    bomb = member(owner)
    try:
        bomb._socket.send(msgpack.packb({"op": "ping", "x": [{} for _ in range(50_000)]}))
        reply = bomb.receive(3.0, "a reply")
    finally:
        bomb.close()
    assert reply is not None and reply["op"] == "error" and reply["kind"] == "protocol"
    legit_read_intact(owner)


def test_renewals_are_clamped_to_the_maximum_ttl(owner: dict[str, Any]) -> None:
    reply = ask(member(owner), {"op": "renew_retention", "handle_id": owner["handle"].handle_id, "ttl_s": 1e8})
    assert reply["op"] == "renewed"
    assert reply["kv_transfer_params"]["kvshuttle_ttl_s"] <= 600.0 + 1.0
    assert reply["kv_transfer_params"]["kvshuttle_mac"]  # renewed handles are signed like issued ones


def test_claims_ignore_what_the_message_says_about_the_reader(owner: dict[str, Any]) -> None:
    """The cap counts the authenticated connection, not a name the peer chose: renaming does not evade it."""
    conn = member(owner)
    try:
        replies = [conn.request({"op": "claim", "handle_id": owner["handle"].handle_id, "generation": 0,
                                 "block_ids": BLOCKS[:1], "digests": list(owner["handle"].digests[:1]),
                                 "reader": f"someone-else-{i}"}, 3.0, "claim") for i in range(5)]
    finally:
        conn.close()
    assert replies[-1]["op"] == "refused"


def test_claimed_blocks_refuses_after_the_claim_ends(owner: dict[str, Any]) -> None:
    ledger: RetentionLedger = owner["ledger"]
    claim = ledger.claim(owner["handle"].handle_id, 0, reader="r")
    assert ledger.claimed_blocks(claim.claim_id) == tuple(BLOCKS)
    ledger.complete(claim.claim_id)
    with pytest.raises(Exception, match="not live"):
        ledger.claimed_blocks(claim.claim_id)
    with pytest.raises(ClaimRefusedError):
        owner["reader"].claim(owner["reader"].connect(owner["address"]),
                              type(owner["handle"])(**{**owner["handle"].__dict__, "generation": 5}))


def test_a_flooding_peer_does_not_hold_up_the_others(owner: dict[str, Any]) -> None:
    """While one member floods the owner with oversized and expanding messages and raw TCP garbage arrives,
    another member's handshake, claims and reads still go through, byte for byte (the bound is generous: it
    proves "not held up", not a speed)."""
    import threading

    stop = threading.Event()
    port = int(owner["address"].rsplit(":", 1)[1])

    def flood() -> None:
        while not stop.is_set():
            conn = member(owner)
            try:
                conn.send({"op": "ping", "pad": b"\x00" * (300 << 10)})
                conn._socket.send(msgpack.packb({"op": "ping", "x": [{} for _ in range(5000)]}))
                with socket.create_connection(("127.0.0.1", port)) as raw:
                    raw.sendall(b"\xff" * 4096)
            finally:
                conn.close()

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
    for thread in flooders:
        thread.start()
    try:
        for _ in range(3):
            started = time.monotonic()
            legit_read_intact(owner)
            assert time.monotonic() - started < 10.0
    finally:
        stop.set()
        for thread in flooders:
            thread.join(10)
