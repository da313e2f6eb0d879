"""The multi-turn router end to end: the official ``openai`` client -> ``Router`` -> fake vLLM servers (test
doubles answering like vLLM's OpenAI server with a P/D connector), three turns, streamed and not."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from typing import Any

import openai
import pytest

from kvshuttle.router import FIRST_TURN_PARAMS
from kvshuttle.router.proxy import NO_PREFILL_PARAMS, PUBLISH_KEY
from kvshuttle.trust import GRANT_FIELD
from router_helpers import (
    Conversation,
    Deployment,
    LoopThread,
    deploy,
    fresh_secret,
    prefill_handles,
    routing,
    wait_until,
)

pytest_plugins = ["router_fixtures"]  # loop, redis_server
ANSWER = " tok0 tok1 tok2"


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(json.loads(resp.read()))


def _delete(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=60) as resp:
        return dict(json.loads(resp.read()))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_three_turns_each_prefill_gets_the_previous_decode_handle(loop: LoopThread, stream: bool) -> None:
    d = deploy(loop)
    try:
        chat = Conversation(d.client(), "conv-1", "hello from conv-1")
        answers = [chat.turn(stream) for _ in range(3)]
        prefill, decode = d.prefills[0], d.decodes[0]
        sent = prefill_handles(prefill)
        assert answers == [ANSWER] * 3
        assert sent[0] == FIRST_TURN_PARAMS
        # turn k's prefill gets exactly what the decode issued at turn k - 1, marked to read back
        for k in (1, 2):
            assert sent[k] == {**decode.issued_params[k - 1], "do_remote_decode": True, "do_remote_prefill": False}
        assert prefill.stats.matched == 2 and prefill.stats.cross == 0 and prefill.stats.lost == 0
        assert d.metric("kvshuttle_router_handle_lookups_total", result="hit") == 2
        assert d.metric("kvshuttle_router_handle_lookups_total", result="miss") == 1
        assert d.metric("kvshuttle_router_handles_stored_total") == 3
        assert d.metric("kvshuttle_router_added_latency_seconds_count") == 3
    finally:
        d.close()


def test_decode_gets_prefill_params_and_both_share_one_request_id(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        Conversation(d.client(), "c", "hi").turn(stream=True)
        p_req, d_req = d.prefills[0].requests[0], d.decodes[0].requests[0]
        p_body, d_body = p_req["body"], d_req["body"]
        assert p_body["stream"] is False and p_body["max_tokens"] == 1 and "conversation_id" not in p_body
        assert d_body["stream"] is True and "conversation_id" not in d_body
        params = dict(d_body["kv_transfer_params"])
        key = params.pop(PUBLISH_KEY)
        params.pop(GRANT_FIELD)
        assert isinstance(key, str) and len(key) >= 16
        assert params["remote_request_id"].endswith(p_req["headers"]["X-Request-Id"])
        assert p_req["headers"]["X-Request-Id"] == d_req["headers"]["X-Request-Id"]
        assert d.decodes[0].stats.published == 1
    finally:
        d.close()


def test_non_streamed_answer_does_not_show_the_handle_to_the_client(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        answer = _post(d.url + "/v1/chat/completions", {"model": "fake", "conversation_id": "c",
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert answer["choices"][0]["message"]["content"] == ANSWER
        assert "kv_transfer_params" not in answer
        assert d.decodes[0].issued_params[0] is not None  # the decode did return one: the router kept it
    finally:
        d.close()


def test_completions_endpoint_and_conversation_header(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        client = d.client()
        headers = {"X-Conversation-Id": "by-header"}
        first = client.completions.create(model="fake", prompt="once upon a time", extra_headers=headers)
        chunks = client.completions.create(model="fake", prompt="once upon a time and more", stream=True,
                                           extra_headers=headers)
        text = "".join(c.choices[0].text for c in chunks)
        sent = prefill_handles(d.prefills[0])
        assert first.choices[0].text == ANSWER and text == ANSWER
        assert sent[0] == FIRST_TURN_PARAMS and sent[1]["kvshuttle_handle_id"]
        assert d.prefills[0].requests[1]["path"] == "/v1/completions"
    finally:
        d.close()


def test_without_a_conversation_id_every_turn_recomputes(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        client = d.client()
        for _ in range(2):
            client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
        assert prefill_handles(d.prefills[0]) == [FIRST_TURN_PARAMS] * 2
        assert d.metric("kvshuttle_router_handle_lookups_total", result="no_conversation") == 2
    finally:
        d.close()


def test_an_expired_handle_is_not_sent(loop: LoopThread) -> None:
    now = [1_000_000.0]
    d = deploy(loop, router_kwargs={"clock": lambda: now[0]}, ttl_s=30.0, decode_ttl_s=60.0)
    try:
        chat = Conversation(d.client(), "c", "hi")
        chat.turn(stream=False)
        now[0] += 31.0
        chat.turn(stream=False)
        assert prefill_handles(d.prefills[0])[1] == FIRST_TURN_PARAMS
        assert d.metric("kvshuttle_router_handle_lookups_total", result="expired") == 1
        assert d.metric("kvshuttle_router_handle_expirations_total") == 1
    finally:
        d.close()


def test_tenants_never_see_each_others_handles(loop: LoopThread) -> None:
    d = deploy(loop, tenant_header="X-Tenant")
    try:
        a = Conversation(d.client(), "same-id", "tenant a speaking", headers={"X-Tenant": "a"})
        b = Conversation(d.client(), "same-id", "tenant b speaking", headers={"X-Tenant": "b"})
        nobody = Conversation(d.client(), "same-id", "no tenant")
        a.turn(stream=True)
        b.turn(stream=True)  # same conversation id, other tenant: a first turn
        nobody.turn(stream=False)  # no tenant: nothing looked up or stored
        a.turn(stream=False)
        b.turn(stream=False)
        sent = prefill_handles(d.prefills[0])
        stats = d.prefills[0].stats
        assert sent[1] == FIRST_TURN_PARAMS and sent[2] == FIRST_TURN_PARAMS
        assert stats.matched == 2 and stats.cross == 0
        assert d.metric("kvshuttle_router_handle_lookups_total", result="no_tenant") == 1
    finally:
        d.close()


def test_api_keys_name_tenants_and_unknown_keys_are_refused(loop: LoopThread) -> None:
    d = deploy(loop, api_keys={"key-a": "a", "key-b": "b"})
    try:
        a = Conversation(d.client(api_key="key-a"), "c", "from a")
        b = Conversation(d.client(api_key="key-b"), "c", "from b")
        a.turn(stream=False)
        b.turn(stream=False)
        a.turn(stream=True)
        with pytest.raises(openai.AuthenticationError):
            Conversation(d.client(api_key="wrong"), "c", "x").turn(stream=False)
        stats = d.prefills[0].stats
        assert stats.matched == 1 and stats.cross == 0
        assert all("Authorization" not in r["headers"] for r in d.prefills[0].requests)  # tenants' keys stay
    finally:
        d.close()


def _concurrent_second_turns(d: Any) -> list[dict[str, Any]]:
    first = Conversation(d.client(), "c", "hi")
    first.turn(stream=False)
    d.prefills[0].barrier = 2  # both second turns looked up their handle before either one's decode stores
    errors: list[BaseException] = []

    def second() -> None:
        try:
            Conversation(d.client(), "c", "hi", messages=list(first.messages)).turn(stream=False)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=second) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    return prefill_handles(d.prefills[0])[1:]


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_two_concurrent_turns_exactly_one_takes_a_use_once_handle(loop: LoopThread, store: str,
                                                                  request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_server").url if store == "redis" else "memory"
    d = deploy(loop, store=url)
    try:
        sent = _concurrent_second_turns(d)
        assert len(sent) == 2
        assert sorted(bool(p.get("kvshuttle_handle_id")) for p in sent) == [False, True]
    finally:
        d.close()


def test_turns_beyond_max_in_flight_wait_their_turn(loop: LoopThread) -> None:
    d = deploy(loop, max_in_flight=1)
    try:
        d.prefills[0].delay_s = 0.2  # both turns would overlap at prefill without the bound
        threads = [threading.Thread(target=Conversation(d.client(), f"c{i}", "hi").turn, args=(False,))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert d.prefills[0].stats.requests == 3 and d.prefills[0].stats.max_active == 1
        assert [m.id for m in d.client().models.list()] == ["fake"]  # /v1/models passes through
    finally:
        d.close()


def test_multi_read_gives_the_handle_to_both_concurrent_turns(loop: LoopThread) -> None:
    d = deploy(loop, reads="multi_read")
    try:
        sent = _concurrent_second_turns(d)
        assert [bool(p.get("kvshuttle_handle_id")) for p in sent] == [True, True]
        assert sent[0]["kvshuttle_handle_id"] == sent[1]["kvshuttle_handle_id"]
    finally:
        d.close()


def test_conversations_survive_a_router_restart_on_redis(loop: LoopThread, redis_server: Any) -> None:
    d = deploy(loop, store=redis_server.url)
    try:
        chat = Conversation(d.client(), "c", "hi")
        chat.turn(stream=True)
        d.stop_router()
        d.start_router()  # a new process would see the same: the handle lives in redis
        chat.turn(stream=False)
        chat.turn(stream=True)
        assert d.prefills[0].stats.matched == 2
        assert d.metric("kvshuttle_router_handle_lookups_total", result="hit") == 2
    finally:
        d.close()


def test_two_replicas_on_redis_share_streamed_turns_even_with_a_slow_board(loop: LoopThread,
                                                                          redis_server: Any) -> None:
    from kvshuttle.router.kv import SideChannelCalls

    secret = fresh_secret()
    calls = SideChannelCalls(secret, threads=2)

    async def slow_taker(address: str, key: str, timeout_s: float) -> dict[str, Any] | None:
        await asyncio.sleep(0.3)  # the client's next turn must still find the handle, on the other replica
        return await calls.take(address, key, timeout_s)

    d = deploy(loop, store=redis_server.url, router_kwargs={"taker": slow_taker}, secret=secret)
    other = Deployment(loop, d.prefills, d.decodes, d.config, {"taker": slow_taker})
    other.start_router()
    try:
        chats = [Conversation(r.client(), "c", "hi") for r in (d, other)]
        for k in range(4):  # turns alternate between the replicas
            chats[k % 2].messages = chats[(k + 1) % 2].messages
            chats[k % 2].turn(stream=True)
        assert d.prefills[0].stats.matched == 3 and d.prefills[0].stats.lost == 0
    finally:
        other.stop_router()
        d.close()
        calls.close()


def test_redis_down_the_router_keeps_serving_with_recompute(loop: LoopThread, redis_server: Any) -> None:
    d = deploy(loop, store=redis_server.url)
    try:
        chat = Conversation(d.client(), "c", "hi")
        chat.turn(stream=False)
        redis_server.stop()
        answers = [chat.turn(stream=True), chat.turn(stream=False)]
        assert answers == [ANSWER, ANSWER]
        assert prefill_handles(d.prefills[0])[1:] == [FIRST_TURN_PARAMS] * 2
        assert d.metric("kvshuttle_router_handle_lookups_total", result="store_error") == 2
    finally:
        d.close()


def test_a_decode_dying_mid_stream_is_an_error_event_and_the_router_goes_on(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        chat = Conversation(d.client(), "c", "hi")
        chat.turn(stream=True)
        d.decodes[0].behaviour = "die_mid_stream"
        with pytest.raises(openai.APIError):
            chat.turn(stream=True)
        d.decodes[0].behaviour = "ok"
        chat.messages.append({"role": "assistant", "content": "(cut)"})
        assert chat.turn(stream=True) == ANSWER
        sent = prefill_handles(d.prefills[0])
        # turn 2 took the handle; its answer died, so turn 3 had nothing to read back (recompute)
        assert bool(sent[1].get("kvshuttle_handle_id")) and sent[2] == FIRST_TURN_PARAMS
        assert d.metric("kvshuttle_router_handles_unlearned_total", reason="stream_failed") == 1
    finally:
        d.close()


def test_a_failing_decode_is_retried_elsewhere_without_prefill_params(loop: LoopThread) -> None:
    d = deploy(loop, decodes=2)
    try:
        bad, good = d.decodes
        bad.behaviour = "fail"
        assert d.router is not None
        d.router.decode.mark(d.router.decode.backends[1], False)  # make the failing one the first choice
        answer = Conversation(d.client(), "c", "hi").turn(stream=True)
        retried = good.requests[0]["body"]["kv_transfer_params"]
        assert answer == ANSWER
        assert bad.requests[0]["body"]["kv_transfer_params"]["remote_block_ids"] == [1, 2, 3]
        assert routing(retried) == NO_PREFILL_PARAMS
        assert d.metric("kvshuttle_router_retries_total", role="decode") == 1
    finally:
        d.close()


def test_a_failing_prefill_is_retried_without_the_use_once_handle(loop: LoopThread) -> None:
    d = deploy(loop, prefills=2)
    try:
        chat = Conversation(d.client(), "c", "hi")
        chat.turn(stream=False)
        first, second = d.prefills
        for p in d.prefills:
            p.requests.clear()
        first.behaviour = "fail"
        assert d.router is not None
        d.router.prefill.mark(d.router.prefill.backends[1], False)  # the failing one is tried first
        assert chat.turn(stream=False) == ANSWER
        assert prefill_handles(first)[0]["kvshuttle_handle_id"]
        assert prefill_handles(second) == [FIRST_TURN_PARAMS]
    finally:
        d.close()


def test_prefills_all_down_or_hanging_the_decode_alone_answers(loop: LoopThread) -> None:
    d = deploy(loop, prefill_timeout_s=1.0)
    try:
        chat = Conversation(d.client(), "c", "hi")
        d.prefills[0].behaviour = "hang"
        assert chat.turn(stream=True) == ANSWER
        d.prefills[0].behaviour = "fail"
        assert chat.turn(stream=False) == ANSWER
        bodies = [r["body"]["kv_transfer_params"] for r in d.decodes[0].requests]
        assert routing(bodies[0]) == NO_PREFILL_PARAMS
        assert routing(bodies[1]) == NO_PREFILL_PARAMS
    finally:
        d.close()


def test_no_decode_answering_is_a_502(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        d.decodes[0].behaviour = "fail"
        with pytest.raises(openai.APIStatusError) as caught:
            Conversation(d.client(), "c", "hi").turn(stream=False)
        assert caught.value.status_code == 502
    finally:
        d.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_malformed_handles_from_a_decode_are_dropped(loop: LoopThread, stream: bool) -> None:
    d = deploy(loop)
    try:
        chat = Conversation(d.client(), "c", "hi")
        d.decodes[0].behaviour = "malformed"
        chat.turn(stream)
        d.decodes[0].behaviour = "ok"
        chat.turn(stream)
        assert prefill_handles(d.prefills[0])[1] == FIRST_TURN_PARAMS
        assert d.metric("kvshuttle_router_handles_invalid_total", reason="malformed") == 1
    finally:
        d.close()


def test_client_supplied_kv_transfer_params_are_dropped(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        evil = {"remote_host": "10.0.0.66", "remote_port": 5600, "remote_block_ids": [0], "kvshuttle_version": 1}
        chat = Conversation(d.client(), "c", "hi")
        chat.turn(stream=False, kv_transfer_params=evil)
        chat.turn(stream=True, kv_transfer_params=evil)
        sent = prefill_handles(d.prefills[0])
        decoded = [r["body"]["kv_transfer_params"] for r in d.decodes[0].requests]
        assert sent[0] == FIRST_TURN_PARAMS and sent[1]["remote_host"] == "127.0.0.1"
        assert all(p["remote_engine_id"] == d.prefills[0].name for p in decoded)
        assert d.metric("kvshuttle_router_client_params_dropped_total") == 2
    finally:
        d.close()


def test_nixl_connector_learns_handles_from_non_streamed_turns_only(loop: LoopThread) -> None:
    d = deploy(loop, connector="nixl")
    try:
        chat = Conversation(d.client(), "c", "hi")
        chat.turn(stream=False)
        chat.turn(stream=True)  # gets turn 1's handle; vLLM streams carry none, so turn 3 recomputes
        chat.turn(stream=False)
        sent = prefill_handles(d.prefills[0])
        assert sent[1]["remote_engine_id"] == d.decodes[0].name and sent[1]["do_remote_decode"] is True
        assert sent[2] == FIRST_TURN_PARAMS
        assert PUBLISH_KEY not in d.decodes[0].requests[1]["body"]["kv_transfer_params"]
        assert d.metric("kvshuttle_router_handles_unlearned_total", reason="stream_without_board") == 1
    finally:
        d.close()


def test_a_dead_board_degrades_to_recompute(loop: LoopThread) -> None:
    async def dead_taker(address: str, key: str, timeout_s: float) -> dict[str, Any] | None:
        from kvshuttle.transfer.errors import PeerUnreachableError

        raise PeerUnreachableError(f"nothing at {address}")

    d = deploy(loop, router_kwargs={"taker": dead_taker})
    try:
        chat = Conversation(d.client(), "c", "hi")
        assert [chat.turn(stream=True), chat.turn(stream=True)] == [ANSWER, ANSWER]
        assert prefill_handles(d.prefills[0])[1] == FIRST_TURN_PARAMS
        assert d.metric("kvshuttle_router_handles_unlearned_total", reason="board_failed") == 2
    finally:
        d.close()


def test_delete_releases_the_decode_retention_once(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        chat = Conversation(d.client(), "c", "hi")
        chat.turn(stream=True)
        issued = d.decodes[0].issued_params[0]
        assert issued is not None
        first = _delete(d.url + "/v1/conversations/c")
        again = _delete(d.url + "/v1/conversations/c")
        chat.turn(stream=False)
        assert first == {"id": "c", "deleted": True, "released": True}
        assert again == {"id": "c", "deleted": False, "released": False}
        assert d.decodes[0].stats.released == [issued["kvshuttle_handle_id"]]
        assert prefill_handles(d.prefills[0])[1] == FIRST_TURN_PARAMS
    finally:
        d.close()


def test_health_reports_backends_and_fails_without_a_decode(loop: LoopThread) -> None:
    d = deploy(loop, health_interval_s=0.05)
    try:
        with urllib.request.urlopen(d.url + "/health", timeout=60) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "ok" and [b["healthy"] for b in body["decode"]] == [True]
        d.decodes[0].behaviour = "unhealthy"
        assert d.router is not None
        assert wait_until(lambda: not d.router.decode.backends[0].healthy)  # type: ignore[union-attr]
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(d.url + "/health", timeout=60)
        d.decodes[0].behaviour = "ok"
        assert caught.value.code == 503
        assert wait_until(lambda: d.router.decode.backends[0].healthy)  # type: ignore[union-attr]
    finally:
        d.close()


def test_bad_requests_are_refused_with_openai_errors(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        with pytest.raises(openai.BadRequestError):
            d.client().chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                               extra_body={"conversation_id": "\x00bad"})
        assert d.prefills[0].requests == []
    finally:
        d.close()
