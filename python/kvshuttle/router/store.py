"""Where the router keeps each conversation's decode handle between turns.

* :class:`MemoryStore` (default): one process. TTL per entry, bounded in entries and in bytes (the approximate
  serialized size of what it holds: a decode may return large params) with least-recently-used eviction, and
  a sweeper task that drops expired entries on a timer (not only when traffic touches them).
* :class:`RedisStore`: several router replicas share conversations, and conversations survive a restart. A
  tenant over its quota of conversations loses its own soonest-expiring ones (a sorted set per tenant).
  A use-once take is one MULTI/EXEC of GETDEL + ZREM (atomic: of two replicas taking at once, exactly one gets
  the handle); multi-read keeps the entry. A sorted set indexes entries by expiry: live count and sweeping
  (which counts expirations) are O(log n), shared by every replica.

Expiry times are wall-clock seconds (``time.time``), the one clock replicas share. Store failures raise
:class:`StoreError`; the router then serves the turn without a handle (recompute). After a Redis failure the
store is skipped for ``backoff_s`` so a dead or blackholed Redis costs a request nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from .errors import StoreError
from .redact import redact_url, scrub

log = logging.getLogger("kvshuttle.router")

Status = Literal["hit", "miss", "expired", "foreign"]
Clock = Callable[[], float]
# Counted per entry beyond its JSON. The budget is in serialized bytes: resident memory is about twice that
# (a 550-byte handle measured 2.1 KB resident on CPython 3.11, its dicts and ints included).
ENTRY_OVERHEAD = 512
_dumps = json.JSONEncoder(separators=(",", ":")).encode


@dataclass(frozen=True)
class StoredHandle:
    """A conversation's decode handle: who it belongs to, where it lives, until when it may be used."""

    tenant: str
    conversation: str
    params: dict[str, Any]  # the decode's kv_transfer_params, validated
    decode: str  # the backend that issued it (name)
    kv_address: str | None  # that decode's side channel (release / renew), kvshuttle only
    expires_at: float  # wall clock
    prefill: str | None = None  # the prefill that served the turn (affinity: its prefix cache holds the prompt)
    history: str | None = None  # what the decode holds, as the router saw it (placement.history_mark)
    # the token-exact path's kept turn (token_exact.kept_json): ids from the decode's answer, bounded there
    kept: str | None = None

    def to_json(self) -> str:
        # The fields by hand: dataclasses.asdict deep-copies params first (a measurable share of a turn's CPU).
        return _dumps({"tenant": self.tenant, "conversation": self.conversation, "params": self.params,
                       "decode": self.decode, "kv_address": self.kv_address, "expires_at": self.expires_at,
                       "prefill": self.prefill, "history": self.history, "kept": self.kept})

    def approx_bytes(self) -> int:
        """About what keeping this entry costs: its serialized size plus the Python objects around it."""
        return len(self.to_json()) + ENTRY_OVERHEAD

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredHandle:
        data = json.loads(text)
        prefill = data.get("prefill")  # absent in entries a router before affinity stored
        history = data.get("history")  # absent in entries a router before issue 31 stored
        kept = data.get("kept")  # absent before issue 34
        return cls(str(data["tenant"]), str(data["conversation"]), dict(data["params"]), str(data["decode"]),
                   data["kv_address"], float(data["expires_at"]), prefill if isinstance(prefill, str) else None,
                   history if isinstance(history, str) else None, kept if isinstance(kept, str) else None)


@dataclass(frozen=True)
class Lookup:
    status: Status
    entry: StoredHandle | None = None  # set on a hit only


def checked(entry: StoredHandle | None, tenant: str, conversation: str, now: float) -> Lookup:
    """A hit only for the same tenant and conversation (defence in depth behind the hashed key) and in time."""
    if entry is None:
        return Lookup("miss")
    if entry.tenant != tenant or entry.conversation != conversation:
        return Lookup("foreign")
    if entry.expires_at <= now:
        return Lookup("expired")
    return Lookup("hit", entry)


