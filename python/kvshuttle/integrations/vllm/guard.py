"""What the facade does when one of kvshuttle's hooks raises: count it, log it, answer safely.

An exception escaping a connector hook kills vLLM's EngineCore (every request of the engine fails, not just
the one that tripped it). The facade therefore catches every ``Exception`` in the hooks it routes, hands it
here, and returns the hook's safe answer (recompute, not retained, empty metadata). Each kind of failure
(hook, exception type) is logged once with its traceback and the request it happened for; every occurrence
is counted, and the counts reach vLLM's connector stats as ``hook_error.<hook>``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("vllm.kvshuttle")


def request_id_of(request: Any) -> str:
    try:
        return str(getattr(request, "request_id", "?"))
    except Exception:
        return "?"


class HookGuard:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # worker hooks and loader threads may fail at once
        self._logged: set[tuple[str, str]] = set()
        self.counts: dict[str, int] = {}

    def failed(self, hook: str, exc: BaseException, request: Any = None) -> None:
        """Record that ``hook`` raised ``exc`` (for ``request``, if it concerns one). Never raises."""
        try:
            kind = (hook, type(exc).__name__)
            with self._lock:
                self.counts[hook] = self.counts.get(hook, 0) + 1
                first = kind not in self._logged
                self._logged.add(kind)
            where = f" for request {request_id_of(request)}" if request is not None else ""
            if first:
                log.error("kvshuttle: %s failed%s: %r; answered safely (recompute / not retained), the engine goes "
                          "on. Further %s errors of %s are counted (hook_error.%s), not logged", hook, where, exc,
                          hook, kind[1], hook, exc_info=exc)
            else:
                log.debug("kvshuttle: %s failed again%s: %r", hook, where, exc)
        except Exception:  # pragma: no cover - logging itself broke; the engine still must not see it
            pass

    def take(self) -> dict[str, int]:
        """``hook_error.<hook>`` counts since the last call."""
        with self._lock:
            counts, self.counts = self.counts, {}
        return {f"hook_error.{hook}": n for hook, n in counts.items()}
