"""The router against hostile or broken clients, over real HTTP (raw sockets where a well-behaved client library
would not misbehave): bodies read whole, bounded and checked before a turn takes an admission slot, slow readers
cut, malformed JSON of any shape a 400, API keys checked in constant time, routable binds only with tenants.

No assertion depends on timing: waits are for conditions, with generous bounds (a loaded 2-core CI machine)."""

from __future__ import annotations

import argparse
import gzip
import hmac
import json
import socket
import subprocess
import sys
from typing import Any

import openai
import pytest

from kvshuttle.router import BackendSpec, RouterConfig, RouterConfigError
from kvshuttle.router.auth import ApiKeys
from kvshuttle.router.config import check_exposure
from kvshuttle.router.main import add_arguments, byte_size, config_from
from router_helpers import (
    TIMEOUT_S,
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
ANSWER = " tok0 tok1 tok2"
CHAT = "/v1/chat/completions"
GOOD = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
P, D = [BackendSpec("http://127.0.0.1:8100")], [BackendSpec("http://127.0.0.1:8200")]


def _error_of(status: int, body: bytes) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert error["code"] == status and error["message"], body
    return dict(error)


# -- bodies are read whole before a slot is taken --------------------------------------------------------------
def test_a_client_trickling_its_body_holds_no_admission_slot(loop: LoopThread) -> None:
    d = deploy(loop, max_in_flight=1, body_timeout_s=600.0)
    slow = raw_connection(d.port, head(CHAT, 1000), b'{"model": "fake", ')  # 980 bytes never come
    try:
        assert d._runner is not None and d._runner.server is not None
        server = d._runner.server
        assert wait_until(lambda: server.requests_count >= 1)  # the router is handling the slow request
        # The only slot is free: without the fix the slow request holds it and this turn times out.
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)
        assert Conversation(client, "c", "hi").turn(stream=False) == ANSWER
        assert d.prefills[0].stats.requests == 1
    finally:
        slow.close()
        d.close()


def test_a_body_that_does_not_arrive_in_time_is_a_408(loop: LoopThread) -> None:
    d = deploy(loop, body_timeout_s=0.5)
    slow = raw_connection(d.port, head(CHAT, 1000), b'{"model": ')
    try:
        status, body = read_response(slow)
        assert status == 408 and "did not arrive" in _error_of(408, body)["message"]
        assert slow.recv(1) == b""  # the connection is closed: the rest of the body is not waited for
        assert d.metric("kvshuttle_router_client_timeouts_total", kind="body") == 1
        assert d.prefills[0].requests == []
        assert Conversation(d.client(), "c", "hi").turn(stream=True) == ANSWER
    finally:
        slow.close()
        d.close()


def test_a_declared_oversized_body_is_refused_before_it_is_sent(loop: LoopThread) -> None:
    d = deploy(loop)
    assert d.config.max_body_bytes == 4 << 20
    big = raw_connection(d.port, head(CHAT, (4 << 20) + 1))  # the head only: the router must not wait for it
    try:
        status, body = read_response(big)
        assert status == 413 and "limit" in _error_of(413, body)["message"]
        status, _ = post_raw(d.url + CHAT, json.dumps({**GOOD, "pad": "x" * ((4 << 20) - 200)}).encode())
        assert status == 200  # up to the limit is fine
    finally:
        big.close()
        d.close()


def test_a_chunked_body_over_the_limit_is_a_413(loop: LoopThread) -> None:
    d = deploy(loop, max_body_bytes=1024)
    body = json.dumps({**GOOD, "pad": "x" * 4096}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 500]), body[i:i + 500]) for i in range(0, len(body), 500))
    sock = raw_connection(d.port, head(CHAT, None, Transfer_Encoding="chunked"), chunked + b"0\r\n\r\n")
    try:
        status, answer = read_response(sock)
        assert status == 413
        _error_of(413, answer)
        assert d.prefills[0].requests == []
        assert post_raw(d.url + CHAT, json.dumps(GOOD).encode())[0] == 200
    finally:
        sock.close()
        d.close()


