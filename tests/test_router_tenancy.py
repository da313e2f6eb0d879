"""Tenants kept apart by the router (issue 31, items 5-7): vLLM's ``cache_salt`` set per tenant (or conversation)
on every backend request, stored conversations and pre-warms under per-tenant quotas, ``/health`` and ``/metrics``
closed to tenants, no backend credentials shown anywhere, and a streamed end marker never held for a handle that
cannot come."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from aiohttp import web

from kvshuttle.router import MemoryStore, RedisStore, StoredHandle, parse_backend
from kvshuttle.router.backends import Backend
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.prewarm import Prewarmer
from router_helpers import (
    TIMEOUT_S,
    Conversation,
    LoopThread,
    RedisServer,
    deploy,
    free_port,
    head,
    raw_connection,
    wait_until,
)

pytest_plugins = ["router_fixtures"]  # loop, redis_server
CHAT = "/v1/chat/completions"
KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}


def _salts(server: Any) -> list[Any]:
    return [r["body"].get("cache_salt") for r in server.requests]


# -- cache_salt ------------------------------------------------------------------------------------------------------
def test_every_backend_request_carries_its_tenants_salt(loop: LoopThread) -> None:
    """With API keys the salt is per tenant by default: the same on a conversation's prefill, decode and pre-warm,
    different for another tenant (same conversation id, same messages); a client's own salt is folded in, never
    in place of the tenant's."""
    d = deploy(loop, api_keys=KEYS, admin_key="sk-admin", prewarm=True)
    try:
        Conversation(d.client(api_key="sk-a"), "c", "same words").turn(stream=False)
        Conversation(d.client(api_key="sk-b"), "c", "same words").turn(stream=True)
        Conversation(d.client(api_key="sk-a"), "c2", "same words").turn(stream=False, cache_salt="mine")
        Conversation(d.client(api_key="sk-b"), "c2", "same words").turn(stream=False, cache_salt="mine")
        assert wait_until(lambda: len(d.prefills[0].prewarms) == 4)
        prefill, decode = _salts(d.prefills[0]), _salts(d.decodes[0])
        warmed = [w.get("cache_salt") for w in d.prefills[0].prewarms]
        assert prefill == decode and all(isinstance(s, str) and len(s) == 32 for s in prefill)
        a, b, a_own, b_own = prefill
        assert len({a, b, a_own, b_own, "mine"}) == 5  # per tenant; the client's salt changes it, never replaces it
        assert sorted(warmed) == sorted(prefill)  # the pre-warm warms the cache the next turn will read
    finally:
        d.close()


@pytest.mark.parametrize("mode", ["conversation", "off"])
def test_the_salt_can_be_per_conversation_or_off(loop: LoopThread, mode: str) -> None:
    d = deploy(loop, api_keys=KEYS, admin_key="sk-admin", cache_salt=mode)
    try:
        for conversation in ("c1", "c2", "c1"):
            Conversation(d.client(api_key="sk-a"), conversation, "hi").turn(stream=False)
        Conversation(d.client(api_key="sk-a"), "c3", "hi").turn(stream=False, cache_salt="client-own")
        salts = _salts(d.decodes[0])
        if mode == "off":
            assert salts == [None, None, None, "client-own"]  # untouched, as vLLM's own proxy passes it
        else:
            assert salts[0] == salts[2] != salts[1] and salts[3] not in (None, "client-own", *salts[:3])
    finally:
        d.close()


def test_no_salt_without_tenants_unless_asked(loop: LoopThread) -> None:
    d = deploy(loop)
    try:
        Conversation(d.client(), "c", "hi").turn(stream=False)
        assert _salts(d.decodes[0]) == [None]
        d.stop_router()
        d.start_router(cache_salt="tenant")
        Conversation(d.client(), "c", "hi").turn(stream=False)
        assert isinstance(_salts(d.decodes[0])[1], str)
    finally:
        d.close()


