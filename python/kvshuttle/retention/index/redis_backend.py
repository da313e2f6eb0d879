"""The content index on Redis: decodes on many hosts publish, prefills anywhere look up (redis-py, sync).

One round trip per operation, each a server-side script (so a lookup's "deepest live entry" is decided next to
the data, not in a second exchange):

* publish: the record (the signed params) under its keyed id with ``PX`` = the retention's remaining life, its
  digest keys (the same ``PX``) unless a key already names a live retention it should keep naming
  (:func:`~.scheme.keeps`), and the publisher's live set (a sorted set by expiry): past ``max_per_publisher`` the
  soonest-expiring records are deleted (their digest keys then name nothing and are skipped until they expire);
* lookup: one ``MGET`` of the prompt's positions, deepest first, then the first whose incarnation is current
  and whose record still exists (at most ``max_tries`` records asked) is returned;
* withdraw: the record and its place in the live set (the digest keys name nothing from then on);
* start: a new incarnation made current; the previous incarnation's records deleted.

Bounded: a lookup asks at most ``MAX_POSITIONS`` keys and reads at most ``max_tries`` records; a publisher keeps
at most ``max_per_publisher`` live records; a record over ``max_record_bytes`` is neither published nor served;
every key expires with its retention except one incarnation key per publisher address (a few bytes).

Thread-safe (redis-py's connection pool); the counts of :meth:`stats` may miss an increment under contention.
Standalone Redis (the scripts touch keys they compute, which Redis Cluster does not allow). Failures and
timeouts (``timeout_s``, per socket operation, no retries) answer None / False: the caller recomputes. After
``TRIP_AFTER`` failures in a row Redis is skipped for ``backoff_s`` (a dead Redis costs a lookup nothing).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import shown
from ...policy.digests import PromptDigests
from ...trust import DeploymentSecret
from .scheme import (
    DEFAULT_STRIDE,
    MAX_RECORD_BYTES,
    IndexArgumentError,
    Match,
    Names,
    Pointer,
    check_publication,
    check_stride,
    decode_record,
    encode_record,
    lookup_positions,
    positions,
    prompt_chain,
    retention_fields,
)

log = logging.getLogger("kvshuttle.retention.index")

# KEYS: incarnation key, live set. ARGV: new incarnation, record key prefix.
_START = """
redis.call('SET', KEYS[1], ARGV[1])
local old = redis.call('ZRANGE', KEYS[2], 0, -1)
for i = 1, #old do redis.call('DEL', ARGV[2] .. old[i]) end
redis.call('DEL', KEYS[2])
return #old
"""

# KEYS: record key, live set, incarnation key, digest keys... ARGV: record, ttl_ms, pointer, incarnation,
# per-publisher cap, record id, record key prefix, now_ms, incarnation key prefix, expiry_ms, mode.
_PUBLISH = """
if redis.call('GET', KEYS[3]) ~= ARGV[4] then return {-1, 0} end
local ttl, now, exp, mode = tonumber(ARGV[2]), tonumber(ARGV[8]), tonumber(ARGV[10]), ARGV[11]
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], exp, ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local excess, evicted = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5]), 0
if excess > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #popped, 2 do redis.call('DEL', ARGV[7] .. popped[i]); evicted = evicted + 1 end
end
if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
if redis.call('EXISTS', KEYS[1]) == 0 then return {-2, evicted} end
local inc, set = {}, 0
for i = 4, #KEYS do
  local old, keep = redis.call('GET', KEYS[i]), false
  if old then
    local pub, pinc, rid, pexp, pmode = string.match(old, '^([^|]*)|([^|]*)|([^|]*)|(%d+)|([mu])$')
    if pub and rid ~= ARGV[6] and tonumber(pexp) > now then
      local cur = inc[pub]
      if cur == nil then cur = redis.call('GET', ARGV[9] .. pub) or false; inc[pub] = cur end
      if cur == pinc and redis.call('EXISTS', ARGV[7] .. rid) == 1 then
        if pmode ~= mode then keep = (pmode == 'm') else keep = tonumber(pexp) > exp end
      end
    end
  end
  if not keep then redis.call('SET', KEYS[i], ARGV[3], 'PX', ttl); set = set + 1 end
