"""The router's parts on their own: settings, handle checks, keys, backend choice, the two stores, the command."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.router import (
    BackendSpec,
    MemoryStore,
    RedisStore,
    RouterConfig,
    RouterConfigError,
    StoredHandle,
    StoreError,
    load_api_keys,
    parse_backend,
    store_key,
)
from kvshuttle.router.backends import BackendPool
from kvshuttle.router.doubles import FakeVllm
from kvshuttle.router.handles import InvalidHandle, checked_handle, prefill_params
from router_helpers import (
    Conversation,
    LoopThread,
    free_port,
    fresh_secret,
    stop_process,
)

pytest_plugins = ["router_fixtures"]  # loop, redis_server
P, D = [BackendSpec("http://127.0.0.1:8100")], [BackendSpec("http://127.0.0.1:8200")]


# -- settings ----------------------------------------------------------------------------------------------------
def test_backend_urls_and_the_kv_suffix() -> None:
    assert parse_backend("http://10.0.0.2:8200,kv=10.0.0.2:5601") == BackendSpec("http://10.0.0.2:8200",
                                                                                 "tcp://10.0.0.2:5601")
    assert parse_backend("http://h:8100/v1") == BackendSpec("http://h:8100")
    assert parse_backend("https://h:8100").name == "h:8100"


@pytest.mark.parametrize("text", ["h:8100", "ftp://h:1", "http://h:8100/x", "http://h:8100,kv=h",
                                  "http://h:8100,kv=h:99999", "http://h:8100,port=h:1", "http://h:bad"])
def test_malformed_backends_are_named_errors(text: str) -> None:
    with pytest.raises(RouterConfigError):
        parse_backend(text)


@pytest.mark.parametrize(("change", "match"), [
    ({"ttl_s": 480.0}, "below the decode"), ({"ttl_s": 0.0}, "positive"), ({"prefill": []}, "at least one"),
    ({"connector": "lmcache"}, "connector"), ({"reads": "twice"}, "reads"), ({"store": "mysql://x"}, "store"),
    ({"tenant_header": "X-T", "api_keys": {"k": "t"}}, "not both"), ({"max_conversations": 0}, "max_conv"),
    ({"connector": "nixl", "decode": [BackendSpec("http://h:1", "tcp://h:2")]}, "side channel"),
    ({"max_body_bytes": 0}, "max_body_bytes"), ({"max_store_bytes": 1.5}, "max_store_bytes"),
    ({"body_timeout_s": 0.0}, "body_timeout_s"), ({"client_write_timeout_s": -1.0}, "client_write_timeout_s"),
    ({"client_idle_timeout_s": float("inf")}, "client_idle_timeout_s"), ({"secret": "hunter2"}, "DeploymentSecret"),
])
def test_inconsistent_settings_are_refused(change: dict[str, Any], match: str) -> None:
    config = RouterConfig(**{"prefill": P, "decode": D, **change})
    with pytest.raises(RouterConfigError, match=match):
        config.check()


def test_api_key_files(tmp_path: Path) -> None:
    good, bad = tmp_path / "keys.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"sk-a": "team-a"}))
    bad.write_text(json.dumps(["sk-a"]))
    assert load_api_keys(good) == {"sk-a": "team-a"}
    with pytest.raises(RouterConfigError, match="JSON object"):
        load_api_keys(bad)
    with pytest.raises(RouterConfigError, match="cannot read"):
        load_api_keys(tmp_path / "missing.json")


# -- handles -----------------------------------------------------------------------------------------------------
SECRET = fresh_secret()


def _kvshuttle_params() -> dict[str, Any]:
    decode = FakeVllm("decode", side_channel=False, secret=SECRET)

    class _Req:
        def __init__(self) -> None:
            self.headers = {"X-Request-Id": "r1"}

    params = decode._decode_params("m", _Req())  # type: ignore[arg-type]
    assert params is not None
    return params


def test_kvshuttle_handles_are_parsed_strictly() -> None:
    params = _kvshuttle_params()
    stored, life = checked_handle(params, "kvshuttle", SECRET)
    assert stored == params and life == 480.0
    for broken in ({**params, "kvshuttle_digests": "zz"}, {**params, "remote_port": 0}, [params], {"a": {1, 2}}):
        with pytest.raises(InvalidHandle):
            checked_handle(broken, "kvshuttle", SECRET)


def test_nixl_handles_are_checked_by_vllm_field_names() -> None:
    good = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 5600, "remote_block_ids": [1, 2],
            "do_remote_decode": True, "tp_size": 1}
    assert checked_handle(good, "nixl", SECRET) == (good, float("inf"))
    for broken in ({**good, "remote_block_ids": [1, -2]}, {**good, "remote_port": "5600"},
                   {**good, "remote_engine_id": ""}, {**good, "do_remote_decode": "yes"}, {}):
        with pytest.raises(InvalidHandle):
            checked_handle(broken, "nixl", SECRET)


def test_a_handle_goes_to_prefill_marked_to_read_back() -> None:
    assert prefill_params({"remote_host": "h", "do_remote_decode": False}) == {
        "remote_host": "h", "do_remote_decode": True, "do_remote_prefill": False}


def test_store_keys_separate_tenants_and_cannot_be_forged_by_joining() -> None:
    assert store_key("a", "b|c") != store_key("a|b", "c")
    assert store_key("a", "x") != store_key("b", "x")
    assert store_key("a", "x") == store_key("a", "x")


# -- backend choice ----------------------------------------------------------------------------------------------
def _pool(balance: str) -> BackendPool:
    return BackendPool([BackendSpec(f"http://h:{p}") for p in (1, 2, 3)], "decode", balance)  # type: ignore[arg-type]


def test_round_robin_cycles_over_healthy_backends() -> None:
    pool = _pool("round_robin")
    pool.mark(pool.backends[1], False)
    picks = [pool.choose() for _ in range(4)]
    assert [b.name for b in picks if b] == ["h:1", "h:3", "h:1", "h:3"]
    assert pool.choose(frozenset({"h:1", "h:2", "h:3"})) is None


def test_least_loaded_picks_the_fewest_in_flight() -> None:
    pool = _pool("least_loaded")
    pool.backends[0].in_flight, pool.backends[1].in_flight, pool.backends[2].in_flight = 3, 1, 2
    assert [pool.choose().name for _ in range(3)] == ["h:2"] * 3  # type: ignore[union-attr]


def test_when_all_are_down_all_are_still_tried() -> None:
    pool = _pool("round_robin")
    for b in pool.backends:
        pool.mark(b, False)
    chosen = pool.choose(frozenset({"h:1"}))
    assert chosen is not None and chosen.name in ("h:2", "h:3")


# -- stores ------------------------------------------------------------------------------------------------------
def _entry(now: float, tenant: str = "t", conversation: str = "c", life: float = 10.0) -> StoredHandle:
    return StoredHandle(tenant, conversation, {"remote_block_ids": [1]}, "d", None, now + life)


def test_memory_store_take_get_expiry_and_foreign() -> None:
    now = [100.0]
    expired: list[int] = []
    store = MemoryStore(clock=lambda: now[0], on_expire=expired.append)

    async def run() -> list[str]:
        await store.put("k", _entry(now[0]))
        out = [(await store.get("k", "t", "c")).status, (await store.take("k", "other", "c")).status,
               (await store.take("k", "t", "c")).status, (await store.take("k", "t", "c")).status]
        await store.put("k", _entry(now[0]))
        now[0] += 11
        out.append((await store.take("k", "t", "c")).status)
        return out

    assert asyncio.run(run()) == ["hit", "foreign", "hit", "miss", "expired"]
    assert expired == [1]


def test_memory_store_is_bounded_least_recently_used_first() -> None:
    evicted: list[int] = []
    store = MemoryStore(max_entries=2, on_evict=evicted.append)

    async def run() -> list[str]:
        for key in ("a", "b"):
            await store.put(key, _entry(1e12))
        await store.get("a", "t", "c")  # a is now more recent than b
        await store.put("x", _entry(1e12))
        return [(await store.get(k, "t", "c")).status for k in ("a", "b", "x")]

    assert asyncio.run(run()) == ["hit", "miss", "hit"]
    assert evicted == [1]


def test_the_memory_sweeper_expires_entries_on_a_timer_without_traffic() -> None:
    now = [100.0]
    expired: list[int] = []
    store = MemoryStore(sweep_interval_s=0.02, clock=lambda: now[0], on_expire=expired.append)

    async def run() -> int:
        await store.put("short", _entry(now[0], life=5.0))
        await store.put("long", _entry(now[0], life=50.0))
        await store.start()
        now[0] += 6.0
        for _ in range(3000):
            if len(store) == 1:
                break
            await asyncio.sleep(0.01)
        await store.close()
        return len(store)

    assert asyncio.run(run()) == 1
    assert expired == [1]


def test_redis_store_shares_entries_and_takes_atomically(redis_server: Any) -> None:
    now = [1_000.0]

    async def run() -> dict[str, Any]:
        a = RedisStore(redis_server.url, prefix="t:", clock=lambda: now[0])
        b = RedisStore(redis_server.url, prefix="t:", clock=lambda: now[0])
        try:
            await a.put("k", _entry(now[0]))
            got = (await b.get("k", "t", "c")).status
            taken = await asyncio.gather(*(s.take("k", "t", "c") for s in (a, b, a, b)))
            await a.put("old", _entry(now[0], life=1.0))
            await a.put("new", _entry(now[0], life=100.0))
            now[0] += 2.0
            return {"get": got, "takes": sorted(t.status for t in taken), "live": await b.live(),
                    "swept": await b.sweep(), "late": (await a.take("old", "t", "c")).status}
        finally:
            await a.close()
            await b.close()

    assert asyncio.run(run()) == {"get": "hit", "takes": ["hit", "miss", "miss", "miss"], "live": 1, "swept": 1,
                                  "late": "expired"}


def test_redis_store_failures_are_store_errors() -> None:
    async def run() -> None:
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
        try:
            await store.take("k", "t", "c")
        finally:
            await store.close()

    with pytest.raises(StoreError, match="redis take failed"):
        asyncio.run(run())


# -- the command -------------------------------------------------------------------------------------------------
def test_the_router_command_serves_turns(loop: LoopThread, tmp_path: Path) -> None:
    prefill = loop.run(FakeVllm("prefill").start())
    decode = loop.run(FakeVllm("decode").start())
    log = (tmp_path / "router.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvshuttle.cli", "router", "--prefill", prefill.backend,
                             "--decode", decode.backend, "--port", "0", "--log-format", "json"],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        import openai

        client = openai.OpenAI(base_url=line.split()[-1] + "/v1", api_key="x", max_retries=0, timeout=60)
        chat = Conversation(client, "cli", "hello")
        chat.turn(stream=True)
        chat.turn(stream=True)
        assert prefill.stats.matched == 1
    finally:
        stop_process(proc)
        log.close()
        loop.run(prefill.stop())
        loop.run(decode.stop())
    lines = [json.loads(x) for x in (tmp_path / "router.log").read_text().splitlines() if x.startswith("{")]
    assert [x["lookup"] for x in lines if x["msg"] == "turn"] == ["miss", "hit"]
    assert proc.returncode == 0


def test_the_router_command_needs_uvloop_installed_to_use_it() -> None:
    pytest.importorskip("aiohttp")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("uvloop is installed here")
    run = subprocess.run([sys.executable, "-m", "kvshuttle.cli", "router", "--prefill", "http://h:1", "--decode",
                          "http://h:2", "--port", "0", "--loop", "uvloop"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "uvloop is not installed" in run.stderr


def test_the_router_command_refuses_a_bad_ttl_pair() -> None:
    run = subprocess.run([sys.executable, "-m", "kvshuttle.cli", "router", "--prefill", "http://h:1", "--decode",
                          "http://h:2", "--ttl", "500"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "below the decode's retention" in run.stderr


# -- the decode side channel ---------------------------------------------------------------------------------------
def test_takes_reuse_one_connection_per_decode_and_take_once() -> None:
    from kvshuttle.router.kv import SideChannelCalls

    decode = FakeVllm("decode", secret=SECRET)
    calls = SideChannelCalls(SECRET, threads=2)
    address = f"tcp://{decode.kv_address}"
    try:
        decode.board.put("k1", {"a": 1})
        decode.board.put("k2", {"b": 2})

        async def three() -> list[Any]:
            got = []
            for k in ("k1", "k2", "k1"):
                got.append(await calls.take(address, k, 2.0))
                got.append(id(calls._channels[address]))
            return got

        got = asyncio.run(three())
        assert got[0::2] == [{"a": 1}, {"b": 2}, None]
        assert len(set(got[1::2])) == 1 and list(calls._channels) == [address]  # one channel, kept
    finally:
        calls.close()
        asyncio.run(decode.stop())


def test_a_take_from_a_dead_decode_is_a_named_error() -> None:
    from kvshuttle.router.kv import SideChannelCalls
    from kvshuttle.transfer.errors import PeerUnreachableError

    calls = SideChannelCalls(SECRET, threads=1)
    try:
        with pytest.raises(PeerUnreachableError):
            asyncio.run(calls.take(f"tcp://127.0.0.1:{free_port()}", "k", 1.0))
    finally:
        calls.close()


def test_concurrent_takes_share_one_channel_and_each_gets_its_own_params() -> None:
    from kvshuttle.router.kv import SideChannelCalls

    decode = FakeVllm("decode", secret=SECRET)
    calls = SideChannelCalls(SECRET)
    address = f"tcp://{decode.kv_address}"
    keys = [f"k{i}" for i in range(50)]
    for i, key in enumerate(keys):
        decode.board.put(key, {"i": i})

    async def all_at_once() -> list[Any]:
        return list(await asyncio.gather(*(calls.take(address, key, 5.0) for key in reversed(keys))))

    try:
        assert asyncio.run(all_at_once()) == [{"i": i} for i in reversed(range(50))]
        assert asyncio.run(calls.take(address, "k0", 0.1)) is None  # taken once; a new loop, a new channel
        decode.board.put("again", {"a": 1})
        assert asyncio.run(calls.take(address, "again", 2.0)) == {"a": 1}
    finally:
        calls.close()
        asyncio.run(decode.stop())


def test_a_take_in_flight_fails_as_soon_as_its_decode_goes_away() -> None:
    from kvshuttle.router.kv import SideChannelCalls
    from kvshuttle.transfer.errors import PeerLostError, PeerUnreachableError

    decode = FakeVllm("decode", secret=SECRET)
    calls = SideChannelCalls(SECRET)
    address = f"tcp://{decode.kv_address}"

    async def take_while_the_decode_dies() -> None:
        waiting = asyncio.ensure_future(calls.take(address, "never-published", 60.0))
        await asyncio.sleep(0.3)  # the take is polling the board by now
        await decode.stop()  # the side channel's socket closes: the take fails, never waits out its 60 s
        with pytest.raises((PeerLostError, PeerUnreachableError)):
            await waiting

    try:
        asyncio.run(take_while_the_decode_dies())
    finally:
        calls.close()


def test_a_stored_handle_serializes_as_its_fields() -> None:
    from dataclasses import asdict

    from kvshuttle.router.store import StoredHandle

    entry = StoredHandle("t", "c", {"a": [1, {"b": "é"}]}, "decode-1", None, 12.5)
    assert entry.to_json() == json.dumps(asdict(entry), separators=(",", ":"))
    assert StoredHandle.from_json(entry.to_json()) == entry


def test_idle_backend_connections_close_before_vllm_closes_them() -> None:
    """vLLM's server closes a kept-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default); a router
    that reuses one it is closing turns the next turn into a 502. The router lets idle connections go first."""
    from kvshuttle.router.proxy import BACKEND_KEEPALIVE_S

    vllm_default_keep_alive_s = 5.0
    assert 0 < BACKEND_KEEPALIVE_S < vllm_default_keep_alive_s
