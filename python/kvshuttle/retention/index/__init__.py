"""A content-addressed index of retentions: a request that arrives with no handle still finds the longest
retained prefix of its prompt on any decode (issue 34).

Decodes :meth:`~ContentIndex.publish` each retention under its block digest chain (sparse: see
:func:`positions`) and :meth:`~ContentIndex.withdraw` it when it ends; a prefill's connector asks
:meth:`~ContentIndex.lookup` once per request with the prompt's own chain and gets the signed params of the
retention holding the longest indexed prefix, which it verifies and claims as any handle. Per scope (a tenant,
or its ``cache_salt``), keyed with the deployment secret, bounded, restart-safe: :mod:`.scheme` says how.

* :class:`MemoryContentIndex` (one process, over a shared :class:`MemoryTable`);
* :class:`RedisContentIndex` (many hosts; redis-py imported when one is made).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .memory import MemoryContentIndex, MemoryTable
from .scheme import (
    DEFAULT_STRIDE,
    MAX_POSITIONS,
    MAX_RECORD_BYTES,
    ContentIndex,
    IndexArgumentError,
    Match,
    positions,
)

if TYPE_CHECKING:
    from .redis_backend import RedisContentIndex

__all__ = [
    "DEFAULT_STRIDE",
    "MAX_POSITIONS",
    "MAX_RECORD_BYTES",
    "ContentIndex",
    "IndexArgumentError",
    "Match",
    "MemoryContentIndex",
    "MemoryTable",
    "RedisContentIndex",
    "positions",
]


def __getattr__(name: str) -> Any:
    if name == "RedisContentIndex":  # redis-py is the router extra's: import it only when asked
        from .redis_backend import RedisContentIndex

        return RedisContentIndex
    raise AttributeError(name)
