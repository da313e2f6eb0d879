"""vLLM's prefix cache as the connector sees it (``compat.VllmPrefixCache``), for tests that run without vLLM.

It keeps what the guard reads and changes: each request's block table, vLLM's count of the request's cached
blocks (``num_cached_block``), and which blocks a prefix lookup would find. ``allocate`` plays vLLM's
``allocate_slots`` for a request scheduled with a synchronous load: allocate, then cache every full block up to the
tokens computed after this step. ``tests/e2e/test_vllm_layered.py`` runs the real one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class PrefixCacheDouble:
    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.tables: dict[str, list[int]] = {}
        self.counts: dict[str, int] = {}
        self.cached: set[int] = set()  # what a lookup finds

    def allocate(self, request_id: str, table: Iterable[int], num_tokens: int) -> None:
        self.tables[request_id] = [int(b) for b in table]
        self.counts.setdefault(request_id, 0)
        self._cache(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        """vLLM frees a request's blocks (preemption, finish): cached ones stay findable until reused."""
        self.tables.pop(request_id, None)
        self.counts.pop(request_id, None)

    # -- the PrefixCache protocol -------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return list(self.tables.get(request_id, []))

    def cached_blocks(self, request_id: str) -> int:
        return self.counts.get(request_id, 0)

    def set_cached_blocks(self, request_id: str, count: int) -> None:
        if request_id in self.counts:
            self.counts[request_id] = count

    def uncache(self, block_ids: Iterable[int]) -> None:
        self.cached -= set(block_ids)

    def cache(self, request: Any, num_tokens: int) -> None:
        self._cache(request.request_id, num_tokens)

    def _cache(self, request_id: str, num_tokens: int) -> None:
        if not self.enabled:
            return
        table, start = self.tables[request_id], self.counts[request_id]
        full = min(num_tokens // self.block_size, len(table))
        if full > start:
            self.cached.update(table[start:full])
            self.counts[request_id] = full