# -- /health and /metrics ---------------------------------------------------------------------------------------------
def _get(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_with_api_keys_health_and_metrics_need_the_admin_key_or_the_admin_listener(loop: LoopThread) -> None:
    d = deploy(loop, api_keys=KEYS, admin_key="sk-admin")
    runner: web.AppRunner | None = None
    try:
        for path in ("/health", "/metrics"):
            assert [_get(d.url + path, key) for key in (None, "sk-a", "sk-admin-not", "sk-admin")] == \
                [401, 401, 401, 200]
        assert d.router is not None
        runner = web.AppRunner(d.router.admin_app())
        loop.run(runner.setup())
        port = free_port()
        loop.run(web.TCPSite(runner, "127.0.0.1", port).start())
        assert _get(f"http://127.0.0.1:{port}/health") == 200 and _get(f"http://127.0.0.1:{port}/metrics") == 200
        d.stop_router()
        d.start_router(admin_key=None)  # API keys and no admin key: closed on the main listener
        assert _get(d.url + "/health", "sk-a") == 401
        d.stop_router()
        d.start_router(api_keys={})  # no API keys: open, as before
        assert _get(d.url + "/health") == 200
    finally:
        if runner is not None:
            loop.run(runner.cleanup())
        d.close()


def test_backend_credentials_never_show_in_health_metrics_or_logs(loop: LoopThread,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A backend URL's user:password@ goes to that backend as a Basic header, never into a backend's name (what
    /health, /metrics labels and log lines show)."""
    password = "pa55-in-the-url"
    d = deploy(loop)
    try:
        p, dec = d.prefills[0], d.decodes[0]
        prefill = parse_backend(f"http://ops:{password}@127.0.0.1:{p.port}")
        decode = parse_backend(f"http://ops:{password}@127.0.0.1:{dec.port},kv={dec.kv_address}")
        assert password not in repr(prefill) and "@" not in prefill.url and prefill.auth is not None
        d.stop_router()
        caplog.set_level(logging.INFO, logger="kvshuttle.router")
        d.start_router(prefill=[prefill], decode=[decode])
        Conversation(d.client(), "c", "hi").turn(stream=True)
        assert all(r["headers"]["Authorization"] == prefill.auth for r in [*p.requests, *dec.requests])
        p.behaviour = "fail"
        Conversation(d.client(), "c2", "hi").turn(stream=False)  # a failing prefill: logged by name
        with urllib.request.urlopen(d.url + "/health", timeout=TIMEOUT_S) as resp:
            health = resp.read().decode()
        with urllib.request.urlopen(d.url + "/metrics", timeout=TIMEOUT_S) as resp:
            metrics = resp.read().decode()
        assert f"127.0.0.1:{p.port}" in health and f'backend="127.0.0.1:{p.port}"' in metrics
        for text in (health, metrics, caplog.text):
            assert password not in text and "ops:" not in text
    finally:
        d.close()


# -- per-tenant quotas -----------------------------------------------------------------------------------------------
def _entry(tenant: str, name: str) -> StoredHandle:
    return StoredHandle(tenant, name, {"remote_block_ids": [1]}, "d", None, 1e12)


def test_one_tenants_churn_evicts_only_its_own_conversations() -> None:
    dropped: list[str] = []
    store = MemoryStore(max_entries=8, tenant_max_entries=4, on_drop=lambda e: dropped.append(e.conversation))

    async def go() -> None:
        for k in range(3):
            await store.put(f"b{k}", _entry("b", f"b{k}"))
        for k in range(100):
            await store.put(f"a{k}", _entry("a", f"a{k}"))
        for k in range(3):
            assert (await store.get(f"b{k}", "b", f"b{k}")).status == "hit"
        assert len(store) == 7 and dropped == [f"a{k}" for k in range(96)]

    asyncio.run(go())


def test_redis_keeps_each_tenant_to_its_quota(redis_server: RedisServer) -> None:
    dropped: list[str] = []

    async def go() -> None:
        store = RedisStore(redis_server.url, tenant_max_entries=3, on_drop=lambda e: dropped.append(e.conversation))
        try:
            for k in range(2):
                await store.put(f"b{k}", _entry("b", f"b{k}"))
            for k in range(10):
                await store.put(f"a{k}", _entry("a", f"a{k}"))
            assert [(await store.get(f"b{k}", "b", f"b{k}")).status for k in range(2)] == ["hit", "hit"]
            assert [(await store.get(f"a{k}", "a", f"a{k}")).status for k in range(10)] == ["miss"] * 7 + ["hit"] * 3
            assert sorted(dropped) == sorted(f"a{k}" for k in range(7))
            await store.take("a9", "a", "a9")  # taken: no longer counted against the quota
            await store.put("a10", _entry("a", "a10"))
            assert (await store.get("a7", "a", "a7")).status == "hit"
        finally:
            await store.close()

    asyncio.run(go())


def test_a_conversation_dropped_at_its_tenants_quota_is_released_on_its_decode(loop: LoopThread) -> None:
    d = deploy(loop, api_keys=KEYS, admin_key="sk-admin", tenant_max_conversations=1)
    try:
        Conversation(d.client(api_key="sk-a"), "first", "hi").turn(stream=False)
        Conversation(d.client(api_key="sk-b"), "theirs", "hi").turn(stream=False)
        Conversation(d.client(api_key="sk-a"), "second", "hi").turn(stream=False)
        assert wait_until(lambda: len(d.decodes[0].stats.released) == 1)
        assert d.metric("kvshuttle_router_releases_total", result="released") == 1
        b = Conversation(d.client(api_key="sk-b"), "theirs", "hi")
        b.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " tok0 tok1 tok2"}]
        b.turn(stream=False)
        assert d.prefills[0].stats.matched == 1  # tenant b's conversation kept its handle
    finally:
        d.close()


def test_one_tenant_holds_at_most_half_of_a_prefills_prewarms() -> None:
    async def go() -> None:
        metrics = RouterMetrics()
        warm = Prewarmer(lambda: None, metrics, max_in_flight=2, timeout_s=1.0, max_tracked=10)
        backend = Backend(parse_backend("http://127.0.0.1:1"), "prefill")
        body = {"messages": [{"role": "user", "content": "hi"}]}
        warm.start("a1", backend, body, "x", {}, "a")
        warm.start("a2", backend, body, "x", {}, "a")  # tenant a's share (1 of 2) is taken
        warm.start("b1", backend, body, "x", {}, "b")
        assert metrics.prewarm["sent"]._value.get() == 2 and metrics.prewarm["busy"]._value.get() == 1
        await asyncio.sleep(0.01)
        warm.start("a3", backend, body, "x", {}, "a")  # done: a's share is free again
        assert metrics.prewarm["sent"]._value.get() == 3
        await warm.close()

    asyncio.run(go())


# -- the end marker ---------------------------------------------------------------------------------------------------
def test_the_end_marker_passes_at_once_when_no_handle_can_come(loop: LoopThread) -> None:
    """No grant and no publish key (no later turn can use a retention): the decode's ``[DONE]`` reaches the client
    when it is sent, not when the decode's stream ends 3 s later."""
    d = deploy(loop, reverse_reads=False)
    try:
        d.decodes[0].behaviour = "linger"
        body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                           "conversation_id": "c"}).encode()
        sock = raw_connection(d.port, head(CHAT, len(body)), body)
        started, data = time.monotonic(), b""
        while b"data: [DONE]" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        assert time.monotonic() - started < 2.0, data
        sock.close()
        assert "kvshuttle_publish_key" not in d.decodes[0].requests[0]["body"]["kv_transfer_params"]
    finally:
        d.close()


