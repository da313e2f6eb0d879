"""The router's token-exact path (``token_exact``, ``--token-exact``): real HTTP through a real ``Router`` to fake
vLLM servers (:mod:`kvshuttle.router.doubles`) that tokenize with the e2e tiny model's real tokenizer (a byte-level
BPE trained with ``tokenizers``) and its chat template (``role: content`` lines, ``assistant:`` as the generation
prompt, so a kept answer renders after ``assistant: ``: one more space than the model saw).

The fake decode spells its answer one character per token and ends it with ``</s>``: a split no re-tokenization of
the answer's text gives back. The next turn's prompt must start with the previous prompt's and answer's very ids
(the decode's blocks then verify on the prefill), and the decode must get the same ids as the prefill."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from kvshuttle.bench.e2e import tiny_model
from kvshuttle.router import RouterConfig, parse_backend
from kvshuttle.router.errors import RouterConfigError
from kvshuttle.router.main import add_arguments, config_from
from kvshuttle.router.sse import EventFilter
from kvshuttle.router.token_exact import ExactTurn, IdsTap, kept_from_json, kept_json, load_codec, renderable
from kvshuttle.router.token_ids import KeptTurn
from router_helpers import Deployment, LoopThread, RedisServer, deploy, post_raw, wait_until

pytest_plugins = ["router_fixtures"]  # loop, redis_server
ANSWER = " tok0 tok1 tok2"
CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
RAISING = ("{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
           "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    tiny_model.write_tokenizer(out, tiny_model.TinyLlamaSpec())
    return out


def with_template(tiny: Path, out: Path, template: str) -> Path:
    """The tiny tokenizer under another chat template."""
    out.mkdir()
    (out / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return out


def exact_deploy(loop: LoopThread, directory: Path | None, **config: Any) -> Deployment:
    """A router with ``token_exact=directory`` (None: off) before fakes tokenizing with that directory's codec
    (``codec_dir``'s when given)."""
    source = config.pop("codec_dir", None) or directory
    assert source is not None
    codec = load_codec(source)
    return deploy(loop, backend_kwargs={"codec": codec}, token_exact=str(directory) if directory else None, **config)


def chat(d: Deployment, messages: list[dict[str, str]], stream: bool, conversation: str = "c",
         **extra: Any) -> tuple[str, bytes]:
    """(the answer's text, the response body as the client got it)."""
    body = {"model": "tiny", "messages": messages, "stream": stream, "conversation_id": conversation, **extra}
    status, raw = post_raw(d.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, raw
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"], raw
    parts = []
    for line in raw.splitlines():
        if line.startswith(b"data: {"):
            parts += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return "".join(parts), raw


def conversation(d: Deployment, streams: tuple[bool, ...], **extra: Any) -> list[bytes]:
    messages: list[dict[str, str]] = []
    seen = []
    for k, stream in enumerate(streams):
        messages.append({"role": "user", "content": f"question {k} about the shuttle"})
        answer, raw = chat(d, messages, stream, **extra)
        assert answer == ANSWER
        messages.append({"role": "assistant", "content": answer})
        seen.append(raw)
    return seen


def outcome(d: Deployment, name: str) -> float:
    return d.metric("kvshuttle_router_token_exact_total", outcome=name)


def kept_ids(d: Deployment, turn: int) -> list[int]:
    """Turn ``turn``'s prompt and the decode's answer ids (its stop token left out: it has no KV)."""
    decode = d.decodes[0]
    answer = [i for ch in ANSWER for i in decode.codec.encode(ch)]
    return decode.prompt_ids[turn] + answer


@pytest.mark.parametrize("streams", [(False, True, False), (True, False, True)], ids=["json-first", "stream-first"])
def test_later_turns_start_with_the_decodes_own_ids_and_the_client_never_sees_them(
        loop: LoopThread, tiny_dir: Path, streams: tuple[bool, ...]) -> None:
    d = exact_deploy(loop, tiny_dir, token_exact_strict=False)  # the tiny template renders kept turns otherwise
    try:
        seen = conversation(d, streams)
        prefill, decode = d.prefills[0], d.decodes[0]
        for turn in (1, 2):
            kept = kept_ids(d, turn - 1)
            assert prefill.prompt_ids[turn][:len(kept)] == kept, f"turn {turn + 1} lost the answer's ids"
            assert decode.prompt_ids[turn] == prefill.prompt_ids[turn]  # the decode computes the same prompt
            assert len(prefill.prompt_ids[turn]) > len(kept)  # and the new message follows
        assert all(b"token_ids" not in raw for raw in seen)  # asked for by the router, removed
        assert all(r["body"]["return_token_ids"] is True for r in decode.requests)
        assert outcome(d, "exact") == 2 and outcome(d, "no_kept_turn") == 1
        assert d.metric("kvshuttle_router_token_exact_kept_total", outcome="kept") == 3
    finally:
        d.close()


def test_without_the_option_a_re_render_loses_every_id_from_the_answer_on(loop: LoopThread, tiny_dir: Path) -> None:
    d = exact_deploy(loop, None, codec_dir=tiny_dir)
    try:
        conversation(d, (False, False))
        prefill = d.prefills[0]
        kept = kept_ids(d, 0)
        assert prefill.prompt_ids[1][:len(d.decodes[0].prompt_ids[0])] == d.decodes[0].prompt_ids[0]
        assert prefill.prompt_ids[1][:len(kept)] != kept  # "assistant: " + the re-tokenized answer
        assert "return_token_ids" not in d.decodes[0].requests[0]["body"]
        assert outcome(d, "exact") == 0
    finally:
        d.close()


def test_strict_falls_back_where_the_template_renders_kept_turns_otherwise_and_not_where_it_does(
        loop: LoopThread, tiny_dir: Path, tmp_path: Path) -> None:
    d = exact_deploy(loop, tiny_dir)
    try:
        conversation(d, (False, False))
        assert outcome(d, "template_rewrites") == 1 and outcome(d, "exact") == 0
        assert "prompt_token_ids" not in d.prefills[0].requests[1]["body"]["kv_transfer_params"]
    finally:
        d.close()
    d = exact_deploy(loop, with_template(tiny_dir, tmp_path / "chatml", CHATML))
    try:
        conversation(d, (True, False, True))
        assert outcome(d, "exact") == 2
        prefill = d.prefills[0]
        for turn in (1, 2):  # the stop token closes the turn in this template: it stays in the prompt
            kept = kept_ids(d, turn - 1) + d.decodes[0].codec.encode("</s>")
            assert prefill.prompt_ids[turn][:len(kept)] == kept
    finally:
        d.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_asks_for_the_ids_gets_them(loop: LoopThread, tiny_dir: Path, stream: bool) -> None:
    d = exact_deploy(loop, tiny_dir, token_exact_strict=False)
    try:
        _, raw = chat(d, [{"role": "user", "content": "hi"}], stream, return_token_ids=True)
        assert b"prompt_token_ids" in raw and b'"token_ids"' in raw
        assert d.metric("kvshuttle_router_token_exact_kept_total", outcome="kept") == 1
    finally:
        d.close()


def test_an_edited_history_a_clients_ids_tools_and_a_failing_template_take_the_plain_path(
        loop: LoopThread, tiny_dir: Path, tmp_path: Path) -> None:
    d = exact_deploy(loop, with_template(tiny_dir, tmp_path / "raising", RAISING), token_exact_strict=False,
                     codec_dir=tiny_dir)  # the router's template raises where the engines' would not
    try:
        prefill = d.prefills[0]
        first = [{"role": "user", "content": "hi"}]
        chat(d, first, False)
        # the client rewrote the answer, and brings ids of its own: never used
        edited = [*first, {"role": "assistant", "content": " tok0 tok1"}, {"role": "user", "content": "go"}]
        chat(d, edited, False, kv_transfer_params={"prompt_token_ids": [5, 6, 7]})
        assert outcome(d, "history_edited") == 1
        assert "prompt_token_ids" not in prefill.requests[1]["body"]["kv_transfer_params"]
        assert prefill.prompt_ids[1] != [5, 6, 7]
        # tools: vLLM renders them into the prompt, the router does not: not asked for ids, nothing kept
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        chat(d, [{"role": "user", "content": "tools"}], False, conversation="t", tools=tools)
        assert outcome(d, "unsupported_request") == 1
        assert "return_token_ids" not in d.decodes[0].requests[-1]["body"]
        # the template raises on this conversation (a 400 from vLLM too, were it rendered): the plain path
        chat(d, [{"role": "user", "content": "x"}], False, conversation="b")
        chat(d, [{"role": "user", "content": "x"}, {"role": "assistant", "content": ANSWER},
                 {"role": "user", "content": "boom"}], False, conversation="b")
        assert outcome(d, "error") == 1
    finally:
        d.close()


def test_a_turn_past_the_bound_is_not_kept(loop: LoopThread, tiny_dir: Path) -> None:
    d = exact_deploy(loop, tiny_dir, token_exact_strict=False, token_exact_max_tokens=16)
    try:
        conversation(d, (False, True))
        assert d.metric("kvshuttle_router_token_exact_kept_total", outcome="oversized") == 2
        assert outcome(d, "no_kept_turn") == 2 and outcome(d, "exact") == 0
    finally:
        d.close()


def test_the_kept_turn_travels_in_redis(loop: LoopThread, tiny_dir: Path, redis_server: RedisServer) -> None:
    d = exact_deploy(loop, tiny_dir, token_exact_strict=False, store=redis_server.url)
    try:
        d.stop_router()
        d.start_router()  # a new router process: only Redis remembers the turn
        conversation(d, (False,))
        d.stop_router()
        d.start_router()
        messages = [{"role": "user", "content": "question 0 about the shuttle"},
                    {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "more"}]
        chat(d, messages, True)
        kept = kept_ids(d, 0)
        assert d.prefills[0].prompt_ids[1][:len(kept)] == kept
        assert outcome(d, "exact") == 1
    finally:
        d.close()


def test_kept_turns_round_trip_and_unreadable_ones_are_none() -> None:
    kept = KeptTurn(({"role": "user", "content": "hi"},), (1, 2, 3), (4, 1 << 31), "ab")
    assert kept_from_json(kept_json(kept)) == kept
    for broken in ("{", '{"m": [], "p": "AAA", "a": "", "t": ""}', '{"m": [1], "p": "", "a": "", "t": ""}', "[]"):
        assert kept_from_json(broken) is None


def test_the_stream_tap_takes_the_ids_out_of_whole_events() -> None:
    turn = ExactTurn([], client_ids=False)
    tap, events = IdsTap(turn, 100), EventFilter(hold_done=False)
    chunks = [b'data: {"prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
              b'"token_ids":[]}]}\n\ndata: {"choices":[{"index":0,"delta":{"content":"a"},',
              b'"token_ids":[7]}]}\n\n', b'data: {"choices":[{"index":0,"delta":{"content":"b"},"token_ids":[8,9]}]}'
              b"\n\ndata: [DONE]\n\n"]
    out = b"".join(tap.feed(events.feed(c)) for c in chunks) + tap.feed(events.finish())
    assert b"token_ids" not in out and out.endswith(b"data: [DONE]\n\n")
    assert turn.prompt_ids == [1, 2] and turn.answer_ids == [7, 8, 9] and "".join(turn.text) == "ab"
    assert turn.usable and not turn.overflow


def test_what_the_router_can_render_and_what_it_cannot() -> None:
    ok = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    assert renderable(ok)
    changes: list[dict[str, Any]] = [
        {"tools": [{}]}, {"chat_template": "x"}, {"n": 2}, {"add_generation_prompt": False},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "u"}]}]},
        {"messages": [{"role": "tool", "content": "r", "tool_call_id": "1"}]},
        {"messages": [{"role": "user", "content": "u", "name": "x"}]}]
    for changed in changes:
        assert not renderable({**ok, **changed}), changed


