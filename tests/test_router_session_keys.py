"""Session keys from the headers clients already send (router/session_keys.py): the official ``openai`` client ->
``Router`` -> fake vLLM servers, one conversation per client convention, two turns each."""

from __future__ import annotations

import openai
import pytest
from multidict import CIMultiDict

from kvshuttle.router import FIRST_TURN_PARAMS
from kvshuttle.router.config import RouterConfigError
from kvshuttle.router.main import session_keys
from kvshuttle.router.session_keys import DEFAULT_SOURCES, SessionKeyError, SessionKeySources
from router_helpers import LoopThread, deploy, prefill_handles

pytest_plugins = ["router_fixtures"]  # loop, redis_server


def test_sources_parse_and_refuse_what_cannot_be_read() -> None:
    assert SessionKeySources.parse(None).sources == DEFAULT_SOURCES
    assert SessionKeySources.parse("X-Session-ID, body:conversation_id").sources == (
        "header:X-Session-ID", "body:conversation_id")
    for bad in ("body:session", "header:", "header:X Session", "X-A,x-a", ""):
        with pytest.raises(SessionKeyError):
            SessionKeySources.parse(bad)
    with pytest.raises(RouterConfigError, match="--session-key"):
        session_keys("header:bad name")


def test_the_first_present_source_wins_and_headers_ignore_case() -> None:
    keys = SessionKeySources.parse("body:conversation_id,X-Session-ID,X-Session-Affinity")
    headers = CIMultiDict({"x-session-id": "s-1", "X-Session-Affinity": "a-1"})
    assert keys.pick({"conversation_id": "c-1"}, headers) == ("c-1", "body:conversation_id")
    assert keys.pick({}, headers) == ("s-1", "header:X-Session-ID")
    assert keys.pick({"conversation_id": None}, CIMultiDict({"X-Session-Affinity": "a-1"})) == (
        "a-1", "header:X-Session-Affinity")
    assert keys.pick({}, CIMultiDict()) == (None, None)


@pytest.mark.parametrize("header", [s.removeprefix("header:") for s in DEFAULT_SOURCES if s.startswith("header:")])
def test_each_clients_session_header_reaches_the_previous_handle(loop: LoopThread, header: str) -> None:
    """With no flag at all: turn 2 of a conversation keyed only by the client's own header gets turn 1's handle."""
    d = deploy(loop)
    try:
        client = d.client()
        for text in ("hello", "hello again"):
            client.chat.completions.create(model="fake", messages=[{"role": "user", "content": text}],
                                           extra_headers={header: f"session-{header}"})
        sent = prefill_handles(d.prefills[0])
        assert sent[0] == FIRST_TURN_PARAMS and sent[1]["kvshuttle_handle_id"]
        assert d.metric("kvshuttle_router_session_keys_total", source=f"header:{header}") == 2
    finally:
        d.close()


def test_only_the_configured_sources_are_read(loop: LoopThread) -> None:
    """``--session-key X-Custom``: the one header named, nothing else (a header a deployment does not trust)."""
    d = deploy(loop, session_keys=SessionKeySources.parse("X-Custom"))
    try:
        client = d.client()
        for text in ("one", "two"):
            client.chat.completions.create(model="fake", messages=[{"role": "user", "content": text}],
                                           extra_headers={"X-Session-ID": "ignored"},
                                           extra_body={"conversation_id": "x"})
        assert prefill_handles(d.prefills[0]) == [FIRST_TURN_PARAMS] * 2
        for text in ("three", "four"):
            client.chat.completions.create(model="fake", messages=[{"role": "user", "content": text}],
                                           extra_headers={"X-Custom": "kept"})
        assert prefill_handles(d.prefills[0])[3]["kvshuttle_handle_id"]
    finally:
        d.close()


def test_a_key_that_is_not_a_short_printable_string_is_refused_naming_its_source(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        with pytest.raises(openai.BadRequestError, match="header:X-Session-ID"):
            d.client().chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                               extra_headers={"X-Session-ID": "k" * 300})
        assert d.prefills[0].requests == []  # refused before any backend saw it
    finally:
        d.close()
