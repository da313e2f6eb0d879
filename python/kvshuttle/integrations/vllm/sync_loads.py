"""A synchronous (layer-pipelined) load's blocks stay out of vLLM's prefix cache until the load is confirmed.

vLLM caches a request's blocks when it allocates them, unless their load is asynchronous (``delay_cache_blocks``).
For a synchronous load that caches the blocks being read, and the blocks the same step computes from them, before a
byte has landed. If the load then fails, vLLM's ``recompute`` policy (the connector forces it) keeps them cached,
"to be recomputed and reused by other requests sharing them" (``Scheduler._handle_invalid_blocks``): a request
sharing the prefix, the same request after preemption, a client's retry after an abort, or any request scheduled
while a chunked recompute is still under way would read stale KV (another request's, or none) as a prefix hit.

So the guard, right after vLLM allocated a layered load's blocks (``update_state_after_alloc``), takes every block
of the request from the first one the load writes out of the prefix cache, and keeps vLLM's count of the request's
cached blocks where it was, so its next allocations do not cache them either. The step's outcome decides:

* **landed** (every rank settled the load whole, ``ShuttleWorkerMeta.landed``; or the request finished normally
  in that step, which vLLM allows only when no block of it was reported invalid): the blocks are cached now, as vLLM
  would have at allocation;
* **failed** (a target block reported invalid): every block from the first loaded one on is taken out again (they
  hold stale KV or KV computed from it) and vLLM's count goes back to the first loaded block, so its recompute
  caches each block in the step that rewrites it, which is vLLM's ordinary rule for a block computed in a step;
* aborted, or preempted before the outcome came: vLLM frees the blocks uncached; nothing is cached.

The guard needs the engine's prefix cache (:class:`PrefixCache`, ``compat.VllmPrefixCache`` in vLLM). Without it a
layered load is refused and read asynchronously (``ShuttleScheduler``), where vLLM delays the caching itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .requests import finished_normally


class PrefixCache(Protocol):
    """What the guard needs of an engine's prefix cache."""

    enabled: bool  # False: the engine caches nothing, so there is nothing to hold back

    def block_ids(self, request_id: str) -> list[int]: ...

    def cached_blocks(self, request_id: str) -> int: ...

    def set_cached_blocks(self, request_id: str, count: int) -> None: ...

    def uncache(self, block_ids: Iterable[int]) -> None: ...

    def cache(self, request: Any, num_tokens: int) -> None: ...


@dataclass(frozen=True)
class _Held:
    request: Any
    first: int  # index in the request's block table of the first block the load writes
    upto: int  # blocks vLLM cached at the allocation: the loaded ones and what this step computes after them
    blocks: frozenset[int]  # the load's target blocks (what a failure reports invalid)
    preemptions: int


def _preemptions(request: Any) -> int:
    return int(getattr(request, "num_preemptions", 0) or 0)


class SyncLoadGuard:
    """The layered loads whose blocks are held out of the prefix cache, until each one's step reports."""

    def __init__(self, cache: PrefixCache, block_size: int, tp_size: int = 1) -> None:
        self.cache = cache
        self.block_size = block_size
        self.tp_size = tp_size
        self._held: dict[str, _Held] = {}
        self.counts: dict[str, int] = {}  # held / landed / failed / dropped, for the connector's stats

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def hold(self, request: Any, first: int, blocks: Iterable[int]) -> None:
        """vLLM has just allocated (and cached) ``request``'s blocks for a synchronous load into ``blocks``, which
        start at table index ``first``: take them, and every later block of the request, out of the cache."""
        if not self.cache.enabled:
            return
        request_id = request.request_id
        table = self.cache.block_ids(request_id)
        self.cache.uncache(table[first:])
        self._held[request_id] = _Held(request, first, self.cache.cached_blocks(request_id), frozenset(blocks),
                                       _preemptions(request))
        self._count("held")

    def settle(self, landed: Mapping[str, int] | None, invalid: set[int] | None) -> None:
        """A step's outcome (``update_connector_output``): ``landed`` counts the ranks that settled each load whole,
        ``invalid`` is every rank's invalid blocks."""
        bad, landed = invalid or set(), landed or {}
        for request_id, held in list(self._held.items()):
            if held.blocks & bad:
                del self._held[request_id]
                self._failed(held)
            elif landed.get(request_id, 0) >= self.tp_size:
                del self._held[request_id]
                self._landed(held)

    def finished(self, request: Any) -> None:
        """``request_finished``, before vLLM frees the blocks. vLLM finishes a request normally only from a step
        whose output reported none of its blocks invalid, and a held load's own step is the request's first: so
        a normal finish confirms the load (the landed report of that step reaches ``settle`` only afterwards)."""
        held = self._held.pop(request.request_id, None)
        if held is None:
            return
        if finished_normally(request):
            self._landed(held)
        else:  # aborted with the outcome open: the blocks go back uncached
            self._count("dropped")

    def _current(self, held: _Held) -> bool:
        """Whether the request still holds the blocks of the load (not preempted since: then they went back to
        vLLM's pool uncached, and whatever it holds now it computes itself)."""
        return _preemptions(held.request) == held.preemptions and \
            len(self.cache.block_ids(held.request.request_id)) >= max(held.upto, held.first)

    def _landed(self, held: _Held) -> None:
        if not self._current(held):
            self._count("dropped")
            return
        request_id = held.request.request_id
        before = self.cache.cached_blocks(request_id)
        self.cache.set_cached_blocks(request_id, held.first)
        self.cache.cache(held.request, held.upto * self.block_size)
        self.cache.set_cached_blocks(request_id, max(before, held.upto))  # (vLLM may have cached later ones)
        self._count("landed")

    def _failed(self, held: _Held) -> None:
        self._count("failed")
        if not self._current(held):
            return
        request_id = held.request.request_id
        self.cache.uncache(self.cache.block_ids(request_id)[held.first:])  # (later steps may have cached some)
        self.cache.set_cached_blocks(request_id, min(self.cache.cached_blocks(request_id), held.first))

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
