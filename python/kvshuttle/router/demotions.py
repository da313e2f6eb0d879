"""Soft TTL classes (``--demote-on-stop``): a turn whose answer ended with ``finish_reason == "stop"`` waits on a
person (minutes), one that ended with ``"tool_calls"`` has its client back in seconds with the tools' results. So
after a ``stop`` the router asks the decode to move the conversation's retention into its host tier at once
(``demote_retention`` on its side channel, every TP rank): the hot blocks go back to vLLM for other requests, the
handle stays valid and its reads are served from the tier. Any other finish (``tool_calls``, ``length``, several
choices that disagree) leaves the retention hot until its TTL.

Never on the answer's path: asked after the turn, as a task of its own (the blocking side-channel call runs in the
router's side-channel thread pool), at most ``max_in_flight`` at once (more are skipped, ``busy``). Its outcome
is counted (``kvshuttle_router_demotions_total{outcome}``) and nothing else: a decode that refuses (no host tier,
an ended handle) or fails changes no client's answer.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from .kv import Demoter
from .metrics import RouterMetrics

log = logging.getLogger("kvshuttle.router")

STOP = "stop"  # the one finish reason that demotes
MIXED = "mixed"  # several choices that did not all finish alike
# A finish reason in whole JSON events: a raw quote right after the name, so never one inside a string value
# (a model's text has its quotes escaped there).
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]{1,32})"')


def merged(seen: str | None, reason: str | None) -> str | None:
    """One answer's finish reason so far, given one more choice's (None: not finished): ``MIXED`` once two differ."""
    if reason is None or seen == reason:
        return seen
    return reason if seen is None else MIXED


def finish_of_json(answer: dict[str, Any]) -> str | None:
    """The finish reason of a whole (non-streamed) answer: its choices' common one, ``MIXED``, or None."""
    seen: str | None = None
    choices = answer.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        reason = choice.get("finish_reason") if isinstance(choice, dict) else None
        seen = merged(seen, reason if isinstance(reason, str) else None)
    return seen


class StreamFinish:
    """The finish reason of a streamed answer, read from its whole events as they pass (``feed``)."""

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason: str | None = None

    def feed(self, events: bytes) -> bytes:
        if b"finish_reason" in events:
            for match in _FINISH.finditer(events):
                self.reason = merged(self.reason, match.group(1).decode())
        return events


class Demotions:
    """``later(params)``: ask the decode holding ``params`` to demote them, off the turn's path (see the module
    docstring); ``close`` cancels those still running."""

    def __init__(self, demote: Demoter, metrics: RouterMetrics, max_in_flight: int = 2) -> None:
        self._demote = demote
        self._metrics = metrics
        self.max_in_flight = max_in_flight
        self._running: set[asyncio.Task[None]] = set()

    def later(self, params: dict[str, Any]) -> None:
        """Start the demotion of ``params`` (needs the running event loop); skipped when ``max_in_flight`` run."""
        if len(self._running) >= self.max_in_flight:
            self._metrics.demotion["busy"].inc()
            return
        task = asyncio.get_running_loop().create_task(self._run(params))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, params: dict[str, Any]) -> None:
        try:
            demoted = await self._demote(params)
        except Exception as exc:  # the retention stays hot until its TTL: nothing is lost
            refused = isinstance(getattr(exc, "reason", None), str)  # the decode refused it by name
            log.info("router: demotion on %s:%s %s: %s: %s", params.get("remote_host"), params.get("remote_port"),
                     "refused" if refused else "failed", type(exc).__name__, exc)
            self._metrics.demotion["refused" if refused else "failed"].inc()
            return
        self._metrics.demotion["demoted" if demoted else "kept"].inc()

    async def close(self) -> None:
        """Cancel the demotions still running and wait for them to end."""
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
