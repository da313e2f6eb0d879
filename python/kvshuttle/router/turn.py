"""One client request on its way through the router: what the turn's metrics and log line say about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .handles import store_key
from .placement import Placement
from .token_exact import ExactTurn


@dataclass
class Turn:
    """One client request on its way through the router (for the metrics and the turn's log line)."""

    endpoint: str
    request_id: str
    stream: bool
    tenant: str | None
    conversation: str | None
    started: float = field(default_factory=time.perf_counter)
    waited: float = 0.0  # seconds spent waiting on backends and publications (not the router's own time)
    lookup: str = "no_conversation"
    prefill: str | None = None
    decode: str | None = None
    learned: str = "no"
    first_byte: bool = False
    placement: Placement = "recompute"
    home: str | None = None  # the prefill whose cache holds the conversation (kept across decode-local turns)
    answer: str | None = None  # the answer's text, kept for a pre-warm
    capture: list[bytes] | None = None  # a streamed answer's bytes, kept for its text (``answer``)
    messages: list[Any] | None = None  # a chat turn's prompt messages, for its history mark (placement.py)
    exact: ExactTurn | None = None  # the token-exact path's state (--token-exact): ids sent and collected
    finish: str | None = None  # the answer's finish reason (--demote-on-stop only; demotions.py)
    stored: dict[str, Any] | None = None  # the decode's params this turn stored for the next one

    @property
    def key(self) -> str | None:
        if self.tenant is None or self.conversation is None:
            return None
        return store_key(self.tenant, self.conversation)
