"""Pre-warming (``prewarm=True``): after a chat turn the router sends the conversation so far to the prefill that
will take the next turn, as a background 1-token request without a handle. Real HTTP through a real ``Router``
to fake vLLM servers (:mod:`kvshuttle.router.doubles`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvshuttle.router import RouterConfig, parse_backend
from kvshuttle.router.errors import RouterConfigError
from kvshuttle.router.prewarm import answer_from_events, answer_from_json, warming_request
from router_helpers import Conversation, LoopThread, deploy, prefill_handles, wait_until

pytest_plugins = ["router_fixtures"]  # loop
ANSWER = " tok0 tok1 tok2"


def _metric(d: Any, result: str) -> float:
    return d.metric("kvshuttle_router_prewarms_total", result=result)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_next_turns_prefill_is_warmed_with_the_history_and_the_answer(loop: LoopThread, stream: bool) -> None:
    d = deploy(loop, prefills=2, prewarm=True)
    try:
        chat = Conversation(d.client(), "c", "hello")
        chat.turn(stream, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
        home = next(i for i, p in enumerate(d.prefills) if p.requests)
        assert wait_until(lambda: bool(d.prefills[home].prewarms))
        warm = d.prefills[home].prewarms[0]
        assert warm["messages"] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ANSWER}]
        assert warm["max_tokens"] == 1 and warm["stream"] is False and warm["add_generation_prompt"] is False
        assert "kv_transfer_params" not in warm and "conversation_id" not in warm  # no handle: it stays stored
        assert warm["tools"][0]["function"]["name"] == "f"  # the template renders the same prompt prefix
        assert not d.prefills[1 - home].prewarms
        assert wait_until(lambda: _metric(d, "done") == 1)
        chat.turn(stream)
        assert prefill_handles(d.prefills[home])[1]["kvshuttle_handle_id"]  # the handle is still there
        assert _metric(d, "used") == 1 and _metric(d, "wasted") == 0
    finally:
        d.close()


def test_prewarms_are_bounded_per_prefill_and_dropped_when_the_next_turn_comes_first(loop: LoopThread) -> None:
    d = deploy(loop, prewarm=True, prewarm_max_in_flight=1)
    try:
        prefill = d.prefills[0]
        prefill.prewarm_gate = loop.run(_event())  # pre-warms hang until released
        a, b = Conversation(d.client(), "a", "hi a"), Conversation(d.client(), "b", "hi b")
        a.turn(stream=False)
        assert wait_until(lambda: len(prefill.prewarms) == 1)
        b.turn(stream=False)  # its pre-warm would be the prefill's second in flight
        assert wait_until(lambda: _metric(d, "busy") == 1)
        assert a.turn(stream=True) == ANSWER  # the next turn did not wait for its pre-warm: cancelled
        assert _metric(d, "superseded") == 1 and _metric(d, "used") == 0
        loop.loop.call_soon_threadsafe(prefill.prewarm_gate.set)
        assert _metric(d, "sent") == 2  # a's two turns; b's was refused for the bound
    finally:
        d.close()


def test_a_prewarm_whose_next_turn_lands_elsewhere_is_wasted(loop: LoopThread) -> None:
    d = deploy(loop, prefills=2, prewarm=True)
    try:
        chat = Conversation(d.client(), "c", "hello")
        chat.turn(stream=False)
        assert wait_until(lambda: _metric(d, "done") == 1)
        home = next(i for i, p in enumerate(d.prefills) if p.prewarms)
        assert d.router is not None
        d.router.prefill.mark(d.router.prefill.backends[home], False)
        chat.turn(stream=False)
        assert _metric(d, "wasted") == 1 and _metric(d, "used") == 0
    finally:
        d.close()


async def _event() -> asyncio.Event:
    return asyncio.Event()  # made on the router's loop


def test_answers_are_read_from_json_and_from_events() -> None:
    assert answer_from_json({"choices": [{"message": {"content": "hi"}}]}) == "hi"
    assert answer_from_json({"choices": []}) is None and answer_from_json({"choices": [{"message": {}}]}) is None
    events = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
              b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\ndata: {"choices":[{"index":0,',
              b'"delta":{"content":"b"}}]}\n\ndata: {"choices":[{"index":1,"delta":{"content":"x"}}]}\n\n',
              b"data: [DONE]\n\n"]
    assert answer_from_events(events) == "ab"
    assert answer_from_events([b"data: {not json\n\n"]) is None
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True, "max_tokens": 50,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 50, "temperature": 0.3}
    request = warming_request(body, "a")
    assert request == {"model": "m", "messages": [{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": "a"}],
                       "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0.3, "stream": False,
                       "add_generation_prompt": False, "continue_final_message": False}
    assert body["messages"] == [{"role": "user", "content": "q"}]  # the client's body is not changed


@pytest.mark.parametrize("changes, message", [
    ({"prewarm": 1}, "prewarm must be a bool"),
    ({"prewarm_max_in_flight": 0}, "prewarm_max_in_flight must be an int"),
])
def test_bad_prewarm_settings_are_refused(changes: dict[str, Any], message: str) -> None:
    config = RouterConfig(prefill=[parse_backend("http://p:1")], decode=[parse_backend("http://d:1")], **changes)
    with pytest.raises(RouterConfigError, match=message):
        config.check()
