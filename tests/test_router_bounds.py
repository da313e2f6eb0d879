"""What one client can make the router hold or do (issue 31, item 5): requests inside bounded per tenant in count
and bytes before their bodies become objects, turns cancelled with their client, a prompt SIGTERM, and a greedy
tenant that leaves the others their latency, the router its memory and the backends their health."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from kvshuttle.router.admission import Gate, Limits, parsed_bytes
from kvshuttle.router.bodies import BadRequest
from router_flood import flood_body, measure
from router_helpers import (
    Conversation,
    LoopThread,
    deploy,
    head,
    post_raw,
    raw_connection,
    read_response,
    wait_until,
)

pytest_plugins = ["router_fixtures"]  # loop, redis_server
CHAT = "/v1/chat/completions"
KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}


def _error(raw: bytes) -> dict[str, Any]:
    return dict(json.loads(raw)["error"])


# -- the flood, measured on a router process -------------------------------------------------------------------------
def test_a_flooding_tenant_leaves_others_their_latency_memory_and_backends(tmp_path: Path) -> None:
    """Tenant A keeps 40 bodies of 3.8 MiB of ``{}`` coming (each refused one retried after ``Retry-After``) while
    tenant B streams small turns: B's median turn stays within 2x of its quiet median (measured in this test),
    the router's RSS stays bounded, no healthy backend is marked down, SIGTERM stops the router promptly.
    Before the bounds: B lost every turn, the router grew past 1.2 GiB, marked backends down and ignored
    SIGTERM for over a minute."""
    got = measure(tmp_path, turns=12, deadline_s=20.0)
    print(json.dumps(got))  # the numbers, for the record
    assert got["flood_failed"] == 0, got
    assert got["flood_median_s"] <= 2 * got["quiet_median_s"], got
    assert got["rss_peak_mib"] <= got["rss_quiet_mib"] + 200, got  # 40 x 3.8 MiB is 152 MiB raw, ~3.5 GiB parsed
    assert got["backend_down_marks"] == 0, got
    assert got["sigterm_s"] < 4.0, got  # under the 5 s grace: nothing of A's was being served
    assert got["flood_statuses"] and not got["flood_statuses"].get(200), got  # every flood body was refused


# -- named refusals before a body is parsed ----------------------------------------------------------------------------
def test_a_tenant_over_its_request_bound_is_refused_before_its_body_is_read(loop: LoopThread) -> None:
    d = deploy(loop, api_keys=KEYS, admin_key="sk-admin", tenant_max_requests=2)
    socks: list[socket.socket] = []
    try:
        for _ in range(2):  # two of A's requests inside, their bodies trickling
            socks.append(raw_connection(d.port, head(CHAT, 1000, Authorization="Bearer sk-a"), b'{"model":'))
        assert wait_until(lambda: d.metric("kvshuttle_router_held_body_bytes") >= 2000)
        third = raw_connection(d.port, head(CHAT, 1000, Authorization="Bearer sk-a"))
        status, body = read_response(third)
        assert status == 429 and _error(body)["type"] == "tenant_busy"
        third.close()
        b = Conversation(d.client(api_key="sk-b"), "b", "hello")
        assert b.turn(stream=True)  # another tenant: served
    finally:
        for sock in socks:
            sock.close()
        d.close()


def test_a_body_that_would_parse_into_too_many_objects_is_refused_unparsed(loop: LoopThread) -> None:
    """4 MiB of ``{}`` would be ~100 MiB of dicts: refused (413 ``body_too_complex``) while it is read, never
    parsed; a body of the same size of plain text is served."""
    d = deploy(loop, api_keys=KEYS, admin_key="sk-admin")
    try:
        with mock.patch("kvshuttle.router.proxy.parse_body", side_effect=AssertionError("parsed")) as parse:
            status, raw = post_raw(d.url + CHAT, flood_body(), {"Authorization": "Bearer sk-a"})
            assert status == 413 and _error(raw)["type"] == "body_too_complex" and parse.call_count == 0
        text = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x" * (3 << 20)}]}).encode()
        status, raw = post_raw(d.url + CHAT, text, {"Authorization": "Bearer sk-a"})
        assert status == 200, raw
        assert d.metric("kvshuttle_router_refusals_total", kind="body_too_complex") == 1
    finally:
        d.close()


def test_the_parsed_estimate_never_falls_short_of_what_parsing_builds() -> None:
    import tracemalloc

    shapes = [b'{"m":[' + b",".join([b"{}"] * 30000) + b"]}", b'{"p":[' + b",".join([b"12345"] * 30000) + b"]}",
              b'{"p":[' + b",".join([b'"ab"'] * 30000) + b"]}",
              json.dumps({"messages": [{"role": "user", "content": "hi"}] * 5000}).encode(),
              json.dumps({"messages": [{"role": "user", "content": "x" * 100000}]}).encode()]
    for raw in shapes:
        tracemalloc.start()
        value = json.loads(raw)
        built, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del value
        assert built <= parsed_bytes(raw), (raw[:40], built, parsed_bytes(raw))


# -- the gate: fairness and shutdown ----------------------------------------------------------------------------------
def test_a_tenant_at_its_in_flight_cap_does_not_hold_up_another_tenant() -> None:
    async def go() -> None:
        gate = Gate(Limits(max_in_flight=2, tenant_max_in_flight=1))
        a1, a2, b1 = gate.enter("a", 10), gate.enter("a", 10), gate.enter("b", 10)
        await gate.serve(a1)
        a2_served = asyncio.ensure_future(gate.serve(a2))
        await asyncio.sleep(0)
        await asyncio.wait_for(gate.serve(b1), 1.0)  # passes A's waiter: A is at its cap, B is not
        assert not a2_served.done() and gate.waiting == 1
        gate.leave(a1)
        await asyncio.wait_for(a2_served, 1.0)
        for ticket in (a2, b1):
            gate.leave(ticket)
        assert gate.held == 0 and gate.serving == 0 and gate.waiting == 0

    asyncio.run(go())


def test_closing_the_gate_refuses_waiters_and_cancels_bodies_still_being_read() -> None:
    async def go() -> None:
        gate = Gate(Limits(max_in_flight=1))
        served = gate.enter("a", None)
        gate.parsed(served)
        await gate.serve(served)
        waiter = gate.enter("b", None)
        gate.parsed(waiter)
        waiting = asyncio.ensure_future(gate.serve(waiter))

        async def reading() -> None:
            gate.enter("c", 100)
            await asyncio.sleep(3600)  # a body trickling in

        reader = asyncio.ensure_future(reading())
        await asyncio.sleep(0.01)
        gate.close()
        with pytest.raises(BadRequest) as refused:
            await asyncio.wait_for(waiting, 1.0)
        assert refused.value.status == 503 and refused.value.kind == "router_shutting_down"
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(reader, 1.0)
        with pytest.raises(BadRequest):
            gate.enter("d", None)

    asyncio.run(go())


# -- a client that goes away takes its turn with it -------------------------------------------------------------------
def test_a_client_that_goes_away_cancels_its_turn(loop: LoopThread) -> None:
    """The client hangs up while its prefill runs: the prefill request is closed and no decode is asked to
    compute for nobody."""
    d = deploy(loop)
    try:
        d.prefills[0].delay_s = 1.5
        body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                           "conversation_id": "gone"}).encode()
        sock = raw_connection(d.port, head(CHAT, len(body)), body)
        assert wait_until(lambda: d.prefills[0].stats.requests == 1)
        sock.close()
        assert wait_until(lambda: d.prefills[0].stats.cancelled == 1, 10.0)
        time.sleep(2.0)  # past the prefill's delay: a turn still running would reach the decode now
        assert d.decodes[0].stats.requests == 0
        assert d.router is not None and d.router.prefill.backends[0].in_flight == 0
        assert d.metric("kvshuttle_router_requests_total", endpoint=CHAT, outcome="client_gone") == 1
    finally:
        d.close()


def test_the_handle_a_cancelled_turn_took_is_released(loop: LoopThread) -> None:
    """Turn 2 took the conversation's use-once handle, then its client hung up: the decode is told to let the
    history go rather than hold it to its TTL for a turn that will never come."""
    d = deploy(loop)
    try:
        chat = Conversation(d.client(), "gone", "hi")
        chat.turn(stream=False)
        d.prefills[0].delay_s = 1.5
        chat.messages.append({"role": "user", "content": "more"})
        body = json.dumps({"model": "fake", "messages": chat.messages, "conversation_id": "gone"}).encode()
        sock = raw_connection(d.port, head(CHAT, len(body)), body)
        assert wait_until(lambda: d.prefills[0].stats.requests == 2)
        sock.close()
        assert wait_until(lambda: len(d.decodes[0].stats.released) == 1, 10.0)
    finally:
        d.close()


def test_shutdown_refuses_waiting_turns_at_once(loop: LoopThread) -> None:
    d = deploy(loop, max_in_flight=1)
    try:
        d.prefills[0].delay_s = 3.0
        body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}]}).encode()
        first = raw_connection(d.port, head(CHAT, len(body)), body)
        assert wait_until(lambda: d.prefills[0].stats.requests == 1)
        second = raw_connection(d.port, head(CHAT, len(body)), body)
        assert d.router is not None
        assert wait_until(lambda: d.metric("kvshuttle_router_waiting_turns") == 1)
        started = time.monotonic()
        loop.loop.call_soon_threadsafe(d.router.shutdown)
        status, raw = read_response(second)
        assert status == 503 and _error(raw)["type"] == "router_shutting_down"
        assert time.monotonic() - started < 1.0
        status, _ = read_response(first)  # the turn being served finishes
        assert status == 200
        first.close()
        second.close()
    finally:
        d.close()


def test_every_admission_bound_is_checked() -> None:
    from kvshuttle.router import RouterConfig, RouterConfigError
    from kvshuttle.router.config import BackendSpec

    spec = [BackendSpec("http://h:1")]
    for field in ("tenant_max_requests", "tenant_max_in_flight", "tenant_max_bytes", "max_held_bytes",
                  "max_parsed_bytes"):
        with pytest.raises(RouterConfigError, match=field):
            RouterConfig(spec, spec, **{field: 0}).check()  # type: ignore[arg-type]
    with pytest.raises(RouterConfigError, match="shutdown_grace_s"):
        RouterConfig(spec, spec, shutdown_grace_s=-1.0).check()