def test_a_compressed_body_is_refused_not_inflated(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        status, body = post_raw(d.url + CHAT, gzip.compress(json.dumps(GOOD).encode()), {"Content-Encoding": "gzip"})
        assert status == 415
        _error_of(415, body)
        assert d.prefills[0].requests == []
    finally:
        d.close()


# -- a streaming client that stops reading ----------------------------------------------------------------------
def test_a_streaming_client_that_stops_reading_is_cut_and_frees_its_slot(loop: LoopThread) -> None:
    d = deploy(loop, max_in_flight=1, client_write_timeout_s=1.0)
    d.decodes[0].behaviour = "flood"  # an endless answer: the router's writes back up once the client stops
    body = json.dumps({**GOOD, "stream": True}).encode()
    reader = raw_connection(d.port, head(CHAT, len(body)), body, rcvbuf=4096)
    try:
        assert reader.recv(16).startswith(b"HTTP/1.1 200")  # the stream started; the client reads no more
        # The router cut the client and closed the decode's stream (without the fix: never).
        assert wait_until(lambda: d.decodes[0].stats.flood_ended == 1)
        d.decodes[0].behaviour = "ok"
        assert Conversation(d.client(), "c", "hi").turn(stream=True) == ANSWER  # the slot is free again
        assert d.metric("kvshuttle_router_client_timeouts_total", kind="write") == 1
    finally:
        reader.close()
        d.close()


def test_a_client_not_reading_a_large_answer_is_cut(loop: LoopThread) -> None:
    d = deploy(loop, max_in_flight=1, client_write_timeout_s=1.0)
    d.decodes[0].tokens = 3_000_000  # a non-streamed answer of about 35 MB: far more than sockets buffer
    body = json.dumps(GOOD).encode()
    reader = raw_connection(d.port, head(CHAT, len(body)), body, rcvbuf=4096)
    try:
        assert reader.recv(16).startswith(b"HTTP/1.1 200")  # the answer started; the client reads no more
        assert wait_until(lambda: d.metric("kvshuttle_router_client_timeouts_total", kind="write") == 1)
        d.decodes[0].tokens = 3
        assert Conversation(d.client(), "c", "hi").turn(stream=False) == ANSWER
    finally:
        reader.close()
        d.close()


# -- malformed bodies of every shape ------------------------------------------------------------------------------
MSG = '"messages": [{"role": "user", "content": "hi"}]'
MALFORMED: dict[str, tuple[str, bytes]] = {
    "empty": (CHAT, b""),
    "not json": (CHAT, b"hello"),
    "truncated": (CHAT, b'{"messages": ['),
    "trailing garbage": (CHAT, b'{' + MSG.encode() + b'} x'),
    "100000 nested lists": (CHAT, b"[" * 100_000 + b"]" * 100_000),
    "100000 nested objects": (CHAT, b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    "200 nested lists in a field": (CHAT, b'{' + MSG.encode() + b', "x": ' + b"[" * 200 + b"]" * 200 + b"}"),
    "a list": (CHAT, b"[]"),
    "null": (CHAT, b"null"),
    "a number": (CHAT, b"42"),
    "a string": (CHAT, b'"hello"'),
    "stream a string": (CHAT, b'{' + MSG.encode() + b', "stream": "yes"}'),
    "stream a number": (CHAT, b'{' + MSG.encode() + b', "stream": 1}'),
    "stream an object": (CHAT, b'{' + MSG.encode() + b', "stream": {}}'),
    "conversation_id a number": (CHAT, b'{' + MSG.encode() + b', "conversation_id": 5}'),
    "conversation_id zero": (CHAT, b'{' + MSG.encode() + b', "conversation_id": 0}'),
    "conversation_id a list": (CHAT, b'{' + MSG.encode() + b', "conversation_id": ["a"]}'),
    "conversation_id an object": (CHAT, b'{' + MSG.encode() + b', "conversation_id": {"a": 1}}'),
    "conversation_id empty": (CHAT, b'{' + MSG.encode() + b', "conversation_id": ""}'),
    "conversation_id a control char": (CHAT, b'{' + MSG.encode() + b', "conversation_id": "a\\u0000b"}'),
    "conversation_id a lone surrogate": (CHAT, b'{' + MSG.encode() + b', "conversation_id": "\\ud800"}'),
    "conversation_id too long": (CHAT, b'{' + MSG.encode() + b', "conversation_id": "' + b"c" * 300 + b'"}'),
    "messages missing": (CHAT, b'{"model": "fake"}'),
    "messages an object": (CHAT, b'{"messages": {"role": "user"}}'),
    "messages a string": (CHAT, b'{"messages": "hi"}'),
    "messages of numbers": (CHAT, b'{"messages": [1, 2]}'),
    "prompt a number": ("/v1/completions", b'{"prompt": 5}'),
    "prompt an object": ("/v1/completions", b'{"prompt": {"a": 1}}'),
    "a number past a double": (CHAT, b'{' + MSG.encode() + b', "temperature": 1e999}'),
    "a negative number past a double": (CHAT, b'{' + MSG.encode() + b', "temperature": -1e999}'),
    "a 5000-digit integer": (CHAT, b'{' + MSG.encode() + b', "seed": ' + b"9" * 5000 + b"}"),
    "NaN": (CHAT, b'{' + MSG.encode() + b', "temperature": NaN}'),
    "Infinity": (CHAT, b'{' + MSG.encode() + b', "temperature": Infinity}'),
    "-Infinity": (CHAT, b'{' + MSG.encode() + b', "temperature": -Infinity}'),
    "invalid UTF-8": (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    "an encoded surrogate": (CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'),
    "overlong UTF-8": (CHAT, b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}'),
    "a UTF-8 BOM": (CHAT, b"\xef\xbb\xbf{" + MSG.encode() + b"}"),
    "UTF-16": (CHAT, ("{" + MSG + "}").encode("utf-16")),
}


def test_malformed_bodies_of_any_shape_are_400s_and_the_router_goes_on(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        wrong = {}
        for name, (path, body) in MALFORMED.items():
            status, answer = post_raw(d.url + path, body)
            try:
                _error_of(400, answer)
            except (ValueError, KeyError, AssertionError):
                wrong[name] = (status, answer[:200])
                continue
            if status != 400:
                wrong[name] = (status, answer[:200])
        assert wrong == {}
        assert d.prefills[0].requests == [] and d.decodes[0].requests == []  # the router refused them itself
        assert post_raw(d.url + CHAT, json.dumps({**GOOD, "conversation_id": "ok"}).encode())[0] == 200
        assert Conversation(d.client(), "ok", "hi", messages=[]).turn(stream=True) == ANSWER
        assert d.metric("kvshuttle_router_requests_total", endpoint=CHAT, outcome="400") == len(
            [p for p, _ in MALFORMED.values() if p == CHAT])
    finally:
        d.close()


def test_client_kv_transfer_params_of_any_type_are_dropped_not_refused(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        for params in ("x", 5, [1], {"remote_host": "10.0.0.66"}):
            assert post_raw(d.url + CHAT, json.dumps({**GOOD, "kv_transfer_params": params}).encode())[0] == 200
        assert d.metric("kvshuttle_router_client_params_dropped_total") == 4
    finally:
        d.close()


# -- API keys -------------------------------------------------------------------------------------------------------
def test_api_keys_are_compared_in_constant_time_with_every_key(loop: LoopThread,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    keys = {"key-a": "a", "key-b": "b", "key-c": "c"}
    d = deploy(loop, api_keys=keys)
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    try:
        status, _ = post_raw(d.url + CHAT, json.dumps(GOOD).encode(), {"Authorization": "Bearer key-x"})
        assert status == 401
        assert compared.count((32, 32)) == len(keys)  # digests of equal size: no length leaks either
        compared.clear()
        status, _ = post_raw(d.url + CHAT, json.dumps(GOOD).encode(), {"Authorization": "Bearer key-a"})
        assert status == 200
        assert compared.count((32, 32)) == len(keys)  # the first key matched; the others were compared anyway
    finally:
        d.close()


def test_api_key_checks_never_show_a_key() -> None:
    keys = ApiKeys({"sk-secret-1": "a", "sk-secret-2": "b"})
    assert keys.tenant("Bearer sk-secret-2") == "b" and keys.tenant("bearer sk-secret-1") == "a"
    assert keys.tenant("Bearer sk-secret") is None and keys.tenant(None) is None and keys.tenant("sk-secret-1") is None
    assert keys.tenant("Bearer ") is None and keys.tenant("Bearer \udcff") is None
    assert "sk-secret" not in repr(keys)
    config = RouterConfig(P, D, api_keys={"sk-secret-1": "a"}, backend_api_key="sk-backend",
                          store="redis://:hunter2-pw@127.0.0.1:6379/0")
    assert "sk-secret" not in repr(config) and "sk-backend" not in repr(config) and "hunter2-pw" not in repr(config)
    assert "redis://:***@127.0.0.1:6379/0" in repr(config)


# -- binds ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
def test_loopback_binds_need_no_tenants(host: str) -> None:
    assert check_exposure(host, RouterConfig(P, D)) is None  # no RouterConfigError


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "router.example.com"])
def test_routable_binds_need_tenants_or_the_explicit_flag(host: str) -> None:
    with pytest.raises(RouterConfigError, match=r"--api-keys FILE .* --tenant-header NAME .* --allow-shared-tenant"):
        check_exposure(host, RouterConfig(P, D))
    assert check_exposure(host, RouterConfig(P, D, tenant_header="X-Tenant")) is None
    assert check_exposure(host, RouterConfig(P, D, api_keys={"k": "t"})) is None
    assert check_exposure(host, RouterConfig(P, D), allow_shared_tenant=True) is None


def test_the_router_command_refuses_a_routable_bind_without_tenants() -> None:
    command = [sys.executable, "-m", "kvshuttle.cli", "router", "--prefill", "http://h:1", "--decode", "http://h:2",
               "--host", "0.0.0.0", "--port", "0"]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the router served 0.0.0.0 without tenants")
    assert run.returncode == 2
    assert "--api-keys" in run.stderr and "--tenant-header" in run.stderr and "--allow-shared-tenant" in run.stderr


# -- the command's flags ----------------------------------------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--prefill", "http://h:1", "--decode", "http://h:2", *argv])


def test_new_flags_and_their_defaults() -> None:
    config = config_from(_args(), environ={})
    assert (config.max_body_bytes, config.body_timeout_s, config.client_write_timeout_s,
            config.client_idle_timeout_s, config.max_store_bytes, config.store) == (
        4 << 20, 30.0, 30.0, 75.0, 256 << 20, "memory")
    config = config_from(_args("--max-body-bytes", "1M", "--max-store-bytes", "64MiB", "--body-timeout", "5",
                               "--client-write-timeout", "7", "--client-idle-timeout", "9"), environ={})
    assert (config.max_body_bytes, config.max_store_bytes, config.body_timeout_s, config.client_write_timeout_s,
            config.client_idle_timeout_s) == (1 << 20, 64 << 20, 5.0, 7.0, 9.0)
    assert [byte_size(t) for t in ("4096", "4k", "4 KiB", "2G", "3mb")] == [4096, 4096, 4096, 2 << 30, 3 << 20]
    for bad in ("0", "-1", "4T", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_the_redis_url_and_backend_key_come_from_one_source(tmp_path: Any) -> None:
    url_file, key_file = tmp_path / "redis-url", tmp_path / "backend-key"
    url_file.write_text("redis://:from-file@127.0.0.1:1/0\n")
    key_file.write_text("sk-from-file\n")
    env = {"KVSHUTTLE_REDIS_URL": "redis://:from-env@127.0.0.1:1/0", "KVSHUTTLE_BACKEND_API_KEY": "sk-from-env"}
    assert config_from(_args(), environ=env).store == env["KVSHUTTLE_REDIS_URL"]
    assert config_from(_args(), environ=env).backend_api_key == "sk-from-env"
    assert config_from(_args("--store", "memory"), environ=env).store == "memory"  # explicit beats the environment
    assert config_from(_args("--redis-url-file", str(url_file)), environ=env).store.endswith("from-file@127.0.0.1:1/0")
    assert config_from(_args("--backend-api-key-file", str(key_file)), environ=env).backend_api_key == "sk-from-file"
    assert config_from(_args("--store", "redis", "--redis-url", "redis://h:1/0"), environ={}).store == "redis://h:1/0"
    assert config_from(_args("--store", "redis://h:2/0"), environ={}).store == "redis://h:2/0"  # as before
    for argv, match in [(("--store", "redis"), "needs the URL"), (("--store", "memory", "--redis-url", "redis://h:1"),
                                                                   "choose one"),
                        (("--store", "redis://h:1", "--redis-url", "redis://h:2"), "once"),
                        (("--redis-url-file", str(tmp_path / "missing")), "cannot read"),
                        (("--backend-api-key", "a", "--backend-api-key-file", str(key_file)), "once")]:
        with pytest.raises(RouterConfigError, match=match):
            config_from(_args(*argv), environ={})
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(RouterConfigError, match="empty") as caught:
        config_from(_args("--redis-url-file", str(tmp_path / "empty")), environ={})
    assert "from-file" not in str(caught.value)


def test_an_api_key_file_error_never_shows_a_key(tmp_path: Any) -> None:
    bad = tmp_path / "keys.json"
    bad.write_text('{"sk-live-very-secret": "team-a",}')  # not JSON: a trailing comma
    with pytest.raises(RouterConfigError) as caught:
        config_from(_args("--api-keys", str(bad)), environ={})
    assert "sk-live-very-secret" not in str(caught.value) and "line 1" in str(caught.value)


def test_a_socket_without_a_request_is_closed_once_idle(loop: LoopThread) -> None:
    d = deploy(loop, client_idle_timeout_s=0.5)
    try:
        sock = socket.create_connection(("127.0.0.1", d.port), timeout=TIMEOUT_S)
        body = json.dumps(GOOD).encode()
        sock.sendall(head(CHAT, len(body)) + body)
        assert read_response(sock)[0] == 200
        assert sock.recv(1) == b""  # kept alive after the answer, then closed for idling (default: over an hour)
        sock.close()
    finally:
        d.close()