end
return {set, evicted}
"""

# KEYS: digest keys, deepest first. ARGV: max records asked, record key prefix, incarnation key prefix, now_ms.
# Returns {index of the key found (0: none), record, pointers of dead incarnations skipped}.
_LOOKUP = """
local vals = redis.call('MGET', unpack(KEYS))
local tries, now, inc, stale = tonumber(ARGV[1]), tonumber(ARGV[4]), {}, 0
for i = 1, #KEYS do
  local p = vals[i]
  if p then
    local pub, pinc, rid, pexp = string.match(p, '^([^|]*)|([^|]*)|([^|]*)|(%d+)|[mu]$')
    if pub and tonumber(pexp) > now then
      local cur = inc[pub]
      if cur == nil then cur = redis.call('GET', ARGV[3] .. pub) or false; inc[pub] = cur end
      if cur == pinc then
        local rec = redis.call('GET', ARGV[2] .. rid)
        if rec then return {i, rec, stale} end
        tries = tries - 1
        if tries <= 0 then return {0, '', stale} end
      else
        stale = stale + 1
      end
    end
  end
end
return {0, '', stale}
"""


class RedisContentIndex:
    """A :class:`~kvshuttle.retention.index.ContentIndex` on Redis at ``url`` (see the module docstring).

    ``publisher``: this decode's address (empty for a reader); ``clock``: wall-clock seconds, the clock the
    retentions' expiries are on (hosts must agree on it, as the router's store already assumes).
    """

    TRIP_AFTER = 3

    def __init__(self, url: str, secret: DeploymentSecret, publisher: str = "", *, prefix: str = "kvshuttle:ci:",
                 stride: int = DEFAULT_STRIDE, timeout_s: float = 0.02, backoff_s: float = 1.0,
                 max_per_publisher: int = 50_000, max_record_bytes: int = MAX_RECORD_BYTES, max_tries: int = 4,
                 clock: Callable[[], float] = time.time) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not isinstance(publisher, str):
            raise IndexArgumentError(f"publisher must be a string (the decode's address), got {shown(publisher)}")
        for name, value in (("timeout_s", timeout_s), ("backoff_s", backoff_s)):
            if type(value) not in (int, float) or not 0 < value < 3600:
                raise IndexArgumentError(f"{name} must be a number of seconds in (0, 3600), got {shown(value)}")
        for name, count in (("max_per_publisher", max_per_publisher), ("max_record_bytes", max_record_bytes),
                            ("max_tries", max_tries)):
            if type(count) is not int or count < 1:
                raise IndexArgumentError(f"{name} must be a positive int, got {shown(count)}")
        self.names = Names(secret, prefix)
        self.stride = check_stride(stride)
        self.max_per_publisher, self.max_record_bytes, self.max_tries = max_per_publisher, max_record_bytes, max_tries
        self.backoff_s, self._clock = float(backoff_s), clock
        # No retries: a lookup that missed its bound is answered "nothing", the caller recomputes.
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        self._start = self._redis.register_script(_START)
        self._publish = self._redis.register_script(_PUBLISH)
        self._lookup = self._redis.register_script(_LOOKUP)
        self._publisher = self.names.publisher_id(publisher) if publisher else ""
        self._incarnation = ""
        self._down_until = 0.0
        self._failures = 0
        self._counts = {"published": 0, "withdrawn": 0, "evicted": 0, "refused": 0, "lookups": 0, "hits": 0,
                        "stale_skipped": 0, "errors": 0, "skipped_down": 0, "malformed": 0}

    def _call(self, what: str, call: Callable[[], Any]) -> tuple[bool, Any]:
        """(True, the answer) or (False, None) after any Redis failure, counted; skips Redis while it is down."""
        from redis.exceptions import RedisError

        if time.monotonic() < self._down_until:
            self._counts["skipped_down"] += 1
            return False, None
        try:
            answer = call()
        except (RedisError, OSError) as exc:
            self._counts["errors"] += 1
            self._failures += 1
            if self._failures >= self.TRIP_AFTER:  # one slow answer is not an outage
                self._down_until = time.monotonic() + self.backoff_s
            log.debug("content index: redis %s failed: %s", what, type(exc).__name__)
            return False, None
        self._failures = 0
        return True, answer

    def start(self) -> None:
        """Make a new incarnation current; raises IndexArgumentError for a reader, and for a Redis that cannot
        be reached (a publisher that cannot start publishes nothing: retry, or run without the index)."""
        if not self._publisher:
            raise IndexArgumentError("a reader (no publisher address) has no incarnation to start")
        incarnation = secrets.token_hex(8)
        names = self.names
        ok, _ = self._call("start", lambda: self._start(
            keys=[names.incarnation_key(self._publisher), names.live_key(self._publisher)],
            args=[incarnation, names.record_key("")]))
        if not ok:
            raise IndexArgumentError("the content index's Redis did not answer start(); retry later")
        self._incarnation = incarnation

    def publish(self, scope: str, digests: Sequence[bytes], params: Mapping[str, Any], expiry_wall_s: float) -> bool:
        handle_id, mode = retention_fields(params)
        check_publication(digests, expiry_wall_s)
        if not self._incarnation:
            raise IndexArgumentError("publish before start(): a publisher needs a current incarnation")
        names, now = self.names, self._clock()
        raw = encode_record(names.scope_tag(scope), self._publisher, self._incarnation, expiry_wall_s, params)
        keys = names.digest_keys(scope, digests, positions(len(digests), self.stride))
        ttl_ms = int((expiry_wall_s - now) * 1000)
        if len(raw) > self.max_record_bytes or ttl_ms < 1 or not keys:
            self._counts["refused"] += 1
            return False
        record_id = names.record_id(handle_id)
        expiry_ms = int(expiry_wall_s * 1000)
        pointer = Pointer(self._publisher, self._incarnation, record_id, expiry_ms, mode)
        ok, answer = self._call("publish", lambda: self._publish(
            keys=[names.record_key(record_id), names.live_key(self._publisher),
                  names.incarnation_key(self._publisher), *keys],
            args=[raw, ttl_ms, pointer.encode(), self._incarnation, self.max_per_publisher, record_id,
                  names.record_key(""), int(now * 1000), names.incarnation_key(""), expiry_ms, mode]))
        if not ok:
            return False
        status, evicted = int(answer[0]), int(answer[1])
        self._counts["evicted"] += evicted
        if status < 0:  # -1: another incarnation of this address is current; -2: evicted at once
            self._counts["refused"] += 1
            return False
        self._counts["published"] += 1
        return True

    def withdraw(self, handle_id: str) -> bool:
        if not isinstance(handle_id, str):
            raise IndexArgumentError(f"handle_id must be a string, got {shown(handle_id)}")
        record_id, names = self.names.record_id(handle_id), self.names

        def call() -> Any:
            with self._redis.pipeline(transaction=False) as pipe:
                pipe.delete(names.record_key(record_id))
                if self._publisher:
                    pipe.zrem(names.live_key(self._publisher), record_id)
                return pipe.execute()

        ok, answer = self._call("withdraw", call)
        withdrawn = bool(ok and answer[0])
        self._counts["withdrawn"] += withdrawn
        return withdrawn

    def lookup(self, scope: str, prompt: Sequence[bytes] | PromptDigests) -> Match | None:
        chain = prompt_chain(prompt)
        at = lookup_positions(len(chain), self.stride)
        names = self.names
        keys = names.digest_keys(scope, chain, at)
        self._counts["lookups"] += 1
        if not keys:
            return None
        now = self._clock()
        ok, answer = self._call("lookup", lambda: self._lookup(
            keys=keys, args=[self.max_tries, names.record_key(""), names.incarnation_key(""), int(now * 1000)]))
        if not ok:
            return None
        try:
            index, raw, stale = int(answer[0]), answer[1], int(answer[2])
        except (TypeError, ValueError, IndexError):
            self._counts["malformed"] += 1
            return None
        self._counts["stale_skipped"] += stale
        if not 1 <= index <= len(at):
            return None
        found = decode_record(raw, names.scope_tag(scope), now, self.max_record_bytes)
        if found is None:  # malformed, oversized, another scope's or expired: never served
            self._counts["malformed"] += 1
            return None
        self._counts["hits"] += 1
        params = found[0]
        return Match(params, at[index - 1] + 1, str(params["kvshuttle_handle_id"]))

    def stats(self) -> dict[str, int]:
        """This client's counts (each client counts its own; Redis holds the shared state)."""
        return dict(self._counts)

    def close(self) -> None:
        self._redis.close()
