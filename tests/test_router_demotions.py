"""Soft TTL classes (``demote_on_stop``): after an answer that ended with ``finish_reason == "stop"`` the router asks
the decode, on its side channel, to demote the conversation's retention into its host tier; ``tool_calls`` (and the
flag off) leave it hot. Off the answer's path: a refusing, broken or hanging decode changes no client's answer. Real
HTTP through a real ``Router`` to fake vLLM servers (:mod:`kvshuttle.router.doubles`), whose side channels record
what they were asked."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import pytest

from kvshuttle.router import RouterConfig, parse_backend
from kvshuttle.router.demotions import MIXED, StreamFinish, finish_of_json
from kvshuttle.router.errors import RouterConfigError
from kvshuttle.router.main import add_arguments, config_from
from router_helpers import Conversation, Deployment, LoopThread, deploy, prefill_handles, wait_until

pytest_plugins = ["router_fixtures"]  # loop
ANSWER = " tok0 tok1 tok2"
STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])


def _metric(d: Deployment, outcome: str) -> float:
    return d.metric("kvshuttle_router_demotions_total", outcome=outcome)


def _handle_ids(d: Deployment) -> list[str]:
    """The handle ids the decode issued, in order."""
    return [str(p["kvshuttle_handle_id"]) for p in d.decodes[0].issued_params if p]


@STREAMS
def test_an_answer_that_stops_demotes_its_retention_on_the_decode(loop: LoopThread, stream: bool) -> None:
    d = deploy(loop, demote_on_stop=True)
    try:
        chat = Conversation(d.client(), "c", "hello")
        assert chat.turn(stream) == ANSWER
        assert wait_until(lambda: _metric(d, "demoted") == 1)
        assert d.decodes[0].stats.demoted == _handle_ids(d)  # the handle this turn stored, on its decode
        chat.turn(stream)  # the demoted handle stays valid: the next turn's prefill still gets it
        assert prefill_handles(d.prefills[0])[1]["kvshuttle_handle_id"] == _handle_ids(d)[0]
    finally:
        d.close()


@STREAMS
def test_tool_calls_keep_the_retention_hot(loop: LoopThread, stream: bool) -> None:
    d = deploy(loop, demote_on_stop=True)
    try:
        decode = d.decodes[0]
        decode.finish_reason = "tool_calls"
        Conversation(d.client(), "tools", "call a tool").turn(stream)
        decode.finish_reason = "stop"
        Conversation(d.client(), "person", "hello").turn(stream)
        assert wait_until(lambda: _metric(d, "demoted") == 1)  # the second conversation's, asked after the first's
        assert decode.stats.demoted == [_handle_ids(d)[1]]
    finally:
        d.close()


def test_without_the_flag_nothing_is_demoted(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        chat = Conversation(d.client(), "c", "hello")
        chat.turn(stream=False)
        chat.turn(stream=True)
        time.sleep(0.5)  # what a demotion would have taken, with room to spare
        assert d.decodes[0].stats.demoted == [] and _metric(d, "demoted") == 0
    finally:
        d.close()


@pytest.mark.parametrize("how", ["refuse", "error"])
def test_a_decode_that_refuses_or_breaks_changes_no_answer(loop: LoopThread, how: str) -> None:
    d = deploy(loop, demote_on_stop=True)
    try:
        d.decodes[0].demotion = how
        chat = Conversation(d.client(), "c", "hello")
        assert chat.turn(stream=False) == ANSWER
        outcome = "refused" if how == "refuse" else "failed"
        assert wait_until(lambda: _metric(d, outcome) == 1)
        assert chat.turn(stream=True) == ANSWER  # the handle was kept and is used as before
        assert prefill_handles(d.prefills[0])[1]["kvshuttle_handle_id"] == _handle_ids(d)[0]
        assert wait_until(lambda: _metric(d, outcome) == 2) and _metric(d, "demoted") == 0
    finally:
        d.close()


def test_demotions_are_off_the_answers_path_and_bounded(loop: LoopThread) -> None:
    asked: list[dict[str, Any]] = []

    async def hang(params: dict[str, Any]) -> bool:  # a decode that never answers
        asked.append(params)
        await asyncio.Event().wait()
        return True

    d = deploy(loop, demote_on_stop=True, router_kwargs={"demoter": hang})
    try:
        for name in ("a", "b", "c"):
            started = time.monotonic()
            assert Conversation(d.client(), name, "hello").turn(stream=name == "b") == ANSWER
            assert time.monotonic() - started < 5.0
        assert len(asked) == 2 and _metric(d, "busy") == 1  # two in flight at most: the third skipped
    finally:
        d.close()


def test_finish_reasons_are_read_from_answers_and_whole_events() -> None:
    assert finish_of_json({"choices": [{"finish_reason": "stop"}]}) == "stop"
    assert finish_of_json({"choices": [{"finish_reason": "stop"}, {"finish_reason": "tool_calls"}]}) == MIXED
    assert finish_of_json({"choices": "none"}) is None and finish_of_json({}) is None
    scan = StreamFinish()
    text = b'data: {"choices":[{"delta":{"content":"say \\"finish_reason\\": \\"stop\\""},"finish_reason":null}]}\n\n'
    assert scan.feed(text) == text and scan.reason is None  # a model's text naming it is not the finish
    scan.feed(b'data: {"choices":[{"delta":{},"finish_reason": "tool_calls"}]}\n\ndata: [DONE]\n\n')
    assert scan.reason == "tool_calls"


def test_the_flag_and_its_checks() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--prefill", "http://h:1", "--decode", "http://h:2"]
    assert config_from(parser.parse_args(argv), environ={}).demote_on_stop is False
    assert config_from(parser.parse_args([*argv, "--demote-on-stop"]), environ={}).demote_on_stop is True
    backends: dict[str, Any] = {"prefill": [parse_backend("http://h:1")], "decode": [parse_backend("http://h:2")]}
    with pytest.raises(RouterConfigError, match="--demote-on-stop"):
        RouterConfig(**backends, connector="nixl", demote_on_stop=True).check()
    with pytest.raises(RouterConfigError, match="demote_on_stop must be a bool"):
        RouterConfig(**backends, demote_on_stop="yes").check()  # type: ignore[arg-type]
