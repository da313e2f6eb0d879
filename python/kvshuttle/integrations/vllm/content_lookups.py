"""Reuse found by content: a request that reaches the prefill with no handle still reads back the longest prefix of
its prompt that any decode retains, found in the deployment's content index (``retention/index``).

The scheduler must never wait on the index: vLLM calls ``get_num_new_matched_tokens`` on its one scheduling thread,
for every waiting request, every step. So the lookup (the prompt's digest chain, computed once, and one index round
trip) runs on a small pool of kept threads, and until it answers the scheduler tells vLLM "not yet" (``None``: the
request is skipped this step and asked about again next step). Past ``wait_s`` the request recomputes: a slow or
absent index costs at most that much time to first token, never a stalled step. What the index returns is a signed
handle like any other: the policy verifies it block by block against the prompt before anything is read.

Decodes publish each retention they issue (its full blocks' digests and its signed params) and withdraw it when it
ends early; publications run on the same threads and are dropped, counted, when too many are queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...policy import PromptDigests
from ...retention.index import ContentIndex, Match
from ...trust import DeploymentSecret

log = logging.getLogger("vllm.kvshuttle")

PENDING = object()  # the lookup has not answered yet: ask vLLM to come back next step
MAX_PENDING = 256  # lookups in flight at once; a request beyond them recomputes (a flood of new prompts)
MAX_QUEUED_PUBLICATIONS = 1024
START_TRIES, START_FIRST_DELAY_S, START_MAX_DELAY_S = 8, 0.25, 8.0  # about 35 s before publishing is given up
PUBLISH_TIMEOUT_S = 1.0  # a publication or withdrawal runs off the scheduling thread: it may wait for Redis


class ContentLookups:
    """The scheduler's side of the content index: lookups and publications off the scheduling thread."""

    def __init__(self, index: ContentIndex, block_size: int, *, wait_s: float = 0.1, threads: int = 2,
                 make_publisher: Callable[[str], ContentIndex] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``index`` answers lookups; ``make_publisher(address)`` makes this decode's publishing index once its
        side channel is known (:meth:`serve_as`; an index publishes under its publisher's address)."""
        self.index = index
        self.block_size = block_size
        self._make_publisher = make_publisher
        self._serving: str | None = None  # the address publishing was started for (once: one incarnation)
        self.publisher: ContentIndex | None = None
        self.wait_s = wait_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvshuttle-index")
        self._pending: dict[str, tuple[Future[Match | None], float]] = {}
        self._lock = threading.Lock()
        self._queued = 0  # publications and withdrawals submitted, not yet run
        self.counts: dict[str, int] = {}

    # -- prefill: find ------------------------------------------------------------------------------------------
    def find(self, request_id: str, scope: str, prompt: Sequence[int], extra_key: bytes) -> Match | object | None:
        """The retention holding the longest indexed prefix of ``prompt``, None (recompute), or PENDING."""
        entry = self._pending.get(request_id)
        if entry is None:
            if len(self._pending) >= MAX_PENDING:
                self._count("lookup_overflow")
                return None
            tokens = list(prompt)  # the scheduler may change the request's lists; the thread digests a copy
            future = self._pool.submit(self._lookup, scope, tokens, extra_key)
            entry = (future, self._clock() + self.wait_s)
            self._pending[request_id] = entry
        future, deadline = entry
        if future.done():
            del self._pending[request_id]
            try:
                match = future.result()
            except Exception as exc:  # the index's own failures are its to log; here: recompute
                self._count("lookup_error")
                log.debug("kvshuttle: content lookup for %s failed: %r", request_id, exc)
                return None
            self._count("lookup_hit" if match is not None else "lookup_miss")
            return match
        if self._clock() >= deadline:
            del self._pending[request_id]  # the answer, when it comes, is dropped with the future
            self._count("lookup_timeout")
            return None
        return PENDING

    def forget(self, request_id: str) -> None:
        """The request left the waiting queue (finished, aborted): its lookup's answer is of no use."""
        self._pending.pop(request_id, None)

    def _lookup(self, scope: str, tokens: list[int], extra_key: bytes) -> Match | None:
        full = len(tokens) // self.block_size * self.block_size  # the index holds full blocks only
        if full == 0:
            return None
        digests = PromptDigests.from_tokens(tokens[:full], self.block_size, extra_key=extra_key)
        return self.index.lookup(scope, digests)

    # -- decode: publish ----------------------------------------------------------------------------------------
    def serve_as(self, address: str) -> None:
        """Start publishing as the decode at ``address`` (a new incarnation: entries a predecessor at the same
        address left are no longer found). Off the scheduling thread; until it is done nothing is published."""
        if self._make_publisher is not None and self._serving is None:
            self._serving = address
            self._pool.submit(self._start_publisher, address)

    def _start_publisher(self, address: str) -> None:
        """Start, retrying with backoff: at an engine's start-up the host is busiest and Redis may answer late (or
        not be up yet); a decode that gave up at once would publish nothing for its whole life."""
        assert self._make_publisher is not None
        delay, failure = START_FIRST_DELAY_S, None
        for _ in range(START_TRIES):
            try:
                publisher = self._make_publisher(address)
                publisher.start()
            except Exception as exc:
                failure = exc
                self._count("publisher_retry")
                time.sleep(delay)
                delay = min(delay * 2, START_MAX_DELAY_S)
                continue
            self.publisher = publisher
            return
        self._count("publisher_error")
        log.warning("kvshuttle: this engine's retentions are not published in the content index: %r", failure)

    def publish(self, scope: str, digests: Sequence[bytes], num_tokens: int, params: Mapping[str, Any],
                expiry_wall_s: float) -> None:
        """Index a retention this decode issued (its full blocks' digests), off the scheduling thread."""
        full = tuple(digests[:num_tokens // self.block_size])
        if self.publisher is None:
            self._count("publish_not_started")
        elif full:
            self._submit("publish", self.publisher.publish, scope, full, dict(params), expiry_wall_s)

    def withdraw(self, handle_id: str) -> None:
        if self.publisher is not None:
            self._submit("withdraw", self.publisher.withdraw, handle_id)

    def _submit(self, what: str, call: Callable[..., object], *args: Any) -> None:
        with self._lock:
            if self._queued >= MAX_QUEUED_PUBLICATIONS:
                self.counts[f"{what}_dropped"] = self.counts.get(f"{what}_dropped", 0) + 1
                return
            self._queued += 1
        self._pool.submit(self._run, what, call, *args)

    def _run(self, what: str, call: Callable[..., object], *args: Any) -> None:
        try:
            call(*args)
        except Exception as exc:
            self._count(f"{what}_error")
            log.debug("kvshuttle: content index %s failed: %r", what, exc)
        finally:
            with self._lock:
                self._queued -= 1

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + 1

    def take_counts(self) -> dict[str, int]:
        with self._lock:
            counts, self.counts = self.counts, {}
        return counts

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for index in {id(i): i for i in (self.index, self.publisher) if i is not None}.values():
            index.close()


def content_lookups(url: str, secret: DeploymentSecret, block_size: int, wait_s: float) -> ContentLookups:
    """The lookups of an engine whose content index is the Redis at ``url`` (its decode publishes there too)."""
    from ...retention.index import RedisContentIndex

    # a lookup never needs longer than the request may wait for it; publishing is off the request's path
    return ContentLookups(RedisContentIndex(url, secret, timeout_s=max(wait_s, 0.01)), block_size, wait_s=wait_s,
                          make_publisher=lambda address: RedisContentIndex(url, secret, address,
                                                                            timeout_s=PUBLISH_TIMEOUT_S))