# -- the command's new flags ------------------------------------------------------------------------------------------
def test_the_bounds_salt_and_admin_flags_and_their_defaults(tmp_path: Any) -> None:
    import argparse

    from kvshuttle.router.main import add_arguments, config_from

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return parser.parse_args(["--prefill", "http://h:1", "--decode", "http://h:2", *argv])

    config = config_from(parse(), environ={})
    assert (config.tenant_max_requests, config.tenant_max_in_flight, config.tenant_max_bytes, config.max_held_bytes,
            config.max_parsed_bytes, config.cache_salt, config.salt_mode, config.shutdown_grace_s,
            config.admin_key) == (64, 32, 64 << 20, 512 << 20, 32 << 20, "auto", "off", 5.0, None)
    assert config.store_quota() == (100_000, 256 << 20)  # one shared tenant: the whole store
    keys, admin = tmp_path / "keys.json", tmp_path / "admin"
    keys.write_text(json.dumps(KEYS))
    admin.write_text("sk-admin\n")
    config = config_from(parse("--api-keys", str(keys), "--admin-key-file", str(admin), "--tenant-max-bytes", "8M",
                               "--cache-salt", "conversation", "--tenant-max-conversations", "10"), environ={})
    assert (config.admin_key, config.tenant_max_bytes, config.salt_mode) == ("sk-admin", 8 << 20, "conversation")
    assert config.store_quota() == (10, 64 << 20)
    assert "sk-admin" not in repr(config)
    assert config_from(parse("--api-keys", str(keys)), environ={"KVSHUTTLE_ROUTER_ADMIN_KEY": "k2"}).admin_key == "k2"
    assert config_from(parse("--api-keys", str(keys)), environ={}).salt_mode == "tenant"
