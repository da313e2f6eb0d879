"""What comes back from a decode: its answer passed to the client (whole, or streamed event by event) without its
``kv_transfer_params``, and the handle in them validated and stored for the conversation's next turn. Used by
:class:`kvshuttle.router.proxy.Router` once a decode answered."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from ..trust import DeploymentSecret
from . import relay
from .backends import BACKEND_FAILURES, Backend, BackendPool
from .bodies import PRIVATE_MARKERS, client_error_body
from .config import RouterConfig
from .demotions import StreamFinish, finish_of_json
from .dispatch import Dispatch
from .errors import StoreError
from .handles import InvalidHandle, checked_handle
from .kv import Taker
from .metrics import RouterMetrics
from .placement import history_mark
from .prewarm import MAX_ANSWER_BYTES, answer_from_events, answer_from_json
from .relay import error_response as _error
from .sse import EventFilter, StreamFormatError
from .store import HandleStore, StoredHandle
from .token_exact import IdsTap, TokenExact
from .turn import Turn

log = logging.getLogger("kvshuttle.router")
_dumps = json.JSONEncoder(separators=(",", ":")).encode


class Answers:
    """The decode's side of a turn, after the request to a decode of ``pool`` went out: :meth:`answer` (whole)
    or :meth:`relay` (streamed). ``take``: how a streamed turn's handle is taken from the decode's board;
    ``keep_answers``: the answers' text is kept (a pre-warm, a decode-local turn's history mark); ``exact``: the
    token-exact path, whose turns' ids are collected here."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, store: HandleStore, secret: DeploymentSecret,
                 pool: BackendPool, take: Taker, clock: Callable[[], float], keep_answers: bool,
                 dispatch: Dispatch, exact: TokenExact | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.store = store
        self.secret = secret
        self.pool = pool
        self._take = take
        self._clock = clock
        self._keep_answers = keep_answers
        self._dispatch = dispatch
        self._exact = exact

    async def answer(self, turn: Turn, client: web.Request, resp: aiohttp.ClientResponse,
                      backend: Backend) -> web.StreamResponse:
        """A non-streamed answer (or any error): the body passes through, without the decode's handle. A large
        one is written here, bounded in time like a stream (a client not reading it is cut)."""
        started = time.perf_counter()
        data = await resp.read()
        turn.waited += time.perf_counter() - started
        if resp.status != 200:
            data = client_error_body(data, resp.status)
        else:
            try:
                answer = json.loads(data)
                params = answer.pop("kv_transfer_params", None) if isinstance(answer, dict) else None
                if isinstance(answer, dict) and turn.exact is not None and self._exact is not None:
                    turn.exact.take(answer, False, self._exact.max_tokens)
                clean = _dumps(answer).encode()
            except (ValueError, RecursionError):
                answer = None
            if isinstance(answer, dict):
                if self._keep_answers:
                    turn.answer = answer_from_json(answer)
                if self.config.demote_on_stop:
                    turn.finish = finish_of_json(answer)
                # The handle is a capability on the decode's blocks: it stays between the router and backends.
                await self._learn(turn, params, backend)
                data = clean
            elif any(marker in data for marker in PRIVATE_MARKERS):
                return _error(502, f"decode backend {backend.name} answered an unreadable body", "backend_error")
        self.metrics.added_latency.observe(max(0.0, time.perf_counter() - turn.started - turn.waited))
        content_type = resp.content_type or "application/json"
        if len(data) <= relay.SMALL:  # fits the socket's buffers: aiohttp's own write cannot wait on the client
            return web.Response(body=data, status=resp.status, content_type=content_type)
        out, stopped = await relay.send(client, resp.status, data, content_type, self.config.client_write_timeout_s)
        if stopped is relay.ClientSlow:
            self.metrics.client_timeouts.labels("write").inc()
        return out

    async def relay(self, turn: Turn, client: web.Request, resp: aiohttp.ClientResponse, backend: Backend,
                     publish: str | None) -> web.StreamResponse:
        """Stream the decode's answer event by event, without kv_transfer_params; store its handle before the end.

        The handle comes from the stream's last chunk (vLLM 0.33) or else the decode's board. The end marker
        (``data: [DONE]``) is held back until the handle is stored: a client that sends its next turn once it
        sees the end, to this replica or another, finds the handle. Every write to the client is bounded in
        time (``client_write_timeout_s``): a client that stops reading is cut and the decode's stream closed.
        """
        out = relay.StreamAnswer(status=200, headers={"Content-Type": resp.headers.get("Content-Type",
                                                                                      "text/event-stream"),
                                                      "Cache-Control": "no-cache"})
        # [DONE] waits only for a handle that can come: one the decode publishes, or one its stream carried
        events = EventFilter(hold_done=turn.key is not None and publish is not None,
                             hold_after_params=turn.key is not None)
        wait = self.config.client_write_timeout_s
        tap = IdsTap(turn.exact, self._exact.max_tokens) if turn.exact is not None and self._exact else None
        feed = events.feed if tap is None else lambda data: tap.feed(events.feed(data))
        finish = StreamFinish() if self.config.demote_on_stop else None
        if finish is not None:
            filtered = feed
            feed = lambda data: finish.feed(filtered(data))  # noqa: E731
        try:
            started = time.perf_counter()
            chunks = resp.content.iter_any()
            first = await anext(chunks, b"")
            turn.waited += time.perf_counter() - started
            await relay.prepare(client, out, wait)
            await relay.write(client, out, feed(first), wait)
            self.metrics.added_latency.observe(max(0.0, time.perf_counter() - turn.started - turn.waited))
            keep = turn.capture
            if keep is not None:
                keep.append(first)
            async for chunk in chunks:
                await relay.write(client, out, feed(chunk), wait)
                if keep is not None:
                    keep.append(chunk)
                    if len(keep) % 64 == 0 and sum(map(len, keep)) > MAX_ANSWER_BYTES:  # too long to pre-warm
                        keep = turn.capture = None
            rest = events.finish() if tap is None else tap.feed(events.finish())
            await relay.write(client, out, rest if finish is None else finish.feed(rest), wait)
        except (relay.ClientGone, relay.ClientSlow) as exc:
            slow = isinstance(exc, relay.ClientSlow)
            turn.learned = "client_slow" if slow else "client_gone"
            if slow:
                self.metrics.client_timeouts.labels("write").inc()
                log.info("router: client of request %s stopped reading for %g s; cut, decode stream closed",
                         turn.request_id, wait)
            resp.close()  # the decode stops generating for nobody
            relay.cut(client)
            return out
        except (*BACKEND_FAILURES, StreamFormatError) as exc:
            turn.learned = "stream_failed"
            self._dispatch.failed(self.pool, backend, exc)
            self.metrics.unlearned.labels("stream_failed").inc()
            resp.close()
            if not out.prepared:
                return _error(502, f"decode backend {backend.name} failed: {type(exc).__name__}", "backend_error")
            await self._stream_error(client, out, f"decode backend {backend.name} failed mid-stream: "
                                                  f"{type(exc).__name__}")
            return out
        if finish is not None:
            turn.finish = finish.reason
        if turn.capture is not None:
            turn.answer, turn.capture = answer_from_events(turn.capture), None
        if events.dropped:
            self.metrics.events_dropped.inc(events.dropped)
        if events.found:
            await self._learn(turn, events.params, backend)
        elif publish is None:
            self.metrics.unlearned.labels("stream_without_board").inc()
        else:
            await self._take_handle(turn, backend, publish)
        try:
            await relay.finish(client, out, events.held, wait)
        except (relay.ClientGone, relay.ClientSlow):
            relay.cut(client)
        return out

    async def _take_handle(self, turn: Turn, backend: Backend, publish: str) -> None:
        address = backend.spec.kv_address
        assert address is not None
        try:
            params = await self._take(address, publish, self.config.publish_timeout_s)
        except Exception as exc:  # a dead decode: the next turn recomputes
            log.info("router: taking the handle from %s failed: %s: %s", backend.name, type(exc).__name__, exc)
            self.metrics.unlearned.labels("board_failed").inc()
            turn.learned = "board_failed"
            return
        await self._learn(turn, params, backend)

    async def _stream_error(self, client: web.Request, out: web.StreamResponse, message: str) -> None:
        wait = self.config.client_write_timeout_s
        try:  # the OpenAI clients raise on an error event: the client never takes a cut answer for a whole one
            await relay.finish(client, out, relay.error_event(message), wait)
        except (relay.ClientGone, relay.ClientSlow):
            relay.cut(client)

    async def _learn(self, turn: Turn, params: Any, backend: Backend) -> None:
        """Validate, authenticate and store the decode's returned params for the conversation's next turn."""
        key = turn.key
        if key is None or turn.tenant is None or turn.conversation is None:
            return
        if params is None:
            turn.learned = "none"
            self.metrics.unlearned.labels("none_returned").inc()
            return
        try:
            stored, life = checked_handle(params, self.config.connector, self.secret)
        except InvalidHandle as exc:
            turn.learned = "invalid"
            self.metrics.invalid.labels(exc.reason).inc()
            log.warning("router: dropping %s's params for request %s (%s): %s", backend.name, turn.request_id,
                        exc.reason, exc)
            return
        history = history_mark(turn.messages, turn.answer) if self.config.decode_local_max_tokens > 0 else None
        kept = await self._exact.keep(turn.exact) if self._exact is not None and turn.exact is not None else None
        entry = StoredHandle(turn.tenant, turn.conversation, stored, backend.name, backend.spec.kv_address,
                             self._clock() + min(self.config.ttl_s, life), turn.prefill or turn.home, history, kept)
        try:
            await self.store.put(key, entry)
        except StoreError as exc:
            self.metrics.store_errors.labels("put").inc()
            turn.learned = "store_error"
            log.info("router: storing the handle failed, the next turn recomputes: %s", exc)
            return
        turn.learned, turn.stored = "stored", stored
        self.metrics.stored.inc()
