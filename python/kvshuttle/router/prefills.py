"""The prefill's side of a turn: one ``max_tokens=1`` request that reads the conversation back from its decode (the
stored handle) or computes it, retried on another prefill without a handle that may have been consumed. Used by
:class:`kvshuttle.router.proxy.Router` for every turn that is not decode-local."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from .backends import BACKEND_FAILURES, BackendPool
from .bodies import client_error_body
from .config import RouterConfig
from .dispatch import Dispatch
from .handles import prefill_params
from .metrics import RouterMetrics
from .releases import Releases
from .store import StoredHandle
from .turn import Turn

PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


class Prefills:
    """What a turn asks of a prefill of ``pool``, before its decode (:meth:`run`). ``session``: the router's
    HTTP client session, made when it starts."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, pool: BackendPool,
                 session: Callable[[], aiohttp.ClientSession | None], dispatch: Dispatch,
                 releases: Releases) -> None:
        self.config = config
        self.metrics = metrics
        self.pool = pool
        self._session = session
        self._dispatch = dispatch
        self._releases = releases

    async def run(self, turn: Turn, body: dict[str, Any], entry: StoredHandle | None,
                  headers: dict[str, str]) -> tuple[dict[str, Any] | None, web.Response | None]:
        """Prefill's returned params (None: the decode computes the prompt), or a client error to return."""
        session = self._session()
        assert session is not None
        handle = entry.params if entry is not None else None
        request = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
        request["stream"], request["max_tokens"] = False, 1
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        tried: set[str] = set()
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s, connect=self.config.connect_timeout_s)
        # what the next attempt sends: a failed prefill may have consumed a use-once handle
        offer = handle if self.config.reverse_reads else None
        if entry is not None and handle is not None and offer is None and self.config.sole_user(handle):
            self._releases.later(entry)  # taken, never to be read
        for attempt in range(1 + self.config.retries):
            backend = self._dispatch.choose(self.pool, turn, entry.prefill if entry is not None else None, tried)
            if backend is None:
                break
            tried.add(backend.name)
            if attempt:
                self.metrics.retries.labels("prefill").inc()
            request["kv_transfer_params"] = self._dispatch.granted(prefill_params(offer))
            if turn.exact is not None and turn.exact.send is not None:  # vLLM uses them instead of rendering
                request["kv_transfer_params"]["prompt_token_ids"] = list(turn.exact.send)
            started = time.perf_counter()
            backend.in_flight += 1
            try:
                async with session.post(backend.url + turn.endpoint, json=request,
                                              headers=backend.headers(headers), timeout=timeout) as resp:
                    status, data = resp.status, await resp.read()
            except BACKEND_FAILURES as exc:
                self._dispatch.failed(self.pool, backend, exc)
                if not isinstance(exc, aiohttp.ClientConnectorError):  # a refused connection sent nothing:
                    offer = None  # the handle goes to the next prefill (failover that still reads back)
                continue
            finally:
                backend.in_flight -= 1
                turn.waited += time.perf_counter() - started
            offer = None
            if 400 <= status < 500:  # the client's request is wrong; the decode would refuse it too
                return None, web.Response(body=client_error_body(data, status), status=status,
                                          content_type="application/json")
            if status != 200:
                self.metrics.backend_errors.labels("prefill", backend.name).inc()
                continue
            turn.prefill = backend.name
            try:
                params = json.loads(data).get("kv_transfer_params")
            except (ValueError, AttributeError, RecursionError):
                params = None
            if not isinstance(params, dict) or not params:
                params = None
            # kvshuttle's prefill says how many tokens it read back (none: its own cache held them, or too few
            # to pay), with or without a handle (one found in its content index); vLLM's NixlConnector does not,
            # so a handle sent counts as a reverse read there
            read = params.get("kvshuttle_read_tokens") if params is not None else None
            sent = bool(request["kv_transfer_params"].get("remote_block_ids"))
            if type(read) is int and 0 <= read < 1 << 31:
                self.metrics.read_tokens.inc(read)
                if sent and not read and entry is not None and self.config.sole_user(entry.params):
                    # its own cache held the history (or too little was left to pay): the handle was not used,
                    # and the decode's next handle supersedes it; the decode need not hold it to its TTL
                    self._releases.later(entry)
                sent = read > 0
            turn.placement = "reverse_read" if sent else "recompute"
            return params, None
        return None, None  # no prefill answered: the decode computes the whole prompt (recompute)