class HandleStore(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def put(self, key: str, entry: StoredHandle) -> None: ...

    async def take(self, key: str, tenant: str, conversation: str) -> Lookup:
        """Remove and return (use-once)."""

    async def get(self, key: str, tenant: str, conversation: str) -> Lookup:
        """Return and keep (multi-read)."""

    async def delete(self, key: str) -> StoredHandle | None: ...

    async def live(self) -> int: ...

    async def sweep(self) -> int:
        """Drop expired entries; how many."""


class _Swept:
    """A store whose expired entries a background task sweeps on a timer (``_sweep_forever``), not on traffic."""

    _sweeper: asyncio.Task[None] | None = None

    async def _sweep_forever(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None


class MemoryStore(_Swept):
    """In-process store; see the module docstring. ``on_expire(n)`` counts expirations, ``on_evict(n)`` entries
    dropped at a bound (metrics), ``on_drop(entry)`` is told of each (the router releases its retention). An
    entry larger than ``max_bytes`` on its own is not kept (an eviction).

    Per tenant, at most ``tenant_max_entries`` entries of ``tenant_max_bytes``: a tenant over its quota loses its
    own least recently used entries, so one tenant's churn pushes out only its own conversations while the
    quotas of the active tenants fit the store's bounds."""

    def __init__(self, max_entries: int = 100_000, sweep_interval_s: float = 5.0, clock: Clock = time.time,
                 on_expire: Callable[[int], None] | None = None,
                 on_evict: Callable[[int], None] | None = None, max_bytes: int = 256 << 20,
                 tenant_max_entries: int | None = None, tenant_max_bytes: int | None = None,
                 on_drop: Callable[[StoredHandle], None] | None = None) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.tenant_max_entries = tenant_max_entries or max_entries
        self.tenant_max_bytes = tenant_max_bytes or max_bytes
        self.sweep_interval_s, self._clock = sweep_interval_s, clock
        self._on_expire, self._on_evict, self._on_drop = on_expire, on_evict, on_drop
        self._entries: OrderedDict[str, tuple[int, StoredHandle, int]] = OrderedDict()  # (version, entry, bytes)
        self._tenants: dict[str, tuple[OrderedDict[str, None], list[int]]] = {}  # tenant -> (its keys LRU, [bytes])
        self._expiry: list[tuple[float, int, str]] = []  # (expires_at, version, key): lazily deleted heap
        self._versions = itertools.count()
        self.bytes = 0  # approximate bytes held (StoredHandle.approx_bytes of every entry)

    def _drop(self, key: str) -> tuple[int, StoredHandle, int] | None:
        item = self._entries.pop(key, None)
        if item is not None:
            self.bytes -= item[2]
            tenant = item[1].tenant
            keys, size = self._tenants[tenant]
            del keys[key]
            size[0] -= item[2]
            if not keys:
                del self._tenants[tenant]
        return item

    def _evict(self, key: str) -> None:
        item = self._drop(key)
        if item is not None and self._on_drop is not None:
            self._on_drop(item[1])

    async def put(self, key: str, entry: StoredHandle) -> None:
        size = entry.approx_bytes()
        self._drop(key)
        if size > self.max_bytes:  # would evict everything else and still not fit: not kept
            if self._on_evict:
                self._on_evict(1)
            log.warning("router store: a handle of about %d bytes is over the store's whole budget (%d bytes); "
                        "not kept", size, self.max_bytes)
            return
        version = next(self._versions)
        self._entries[key] = (version, entry, size)
        self.bytes += size
        keys, held = self._tenants.setdefault(entry.tenant, (OrderedDict(), [0]))
        keys[key] = None
        held[0] += size
        heapq.heappush(self._expiry, (entry.expires_at, version, key))
        evicted = 0
        while len(keys) > self.tenant_max_entries or held[0] > self.tenant_max_bytes:  # the tenant's own first
            self._evict(next(iter(keys)))
            evicted += 1
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._evict(next(iter(self._entries)))  # least recently used; its heap item dies lazily
            evicted += 1
        if evicted and self._on_evict:
            self._on_evict(evicted)
        if len(self._expiry) > 2 * len(self._entries) + 1024:  # taken entries left stale heap items: rebuild
            self._expiry = [(e.expires_at, v, k) for k, (v, e, _) in self._entries.items()]
            heapq.heapify(self._expiry)

    async def take(self, key: str, tenant: str, conversation: str) -> Lookup:
        item = self._entries.get(key)
        result = checked(item[1] if item else None, tenant, conversation, self._clock())
        if result.status in ("hit", "expired"):
            self._drop(key)
            if result.status == "expired" and self._on_expire:
                self._on_expire(1)
        return result

    async def get(self, key: str, tenant: str, conversation: str) -> Lookup:
        item = self._entries.get(key)
        result = checked(item[1] if item else None, tenant, conversation, self._clock())
        if result.status == "hit":
            self._entries.move_to_end(key)
            self._tenants[tenant][0].move_to_end(key)
        elif result.status == "expired":
            self._drop(key)
            if self._on_expire:
                self._on_expire(1)
        return result

    async def delete(self, key: str) -> StoredHandle | None:
        item = self._drop(key)
        return item[1] if item else None

    async def live(self) -> int:
        return len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    async def sweep(self) -> int:
        now, expired = self._clock(), 0
        while self._expiry and self._expiry[0][0] <= now:
            _, version, key = heapq.heappop(self._expiry)
            item = self._entries.get(key)
            if item is not None and item[0] == version:
                self._drop(key)
                expired += 1
        if expired and self._on_expire:
            self._on_expire(expired)
        return expired

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            await self.sweep()


class RedisStore(_Swept):
    """Shared store on Redis (redis.asyncio); see the module docstring."""

    GRACE_S = 60.0  # keys outlive their expiry a little, so a late take is counted as expired, not a miss
    TRIP_AFTER = 3  # consecutive failures that make the store skip Redis for backoff_s

    def __init__(self, url: str, prefix: str = "kvshuttle:router:", sweep_interval_s: float = 5.0,
                 timeout_s: float = 2.0, backoff_s: float = 1.0, clock: Clock = time.time,
                 on_expire: Callable[[int], None] | None = None, tenant_max_entries: int | None = None,
                 on_drop: Callable[[StoredHandle], None] | None = None) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                              retry_on_timeout=False)
        self.url = redact_url(url)  # what messages show: never the password
        self.prefix, self.sweep_interval_s = prefix, sweep_interval_s
        self.backoff_s, self._clock, self._on_expire = backoff_s, clock, on_expire
        self._index = prefix + "expiry"
        self.tenant_max_entries, self._on_drop = tenant_max_entries, on_drop
        self._down_until = 0.0
        self._failures = 0

    async def close(self) -> None:
        await super().close()
        await self._redis.aclose()

    def _key(self, key: str) -> str:
        return self.prefix + "h:" + key

    async def _run(self, what: str, call: Callable[[], Any]) -> Any:
        """Run one Redis exchange; StoreError on any failure, and skip Redis for ``backoff_s`` after one."""
        from redis.exceptions import RedisError

        if time.monotonic() < self._down_until:
            raise StoreError(f"redis at {self.url} failed repeatedly; skipping it for {self.backoff_s:g} s")
        try:
            result = await call()
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._failures += 1
            if self._failures >= self.TRIP_AFTER:  # one slow answer is not an outage
                self._down_until = time.monotonic() + self.backoff_s
            why = f"{type(exc).__name__}: {scrub(str(exc))}"
            raise StoreError(f"redis {what} failed: {why} (store {self.url})") from exc
        self._failures = 0
        return result

    def _tenant_index(self, tenant: str) -> str:
        """A sorted set per tenant (its keys by expiry), for its quota."""
        return self.prefix + "t:" + hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()

    async def put(self, key: str, entry: StoredHandle) -> None:
        now = self._clock()
        ttl_ms = max(1, int((entry.expires_at - now + self.GRACE_S) * 1000))
        tenant_index = self._tenant_index(entry.tenant)

        async def call() -> Any:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._key(key), entry.to_json(), px=ttl_ms)
                pipe.zadd(self._index, {key: entry.expires_at})
                pipe.zadd(tenant_index, {key: entry.expires_at})
                pipe.zremrangebyscore(tenant_index, "-inf", now)
                pipe.zcard(tenant_index)
                pipe.pexpire(tenant_index, ttl_ms)
                return await pipe.execute()

        count = (await self._run("put", call))[4]
        if self.tenant_max_entries is not None and count > self.tenant_max_entries:
            await self._trim(tenant_index, count - self.tenant_max_entries)

    async def _trim(self, tenant_index: str, excess: int) -> None:
        """Drop a tenant's ``excess`` soonest-expiring entries (its quota; every replica trims alike)."""
        popped = await self._run("trim", lambda: self._redis.zpopmin(tenant_index, excess))
        for member, _ in popped:
            key = member.decode() if isinstance(member, bytes) else str(member)
            raw, _ = await self._getdel(key)
            entry = self._decode(raw)
            if entry is not None and self._on_drop is not None:
                self._on_drop(entry)

    async def _getdel(self, key: str, tenant: str | None = None) -> tuple[bytes | None, bool]:
        """The value (removed) and whether it was still indexed (not yet counted by a sweep)."""
        async def call() -> Any:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.getdel(self._key(key))
                pipe.zrem(self._index, key)
                if tenant is not None:
                    pipe.zrem(self._tenant_index(tenant), key)
                return await pipe.execute()

        value, indexed, *_ = await self._run("take", call)
        return value, bool(indexed)

    async def take(self, key: str, tenant: str, conversation: str) -> Lookup:
        raw, indexed = await self._getdel(key, tenant)
        result = checked(self._decode(raw), tenant, conversation, self._clock())
        if result.status == "foreign" and raw is not None:  # not ours to consume: put it back as it was
            await self.put(key, StoredHandle.from_json(raw))
        if result.status == "expired" and indexed and self._on_expire:
            self._on_expire(1)
        return result

    async def get(self, key: str, tenant: str, conversation: str) -> Lookup:
        raw = await self._run("get", lambda: self._redis.get(self._key(key)))
        return checked(self._decode(raw), tenant, conversation, self._clock())

    async def delete(self, key: str) -> StoredHandle | None:
        entry = self._decode((await self._getdel(key))[0])
        if entry is not None:
            await self._run("delete", lambda: self._redis.zrem(self._tenant_index(entry.tenant), key))
        return entry

    async def live(self) -> int:
        now = self._clock()
        count: int = await self._run("count", lambda: self._redis.zcount(self._index, f"({now}", "+inf"))
        return count

    async def sweep(self) -> int:
        now = self._clock()
        expired: int = await self._run("sweep", lambda: self._redis.zremrangebyscore(self._index, "-inf", now))
        if expired and self._on_expire:
            self._on_expire(expired)
        return expired

    def _decode(self, raw: Any) -> StoredHandle | None:
        if raw is None:
            return None
        try:
            return StoredHandle.from_json(raw)
        except (ValueError, KeyError, TypeError) as exc:  # a foreign or corrupted value: never forwarded
            log.warning("router store: dropping an unreadable entry: %s", exc)
            return None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep()
            except StoreError as exc:
                log.debug("router store: sweep skipped: %s", exc)
