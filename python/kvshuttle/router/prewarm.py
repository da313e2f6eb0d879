"""Pre-warming: when a chat turn's answer is complete, the router sends the conversation so far (its messages and
the answer, as the next turn's prompt will start) to the prefill that will take the next turn, as a background
1-token request, so that prefill's own prefix cache holds the whole history before the client's next turn arrives
(agents' tool calls leave seconds between turns).

No handle goes with it: under affinity that prefill already holds the history up to this turn's prompt, so it
computes only the answer's tokens (the decode's handle stays in the store for the next turn, in case that prefill
is gone by then). Bounded: at most ``max_in_flight`` pre-warms per prefill (more are skipped, ``busy``), of which
one tenant holds at most half (at least one), so one tenant's churn never takes another's pre-warms; the next
turn of the conversation cancels its pre-warm if it is still running (``superseded``); a pre-warm counts ``used``
when the next turn went to the prefill it warmed, ``wasted`` when it went elsewhere. Pre-warms never take an
admission slot and nothing on a turn's path waits for one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import aiohttp

from .backends import BACKEND_FAILURES, Backend
from .metrics import RouterMetrics

log = logging.getLogger("kvshuttle.router")

DROPPED = ("stream", "stream_options", "min_tokens", "min_completion_tokens", "n", "logprobs", "top_logprobs",
           "kv_transfer_params", "conversation_id")
MAX_ANSWER_BYTES = 4 << 20  # a streamed answer kept for a pre-warm; a longer one is not pre-warmed


def answer_from_json(answer: Any) -> str | None:
    """The assistant text of a non-streamed chat answer (one choice), or None."""
    try:
        content = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


def answer_from_events(chunks: list[bytes]) -> str | None:
    """The assistant text of a streamed chat answer (its events' ``delta.content``, one choice), or None."""
    parts = []
    for line in b"".join(chunks).splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        try:
            choices = json.loads(data).get("choices") or []
        except (ValueError, AttributeError, RecursionError):
            return None
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                piece = (choice.get("delta") or {}).get("content")
                if isinstance(piece, str):
                    parts.append(piece)
    return "".join(parts)


def warming_request(body: dict[str, Any], answer: str, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """The pre-warm's chat request: the client's (model, template and tool settings kept, so the prompt renders
    alike), its messages plus the answer, no generation prompt, one token, no transfer parameters; with
    ``prompt_ids`` (the token-exact path's: the turn's prompt and answer ids) those instead of the rendering, as
    the next turn's prompt will start."""
    request = {k: v for k, v in body.items() if k not in DROPPED}
    if prompt_ids is not None:
        request["kv_transfer_params"] = {"prompt_token_ids": prompt_ids}
    request["messages"] = [*body["messages"], {"role": "assistant", "content": answer}]
    request.update(max_tokens=1, stream=False, add_generation_prompt=False, continue_final_message=False)
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


class Prewarmer:
    """The router's pre-warms (see the module docstring); ``session()`` is the router's client session."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession | None], metrics: RouterMetrics,
                 max_in_flight: int, timeout_s: float, max_tracked: int) -> None:
        self._session, self._metrics = session, metrics
        self.max_in_flight, self.timeout_s, self.max_tracked = max_in_flight, timeout_s, max_tracked
        self._busy: dict[str, int] = {}  # prefill name -> pre-warms in flight there
        self._tenant_busy: dict[tuple[str, str], int] = {}  # (prefill name, tenant) -> its pre-warms there
        self.tenant_share = max(1, max_in_flight // 2)
        self._running: dict[str, asyncio.Task[None]] = {}  # conversation key -> its pre-warm in flight
        self._warmed: OrderedDict[str, str] = OrderedDict()  # conversation key -> prefill warmed (bounded)

    def count(self, result: str) -> None:
        self._metrics.prewarm[result].inc()

    def arrived(self, key: str | None) -> None:
        """A turn of conversation ``key`` arrived: its pre-warm, if still running, is too late."""
        task = self._running.pop(key, None) if key is not None else None
        if task is not None and not task.done():
            task.cancel()
            self.count("superseded")

    def placed(self, key: str | None, prefill: str | None) -> None:
        """The turn of ``key`` went to ``prefill`` (None: decode-local): was the pre-warm used?"""
        warmed = self._warmed.pop(key, None) if key is not None else None
        if warmed is not None:
            self.count("used" if warmed == prefill else "wasted")

    def start(self, key: str, backend: Backend, body: dict[str, Any], answer: str,
              headers: dict[str, str], tenant: str = "", prompt_ids: list[int] | None = None) -> None:
        mine = (backend.name, tenant)
        if self._busy.get(backend.name, 0) >= self.max_in_flight or \
                self._tenant_busy.get(mine, 0) >= self.tenant_share:
            self.count("busy")
            return
        self._busy[backend.name] = self._busy.get(backend.name, 0) + 1
        self._tenant_busy[mine] = self._tenant_busy.get(mine, 0) + 1
        request = warming_request(body, answer, prompt_ids)
        task = asyncio.get_running_loop().create_task(self._send(key, backend, request, backend.headers(headers)))
        self._running[key] = task
        task.add_done_callback(lambda _: self._done(key, mine, task))
        self.count("sent")

    def _done(self, key: str, mine: tuple[str, str], task: asyncio.Task[None]) -> None:
        self._busy[mine[0]] -= 1
        self._tenant_busy[mine] -= 1
        if not self._tenant_busy[mine]:
            del self._tenant_busy[mine]
        if self._running.get(key) is task:
            del self._running[key]

    async def _send(self, key: str, backend: Backend, request: dict[str, Any], headers: dict[str, str]) -> None:
        session = self._session()
        if session is None:
            return
        try:
            async with session.post(backend.url + "/v1/chat/completions", json=request, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                await resp.read()
                ok = resp.status == 200
        except BACKEND_FAILURES as exc:
            log.info("router: pre-warming %s failed: %s", backend.name, type(exc).__name__)
            ok = False
        if not ok:
            self.count("failed")
            return
        self.count("done")
        self._warmed[key] = backend.name
        self._warmed.move_to_end(key)
        while len(self._warmed) > self.max_tracked:  # conversations that never came back
            self._warmed.popitem(last=False)
            self.count("wasted")

    async def close(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
