"""The router's trust boundary over real HTTP: handles authenticated before they are stored, retention grants on
every backend request, nothing of the KV plumbing (handles, grants) ever shown to a client, streamed answers
included (vLLM 0.33 puts ``kv_transfer_params`` on a stream's last chunk), secrets masked in every log line and
error body, and the memory store bounded in bytes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.router import (
    FIRST_TURN_PARAMS,
    MemoryStore,
    RedisStore,
    RouterConfig,
    RouterConfigError,
    StoredHandle,
    StoreError,
)
from kvshuttle.router.bodies import PRIVATE_MARKERS
from kvshuttle.router.doubles import FakeVllm
from kvshuttle.router.kv import SideChannelCalls
from kvshuttle.router.redact import redact_url
from kvshuttle.router.sse import EventFilter, StreamFormatError
from kvshuttle.router.store import Lookup
from kvshuttle.transfer.errors import PeerAuthError
from kvshuttle.trust import GRANT_FIELD, DeploymentSecret
from router_helpers import (
    TIMEOUT_S,
    Conversation,
    LoopThread,
    RedisServer,
    deploy,
    free_port,
    fresh_secret,
    post_raw,
    prefill_handles,
    routing,
    stop_process,
)

pytest_plugins = ["router_fixtures"]  # loop, redis_server
ANSWER = " tok0 tok1 tok2"
CHAT = "/v1/chat/completions"
PLUMBING = (*PRIVATE_MARKERS, GRANT_FIELD.encode())


def _turn_raw(url: str, conversation: str, stream: bool, history: list[dict[str, str]]) -> bytes:
    """One chat turn as raw bytes (what a client receives), its answer appended to ``history``."""
    history.append({"role": "user", "content": "hello there" if not history else "more"})
    body = {"model": "fake", "messages": history, "stream": stream, "conversation_id": conversation}
    status, raw = post_raw(url + CHAT, json.dumps(body).encode())
    assert status == 200, raw
    if stream:
        events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
        text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events)
        assert raw.endswith(b"data: [DONE]\n\n")
    else:
        text = json.loads(raw)["choices"][0]["message"]["content"]
    history.append({"role": "assistant", "content": text})
    assert text == ANSWER
    return raw


def _shows_no_plumbing(raw: bytes) -> None:
    assert not [m for m in PLUMBING if m in raw], raw[:400]


# -- streamed answers: kv_transfer_params on the last chunk (vLLM 0.33) ------------------------------------------------
@pytest.mark.parametrize("connector", ["kvshuttle", "nixl"])
def test_params_on_a_streams_last_chunk_are_learned_and_never_shown(loop: LoopThread, connector: str) -> None:
    # no side channel: the only way to learn a streamed turn's handle is the chunk itself
    d = deploy(loop, connector=connector, backend_kwargs={"stream_params": True, "side_channel": False})
    try:
        history: list[dict[str, str]] = []
        raws = [_turn_raw(d.url, "c", True, history) for _ in range(3)]
        for raw in raws:
            _shows_no_plumbing(raw)
        sent = prefill_handles(d.prefills[0])
        assert sent[0] == FIRST_TURN_PARAMS
        if connector == "kvshuttle":
            decode = d.decodes[0]
            for k in (1, 2):
                assert sent[k] == {**routing(decode.issued_params[k - 1]), "do_remote_decode": True,
                                   "do_remote_prefill": False}
        else:
            assert all(p["remote_engine_id"] == d.decodes[0].name for p in sent[1:])
        assert d.metric("kvshuttle_router_handles_stored_total") == 3
        assert d.metric("kvshuttle_router_handles_unlearned_total", reason="stream_without_board") == 0
    finally:
        d.close()


def test_a_streams_chunk_params_are_authenticated_like_a_bodys(loop: LoopThread) -> None:
    d = deploy(loop, backend_kwargs={"stream_params": True, "side_channel": False})
    try:
        history: list[dict[str, str]] = []
        d.decodes[0].behaviour = "forged"
        _shows_no_plumbing(_turn_raw(d.url, "c", True, history))
        d.decodes[0].behaviour = "ok"
        _turn_raw(d.url, "c", True, history)
        assert prefill_handles(d.prefills[0])[1] == FIRST_TURN_PARAMS
        assert d.metric("kvshuttle_router_handles_invalid_total", reason="unauthenticated") == 1
    finally:
        d.close()


def test_the_event_filter_strips_params_across_chunk_boundaries() -> None:
    params = {"remote_block_ids": [1], "kvshuttle_grant": "v1.1.aa"}
    last = b"data: " + json.dumps({"id": "x", "choices": [], "kv_transfer_params": params}).encode() + b"\n\n"
    token = b'data: {"choices": [{"delta": {"content": "say kv_transfer_params"}}]}\n\n'
    stream = token + last + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):  # every split into two network reads
        events = EventFilter(hold_done=True)
        out = events.feed(stream[:cut]) + events.feed(stream[cut:]) + events.finish()
        assert out == token + b'data: {"id":"x","choices":[]}\n\n', cut
        assert events.found and events.params == params and events.held == b"data: [DONE]\n\n"
    crlf = EventFilter(hold_done=False)
    assert crlf.feed(last.replace(b"\n\n", b"\r\n\r\n")) == b'data: {"id":"x","choices":[]}\r\n\r\n'
    bad = EventFilter(hold_done=False)
    assert bad.feed(b"data: not json kv_transfer_params\n\n" + token) == token and bad.dropped == 1
    assert EventFilter(hold_done=False).feed(b"event: x\ndata: {\"kv_transfer_params\": 1,\ndata: \"a\": 2}\n\n") == (
        b'event: x\ndata: {"a":2}\n\n')
    tail = EventFilter(hold_done=False)
    assert tail.feed(last[:-2]) == b"" and tail.finish() == b'data: {"id":"x","choices":[]}\n\n'
    with pytest.raises(StreamFormatError):
        EventFilter(hold_done=False, max_event_bytes=100).feed(b"data: " + b"x" * 200)


# -- handles are authenticated ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("behaviour", ["forged", "unsigned"])
def test_handles_that_do_not_verify_are_not_stored(loop: LoopThread, stream: bool, behaviour: str) -> None:
    d = deploy(loop)
    try:
        chat = Conversation(d.client(), "c", "hi")
        d.decodes[0].behaviour = behaviour
        chat.turn(stream)
        d.decodes[0].behaviour = "ok"
        chat.turn(stream)
        chat.turn(stream)
        sent = prefill_handles(d.prefills[0])
        assert sent[1] == FIRST_TURN_PARAMS and sent[2]["kvshuttle_handle_id"]  # only the good one went on
        assert d.metric("kvshuttle_router_handles_invalid_total", reason="unauthenticated") == 1
        assert d.metric("kvshuttle_router_handles_stored_total") == 2
    finally:
        d.close()


def test_a_decode_of_another_deployment_is_not_trusted(loop: LoopThread) -> None:
    d = deploy(loop, backend_kwargs={"secret": fresh_secret()})  # the router holds another secret
    try:
        chat = Conversation(d.client(), "c", "hi")
        assert [chat.turn(stream=False), chat.turn(stream=False)] == [ANSWER, ANSWER]
        assert prefill_handles(d.prefills[0])[1] == FIRST_TURN_PARAMS
        assert d.metric("kvshuttle_router_handles_invalid_total", reason="unauthenticated") == 2
        assert d.prefills[0].stats.granted == 0  # its grants are not this deployment's either
    finally:
        d.close()


def test_side_channel_calls_authenticate_with_the_routers_secret() -> None:
    secret = fresh_secret()
    decode = FakeVllm("decode", secret=secret)
    strangers, members = SideChannelCalls(fresh_secret(), threads=1), SideChannelCalls(secret, threads=1)
    address = f"tcp://{decode.kv_address}"
    try:
        decode.board.put("k1", {"a": 1})
        with pytest.raises(PeerAuthError):
            asyncio.run(strangers.take(address, "k1", 2.0))
        assert asyncio.run(members.take(address, "k1", 2.0)) == {"a": 1}
    finally:
        strangers.close()
        members.close()
        asyncio.run(decode.stop())


# -- retention grants ----------------------------------------------------------------------------------------------
def test_every_prefill_and_decode_request_carries_a_fresh_grant(loop: LoopThread) -> None:
    d = deploy(loop, decodes=2)
    try:
        chat = Conversation(d.client(), "c", "hi")
        chat.turn(stream=False)
        chat.turn(stream=True)
        d.decodes[0].behaviour = "fail"  # tried first, fails: the retry on the other one carries a grant too
        assert d.router is not None
        d.router.decode.mark(d.router.decode.backends[1], False)
        chat.turn(stream=True)
        assert d.metric("kvshuttle_router_retries_total", role="decode") == 1
        requests = [*d.prefills[0].requests, *d.decodes[0].requests, *d.decodes[1].requests]
        assert len(requests) == 7
        for server in (d.prefills[0], *d.decodes):
            assert server.stats.ungranted == 0 and server.stats.granted == len(server.requests)
        grants = {r["body"]["kv_transfer_params"][GRANT_FIELD] for r in requests}
        assert all(g.startswith("v2.") for g in grants) and len(grants) == len(requests)  # one per request
    finally:
        d.close()


def test_no_grant_goes_to_nixl_engines(loop: LoopThread) -> None:
    d = deploy(loop, connector="nixl")
    try:
        Conversation(d.client(), "c", "hi").turn(stream=False)
        bodies = [r["body"]["kv_transfer_params"] for r in (*d.prefills[0].requests, *d.decodes[0].requests)]
        assert bodies and all(GRANT_FIELD not in b for b in bodies)
    finally:
        d.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_clients_never_see_handles_or_grants_even_in_echoed_errors(loop: LoopThread, stream: bool) -> None:
    d = deploy(loop)
    try:
        history: list[dict[str, str]] = []
        for _ in range(2):
            _shows_no_plumbing(_turn_raw(d.url, "c", stream, history))
        body = json.dumps({"model": "fake", "messages": history, "stream": stream, "conversation_id": "c"}).encode()
        for server in (d.prefills[0], d.decodes[0]):  # vLLM's 400s may quote the request, params and all
            server.behaviour = "echo_400"
            status, raw = post_raw(d.url + CHAT, body)
            server.behaviour = "ok"
            assert status == 400 and json.loads(raw)["error"]["code"] == 400
            _shows_no_plumbing(raw)
        assert d.decodes[0].requests[-1]["body"]["kv_transfer_params"][GRANT_FIELD]  # there was one to echo
    finally:
        d.close()


# -- secrets in logs and error bodies --------------------------------------------------------------------------------
def test_a_redis_password_never_reaches_a_log_line_or_an_error_body(loop: LoopThread,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    password = "hunter2-redis-password"
    url = f"redis://:{password}@127.0.0.1:{free_port()}/0"  # nothing listens: every exchange fails
    caplog.set_level(logging.DEBUG)
    d = deploy(loop, store=url, store_timeout_s=1.0)
    try:
        bodies = []
        for _ in range(5):  # past three failures the store is skipped: a message naming the store
            bodies.append(Conversation(d.client(), "c", "hi").turn(stream=False))
        req = urllib.request.Request(d.url + "/v1/conversations/c", method="DELETE")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=TIMEOUT_S)
        error = caught.value.read()
        assert caught.value.code == 503 and json.loads(error)["error"]["code"] == 503
        for path in ("/metrics", "/health"):
            with urllib.request.urlopen(d.url + path, timeout=TIMEOUT_S) as resp:
                bodies.append(resp.read().decode())
        assert password.encode() not in error and all(password not in b for b in bodies)
        assert password not in caplog.text and password not in repr(d.config)
        assert f"redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]}" in caplog.text  # the store is still named
    finally:
        d.close()


def test_error_bodies_carry_no_internal_exception_text(loop: LoopThread) -> None:
    class Broken(MemoryStore):
        async def take(self, key: str, tenant: str, conversation: str) -> Lookup:
            raise RuntimeError("internal detail redis://:hunter2@10.0.0.9")

        async def delete(self, key: str) -> StoredHandle | None:
            raise StoreError("redis delete failed: internal detail hunter2")

    d = deploy(loop, router_kwargs={"store": Broken()})
    try:
        body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "conversation_id": "c"}
        status, raw = post_raw(d.url + CHAT, json.dumps(body).encode())
        assert status == 500 and json.loads(raw)["error"]["type"] == "internal_error"
        req = urllib.request.Request(d.url + "/v1/conversations/c", method="DELETE")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=TIMEOUT_S)
        assert caught.value.code == 503
        assert b"hunter2" not in raw and b"hunter2" not in caught.value.read() and b"internal detail" not in raw
    finally:
        d.close()


def test_redis_store_errors_name_the_store_without_its_password() -> None:
    password = "pw-only-in-this-url"  # registered nowhere: only redact_url can hide it

    async def run() -> str:
        store = RedisStore(f"redis://:{password}@127.0.0.1:{free_port()}/0", timeout_s=1.0, backoff_s=60.0)
        try:
            for _ in range(RedisStore.TRIP_AFTER + 1):  # the last one: "failed repeatedly", naming the store
                with pytest.raises(StoreError) as caught:
                    await store.take("k", "t", "c")
                assert password not in str(caught.value)
            return str(caught.value)
        finally:
            await store.close()

    message = asyncio.run(run())
    assert "redis://:***@127.0.0.1:" in message and "repeatedly" in message


def test_registered_secrets_are_masked_in_every_log_record(caplog: pytest.LogCaptureFixture) -> None:
    from kvshuttle.router.main import JsonFormatter, TextFormatter
    from kvshuttle.router.redact import install_filter, register

    register(["sk-logged-by-mistake"])
    install_filter()
    caplog.set_level(logging.INFO, logger="kvshuttle.router")
    log = logging.getLogger("kvshuttle.router")
    log.info("key %s", "sk-logged-by-mistake", extra={"kv": {"auth": "Bearer sk-logged-by-mistake"}})
    try:
        raise RuntimeError("failed with sk-logged-by-mistake")
    except RuntimeError:
        log.exception("oops")
    assert len(caplog.records) == 2
    for record in caplog.records:
        for formatter in (JsonFormatter(), TextFormatter()):
            line = formatter.format(record)
            assert "sk-logged-by-mistake" not in line and "***" in line, line
    assert "sk-logged-by-mistake" not in caplog.text


def test_store_urls_are_shown_redacted() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://user:pw@h/0") == "redis://user:***@h/0"
    assert redact_url("rediss://pw@h:1") == "rediss://***@h:1"
    assert redact_url("unix:///run/redis.sock?db=1&password=pw") == "unix:///run/redis.sock?db=1&password=***"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    with pytest.raises(RouterConfigError) as caught:
        RouterConfig([], [], store="mysql://root:pw-in-url@db").check()
    assert "pw-in-url" not in str(caught.value)


def test_the_router_command_takes_the_redis_url_from_the_environment_or_a_file(loop: LoopThread,
                                                                              tmp_path: Path) -> None:
    import redis

    password = "s3cret-redis-pass"
    server = RedisServer(tmp_path, password=password).start()
    text = secrets.token_hex(32)  # the deployment secret, shared with the router process by the environment
    secret = DeploymentSecret(text.encode())
    prefill = loop.run(FakeVllm("prefill", secret=secret).start())
    decode = loop.run(FakeVllm("decode", secret=secret).start())
    url_file = tmp_path / "redis-url"
    url_file.write_text(server.url + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSHUTTLE_")}
    env["KVSHUTTLE_SECRET"] = text
    try:
        for source, extra_env, extra_args in (("env", {"KVSHUTTLE_REDIS_URL": server.url}, []),
                                              ("file", {}, ["--redis-url-file", str(url_file)])):
            redis.Redis.from_url(server.url).flushall()
            log = tmp_path / f"router-{source}.log"
            stderr = run_router(prefill, decode, {**env, **extra_env}, extra_args, log, conversation=source)
            keys = redis.Redis.from_url(server.url).keys("kvshuttle:router:h:*")
            assert keys, f"{source}: nothing stored in redis"
            assert password not in stderr and f"redis://:***@127.0.0.1:{server.port}/0" in stderr, stderr[-2000:]
        server.stop()  # now every exchange fails: the failures are logged, the password is not
        stderr = run_router(prefill, decode, {**env, "KVSHUTTLE_REDIS_URL": server.url}, ["--store-timeout", "0.5"],
                            tmp_path / "router-down.log", conversation="down", turns=4)
        assert "store lookup failed" in stderr and password not in stderr
    finally:
        server.stop()
        loop.run(prefill.stop())
        loop.run(decode.stop())


def run_router(prefill: FakeVllm, decode: FakeVllm, env: dict[str, str], extra: list[str], log: Path, *,
               conversation: str, turns: int = 2) -> str:
    """Run ``kvshuttle router`` as a process for a few turns; its stderr."""
    import openai

    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvshuttle.cli", "router", "--prefill", prefill.backend,
                                 "--decode", decode.backend, "--port", "0", *extra], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert "listening on http://127.0.0.1:" in line, log.read_text()[-2000:]
            client = openai.OpenAI(base_url=line.split()[-1] + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)
            chat = Conversation(client, conversation, "hello")
            for _ in range(turns):
                assert chat.turn(stream=True) == ANSWER
        finally:
            stop_process(proc)
    return log.read_text()


# -- the memory store is bounded in bytes -----------------------------------------------------------------------------
def _entry(name: str, pad: int = 0) -> StoredHandle:
    return StoredHandle("t", name, {"remote_block_ids": [1], "pad": "x" * pad}, "d", None, 1e12)


def test_the_memory_store_is_bounded_in_bytes_least_recently_used_first() -> None:
    size = _entry("a", 1000).approx_bytes()
    evicted: list[int] = []
    store = MemoryStore(max_entries=1000, max_bytes=3 * size, on_evict=evicted.append)

    async def run() -> dict[str, Any]:
        for name in "abc":
            await store.put(name, _entry(name, 1000))
        full = store.bytes
        await store.get("a", "t", "a")  # a is now more recent than b
        await store.put("d", _entry("d", 1000))
        after = {k: (await store.get(k, "t", k)).status for k in "abcd"}
        await store.put("huge", _entry("huge", 4 * size))  # over the whole budget: not kept, nothing evicted
        kept = len(store)
        await store.put("e", _entry("e", 2 * size))  # two entries' worth: two more go
        return {"full": full, "after": after, "kept": kept, "left": sorted(store._entries)}

    result = asyncio.run(run())
    assert result["full"] == 3 * size and store.bytes <= store.max_bytes
    assert result["after"] == {"a": "hit", "b": "miss", "c": "hit", "d": "hit"}  # b, least recent, went
    assert result["kept"] == 3 and result["left"] == ["e"]  # e alone is near the whole budget
    assert evicted == [1, 1, 3]  # b; huge itself; a, c and d


def test_the_memory_store_gives_its_bytes_back() -> None:
    now = [100.0]
    store = MemoryStore(clock=lambda: now[0], max_bytes=1 << 20)

    async def run() -> list[int]:
        seen = []
        for name in "abcd":
            await store.put(name, StoredHandle("t", name, {"pad": "x" * 500}, "d", None, now[0] + 10))
        seen.append(store.bytes)
        await store.take("a", "t", "a")
        await store.delete("b")
        await store.put("c", StoredHandle("t", "c", {"pad": "y"}, "d", None, now[0] + 10))  # replaced, smaller
        now[0] += 11
        await store.sweep()
        seen.append(store.bytes)
        return seen

    full, empty = asyncio.run(run())
    assert full > 4 * 500 and empty == 0 and len(store) == 0


def test_the_routers_store_budget_holds_over_http(loop: LoopThread) -> None:
    d = deploy(loop, max_store_bytes=6000)  # a signed kvshuttle handle is about 1.3 KB serialized here
    try:
        for i in range(8):
            Conversation(d.client(), f"conversation-{i}", f"hello {i}").turn(stream=i % 2 == 0)
        stored = d.metric("kvshuttle_router_store_bytes")
        assert 0 < stored <= 6000
        assert d.metric("kvshuttle_router_handle_evictions_total") >= 1
        assert d.metric("kvshuttle_router_live_handles") < 8
        with pytest.raises(RouterConfigError):
            RouterConfig(d.config.prefill, d.config.decode, max_store_bytes=0).check()
    finally:
        d.close()