def test_a_tokenizer_directory_that_cannot_serve_is_refused_at_start(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RouterConfigError, match="cannot load"):
        load_codec(tmp_path)
    with pytest.raises(RouterConfigError, match="no chat_template"):
        load_codec(with_template(tiny_dir, tmp_path / "none", ""))
    (tmp_path / "none" / "chat_template.jinja").write_text(CHATML)  # transformers' newer layout
    rendered = load_codec(tmp_path / "none").render([{"role": "user", "content": "u"}], True)
    assert rendered == "<s>user\nu</s>\n<s>assistant\n"
    with pytest.raises(RouterConfigError, match="does not compile"):
        load_codec(with_template(tiny_dir, tmp_path / "bad", "{% for %}"))


def test_the_flags_and_their_checks(tiny_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--prefill", "http://h:1", "--decode", "http://h:2"]
    off = config_from(parser.parse_args(base), environ={})
    assert (off.token_exact, off.token_exact_max_tokens, off.token_exact_strict) == (None, 65_536, True)
    on = config_from(parser.parse_args([*base, "--token-exact", str(tiny_dir), "--token-exact-lenient",
                                        "--token-exact-max-tokens", "1000"]), environ={})
    assert (on.token_exact, on.token_exact_max_tokens, on.token_exact_strict) == (str(tiny_dir), 1000, False)
    config = RouterConfig([parse_backend("http://h:1")], [parse_backend("http://h:2")])
    for bad in ({"token_exact": ""}, {"token_exact_max_tokens": 0}, {"token_exact_strict": "yes"}):
        with pytest.raises(RouterConfigError):
            replace(config, **bad).check()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_prewarm_computes_the_ids_the_next_exact_prompt_starts_with(loop: LoopThread, tiny_dir: Path,
                                                                      stream: bool) -> None:
    d = exact_deploy(loop, tiny_dir, token_exact_strict=False, prewarm=True)
    try:
        conversation(d, (stream,))
        prefill = d.prefills[0]
        assert wait_until(lambda: bool(prefill.prewarms))
        warm = prefill.prewarms[0]["kv_transfer_params"]["prompt_token_ids"]
        assert warm == kept_ids(d, 0)  # the prompt and the answer, its stop token left out
        chat(d, [{"role": "user", "content": "question 0 about the shuttle"}, {"role": "assistant", "content": ANSWER},
                 {"role": "user", "content": "more"}], False)
        assert prefill.prompt_ids[-1][:len(warm)] == warm  # what the warmed prefix cache holds is the prefix
    finally:
        d.close()


def test_an_answer_whose_ids_do_not_cover_its_text_is_not_kept() -> None:
    turn = ExactTurn([], client_ids=False)
    turn.take({"prompt_token_ids": [1], "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [7]}]},
              True, 100)
    turn.take({"choices": [{"index": 0, "delta": {"content": "b"}}]}, True, 100)  # reasoning hid its ids
    assert not turn.usable
    several = ExactTurn([], client_ids=False)
    several.take({"prompt_token_ids": [1], "choices": [
        {"index": 0, "message": {"content": "a"}, "token_ids": [7]},
        {"index": 1, "message": {"content": "b"}, "token_ids": [8]}]}, False, 100)
    assert not several.usable and several.answer_ids == [7]
    tools = ExactTurn([], client_ids=True)
    answer = {"prompt_token_ids": [1], "choices": [
        {"index": 0, "message": {"content": "", "tool_calls": [{"id": "x"}]}, "token_ids": [7]}]}
    tools.take(answer, False, 100)
    assert not tools.usable and answer["choices"][0]["token_ids"] == [7]  # the client asked: left in


def test_a_tokenizer_or_template_other_than_the_served_ones_keeps_nothing(loop: LoopThread, tiny_dir: Path,
                                                                          tmp_path: Path) -> None:
    # the router was given a ChatML template; the engines render the tiny model's own
    d = exact_deploy(loop, with_template(tiny_dir, tmp_path / "chatml", CHATML), codec_dir=tiny_dir)
    try:
        conversation(d, (False, True, False))
        assert d.metric("kvshuttle_router_token_exact_kept_total", outcome="mismatch") == 3
        assert outcome(d, "no_kept_turn") == 3 and outcome(d, "exact") == 0
        assert all("prompt_token_ids" not in r["body"]["kv_transfer_params"] for r in d.prefills[0].requests)
    finally:
        d.close()
